"""Rank-0-only file work that the other ranks wait for outside any collective.

Committing and pruning checkpoints, writing an HF export and reading an HF folder happen on
rank 0 alone. Were the other ranks waiting in ``dist.barrier()``, a slow network filesystem
could keep that barrier past ``launcher.timeout_s`` and NCCL's watchdog would kill a job whose
work succeeded. Instead they wait on the process group's key-value store (the rendezvous
store, no communicator involved) for rank 0's verdict, bounded by ``checkpoint.rank0_wait_s``;
rank 0 posts 'ok' or its error, so a failure reaches every rank at once with its cause.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from datetime import timedelta

import torch.distributed as dist

# Every rank makes the same calls in the same order, so the n-th call has the same key on all.
_calls: dict[int, itertools.count] = defaultdict(itertools.count)


def _default_store():
    # Private, but the only handle on the store the default group was built on; used here only.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def run_on_rank0(what: str, fn, wait_s: float, *, rank: int | None = None, store=None):
    """Run ``fn()`` on rank 0; every other rank waits (up to ``wait_s`` seconds) until it ends.

    ``what`` names the work for messages ("pruning checkpoints in ..."). Returns ``fn``'s
    result on rank 0, None elsewhere. Rank 0 re-raises its own error; the others raise
    RuntimeError naming it, or naming ``checkpoint.rank0_wait_s`` when rank 0 takes longer.
    ``rank`` and ``store`` default to the default process group's.
    """
    rank = dist.get_rank() if rank is None else rank
    store = _default_store() if store is None else store
    key = f"hsdp_runner/rank0_io/{next(_calls[rank])}"
    if rank == 0:
        try:
            result = fn()
        except BaseException as err:
            store.set(key, f"failed: {type(err).__name__}: {err}")
            raise
        store.set(key, "ok")
        return result
    try:
        store.wait([key], timedelta(seconds=wait_s))
    except dist.DistStoreError as err:
        raise RuntimeError(
            f"rank 0 did not finish {what} within checkpoint.rank0_wait_s="
            f"{wait_s:g} s; raise it for a slow filesystem"
        ) from err
    status = store.get(key).decode()
    if status != "ok":
        raise RuntimeError(f"rank 0 failed while {what}: {status.removeprefix('failed: ')}")
    return None
