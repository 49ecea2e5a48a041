"""The batches of ``data=hf``: this rank's lanes, made in the background, and the held-out batches.

``HFBatches`` has ``TokenBatches``' interface (``global_batch``, ``seq_len``, ``held_out``,
``split``, ``stream``), so the trainer, context parallel and pipeline schedules take it as they
take synthetic batches. A data-parallel rank owns lanes ``[dp_rank * rows, (dp_rank + 1) *
rows)`` of the ``trainer.global_batch_size`` lanes (``lanes.py``); its stream makes their
windows step after step in a background thread (tokenizers' own threads do the tokenizing), or
with ``data.workers > 0`` in that many ``torch.utils.data.DataLoader`` worker processes, each
owning a contiguous part of the lanes, ``data.prefetch`` steps ahead.

The position a checkpoint saves is every lane's ``LaneState`` after the step, gathered from all
ranks (``position``), plus the global cursor: steps x global batch samples. It is a property of
the lanes, not of the ranks, so a job resumes it at any data-parallel degree.

The held-out batches are the held-out documents packed in order (no shuffling), the same in
every job and layout: batch i is windows ``[i * global_batch, (i + 1) * global_batch)``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

import numpy as np
import torch

from hsdp_runner.config.schema import DataConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.context_parallel import shard_sequence
from hsdp_runner.train.hf_source import SourceSpec, open_docs
from hsdp_runner.train.hf_tokenizer import Encoder, TokenizerSpec, check_tokenizer
from hsdp_runner.train.lanes import DataError, LaneGroup, LaneState

log = logging.getLogger(__name__)

POSITION_FORMAT = "hsdp_runner.lanes/1"


class RoundReader:
    """``lanes.DocReader`` over training documents: round k, lane l -> document k * n + l."""

    def __init__(self, docs, n_lanes: int):
        self.docs, self.n_lanes = docs, n_lanes

    def read(self, round_: int, lanes: list[int]) -> list[str]:
        """The texts of round ``round_``'s documents of ``lanes``."""
        return self.docs.texts([round_ * self.n_lanes + lane for lane in lanes])


def pack_in_order(texts, encode: Encoder, window: int, count: int) -> list[np.ndarray]:
    """The first ``count`` windows of ``window`` tokens of ``texts`` packed in order (fewer
    when the texts run out); documents are tokenized 64 at a time."""
    out, carry, batch = [], np.zeros(0, dtype=np.int32), []
    for text in texts:
        batch.append(text)
        if len(batch) < 64:
            continue
        carry = _cut(np.concatenate([carry, *encode(batch)]), window, out, count)
        batch = []
        if len(out) >= count:
            return out[:count]
    if batch:
        _cut(np.concatenate([carry, *encode(batch)]), window, out, count)
    return out[:count]


def _cut(tokens: np.ndarray, window: int, out: list, count: int) -> np.ndarray:
    whole = len(tokens) // window
    out.extend(tokens[i * window : (i + 1) * window] for i in range(min(whole, count)))
    return tokens[whole * window :]


