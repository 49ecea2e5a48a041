"""The training loop: AdamW, warmup + cosine LR, clipping, accumulation, per-step figures.

Runs on every rank with the already-sharded model; rank 0 alone writes the console line,
``metrics.jsonl``, W&B and ``summary.json``. The host runs a step ahead of the device: per
step one collective of its own and one host read, one step late (``step_stats``), and the
next batch is made in the background (``data.Prefetcher``, or a data=hf stream); how long a
step waited for it is its record's ``data_wait_s``. With ``trainer.val_every`` the held-out
batches are evaluated every that many steps (the record's ``val_loss``).
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from hsdp_runner.config.schema import FaultConfig, MetricsConfig, OptimConfig, TrainerConfig
from hsdp_runner.core.choices import OnNan
from hsdp_runner.core.faults import inject_fault
from hsdp_runner.distributed import comm_counting, step_stats
from hsdp_runner.distributed.comm_model import comm_report
from hsdp_runner.distributed.expert_parallel import recording_routing
from hsdp_runner.distributed.parallel_dims import ParallelDims, WorldMesh
from hsdp_runner.distributed.pipeline import Schedule
from hsdp_runner.models.base import ModelSpec
from hsdp_runner.train import metrics
from hsdp_runner.train.data import Prefetcher, TokenBatches
from hsdp_runner.train.figures import RunFigures
from hsdp_runner.train.grad_clip import local_norm_square, scale_to_norm
from hsdp_runner.train.hf_batches import HFBatches, LaneLoader
from hsdp_runner.train.loss import loss_context
from hsdp_runner.train.optimizer import build_optimizer
from hsdp_runner.train.sinks import Tracker

log = logging.getLogger(__name__)


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float):
    """Return step -> LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class NonFiniteError(RuntimeError):
    """A step produced a NaN/inf loss or gradient norm and ``trainer.on_nan=stop``."""


def progress_bar(steps: int, start_step: int, rank: int, console=None) -> tqdm:
    """Rank 0's bar over ``steps`` from ``start_step``; shown only when ``console`` (default
    stdout, where the per-step lines go) is a terminal, disabled elsewhere.

    In a file or a pipe the bar's redraws would interleave with the step lines, which then
    report progress alone. tqdm's own ``disable=None`` tests the bar's stream, stderr, which
    on rank 0 is the sidecar's pipe even on a terminal, so it cannot tell."""
    console = sys.stdout if console is None else console
    return tqdm(
        total=steps,
        initial=start_step,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=rank != 0 or not console.isatty(),
        leave=False,
    )


