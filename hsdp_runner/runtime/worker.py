"""One rank's process: logs, rank 0's sidecar, the process group, a failure's record, clean exit.

``run_worker`` is the function the elastic launcher starts in each process, and the one a
``torchrun`` rank calls directly. It lives in an importable module because spawned workers
must be able to import it. What the rank trains, from its mesh to its summary, is
``rank_training.train_rank``'s.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from hsdp_runner.checkpoint import start as checkpoint_start
from hsdp_runner.config.schema import CheckpointConfig, RunConfig
from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.frozen_imports import freeze_imports
from hsdp_runner.core.records import RunInfo, RunSummary
from hsdp_runner.distributed.hardware import pick_device, set_cpu_threads
from hsdp_runner.distributed.parallel_dims import ParallelDims
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
from hsdp_runner.runtime.rank_training import train_rank
from hsdp_runner.runtime.signals import StopNow, StopRequest, signal_name, stop_signals
from hsdp_runner.runtime.slurm import requeue_if_asked
from hsdp_runner.train import sinks

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
    # DTensor warns on every redistribution over a multi-dim mesh that several all-reduces run.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def run_worker(cfg: RunConfig, dims: ParallelDims, run_info: RunInfo) -> RunSummary | None:
    """Train one rank of the job described by ``cfg``.

    Takes the typed config (converted once, by the launching process), the validated
    ParallelDims and run facts (output dir, W&B group, run name, tags). Returns rank 0's
    summary (None on other ranks).
    """
    # Out of every collection, the teardown's gc.collect() included; a forked worker then
    # does not write to its parent's pages to scan them either.
    freeze_imports()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # A stop signal (signals.py) only sets a flag: the ranks agree to stop at the next step
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
        summary = train_rank(cfg, dims, run_info, device, output_dir, rank, stop)
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
            sinks.last_step(output_dir),
            last_ckpt,
        )
        return
    log.exception("rank %d failed", rank)
    summary = record_rank_failure(output_dir, dims.describe(), rank, err, last_ckpt)
    if summary.failed_rank != rank:
        log.error("rank %d failed first: %s", summary.failed_rank, summary.error)