class HFBatches:
    """This rank's batches of ``data=hf`` (see the module docstring): the ``data`` section,
    the model's vocabulary size and sequence length, the global batch, this rank's dp and cp
    coordinates and the seed, as ``TokenBatches`` takes them."""

    stateful = True

    def __init__(
        self,
        data_cfg: DataConfig,
        vocab_size: int,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        cp_rank: int = 0,
        cp_size: int = 1,
    ):
        self.spec = SourceSpec.from_config(data_cfg)
        self.tokenizer: TokenizerSpec = check_tokenizer(data_cfg, vocab_size)
        self.encode = Encoder(self.tokenizer)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.dp_rank, self.cp_rank, self.cp_size = dp_rank, cp_rank, cp_size
        rows = global_batch // dp_size
        self.lanes = range(dp_rank * rows, (dp_rank + 1) * rows)
        self.buffer_size, self.workers = data_cfg.shuffle_buffer, data_cfg.workers
        self.prefetch = data_cfg.prefetch
        self.resumed: dict[int, LaneState] | None = None
        self._held_out: list[np.ndarray] = []

    def held_out(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of held-out batch ``index`` as (inputs, targets), on CPU."""
        need = (index + 1) * self.global_batch
        if len(self._held_out) < need:
            texts = open_docs(self.spec, "val").iter_texts()
            self._held_out = pack_in_order(texts, self.encode, self.seq_len + 1, need)
            if len(self._held_out) < need:
                raise DataError(
                    f"the held-out documents of data.path={self.spec.path!r} fill "
                    f"{len(self._held_out)} windows, fewer than the {need} of held-out batch "
                    f"{index + 1}; raise data.val_fraction or lower trainer.val_batches"
                )
        first = index * self.global_batch + self.lanes.start
        rows = np.stack(self._held_out[first : first + len(self.lanes)])
        return self.split(torch.from_numpy(rows).long())

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of (rows, seq_len + 1) tokens, each cut to this cp rank's part."""
        inputs, targets = rows[:, :-1], rows[:, 1:]
        return (
            shard_sequence(inputs, self.cp_size, self.cp_rank),
            shard_sequence(targets, self.cp_size, self.cp_rank),
        )

    def group(self, lanes: range) -> LaneGroup:
        """A LaneGroup making ``lanes``' windows, resumed where the checkpoint left them."""
        reader = RoundReader(open_docs(self.spec, "train"), self.global_batch)
        states = {lane: self.resumed[lane] for lane in lanes} if self.resumed else None
        return LaneGroup(
            reader,
            self.encode,
            lanes,
            self.global_batch,
            self.buffer_size,
            self.seed,
            self.seq_len + 1,
            states,
        )

    def stream(self, start_step: int, device: torch.device) -> LaneLoader:
        """This rank's batches from ``start_step`` on (``LaneLoader``)."""
        if start_step and self.resumed is None:
            log.warning(
                "no data position was restored (the checkpoint was saved with another "
                "data.kind): the data=hf stream starts from its beginning at step %d",
                start_step + 1,
            )
        return LaneLoader(self, start_step, device)

    def manifest_facts(self, step: int) -> dict:
        """How a checkpoint's manifest describes the position after ``step``: the global
        cursor (``position`` is what the checkpoint itself holds)."""
        return {
            "loader": "data=hf lanes: every lane's state in the checkpoint's data_position",
            "position": {"samples": step * self.global_batch, "lanes": self.global_batch},
        }

    def restore(self, position: dict) -> None:
        """Take the lane states of a saved ``position`` (``position()``'s form) for this
        rank's lanes. Raises ConfigError when it was saved for another number of lanes."""
        if position.get("lanes") != self.global_batch:
            raise ConfigError(
                f"the checkpoint's data position has {position.get('lanes')} lanes (its "
                f"trainer.global_batch_size), this job {self.global_batch}; keep "
                f"trainer.global_batch_size={position.get('lanes')} to resume the data=hf stream"
            )
        self.resumed = {
            lane: LaneState.from_dict(position["states"][str(lane)]) for lane in self.lanes
        }


def position(states: dict, step: int, global_batch: int) -> dict:
    """The JSON-able position a checkpoint saves: every lane's state after ``step`` steps and
    the global cursor (``samples``: ``step * global_batch`` windows of the global batch)."""
    return {
        "format": POSITION_FORMAT,
        "lanes": global_batch,
        "step": step,
        "samples": step * global_batch,
        "states": {str(lane): state for lane, state in sorted(states.items())},
    }


class LaneLoader:
    """This rank's batches of consecutive steps from ``batches``' lanes, from ``start_step``.

    ``get(step)`` returns (inputs, targets) on ``device`` (pinned and copied without blocking
    on CUDA); steps come in order. ``state_at(n)`` is every owned lane's state after step n
    (recent steps only). ``close()`` stops the background work."""

    def __init__(self, batches: HFBatches, start_step: int, device: torch.device):
        self.batches, self.device, self.next_step = batches, device, start_step
        self.pin = device.type == "cuda"
        first = batches.resumed or {lane: LaneState() for lane in batches.lanes}
        self.states = {start_step: {lane: s.to_dict() for lane, s in first.items()}}
        workers = min(batches.workers, len(batches.lanes))
        pin = self.pin
        self.source = (
            _ProcessSource(batches, workers, pin) if workers else _ThreadSource(batches, pin)
        )

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of ``step``, the step after the last one got."""
        if step != self.next_step:
            raise RuntimeError(
                f"data=hf batches come in order: step {step} asked for, {self.next_step} is next"
            )
        rows, states = self.source.next()
        self.states[step + 1] = {**self.states[step], **states}
        for old in [s for s in self.states if s < step - 2]:
            del self.states[old]
        self.next_step = step + 1
        return self.batches.split(rows.to(self.device, non_blocking=True))

    def state_at(self, step: int) -> dict | None:
        """{lane: state} of this rank's lanes after ``step`` steps, if still kept."""
        return self.states.get(step)

    def close(self) -> None:
        """Stop the background thread or worker processes."""
        self.source.close()


def _host_batch(rows: torch.Tensor, pin: bool) -> torch.Tensor:
    """int64 rows, in pinned memory when ``pin`` (a CUDA job: the copy then overlaps)."""
    rows = rows.long()
    return rows.pin_memory() if pin else rows


class _ThreadSource:
    """One background thread making whole steps ahead, ``data.prefetch`` at most, pinned
    there too."""

    def __init__(self, batches: HFBatches, pin: bool):
        self.pin = pin
        self.queue: queue.Queue = queue.Queue(maxsize=batches.prefetch)
        self.stopping = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(batches,), name="hsdp-data", daemon=True
        )
        self.thread.start()

    def _run(self, batches: HFBatches) -> None:
        try:
            group = batches.group(batches.lanes)
            while not self.stopping.is_set():
                rows, states = group.next_rows()
                self._put((_host_batch(torch.from_numpy(rows), self.pin), states))
        except BaseException as err:  # handed to the training thread, which raises it
            self._put(err)

    def _put(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> tuple[torch.Tensor, dict]:
        """The next step's (rows, lane states); re-raises the thread's error."""
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (a step being made is finished and dropped)."""
        self.stopping.set()
        self.thread.join()


class LaneDataset(torch.utils.data.IterableDataset):
    """The endless steps of ``batches``' lanes for a DataLoader: worker w of W makes the
    w-th contiguous part of the lanes and yields (rows, states) per step, or ("error",
    message) once when its data fail (a plain message rather than DataLoader's wrapped
    traceback)."""

    def __init__(self, batches: HFBatches):
        self.batches = batches

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        lanes = np.array_split(np.asarray(self.batches.lanes), info.num_workers)[info.id]
        try:
            group = self.batches.group(range(int(lanes[0]), int(lanes[-1]) + 1))
            while True:
                rows, states = group.next_rows()
                yield torch.from_numpy(rows), states
        except DataError as err:
            yield "error", str(err)
        except Exception as err:
            yield "error", f"{type(err).__name__} in a data worker: {err}"


def _quiet_worker(worker_id: int) -> None:
    """DataLoader worker set-up: one torch thread, tokenizers' threads off (the workers are
    the parallelism), no second copy of the rank's progress output."""
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


class _ProcessSource:
    """``workers`` DataLoader worker processes; a step is one item of each, in worker order
    (DataLoader hands an iterable dataset's items out round-robin), joined (and pinned) in the
    training thread: a copy of the step's tokens."""

    def __init__(self, batches: HFBatches, workers: int, pin: bool):
        self.workers, self.pin = workers, pin
        loader = torch.utils.data.DataLoader(
            LaneDataset(batches),
            batch_size=None,
            num_workers=workers,
            prefetch_factor=batches.prefetch,
            worker_init_fn=_quiet_worker,
        )
        self.iterator = iter(loader)

    def next(self) -> tuple[torch.Tensor, dict]:
        """The next step's (rows, lane states), its workers' parts joined in lane order."""
        parts, states = [], {}
        for _ in range(self.workers):
            rows, part_states = next(self.iterator)
            if isinstance(rows, str):
                raise DataError(part_states)
            parts.append(rows)
            states.update({int(k): v for k, v in part_states.items()})
        return _host_batch(torch.cat(parts), self.pin), states

    def close(self) -> None:
        """Shut the worker processes down."""
        self.iterator = None
