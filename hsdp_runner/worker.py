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
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hsdp_runner import checkpoint, metrics, profiling, tracking
from hsdp_runner.devices import pick_device, set_cpu_threads
from hsdp_runner.failures import nccl_failure_env
from hsdp_runner.interrupt import StopRequest, signal_name
from hsdp_runner.mesh import ParallelDims
from hsdp_runner.sharding import build_model
from hsdp_runner.trainer import Trainer

log = logging.getLogger("hsdp_runner")


def setup_logging(output_dir: Path, rank: int) -> None:
    """Rank 0 logs to the console and ``logs/rank0.log``; other ranks only to their own file.

    Non-zero ranks also point their stdout/stderr file descriptors at their log, so warnings
    from C++ and third-party code do not clutter the console.
    """
    logs = output_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
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
    fmt = logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    # clip_grad_norm_ over a 3-D mesh warns on every step that two all-reduces are used.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def run_worker(cfg_dict: dict, dims: ParallelDims, run_info: dict) -> dict | None:
    """Train one rank of the job described by the resolved config ``cfg_dict``.

    Takes the plain resolved config, the validated ParallelDims and run facts (output dir,
    W&B group, run name, tags). Returns rank 0's summary dict (None on other ranks).
    """
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # SIGTERM / SIGINT (preemption, Ctrl-C, or the launcher stopping the job because another
    # rank failed) only set a flag: the ranks agree to stop at the next step boundary, save a
    # checkpoint and write an 'interrupted' summary; a collective with a dead peer fails first.
    stop = StopRequest()
    stop.install()
    output_dir = Path(run_info["output_dir"])
    setup_logging(output_dir, rank)
    faulthandler.enable(all_threads=True)  # a rank killed in C++ leaves its Python stack in its log
    cfg = OmegaConf.create(cfg_dict)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    set_cpu_threads(local_world_size)
    device = pick_device(cfg.device, local_rank, local_world_size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        for key, value in nccl_failure_env(output_dir / "logs").items():
            os.environ.setdefault(key, value)  # the user's own TORCH_NCCL_* settings win
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.launcher.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    try:
        summary = _train(cfg, dims, run_info, device, output_dir, rank, stop)
    except BaseException:
        log.exception("rank %d failed", rank)
        dist.destroy_process_group()
        raise
    # Without this orderly teardown a gloo worker that used DeviceMesh often aborts at
    # interpreter exit (SIGABRT, exit code 1) although training finished.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if stop.signum is not None and run_info.get("local_launch"):
        # Our elastic agent is shutting down after the signal: it no longer collects return
        # values, and torch's worker wrapper would block until the agent's shutdown timeout
        # kills it. Rank 0's summary is on disk; leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return summary


def _train(cfg, dims: ParallelDims, run_info: dict, device: torch.device, output_dir: Path,
           rank: int, stop: StopRequest) -> dict | None:
    world = dims.build_mesh(device.type, cfg.launcher.timeout_s)
    log.info("mesh %s over %s (%s, %d ranks)", dict(zip(world.root.mesh_dim_names, dims.shape)),
             device.type, dims.layout, dims.world_size)
    model = build_model(cfg.model, dims, world, cfg.parallel, cfg.precision, device,
                        cfg.trainer.seed, cfg.trainer.freeze)
    # Checkpoints (issue 4): where the state comes from; a resumed job's metrics.jsonl keeps
    # only the steps up to its checkpoint, the later ones are trained again.
    start = checkpoint.agree_on_start(cfg, output_dir)
    if rank == 0 and start.step:
        tracking.truncate_metrics(output_dir, start.step)
    sinks = None
    if rank == 0:
        facts = run_facts(dims, device)
        config = {**OmegaConf.to_container(cfg, resolve=True), "derived": facts}
        sinks = (tracking.MetricsFile(output_dir),
                 tracking.WandbRun(cfg.logger, run_info, config, output_dir))
    trainer = Trainer(cfg, dims, world, model, device, sinks)
    # Memory estimate (issue 7), to compare with the measured peak.
    mem_estimate = metrics.memory_breakdown(model, cfg.precision.master_dtype)
    if rank == 0:
        log.info("peak %s TFLOP/s per device (%s)", _fmt(trainer.peak_tflops), trainer.peak_source)
        log.info("memory estimate per rank: params %.3f + grads %.3f + optimizer %.3f = %.3f GiB "
                 "(activations and gathered parameters come on top)", mem_estimate["params"],
                 mem_estimate["grads"], mem_estimate["optimizer"], mem_estimate["total"])
    ckpt = checkpoint.Checkpointer(cfg, dims, output_dir, trainer.model, trainer.optimizer,
                                   trainer.scheduler, device)
    try:
        first = ckpt.restore(start)
        profiler = profiling.StepProfiler(cfg.profile, rank, output_dir, device)  # issue 7
        records = trainer.fit(first, profiler.wrap(ckpt.after_step, first), stop)
        if trainer.stopped_by:
            _save_on_stop(cfg, ckpt, trainer.last_step)
    except BaseException:
        if rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the flush must not be cut short
            sinks[1].finish(exit_code=1)
        raise
    ckpt.export_at_end()
    eval_loss = None
    if cfg.trainer.eval_batches and not trainer.stopped_by:
        eval_loss = trainer.evaluate(cfg.trainer.eval_batches)
    memory = _memory_facts(device, mem_estimate)  # a collective: every rank calls it
    if rank != 0:
        return None
    metrics_file, wandb_run = sinks
    metrics_file.close()
    steady = metrics.steady_state(records, cfg.metrics.warmup_steps)
    interrupted = {"status": "interrupted", "interrupted_at_step": trainer.last_step,
                   "signal": signal_name(trainer.stopped_by)} if trainer.stopped_by else {}
    summary = {"status": "completed", **facts, "steps": len(records),
               "skipped_steps": trainer.skipped_steps,
               "final_loss": records[-1]["loss"] if records else None, "eval_loss": eval_loss,
               "peak_tflops": trainer.peak_tflops, "peak_tflops_source": trainer.peak_source,
               "flops_per_token": trainer.flops_per_token, **steady, **ckpt.facts,
               **memory, **trainer.comm_facts, "error": None, **interrupted}
    wandb_run.summary(steady | {"final_loss": summary["final_loss"], "status": summary["status"],
                                "skipped_steps": trainer.skipped_steps}
                      | metrics.flat_summary(memory, trainer.comm_facts))
    wandb_run.finish()
    tracking.write_summary(output_dir, summary)
    return summary


def _save_on_stop(cfg, ckpt, step: int) -> None:
    """After a stop request, save the step just finished unless it was saved already."""
    if not cfg.checkpoint.enable:
        log.warning("stopped after step %d; checkpointing is off (checkpoint.enable=false), so "
                    "a rerun starts over", step)
        return
    if ckpt.facts["last_checkpoint"] != str(ckpt.folder / f"step-{step}"):
        ckpt.save(step)
    log.warning("stopped after step %d; checkpoint %s; rerun the same command to resume",
                step, ckpt.facts["last_checkpoint"])


def _memory_facts(device: torch.device, estimate: dict) -> dict:
    """Every rank's peak memory (allocated; reserved on CUDA) and the state estimate."""
    mine = (metrics.peak_memory_gib(device), metrics.peak_reserved_gib(device))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    facts = {"mem_peak_gib_per_rank": [m[0] for m in every], "mem_estimate_gib": estimate}
    if device.type == "cuda":
        facts["mem_reserved_gib_per_rank"] = [m[1] for m in every]
    return facts


def run_facts(dims: ParallelDims, device: torch.device) -> dict:
    """Derived facts recorded with every run: mesh, device, versions."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {**dims.describe(), "device": device.type, "device_name": name,
            "torch_version": torch.__version__, "hostname": platform.node()}


def _fmt(value) -> str:
    return "unknown" if value is None else f"{value:.3f}"
