"""From a composed config to running ranks: validate, then start workers or join torchrun.

Everything that can be checked without a process group is checked here, in the launching
process, so a bad degree or path costs seconds, not a node-hour. Then either
- not under a distributed launcher: start world-size workers with torch's elastic launcher
  API on this node, or
- under torchrun (RANK and WORLD_SIZE set): this process is one rank; run it directly.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from hsdp_runner import checkpoint, tracking
from hsdp_runner.config import ConfigError, validate_batch, validate_config
from hsdp_runner.data import load_corpus
from hsdp_runner.mesh import ParallelDims, infer_world_size
from hsdp_runner.sharding import check_torch_apis

log = logging.getLogger("hsdp_runner")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
RESOLVED_CONFIG_FILE = "config_resolved.yaml"


def under_torchrun() -> bool:
    """True when an external launcher (torchrun, SLURM export) made this process a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _cuda_count(cfg) -> int:
    if cfg.device == "cpu":
        return 0
    count = torch.cuda.device_count()
    if cfg.device == "cuda" and count == 0:
        raise ConfigError("device=cuda but no CUDA device is visible; set device=cpu or auto")
    return count


def validate(cfg: DictConfig, output_dir: Path) -> ParallelDims:
    """Run every pre-launch check; return the job's ParallelDims or raise ConfigError."""
    validate_config(cfg)
    check_torch_apis()
    gpus = _cuda_count(cfg)
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
    else:
        world_size = infer_world_size(cfg.launcher, cfg.parallel, gpus)
        nproc = world_size // cfg.launcher.nnodes
        if gpus and nproc > gpus:
            raise ConfigError(f"launcher.nproc_per_node={nproc} exceeds the {gpus} visible GPUs; "
                              f"use at most {gpus} ranks per node or set device=cpu")
        if cfg.launcher.nnodes > 1:
            raise ConfigError(f"launcher.nnodes={cfg.launcher.nnodes}: the built-in launcher "
                              "starts ranks on this node only; use torchrun on every node "
                              "(README, 'Many nodes') or keep launcher.nnodes=1")
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world_size)
    validate_batch(cfg, dims.dp)
    if gpus and "bfloat16" in (cfg.precision.param_dtype, cfg.precision.reduce_dtype) \
            and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"precision={cfg.precision.name} needs bfloat16, which this GPU does not "
                          "support; use precision=fp32")
    if cfg.data.kind == "text":
        load_corpus(cfg.data.path, cfg.model.seq_len + 1)
    _check_writable(output_dir)
    checkpoint.validate(cfg, output_dir)
    return dims


def _check_writable(output_dir: Path) -> None:
    probe = output_dir / f".write-probe-{uuid.uuid4().hex}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output dir {output_dir} is not writable ({err.strerror}); set "
                          "hydra.run.dir (or hydra.sweep.dir) to a writable folder") from None


def run_job(cfg: DictConfig, run_info: dict) -> int:
    """Validate, launch and wait for one job; return its exit code (0, 1 failed, 2 config)."""
    output_dir = Path(run_info["output_dir"])
    try:
        dims = validate(cfg, output_dir)
    except ConfigError as err:
        print(f"hsdp_runner: config error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if not under_torchrun() or int(os.environ["RANK"]) == 0:
        (output_dir / RESOLVED_CONFIG_FILE).write_text(OmegaConf.to_yaml(cfg_dict))
    if under_torchrun():
        from hsdp_runner.worker import run_worker
        summary = run_worker(cfg_dict, dims, run_info)
    else:
        code, summary = _launch_local(cfg_dict, dims, run_info)
        if code != EXIT_OK:
            return code
    if summary is not None:
        print(f"hsdp_runner: done ({dims.layout}, {dims.world_size} ranks, final loss "
              f"{summary['final_loss']:.4f}); outputs in {output_dir}")
    return EXIT_OK


def start_local_workers(fn, nproc: int, *args) -> dict:
    """Run ``fn(*args)`` in ``nproc`` fresh processes on this node with torch's elastic launcher.

    ``fn`` must live in an importable module. Returns {rank: return value}; a failing rank
    raises ``ChildFailedError`` (the others are stopped).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
        start_method="spawn", monitor_interval=0.1)
    return elastic_launch(config, fn)(*args)


def _launch_local(cfg_dict: dict, dims: ParallelDims, run_info: dict) -> tuple[int, dict | None]:
    """Start ``dims.world_size`` workers on this node and wait; return (exit code, summary)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hsdp_runner.worker import run_worker

    # Our own message names the failed rank and error; the elastic agent would repeat the
    # whole traceback (it is in the rank's log).
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # torch's launcher sets 1 thread per worker when OMP_NUM_THREADS is unset, with a warning;
    # share the cores out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // dims.world_size)))
    try:
        results = start_local_workers(run_worker, dims.world_size, cfg_dict, dims, run_info)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = _failure_message(failure)
        print(f"hsdp_runner: rank {rank} failed (exit code {failure.exitcode}): {message}\n"
              f"rank logs: {Path(run_info['output_dir']) / 'logs'}", file=sys.stderr)
        _write_failed_summary(run_info["output_dir"], dims, rank, message)
        return EXIT_FAILED, None
    return EXIT_OK, results.get(0)


def _failure_message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):  # the error file's JSON: {"message": ..., "extraInfo": ...}
        message = message.get("message", message)
    return str(message).strip() or f"exit code {failure.exitcode}"


def _write_failed_summary(output_dir: str, dims: ParallelDims, rank: int, message: str) -> None:
    previous = tracking.read_summary(output_dir) or {}
    tracking.write_summary(output_dir, {**previous, "status": "failed", **dims.describe(),
                                        "failed_rank": rank, "error": message})