class Trainer:
    """Trains a rank's stages for ``train.steps`` steps; ``fit()`` returns the step records.

    Takes the rank's ``schedule`` (``distributed.pipeline``: its stage chunks, ``parts``, and
    how a step runs through them: the whole model's micro-batches in turn, or a pipeline's),
    the job's ParallelDims and world mesh, the rank's device, its batches and the run's fixed
    figures (computed once, ``figures``); then the config it reads: the model's spec (which
    parameters get no weight decay) and the ``optim``, ``trainer``, ``metrics``
    (``comm_step``: the step whose collectives are counted) and ``fault`` sections; rank 0's
    sinks (an empty list elsewhere); ``after_update``, run after every optimizer step (float8
    all-gather's scale precompute, ``distributed.float8``; the experts' balance step,
    ``distributed.expert_balance``), which may return figures of the step ({name: 0-dim device
    tensor}, read with the step's stats and added to its record); and ``loss_parallel``,
    whether the logits are sharded over the vocabulary (the loss's context, ``train.loss``).
    """

    def __init__(
        self,
        schedule: Schedule,
        dims: ParallelDims,
        world: WorldMesh,
        device: torch.device,
        batches: TokenBatches | HFBatches,
        figures: RunFigures,
        *,
        spec: ModelSpec,
        optim: OptimConfig,
        train: TrainerConfig,
        metrics: MetricsConfig,
        fault: FaultConfig,
        sinks: list[Tracker] = (),
        after_update: Callable[[torch.Tensor], dict[str, torch.Tensor] | None] | None = None,
        loss_parallel: bool = False,
    ):
        self.schedule, self.parts = schedule, schedule.parts
        self.dims, self.world, self.device = dims, world, device
        self.loss_parallel = loss_parallel  # the logits are sharded over the vocabulary
        self.batches, self.train, self.figures, self.fault = batches, train, figures, fault
        self.grad_clip, self.comm_step = optim.grad_clip, metrics.comm_step
        if self.comm_step == 1:  # the first step that later ones repeat, if the run has it
            self.comm_step = min(schedule.repeated_from, train.steps)
        self.rank = dist.get_rank()
        self.sinks = list(sinks)
        self.after_update = after_update
        self.optimizer = build_optimizer(self.parts, optim, spec.no_weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(optim.warmup_steps, train.steps, optim.min_lr_ratio)
        )
        # The per-step stats all-reduce (and eval's) counts each dp x cp rank's loss once: on
        # its tp rank 0 of the rank holding the last stage (the only one that computes the
        # loss). dp ranks read different rows, cp ranks different parts of each sequence
        # (equal token counts), so the loss is their mean.
        self.counts_loss = world.local_rank_in("tp") == 0 and schedule.is_last
        self.records: list[dict] = []
        self.stream: Prefetcher | LaneLoader | None = None  # the batches of fit()
        self._data_wait: dict[int, float] = {}  # step -> seconds it waited for its batch
        self._val_loss: dict[int, float] = {}  # 1-based step -> validation loss after it
        self.skipped_steps = 0
        self.stopped_by: int | None = None  # signal number when a stop request ended fit()
        self.last_step = 0
        # Communication accounting: filled after the step ``comm_step``. The counter is built
        # here: it looks up the mesh's groups, host work no step should do.
        self.comm_facts: dict = {}
        self.comm_counter = None if self.comm_step is None else comm_counting.CommCounter(world)
        # The counted step's token exchange rows per forward dispatch (expert parallel only).
        self.comm_routing: list[tuple[int, int]] | None = None

    def _forward_backward(
        self, step: int, data: Prefetcher | LaneLoader, signum: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue step ``step``'s forward and backward (the schedule's micro-batches), the
        stats all-reduce (which sums the gradient norm's squares too) and the clipping over
        every stage's gradients.

        Returns the all-reduced stats vector, on the device; nothing is read.
        """
        poison = inject_fault(self.fault, self.rank, step + 1)
        waited = time.perf_counter()
        inputs, targets = data.get(step)
        self._data_wait[step] = time.perf_counter() - waited
        loss = self.schedule.step(inputs, targets, poison)
        grads = [p.grad for part in self.parts for p in part.parameters() if p.grad is not None]
        square = local_norm_square(grads, self.dims.world_size // self.dims.pp)
        stats = step_stats.pack(loss, square, self.counts_loss, signum)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        scale_to_norm(grads, stats[step_stats.NORM_SQ].sqrt(), self.grad_clip)
        return stats

    def _update(self, stats: torch.Tensor) -> dict[str, torch.Tensor]:
        """Queue the optimizer step, skipped on the device when any rank saw a non-finite
        loss or grad norm (fused AdamW's ``found_inf``: parameters, moments and step counts
        stay as they were), ``after_update``, then the LR schedule's step. Returns the
        figures ``after_update`` gave (none without)."""
        self.optimizer.found_inf = (stats[step_stats.NONFINITE] > 0).float()
        self.optimizer.step()
        applied = 1.0 - self.optimizer.found_inf  # 0-dim: 1 applied, 0 skipped
        figures = self.after_update(applied) if self.after_update is not None else None
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return figures or {}

    @torch.no_grad()
    def evaluate(self, n_batches: int, what: str = "eval") -> float:
        """Mean loss over ``n_batches`` held-out batches (never used for training), dp-averaged
        (``what`` names it in the log: eval after training, or validation during it).

        Runs the stages in eval mode through the same sharded forward as training, so it
        exercises FSDP's unshard/reshard outside of backward.
        """
        for part in self.parts:
            part.eval()
        total = torch.zeros((), device=self.device)
        with loss_context(self.loss_parallel):
            for i in range(n_batches):
                inputs, targets = self.batches.held_out(i)
                loss = self.schedule.eval_loss(inputs.to(self.device), targets.to(self.device))
                total += loss if self.counts_loss else 0.0
        dist.all_reduce(total, op=dist.ReduceOp.SUM)  # each dp x cp rank's loss once
        for part in self.parts:
            part.train()
        loss = total.item() / (self.dims.dp_cp * n_batches)
        if self.rank == 0:
            log.info("%s loss %.6f over %d held-out batches", what, loss, n_batches)
        return loss

    def _validate(self, done: int) -> None:
        """With ``trainer.val_every``: the validation loss once ``done`` steps are done (their
        updates queued), kept for step ``done``'s record."""
        every = self.train.val_every
        if every and done % every == 0 and done not in self._val_loss:
            self._val_loss[done] = self.evaluate(self.train.val_batches, f"step {done}: val")

    def data_state(self, step: int) -> dict | None:
        """This rank's data position after ``step`` steps (a data=hf stream's lane states;
        None for stateless data), for the checkpoint."""
        if self.stream is None or (state := self.stream.state_at(step)) is None:
            if self.batches.stateful:
                raise RuntimeError(f"no data position kept for step {step}")
            return None
        return state

    def fit(self, start_step: int = 0, after_step=None, stop=None) -> list[dict]:
        """Run steps ``start_step``..``train.steps - 1`` (0-based); reports each to the sinks.

        Step s's results are read (one host read) once step s+1's forward and backward are
        queued, before step s+1's optimizer step; then step s is reported and
        ``after_step(s + 1)`` is called on every rank with its 1-based number (the
        checkpointer saves there: the weights are those after step s). ``stop`` (an
        ``runtime.signals.StopRequest``) is sampled into each step's stats all-reduce; when any rank
        was signalled, all stop after that step (step s+1's gradients are dropped) and
        ``stopped_by`` is set. A non-finite step is never applied; with
        ``trainer.on_nan=stop`` NonFiniteError is raised when it is read, with ``skip`` it
        is counted. With ``trainer.val_every`` the held-out batches are evaluated once every
        that many steps are done (before the next step's forward), into that step's record
        (``val_loss``). Returns the reported records.
        """
        steps = self.train.steps
        bar = progress_bar(steps, start_step, self.rank)
        for part in self.parts:
            part.train()
        data = self.stream = self.batches.stream(start_step, self.device)
        pending = None
        try:
            for step in range(start_step, steps):
                if step > start_step:
                    self._validate(step)
                counter = self.comm_counter if step + 1 == self.comm_step else None
                marks = [step_stats.mark(self.device)]
                with (
                    comm_counting.counting(counter),
                    loss_context(self.loss_parallel),
                    recording_routing(self.parts, counter is not None) as routing,
                ):
                    stats = self._forward_backward(
                        step, data, stop.signum if stop is not None else None
                    )
                if routing is not None:
                    self.comm_routing = routing
                marks.append(step_stats.mark(self.device))
                if pending is not None and self._finish(pending, after_step, bar):
                    pending = None
                    self.optimizer.zero_grad(set_to_none=True)  # step s+1 is dropped
                    break
                marks.append(step_stats.mark(self.device))
                lr = self.scheduler.get_last_lr()[0]
                with comm_counting.counting(counter):
                    figures = self._update(stats)
                marks.append(step_stats.mark(self.device))
                pending = step_stats.PendingStep(
                    step, lr, stats, marks, counter, self.dims.dp_cp, figures
                )
            if pending is not None:
                self._validate(pending.step + 1)
                self._finish(pending, after_step, bar)
        finally:
            data.close()
            bar.close()
        return self.records

    def _finish(self, pending: step_stats.PendingStep, after_step, bar) -> bool:
        """Read a queued step, act on a non-finite one, report it, run ``after_step``.

        Returns True when the ranks agreed to stop (``stopped_by`` is then set).
        """
        values = pending.read()
        step = pending.step + 1
        if values.nonfinite:
            if self.train.on_nan is OnNan.stop:
                raise NonFiniteError(
                    f"step {step}: loss {values.loss} / grad norm {values.grad_norm} is not "
                    "finite; the run stops (trainer.on_nan=stop). Lower optim.lr, check the "
                    "data, or set trainer.on_nan=skip to drop such steps"
                )
            self.skipped_steps += 1
            log.warning(
                "step %d: non-finite loss %s / grad norm %s; update skipped "
                "(trainer.on_nan=skip, %d skipped so far)",
                step,
                values.loss,
                values.grad_norm,
                self.skipped_steps,
            )
        tokens = self.batches.global_batch * self.batches.seq_len
        record = metrics.step_record(
            step,
            values.loss,
            values.grad_norm,
            pending.lr,
            pending.seconds(),
            tokens,
            self.dims.world_size,
            self.figures.flops_per_token,
            self.figures.peak,
            metrics.peak_memory_gib(self.device),
        )
        record["skipped"] = values.nonfinite
        record.update(values.figures)
        record["data_wait_s"] = self._data_wait.pop(pending.step)
        if step in self._val_loss:
            record["val_loss"] = self._val_loss.pop(step)
        self.last_step = step
        if pending.counter is not None:
            record.update(self._comm_record(pending.counter, step))
        bar.update(1)
        self._report(record, bar)
        if after_step is not None:
            after_step(step)
        if values.signum:
            self.stopped_by = values.signum
            log.warning("stopping after step %d on %s", step, signal.Signals(values.signum).name)
            return True
        return False

    def _comm_record(self, counter: comm_counting.CommCounter, step: int) -> dict:
        """Keep the measured vs analytic comm facts (the analytic figure with the counted
        step's routing, under expert parallel); return the per-step fields of the record."""
        analytic = self.figures.analytic_comm(routing=self.comm_routing)
        self.comm_facts = comm_report(counter.result(), analytic, step)
        if self.rank == 0:
            log.info(
                "step %d communication per rank: measured %s bytes, analytic %s bytes (ratio %s)",
                step,
                f"{self.comm_facts['comm_bytes_measured']:,}",
                f"{self.comm_facts['comm_bytes_analytic']:,}",
                self.comm_facts["comm_ratio"],
            )
        return {k: v for k, v in self.comm_facts.items() if k != "comm_step"}

    def _report(self, record: dict, bar) -> None:
        """Keep the record (every rank), hand it to the sinks, print rank 0's console line."""
        self.records.append(record)
        for sink in self.sinks:
            sink.log_step(record)
        step = record["step"]
        if self.rank == 0 and (step % self.train.log_every == 0 or step == self.train.steps):
            mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
            val = f"val {record['val_loss']:.4f}  " if "val_loss" in record else ""
            bar.write(
                f"step {record['step']:>4}/{self.train.steps}  loss {record['loss']:.4f}  {val}"
                f"gnorm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
                f"{record['tps_per_device']:,.0f} tok/s/dev  {record['tps_global']:,.0f} tok/s  "
                f"{record['tflops']:.3g} TFLOP/s  mfu {mfu}  mem {record['mem_peak_gib']:.2f} GiB  "
                f"{record['step_time_s']:.2f}s"
            )
