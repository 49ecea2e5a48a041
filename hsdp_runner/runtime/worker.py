"""One rank's life: process group, logs, mesh, model, training, summary, clean exit.

``run_worker`` is the function the elastic launcher starts in each process, and the one a
``torchrun`` rank calls directly. It lives in an importable module because spawned workers
must be able to import it.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import platform
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hsdp_runner.checkpoint import start as checkpoint_start
from hsdp_runner.checkpoint.checkpointer import Checkpointer
from hsdp_runner.config.compose import plain_config, to_run_config
from hsdp_runner.config.schema import CheckpointConfig, RunConfig
from hsdp_runner.core.choices import RunStatus, StartSource
from hsdp_runner.core.records import RunInfo, RunSummary
from hsdp_runner.distributed.hardware import pick_device, set_cpu_threads
from hsdp_runner.distributed.parallel_dims import DIM_NAMES, ParallelDims, WorldMesh
from hsdp_runner.distributed.parallelize import build_model
from hsdp_runner.distributed.topology import FLATTENED, observed_placements
from hsdp_runner.models.base import model_spec
from hsdp_runner.report import prediction
from hsdp_runner.runtime import sidecar as rank0_sidecar
from hsdp_runner.runtime.failures import (
    NCCL_ERROR_HANDLING,
    PEER_LOST_GRACE_S,
    mark_attempt,
    nccl_failure_env,
    peer_lost,
    record_rank_failure,
    record_stopped_at_once,
)
from hsdp_runner.runtime.signals import StopNow, StopRequest, signal_name, stop_signals
from hsdp_runner.runtime.slurm import requeue_if_asked
from hsdp_runner.train import metrics, profiling
from hsdp_runner.train import sinks as tracking
from hsdp_runner.train.data import TokenBatches
from hsdp_runner.train.figures import RunFigures, compute_run_figures
from hsdp_runner.train.tensor_memory import TensorMemoryMeter
from hsdp_runner.train.trainer import Trainer

log = logging.getLogger("hsdp_runner")


def setup_logging(output_dir: Path, rank: int) -> None:
    """Rank 0 logs to the console and ``logs/rank0.log``; other ranks only to their own file.

    Non-zero ranks also point their stdout/stderr file descriptors at their log, so warnings
    from C++ and third-party code do not clutter the console (rank 0's stderr reaches its log
    through its sidecar, started by ``run_worker``).
    """
    logs = output_dir / "logs"
    mark_attempt(logs, rank)
    path = logs / f"rank{rank}.log"
    handlers: list[logging.Handler] = [logging.FileHandler(path)]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    fmt = logging.Formatter(
        f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    # clip_grad_norm_ over a 3-D mesh warns on every step that two all-reduces are used.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def run_worker(cfg_dict: dict, dims: ParallelDims, run_info: RunInfo) -> RunSummary | None:
    """Train one rank of the job described by the resolved config ``cfg_dict``.

    Takes the plain resolved config (converted here, once, into the typed ``RunConfig``), the
    validated ParallelDims and run facts (output dir, W&B group, run name, tags). Returns rank
    0's summary (None on other ranks).
    """
    cfg = to_run_config(cfg_dict)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # A stop signal (interrupt.py) only sets a flag: the ranks agree to stop at the next step
    # boundary, save a checkpoint and write an 'interrupted' summary; a collective with a dead
    # peer fails first. A later signal stops at once (StopNow).
    stop = StopRequest()
    stop.install(stop_signals(cfg.launcher.signal))
    output_dir = Path(run_info.output_dir)
    setup_logging(output_dir, rank)
    # Rank 0's stderr goes through a process that outlives it (its C++ last words reach its
    # log; under torchrun / SLURM it records a rank 0 that died without a word).
    sidecar = (
        rank0_sidecar.start(
            output_dir, None if run_info.local_launch else dims.describe(), cfg.launcher.timeout_s
        )
        if rank == 0
        else None
    )
    faulthandler.enable(all_threads=True)  # a rank killed in C++ leaves its Python stack in its log
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    set_cpu_threads(local_world_size)
    device = pick_device(cfg.device, local_rank, local_world_size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        for key, value in nccl_failure_env(output_dir / "logs").items():
            os.environ.setdefault(key, value)  # the user's own TORCH_NCCL_* settings win
        key, ours = NCCL_ERROR_HANDLING
        if rank == 0 and os.environ[key] != ours:  # torchrun's agent default, or the user's
            log.warning(
                "%s=%s, not the runner's %s: under torchrun the agent sets 1 unless "
                "you export %s=%s (docs/gpu.md)",
                key,
                os.environ[key],
                ours,
                key,
                ours,
            )
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=cfg.launcher.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        summary = _train(cfg, dims, run_info, device, output_dir, rank, stop)
    except BaseException as err:
        if peer_lost(err):
            time.sleep(PEER_LOST_GRACE_S)
        _record_failure(cfg.checkpoint, dims, output_dir, rank, err)
        end_process_group(failed=True)
        if sidecar is not None:
            sidecar.stop()
        raise
    end_process_group(failed=False)
    if sidecar is not None:
        sidecar.stop()
    if summary is not None and summary.status is RunStatus.interrupted:
        requeue_if_asked(cfg.launcher, stop, summary)
    return summary


def end_process_group(failed: bool) -> None:
    """Tear down the process groups; ``failed``: this rank is leaving on an exception.

    On success (and on gloo) an orderly teardown: without it a gloo worker that used
    DeviceMesh often aborts at interpreter exit (SIGABRT, exit code 1) although training
    finished. A failing NCCL rank aborts its communicators instead: NCCL's
    ``destroy_process_group`` waits for the peers' communicators (read in torch 2.13's
    ``distributed_c10d.py``), which are still in the collectives this rank left, so the rank
    would hang until the watchdog's timeout and the launcher would report a peer's timeout
    minutes later instead of this rank's error (a CUDA out-of-memory, often).
    """
    if failed and dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        try:
            _abort_process_group()
        except Exception as err:  # the rank's own error is the one to report
            log.warning("aborting the NCCL process groups failed: %s", err)
        return
    if not failed:
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def _record_failure(
    ckpt_cfg: CheckpointConfig, dims: ParallelDims, output_dir: Path, rank: int, err: BaseException
) -> None:
    """Log why this rank ends early and, if it is the first rank of this attempt to end so,
    write summary.json: ``interrupted`` for a stop-at-once signal, else ``failed``."""
    last_ckpt = checkpoint_start.newest_checkpoint(ckpt_cfg, output_dir)
    if isinstance(err, StopNow):
        log.warning("rank %d stopped at once on a repeated %s", rank, signal_name(err.signum))
        record_stopped_at_once(
            output_dir,
            dims.describe(),
            signal_name(err.signum),
            tracking.last_step(output_dir),
            last_ckpt,
        )
        return
    log.exception("rank %d failed", rank)
    summary = record_rank_failure(output_dir, dims.describe(), rank, err, last_ckpt)
    if summary.failed_rank != rank:
        log.error("rank %d failed first: %s", summary.failed_rank, summary.error)


def _train(
    cfg: RunConfig,
    dims: ParallelDims,
    run_info: RunInfo,
    device: torch.device,
    output_dir: Path,
    rank: int,
    stop: StopRequest,
) -> RunSummary | None:
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
    # What the process holds before the model exists (interpreter, torch, process groups),
    # and from here the tensor memory the model and the first steps add: the planner's figure.
    mem_baseline = metrics.current_memory_gib(device)
    meter = TensorMemoryMeter(device, cfg.metrics.memory_steps, enabled=not cfg.profile.enable)
    meter.start()
    model = build_model(
        cfg.model,
        dims,
        world,
        cfg.parallel,
        cfg.precision,
        device,
        cfg.trainer.seed,
        cfg.trainer.freeze,
    )
    # Where the state comes from (checkpoint, HF folder or fresh); a resumed job's
    # metrics.jsonl keeps only the steps up to its checkpoint, the later ones are trained again.
    start = checkpoint_start.agree_on_start(cfg.checkpoint, cfg.model, output_dir)
    figures = compute_run_figures(cfg, dims, model, device)
    sinks: list[tracking.Tracker] = []
    if rank == 0:
        _prepare_metrics(cfg.checkpoint, output_dir, start)
        facts = {**run_facts(dims, device), "mesh_placement": placements}
        config = {**plain_config(cfg), "derived": facts}
        sinks = tracking.open_trackers(cfg.logger, run_info, config, output_dir)
        _log_figures(figures)
    trainer = make_trainer(cfg, dims, world, model, device, figures, sinks)
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
        for sink in sinks:
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
    for sink in sinks:
        sink.log_summary(summary)
        sink.finish()
    return summary


def make_trainer(
    cfg: RunConfig,
    dims: ParallelDims,
    world: WorldMesh,
    model: torch.nn.Module,
    device: torch.device,
    figures: RunFigures,
    sinks: list[tracking.Tracker],
) -> Trainer:
    """Build the Trainer from the typed config: the sections it uses, this rank's batches and
    the run's fixed figures; ``sinks`` on rank 0 (an empty list elsewhere)."""
    batches = TokenBatches(
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
        model,
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
        sinks=sinks,
    )


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
        tracking.truncate_metrics(output_dir, start.step)
    elif (aside := tracking.set_aside_earlier_run(output_dir)) is not None:
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
        "mem_baseline_gib_per_rank": [m[2] for m in every],
        "mem_tensor_peak_gib_per_rank": [m[3] for m in every],
        "mem_estimate_gib": estimate,
    }
    if device.type == "cuda":
        facts["mem_reserved_gib_per_rank"] = [m[1] for m in every]
    return facts


def run_facts(dims: ParallelDims, device: torch.device) -> dict:
    """Derived facts recorded with every run: mesh, device, versions."""
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    return {
        **dims.describe(),
        "device": device.type,
        "device_name": name,
        "torch_version": torch.__version__,
        "hostname": platform.node(),
    }


def _fmt(value) -> str:
    return "unknown" if value is None else f"{value:.3f}"
