"""One rank's training, from its mesh to its summary: the pieces a job is made of, in order.

``train_rank`` runs once the rank's process group is up (``worker.run_worker``): it builds the
world mesh, the sharded model, where the job starts (checkpoint, HF folder or fresh), the run's
fixed figures, the trainer and the checkpointer, trains, saves on a stop request, and on rank 0
writes the summary to the sinks. ``make_trainer`` and ``make_checkpointer`` are also what
in-process tests build a job from.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from hsdp_runner.checkpoint import start as checkpoint_start
from hsdp_runner.checkpoint.checkpointer import Checkpointer
from hsdp_runner.config.compose import plain_config
from hsdp_runner.config.schema import CheckpointConfig, RunConfig
from hsdp_runner.core.choices import RunStatus, StartSource
from hsdp_runner.core.records import RunInfo, RunSummary, precision_label
from hsdp_runner.distributed import expert_balance, float8
from hsdp_runner.distributed.hardware import cpu_model
from hsdp_runner.distributed.parallel_dims import DIM_NAMES, ParallelDims, WorldMesh
from hsdp_runner.distributed.pipeline import Schedule, build_stages
from hsdp_runner.distributed.topology import FLATTENED, observed_placements
from hsdp_runner.models.base import build_meta_model, model_spec, routed_experts
from hsdp_runner.report import prediction
from hsdp_runner.runtime.signals import StopRequest, signal_name
from hsdp_runner.train import metrics, profiling, sinks
from hsdp_runner.train.data import make_batches
from hsdp_runner.train.figures import RunFigures, compute_run_figures, run_peak
from hsdp_runner.train.loss import loss_parallel_on, trainer_loss
from hsdp_runner.train.tensor_memory import TensorMemoryMeter
from hsdp_runner.train.trainer import Trainer

log = logging.getLogger("hsdp_runner")


def train_rank(
    cfg: RunConfig,
    dims: ParallelDims,
    run_info: RunInfo,
    device: torch.device,
    output_dir: Path,
    rank: int,
    stop: StopRequest,
) -> RunSummary | None:
    """Train this rank of the job ``cfg`` once its process group is up: mesh, model, where it
    starts, trainer, checkpointer, the run's sinks on rank 0; return rank 0's RunSummary (None
    on other ranks). A stop request ends training at a step boundary with a checkpoint."""
    world = dims.build_mesh(device.type, cfg.launcher.timeout_s)
    log.info(
        "mesh %s over %s (%s, %d ranks)",
        dict(zip(world.root.mesh_dim_names, dims.shape)),
        device.type,
        dims.layout,
        dims.world_size,
    )
    # How the real process groups of every dim sit on the nodes: recorded so that it can be
    # checked against the planner's arithmetic. A collective: every rank calls it.
    placements = observed_placements(world, (*DIM_NAMES, *FLATTENED))
    # The MFU's peak, before the meter starts: measuring it on a CPU allocates matrices that
    # are not the job's tensor memory.
    peak = run_peak(cfg, dims, device)
    # What the process holds before the model exists (interpreter, torch, process groups),
    # and from here the tensor memory the model and the first steps add: the planner's figure.
    mem_baseline = metrics.current_memory_gib(device)
    meter = TensorMemoryMeter(device, cfg.metrics.memory_steps, enabled=not cfg.profile.enable)
    meter.start()
    schedule = build_rank_model(cfg, dims, world, device)
    # Where the state comes from (checkpoint, HF folder or fresh); a resumed job's
    # metrics.jsonl keeps only the steps up to its checkpoint, the later ones are trained again.
    start = checkpoint_start.agree_on_start(cfg.checkpoint, cfg.model, output_dir)
    figures = compute_run_figures(cfg, dims, schedule.parts, device, peak)
    trackers: list[sinks.Tracker] = []
    if rank == 0:
        _prepare_metrics(cfg.checkpoint, output_dir, start)
        facts = {**run_facts(dims, device), "mesh_placement": placements}
        # W&B's grouping key for the numerics (config.derived.precision), as compare shows it.
        label = precision_label(
            dataclasses.asdict(cfg.precision), cfg.parallel.compile, cfg.parallel.compile_backend
        )
        config = {**plain_config(cfg), "derived": {**facts, "precision": label}}
        trackers = sinks.open_trackers(cfg.logger, run_info, config, output_dir)
        _log_figures(figures)
    trainer = make_trainer(cfg, dims, world, schedule, device, figures, trackers)
    ckpt = make_checkpointer(cfg, output_dir, trainer)
    try:
        first = ckpt.restore(start)
        profiler = profiling.StepProfiler(cfg.profile, rank, output_dir, device)
        records = trainer.fit(first, meter.wrap(profiler.wrap(ckpt.after_step, first), first), stop)
        meter.stop()  # a run of fewer steps than the meter covers
        # A signal during the last step stops nothing: training is complete (saved as usual).
        stopped = trainer.stopped_by if trainer.last_step < cfg.trainer.steps else None
        if stopped:
            _save_on_stop(cfg.checkpoint, ckpt, trainer.last_step)
        elif trainer.stopped_by and rank == 0:
            log.warning(
                "%s arrived during the last step: training is complete, finishing the job",
                signal_name(trainer.stopped_by),
            )
    except BaseException:
        if rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the flush must not be cut short
        for sink in trackers:
            sink.finish(exit_code=1)
        raise
    if not stopped:  # an unfinished run is not exported; its rerun exports at its end
        ckpt.export_at_end()
    eval_loss = None
    if cfg.trainer.eval_batches and not stopped:
        eval_loss = trainer.evaluate(cfg.trainer.eval_batches)
    # A collective: every rank calls it.
    memory = _memory_facts(device, figures.memory_estimate, mem_baseline, meter.peak_gib)
    if rank != 0:
        return None
    interrupted = (
        {
            "status": RunStatus.interrupted,
            "interrupted_at_step": trainer.last_step,
            "signal": signal_name(stopped),
        }
        if stopped
        else {}
    )
    summary = RunSummary(
        **{
            "status": RunStatus.completed,
            **facts,
            "steps": len(records),
            "skipped_steps": trainer.skipped_steps,
            "final_loss": records[-1]["loss"] if records else None,
            "eval_loss": eval_loss,
            # The last validation of the whole run (a resumed job's may be in an earlier attempt).
            "val_loss": next(
                (
                    r["val_loss"]
                    for r in reversed(sinks.read_metrics(output_dir))
                    if "val_loss" in r
                ),
                None,
            ),
            "peak_tflops": figures.peak_tflops,
            "peak_tflops_source": figures.peak_source,
            "flops_per_token": figures.flops_per_token,
            **metrics.steady_state(records, cfg.metrics.warmup_steps),
            **ckpt.facts,
            **memory,
            **trainer.comm_facts,
            **interrupted,
        }
    )
    summary.prediction = prediction.job_prediction(config, summary)
    for sink in trackers:
        sink.log_summary(summary)
        sink.finish()
    return summary


def build_rank_model(
    cfg: RunConfig, dims: ParallelDims, world: WorldMesh, device: torch.device
) -> Schedule:
    """This rank's sharded stage chunks on ``device`` and the schedule that runs them
    (``pipeline.build_stages``: the whole model as one stage without pipeline parallel),
    with the trainer's loss."""
    return build_stages(
        cfg.model,
        dims,
        world,
        cfg.parallel,
        cfg.precision,
        cfg.trainer,
        device,
        trainer_loss(cfg.trainer.chunked_loss, cfg.trainer.loss_fp32),
    )


