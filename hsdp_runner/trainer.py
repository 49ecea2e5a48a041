"""The training loop: AdamW, warmup + cosine LR, clipping, accumulation, per-step figures.

Runs on every rank with the already-sharded model; rank 0 alone writes the console line,
``metrics.jsonl``, W&B and ``summary.json``.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from hsdp_runner import comm, metrics
from hsdp_runner.comm_model import analytic_comm, comm_report
from hsdp_runner.data import TokenBatches
from hsdp_runner.mesh import ParallelDims, WorldMesh
from hsdp_runner.models.llama import flops_per_token

log = logging.getLogger(__name__)

# Eval batches come from step indices no training run reaches.
EVAL_STEP_OFFSET = 1 << 40


def build_optimizer(model: torch.nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; norms and embeddings get no weight decay."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "tok_embeddings" in name else decay).append(param)
    groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                             eps=optim_cfg.eps, foreach=True)


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


def inject_fault(fault_cfg, rank: int, step: int, phase: str = "step") -> bool:
    """Fail on purpose when ``fault.rank`` is this rank, ``fault.step`` this (1-based) step and
    ``fault.phase`` this phase ('step': its start; 'save': while its checkpoint is written).

    Returns True when the fault is ``nan``: the caller poisons this step's loss.
    """
    if fault_cfg.rank != rank or fault_cfg.step != step or fault_cfg.phase != phase:
        return False
    if fault_cfg.kind == "nan":
        return True
    if fault_cfg.kind == "hang":
        while True:  # never joins the next collective; the peers' timeout ends the job
            time.sleep(3600)
    if fault_cfg.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault_cfg.kind == "sigterm":  # as a scheduler would send it; the step goes on
        os.kill(os.getpid(), signal.SIGTERM)
        return False
    raise RuntimeError(f"injected fault (fault.kind=exception) on rank {rank} at step {step}"
                       + (" while saving its checkpoint" if phase == "save" else ""))


def _full_value(tensor: torch.Tensor) -> float:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).item()


class Trainer:
    """Trains ``model`` for ``cfg.trainer.steps`` steps; ``fit()`` returns the step records."""

    def __init__(self, cfg, dims: ParallelDims, world: WorldMesh, model: torch.nn.Module,
                 device: torch.device, sinks=None):
        self.cfg, self.dims, self.world, self.model, self.device = cfg, dims, world, model, device
        self.rank = dist.get_rank()
        self.sinks = sinks  # rank 0: (MetricsFile, WandbRun); None: report nothing
        self.optimizer = build_optimizer(model, cfg.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.optim.warmup_steps, cfg.trainer.steps,
                                      cfg.optim.min_lr_ratio))
        self.dp_group = world["dp"].get_group()
        self.batches = TokenBatches(
            cfg.data, cfg.model.vocab_size, cfg.model.seq_len, cfg.trainer.global_batch_size,
            dp_rank=world.local_rank_in("dp"), dp_size=dims.dp, seed=cfg.trainer.seed)
        self.flops_per_token = flops_per_token(cfg.model)
        self.peak_tflops, self.peak_source = metrics.resolve_peak_tflops(
            device, cfg.precision.param_dtype, cfg.metrics.peak_tflops)
        self.records: list[dict] = []
        self.skipped_steps = 0
        self.stopped_by: int | None = None  # signal number when a stop request ended fit()
        self.last_step = 0
        # Communication accounting (issue 7): filled after the step ``metrics.comm_step``.
        self.comm_facts: dict = {}

    def loss_on(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the model on one micro-batch (fp32 logits)."""
        logits = self.model(inputs.to(self.device))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.to(self.device).flatten())

    def train_step(self, step: int) -> tuple[float, float, bool]:
        """One optimizer step over the rank's local batch.

        Returns (dp-mean loss, grad norm, skipped). A non-finite loss or grad norm (the same
        on every rank, both being reduced) raises NonFiniteError with ``trainer.on_nan=stop``
        or, with ``skip``, drops the update and returns skipped=True.
        """
        poison = inject_fault(self.cfg.fault, self.rank, step + 1)
        inputs, targets = self.batches.local_batch(step)
        accum = self.cfg.trainer.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for micro, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
            if hasattr(self.model, "set_requires_gradient_sync"):
                # Reduce gradients once, on the last micro-batch.
                self.model.set_requires_gradient_sync(micro == accum - 1)
            loss = self.loss_on(x, y) / accum
            if poison:
                loss = loss * float("nan")
            loss.backward()
            total += loss.detach()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = _full_value(
            torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip, foreach=True))
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_group)
        loss = total.item() / self.dims.dp
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if not finite:
            if self.cfg.trainer.on_nan == "stop":
                raise NonFiniteError(
                    f"step {step + 1}: loss {loss} / grad norm {grad_norm} is not finite; the run "
                    "stops (trainer.on_nan=stop). Lower optim.lr, check the data, or set "
                    "trainer.on_nan=skip to drop such steps")
            self.skipped_steps += 1
            log.warning("step %d: non-finite loss %s / grad norm %s; update skipped "
                        "(trainer.on_nan=skip, %d skipped so far)", step + 1, loss, grad_norm,
                        self.skipped_steps)
        return loss, grad_norm, not finite

    @torch.no_grad()
    def evaluate(self, n_batches: int) -> float:
        """Mean loss over ``n_batches`` held-out batches (never used for training), dp-averaged.

        Runs the model in eval mode through the same sharded forward as training, so it
        exercises FSDP's unshard/reshard outside of backward.
        """
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for i in range(n_batches):
            inputs, targets = self.batches.local_batch(EVAL_STEP_OFFSET + i)
            total += self.loss_on(inputs, targets)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_group)
        self.model.train()
        loss = total.item() / (self.dims.dp * n_batches)
        if self.rank == 0:
            log.info("eval loss %.6f over %d held-out batches", loss, n_batches)
        return loss

    def fit(self, start_step: int = 0, after_step=None, stop=None) -> list[dict]:
        """Run steps ``start_step``..``trainer.steps - 1`` (0-based); reports each to the sinks.

        ``after_step(step)`` is called on every rank after each step with its 1-based number
        (the checkpointer saves there). ``stop`` (an ``interrupt.StopRequest``) is asked after
        each step; when any rank was signalled all stop there and ``stopped_by`` is set.
        Returns the reported records.
        """
        steps = self.cfg.trainer.steps
        tokens = self.cfg.trainer.global_batch_size * self.cfg.model.seq_len
        bar = tqdm(total=steps, initial=start_step, desc="train", unit="step",
                   dynamic_ncols=True, disable=self.rank != 0, leave=False)
        self.model.train()
        for step in range(start_step, steps):
            metrics.reset_peak_memory(self.device)
            lr = self.scheduler.get_last_lr()[0]
            start = time.perf_counter()
            with comm.count_if(step + 1 == self.cfg.metrics.comm_step, self.world) as counter:
                loss, grad_norm, skipped = self.train_step(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            record = metrics.step_record(
                step + 1, loss, grad_norm, lr, time.perf_counter() - start, tokens,
                self.dims.world_size, self.flops_per_token, self.peak_tflops,
                metrics.peak_memory_gib(self.device))
            record["skipped"] = skipped
            self.last_step = step + 1
            if counter is not None:
                record.update(self._comm_record(counter, step + 1))
            bar.update(1)
            if self.sinks is not None:
                self._report(record, bar)
            if after_step is not None:
                after_step(step + 1)
            if stop is not None:
                self.stopped_by = stop.agreed(self.device)
                if self.stopped_by:
                    log.warning("stopping after step %d on %s", step + 1,
                                signal.Signals(self.stopped_by).name)
                    break
        bar.close()
        return self.records

    def _comm_record(self, counter: comm.CommCounter, step: int) -> dict:
        """Keep the measured vs analytic comm facts; return the per-step fields of the record."""
        c = self.cfg
        analytic = analytic_comm(c.model, self.dims, c.parallel, c.precision, c.trainer)
        self.comm_facts = comm_report(counter.result(), analytic, step)
        if self.rank == 0:
            log.info("step %d communication per rank: measured %s bytes, analytic %s bytes "
                     "(ratio %s)", step, f"{self.comm_facts['comm_bytes_measured']:,}",
                     f"{self.comm_facts['comm_bytes_analytic']:,}", self.comm_facts["comm_ratio"])
        return {k: v for k, v in self.comm_facts.items() if k != "comm_step"}

    def _report(self, record: dict, bar) -> None:
        self.records.append(record)
        metrics_file, wandb_run = self.sinks
        metrics_file.log(record)
        wandb_run.log(record)
        if record["step"] % self.cfg.trainer.log_every == 0 or record["step"] == self.cfg.trainer.steps:
            mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
            bar.write(f"step {record['step']:>4}/{self.cfg.trainer.steps}  loss {record['loss']:.4f}  "
                      f"gnorm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
                      f"{record['tps_per_device']:,.0f} tok/s/dev  {record['tps_global']:,.0f} tok/s  "
                      f"{record['tflops']:.3g} TFLOP/s  mfu {mfu}  mem {record['mem_peak_gib']:.2f} GiB  "
                      f"{record['step_time_s']:.2f}s")
