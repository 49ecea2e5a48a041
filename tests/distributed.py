"""The one helper tests use to start N gloo workers and collect what each returns."""

from __future__ import annotations

import gc
from datetime import timedelta

import torch.distributed as dist

from hsdp_runner.runtime.launch import start_local_workers

# Short collective timeout: a test that deadlocks fails in minutes instead of hanging. Meshes
# built without a timeout (ParallelDims.build_mesh) give every group the default group's.
TEST_TIMEOUT_S = 120


def _wrapped(fn, args):
    dist.init_process_group("gloo", timeout=timedelta(seconds=TEST_TIMEOUT_S))
    try:
        result = fn(*args)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Orderly teardown avoids the gloo abort at exit after DeviceMesh use (TORCH_NOTES).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return result


def run_workers(fn, nproc: int, *args) -> dict:
    """Run ``fn(*args)`` on ``nproc`` gloo ranks with a process group set up and torn down.

    ``fn`` must live in an importable module. Returns {rank: fn's return value}.
    """
    return start_local_workers(_wrapped, nproc, fn, args)