def rank_trainer(
    cfg: RunConfig,
    device: torch.device | None = None,
    timeout_s: float | None = None,
    ranks_per_node: int | None = None,
) -> tuple[Trainer, ParallelDims]:
    """A rank's trainer built in a process whose process group is already up (tests, the
    overhead benchmark's interleaved loop), as ``train_rank`` builds one: the world mesh of
    ``cfg``'s degrees, the stage chunks and their schedule, the run's fixed figures, the
    trainer without sinks. ``device``: the CPU by default; ``timeout_s``: the mesh's collective
    timeout (None: the process group's); ``ranks_per_node``: the ranks per node the degrees
    are told, as a launch's LOCAL_WORLD_SIZE tells a job (None: one node). Returns (trainer,
    dims); ``trainer.parts`` holds the rank's stage chunks."""
    device = device or torch.device("cpu")
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, dist.get_world_size(), ranks_per_node)
    world = dims.build_mesh(device.type, timeout_s)
    schedule = build_rank_model(cfg, dims, world, device)
    figures = compute_run_figures(cfg, dims, schedule.parts, device)
    return make_trainer(cfg, dims, world, schedule, device, figures, trackers=[]), dims


def make_trainer(
    cfg: RunConfig,
    dims: ParallelDims,
    world: WorldMesh,
    schedule: Schedule,
    device: torch.device,
    figures: RunFigures,
    trackers: list[sinks.Tracker],
) -> Trainer:
    """Build the Trainer from the typed config: the rank's ``schedule`` (``build_rank_model``),
    the sections it uses, this rank's batches and the run's fixed figures; ``trackers`` on rank
    0 (an empty list elsewhere)."""
    batches = make_batches(
        cfg.data,
        cfg.model.vocab_size,
        cfg.model.seq_len,
        cfg.trainer.global_batch_size,
        dp_rank=world.local_rank_in("dp"),
        dp_size=dims.dp,
        seed=cfg.trainer.seed,
        cp_rank=world.local_rank_in("cp"),
        cp_size=dims.cp,
    )
    return Trainer(
        schedule,
        dims,
        world,
        device,
        batches,
        figures,
        spec=model_spec(cfg.model),
        optim=cfg.optim,
        train=cfg.trainer,
        metrics=cfg.metrics,
        fault=cfg.fault,
        sinks=trackers,
        after_update=_after_update(
            float8.after_update(schedule.parts, cfg.precision, dims.dp_mode),
            _balance_step(cfg, dims, schedule, device),
        ),
        loss_parallel=loss_parallel_on(cfg.parallel.loss_parallel, dims.tp),
    )


