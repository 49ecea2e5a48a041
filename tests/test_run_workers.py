"""``run_workers`` (tests/distributed.py): each call's ranks see what freshly launched ranks see
(the caller's environment of the moment, nothing an earlier call changed), and a failing or
dying rank fails the call, naming the rank, as torch's elastic launch did."""

import gc
import multiprocessing
import os
import signal

import pytest
import torch
from distributed import run_workers
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from hsdp_runner.runtime.failures import first_failure

pytestmark = pytest.mark.multiprocess


def _leave_traces():
    """What a careless task changes, and what the next task must not inherit."""
    import logging
    import sys

    import torch.distributed as dist

    seen = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env_rank": os.environ["RANK"],
        "leftover": os.environ.get("HSDP_TEST_LEFTOVER"),
        "pool_var": os.environ.get("HSDP_TEST_POOL_VAR"),
        "dtype": str(torch.get_default_dtype()),
        "draw": torch.rand(3).tolist(),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "handlers": len(logging.getLogger().handlers),
        "stdout_fd_target": os.readlink("/proc/self/fd/1"),
        "cwd": os.getcwd(),
        # The server never collects; a rank does, as a job's rank does.
        "collecting": gc.isenabled(),
    }
    gc.disable()
    os.environ["HSDP_TEST_LEFTOVER"] = "set by the previous task"
    torch.set_default_dtype(torch.float64)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.getLogger().addHandler(logging.NullHandler())
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = open(os.devnull, "w")
    os.chdir("/")
    return seen


def test_a_call_starts_from_a_fresh_rank_with_the_callers_environment(monkeypatch):
    monkeypatch.setenv("HSDP_TEST_POOL_VAR", "first")
    first = run_workers(_leave_traces, 2)
    monkeypatch.setenv("HSDP_TEST_POOL_VAR", "second")
    second = run_workers(_leave_traces, 2)
    assert sorted(first) == sorted(second) == [0, 1]
    for rank in (0, 1):
        a, b = first[rank], second[rank]
        assert (a["rank"], a["world"], a["env_rank"]) == (rank, 2, str(rank))
        assert (a["pool_var"], b["pool_var"]) == ("first", "second")
        assert a["leftover"] is None and b["leftover"] is None
        assert a["dtype"] == b["dtype"] == "torch.float32"
        assert a["draw"] == b["draw"]  # the RNG of a fresh worker, each time
        assert a["sigterm_default"] and b["sigterm_default"]
        assert a["handlers"] == b["handlers"]
        assert a["stdout_fd_target"] == b["stdout_fd_target"] != os.devnull
        assert a["cwd"] == b["cwd"] != "/"
        assert a["collecting"] and b["collecting"]


def _rank_1_raises():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1's own error")
    dist.barrier()  # rank 0 waits for a peer that never comes: the call ends it
    return "unreachable"


def _rank_1_dies():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _world_size():
    import torch.distributed as dist

    return dist.get_world_size()


def test_a_failing_or_killed_rank_fails_the_call_naming_it_and_leaves_no_process():
    before = set(multiprocessing.active_children())  # other tests' children (the planner's)
    with pytest.raises(ChildFailedError) as raised:
        run_workers(_rank_1_raises, 2)
    # Rank 0's barrier may fail too once rank 1 left; the launcher still names rank 1 first.
    rank, failure = first_failure(raised.value.failures)
    assert rank == 1 and failure.exitcode == 1
    assert failure.message["message"] == "ValueError: rank 1's own error"
    assert "_rank_1_raises" in failure.message["extraInfo"]["py_callstack"]
    assert set(multiprocessing.active_children()) <= before  # the peer in the barrier too

    with pytest.raises(ChildFailedError) as raised:
        run_workers(_rank_1_dies, 2)
    rank, failure = first_failure(raised.value.failures)
    assert rank == 1 and failure.exitcode == -signal.SIGKILL
    assert "Signal 9 (SIGKILL)" in failure.message
    assert set(multiprocessing.active_children()) <= before

    assert run_workers(_world_size, 3) == {0: 3, 1: 3, 2: 3}


def _a_tensor():
    import torch.distributed as dist

    return torch.full((2,), float(dist.get_rank()))


def test_tensors_come_back_by_value_after_their_ranks_exited():
    results = run_workers(_a_tensor, 2)
    assert [r.tolist() for r in results.values()] == [[0.0, 0.0], [1.0, 1.0]]
