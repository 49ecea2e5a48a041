"""``profile.enable=true``: a torch.profiler trace of a window of steps, into the job dir.

The trace of steps ``profile.start_step`` .. ``start_step + steps - 1`` (1-based) is written
to ``<job dir>/profile/rank<N>_steps<a>-<b>.pt.trace.json`` on rank 0, or on every rank with
``profile.all_ranks=true``. It is a Chrome trace: open it in https://ui.perfetto.dev (or
chrome://tracing), or point TensorBoard's profiler plugin at the folder
(``pip install torch-tb-profiler; tensorboard --logdir <job dir>/profile``). The rank's log
also gets the ten ops with the most self time. Checkpoint saves between steps are left out.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hsdp_runner.config.schema import ProfileConfig

log = logging.getLogger(__name__)


class StepProfiler:
    """Starts torch.profiler before the window's first step and stops it after its last."""

    def __init__(
        self, profile_cfg: ProfileConfig, rank: int, output_dir: Path, device: torch.device
    ):
        self.cfg = profile_cfg
        self.active = profile_cfg.enable and (profile_cfg.all_ranks or rank == 0)
        self.first = profile_cfg.start_step
        self.last = profile_cfg.start_step + profile_cfg.steps - 1
        name = f"rank{rank}_steps{self.first}-{self.last}.pt.trace.json"
        self.path = Path(output_dir) / "profile" / name
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = None

    def wrap(self, after_step, start_step: int):
        """Return an ``after_step(step)`` hook that also drives the profiler; ``start_step`` is
        the number of steps already done (the window starts now if it begins with the next)."""
        self._maybe_start(start_step + 1)

        def hook(step: int) -> None:
            self._maybe_stop(step)
            if after_step is not None:
                after_step(step)
            self._maybe_start(step + 1)

        return hook

    def _maybe_start(self, next_step: int) -> None:
        if self.active and next_step == self.first:
            self.prof = torch.profiler.profile(activities=self.activities, record_shapes=True)
            self.prof.start()

    def _maybe_stop(self, step: int) -> None:
        if self.prof is None or step != self.last:
            return
        self.prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.path))
        log.info(
            "profile of steps %d-%d written to %s (open in https://ui.perfetto.dev)\n%s",
            self.first,
            self.last,
            self.path,
            self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10),
        )
        self.prof = None
