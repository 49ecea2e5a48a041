"""What the trainer itself sends and reads per step: one small all-reduce, one host read.

Every step packs what the ranks must agree on into one fp32 vector and all-reduces it (sum)
over all ranks:

- ``[LOSS]``: the sum of the data-parallel ranks' losses. Each dp rank's loss is counted
  once: only the rank at coordinate 0 of every non-dp dim (``tp``) adds it, the others add 0
  (TP ranks hold the same loss), so the sum is the one a dp-only all-reduce gives.
- ``[NONFINITE]``: how many ranks saw a NaN/inf local loss or gradient. Computed on the
  device, so the optimizer can skip the step's update without the host looking.
- ``[NORM_SQ]``: the squared total gradient norm: each rank adds its weighted share
  (``train/grad_clip.local_norm_square``), so the clip needs no reduction of its own.
- ``[SIGNALS + s]``: how many ranks had received signal ``s`` (their ``StopRequest``) when
  the step was issued. The agreed signal is the largest such ``s``.

After the optimizer step the step's figures (``figures``: 0-dim device tensors, e.g. the
experts' load, ``expert_balance``) are appended and the vector is copied to the host, on CUDA into pinned memory with ``non_blocking=True`` behind an event;
``PendingStep.read()`` is the step's single host read and is done one step later, once the
next step's forward and backward are queued. ``comm_model`` counts the all-reduce
(``STATS_BYTES``).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import torch

LOSS, NONFINITE, NORM_SQ, SIGNALS = 0, 1, 2, 3
STATS_FLOATS = SIGNALS + signal.NSIG
STATS_BYTES = 4 * STATS_FLOATS


def pack(
    local_loss: torch.Tensor, norm_square: torch.Tensor, counts_loss: bool, signum: int | None
) -> torch.Tensor:
    """Return this rank's fp32 stats vector (see the module docstring) on the loss's device.

    ``local_loss``: the rank's loss (0-dim tensor); ``norm_square``: the rank's share of the
    squared gradient norm (0-dim fp32, ``grad_clip.local_norm_square``); ``counts_loss``:
    whether this rank adds its loss; ``signum``: the signal this rank received, if any.
    Queues device work only (no host read).
    """
    stats = torch.zeros(STATS_FLOATS, device=local_loss.device)
    if counts_loss:
        stats[LOSS] = local_loss.float()
    stats[NORM_SQ] = norm_square
    stats[NONFINITE] = (~(torch.isfinite(local_loss) & torch.isfinite(norm_square))).float()
    if signum:
        stats[SIGNALS + signum] = 1.0
    return stats


@dataclass
class StepValues:
    """The host's view of a finished step."""

    loss: float  # dp-mean loss
    grad_norm: float
    nonfinite: bool  # some rank saw a non-finite loss or grad norm: the update was skipped
    signum: int | None  # the agreed stop signal, if any rank was signalled
    figures: dict  # {name: value} of the step's figures (PendingStep's ``figures``)


def mark(device: torch.device):
    """A point in the step's timeline: a recorded CUDA event, or the host clock on CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _span(start, end) -> float:
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1000.0


class PendingStep:
    """A step whose results are queued but not read yet.

    Takes the step (0-based), its LR, the all-reduced stats vector (its grad norm included), the four
    ``mark``s around its two halves (forward/backward/all-reduce, then the optimizer), the
    comm counter that watched it (or None), the number of ranks whose losses the stats sum
    and the step's ``figures`` ({name: 0-dim device tensor}, read with the rest). Starts the
    copy to the host at once.
    """

    def __init__(
        self,
        step: int,
        lr: float,
        stats: torch.Tensor,
        marks: list,
        counter,
        dp: int,
        figures: dict[str, torch.Tensor] | None = None,
    ):
        # dp: how many ranks' losses the stats vector sums (the dp x cp ranks).
        self.step, self.lr, self.marks, self.counter, self.dp = step, lr, marks, counter, dp
        self.names = list(figures or {})
        extra = [figures[name].reshape(1).float() for name in self.names]
        values = torch.cat([stats, *extra])
        self.ready = None
        if values.device.type == "cuda":
            # non_blocking to the CPU allocates the destination in pinned memory.
            values = values.to("cpu", non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.values = values

    def read(self) -> StepValues:
        """Wait for the step's copy to land and return its values (the step's one host read)."""
        if self.ready is not None:
            self.ready.synchronize()
        v = self.values.tolist()
        signals = [s for s, count in enumerate(v[SIGNALS : SIGNALS + signal.NSIG]) if count > 0]
        return StepValues(
            loss=v[LOSS] / self.dp,
            grad_norm=v[NORM_SQ] ** 0.5,
            nonfinite=v[NONFINITE] > 0,
            signum=max(signals) if signals else None,
            figures=dict(zip(self.names, v[STATS_FLOATS:])),
        )

    def seconds(self) -> float:
        """Time the step's two halves took (call after ``read``): the device's time on CUDA,
        the host's on CPU; the gap between the halves (reading, reporting, checkpointing the
        previous step) is left out."""
        a, b, c, d = self.marks
        return _span(a, b) + _span(c, d)