def _balance_step(cfg: RunConfig, dims: ParallelDims, schedule: Schedule, device: torch.device):
    """The experts' balance step of this rank's stage chunks (``expert_balance``; the bias
    update speed is ``model.bias_update_speed``), or None for a dense model."""
    experts = routed_experts(cfg.model)
    if not experts:
        return None
    speed = float(getattr(cfg.model, "bias_update_speed", 0.0) or 0.0)
    meta = build_meta_model(cfg.model)
    return expert_balance.balance_step(schedule.parts, meta, experts, speed, dims, device)


def _after_update(*hooks):
    """One hook running each of ``hooks`` (None ones left out) after the optimizer step, in
    order, each given the step's ``applied`` flag (a 0-dim device tensor: 1.0 when the
    optimizer applied the step, 0.0 when it skipped a non-finite one), and returning their
    figures merged; None when there is none."""
    hooks = [hook for hook in hooks if hook is not None]
    if not hooks:
        return None

    def run(applied: torch.Tensor) -> dict:
        figures = {}
        for hook in hooks:
            figures.update(hook(applied) or {})
        return figures

    return run


def make_checkpointer(cfg: RunConfig, output_dir: Path, trainer: Trainer) -> Checkpointer:
    """Build the Checkpointer over the trainer's model, optimizer and LR scheduler."""
    return Checkpointer(
        cfg.checkpoint, trainer, output_dir, model=cfg.model, precision=cfg.precision, data=cfg.data
    )


def _log_figures(figures: RunFigures) -> None:
    mem = figures.memory_estimate
    log.info("peak %s TFLOP/s per device (%s)", _fmt(figures.peak_tflops), figures.peak_source)
    log.info(
        "memory estimate per rank: params %.3f + grads %.3f + optimizer %.3f = %.3f GiB "
        "(activations and gathered parameters come on top)",
        mem["params"],
        mem["grads"],
        mem["optimizer"],
        mem["total"],
    )


def _prepare_metrics(
    ckpt_cfg: CheckpointConfig, output_dir: Path, start: checkpoint_start.Start
) -> None:
    """Rank 0, before the first step: a job resuming its own checkpoint keeps each step up to
    it once in metrics.jsonl; any other start sets an earlier run's files aside."""
    own = start.source is StartSource.checkpoint and Path(
        start.path
    ).parent == checkpoint_start.checkpoint_dir(ckpt_cfg, output_dir)
    if own:
        sinks.truncate_metrics(output_dir, start.step)
    elif (aside := sinks.set_aside_earlier_run(output_dir)) is not None:
        log.warning(
            "this run starts afresh; the earlier run's metrics.jsonl and summary.json "
            "in this dir were moved to %s",
            aside,
        )


def _save_on_stop(ckpt_cfg: CheckpointConfig, ckpt: Checkpointer, step: int) -> None:
    """After a stop request, save the step just finished unless it was saved already
    (``ckpt_cfg``: the ``checkpoint`` config)."""
    if not ckpt_cfg.enable:
        log.warning(
            "stopped after step %d; checkpointing is off (checkpoint.enable=false), so "
            "a rerun starts over",
            step,
        )
        return
    if ckpt.facts["last_checkpoint"] != str(ckpt.folder / f"step-{step}"):
        ckpt.save(step)
    log.warning(
        "stopped after step %d; checkpoint %s; rerun the same command to resume",
        step,
        ckpt.facts["last_checkpoint"],
    )


def _memory_facts(
    device: torch.device, estimate: dict, baseline: float, tensor_peak: float | None
) -> dict:
    """Every rank's peak memory (allocated; reserved on CUDA), its memory before the model
    was built (``baseline``, GiB), the peak of tensor memory added since then
    (``tensor_peak``, GiB, None when not measured) and the state estimate."""
    mine = (
        metrics.peak_memory_gib(device),
        metrics.peak_reserved_gib(device),
        baseline,
        tensor_peak,
    )
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    facts = {
        "mem_peak_gib_per_rank": [m[0] for m in every],
        # The ranks differ (pipeline stages most): the busiest one is what must fit.
        "mem_peak_gib_max": max(m[0] for m in every),
        "mem_baseline_gib_per_rank": [m[2] for m in every],
        "mem_tensor_peak_gib_per_rank": [m[3] for m in every],
        "mem_estimate_gib": estimate,
    }
    if device.type == "cuda":
        facts["mem_reserved_gib_per_rank"] = [m[1] for m in every]
    return facts


def run_facts(dims: ParallelDims, device: torch.device) -> dict:
    """Derived facts recorded with every run: mesh, device, the rank's intra-op CPU threads,
    versions."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {
        **dims.describe(),
        "device": device.type,
        "device_name": name,
        "cpu_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "hostname": platform.node(),
    }


def _fmt(value) -> str:
    return "unknown" if value is None else f"{value:.3f}"
