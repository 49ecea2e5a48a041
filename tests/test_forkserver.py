"""Workers forked from the forkserver see the launcher's environment of the moment and
default signal handling, whatever the server inherited when it started. (These are the
launcher's workers, started by ``start_local_workers``; ``run_workers`` forks its own.)"""

from __future__ import annotations

import os
import signal

import pytest

from hsdp_runner.runtime.launch import start_local_workers

pytestmark = pytest.mark.multiprocess


def _what_a_worker_sees() -> dict:
    return {
        "env": os.environ.get("HSDP_TEST_ENV"),
        "gone": os.environ.get("HSDP_TEST_GONE"),
        "rank": os.environ["RANK"],
        "world": os.environ["WORLD_SIZE"],
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigusr2_default": signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL,
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    }


def test_a_worker_gets_the_launchers_current_environment_and_default_signals(monkeypatch):
    monkeypatch.setenv("HSDP_TEST_GONE", "set when the server may have started")
    start_local_workers(
        _what_a_worker_sees, 1
    )  # the server exists from here on, with that variable
    monkeypatch.setenv("HSDP_TEST_ENV", "set after the server started")
    monkeypatch.delenv("HSDP_TEST_GONE")
    seen = start_local_workers(_what_a_worker_sees, 2)
    assert [seen[r]["rank"] for r in (0, 1)] == ["0", "1"]
    for rank in (0, 1):
        assert seen[rank]["env"] == "set after the server started"
        assert seen[rank]["gone"] is None and seen[rank]["world"] == "2"
        assert seen[rank]["sigterm_default"] and seen[rank]["sigusr2_default"]
        assert seen[rank]["sigint_raises"]


def _what_a_planning_child_sees() -> dict:
    return {
        "parent": os.getppid(),
        "env": os.environ.get("HSDP_TEST_ENV"),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    }


def test_the_planners_children_are_forked_from_the_server_with_the_launchers_state(monkeypatch):
    """``plan_children`` (a job's launcher and ``python -m hsdp_runner.plan`` call it before
    planning): the measuring children come from the forkserver, which imported torch already,
    with the environment of the moment and the stop signals' default handling back."""
    from hsdp_runner.planner import memory
    from hsdp_runner.runtime import forkserver

    memory.release_children()  # this test process's children so far may be older
    monkeypatch.setenv("HSDP_TEST_ENV", "set before planning")
    forkserver.plan_children()
    try:
        seen = memory._children().submit(_what_a_planning_child_sees).result(timeout=120)
    finally:
        memory.release_children()
    assert seen["parent"] in forkserver.server_pids()
    assert seen["env"] == "set before planning"
    assert seen["sigterm_default"] and seen["sigint_raises"]


def _fail_or_hang(marker: str) -> None:
    """Rank 1 fails at once; rank 0 remembers a SIGTERM, as a worker's stop request does, and
    sleeps on, as a rank blocked in a collective whose peer has failed would."""
    import time

    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 fails")
    signal.signal(signal.SIGTERM, lambda *_: None)
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def test_a_failed_jobs_hung_worker_is_killed_after_the_launchers_timeout(tmp_path):
    """torch's launcher ends a failed group's other workers with a fixed 30 s between SIGTERM
    and SIGKILL; the launcher caps it at ``shutdown_timeout`` (here 2 s; ``agent_shutdown``).
    Measured alone: 33 s with torch's wait."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    marker = tmp_path / "rank0.pid"
    start = time.monotonic()
    with pytest.raises(ChildFailedError) as failed:
        start_local_workers(_fail_or_hang, 2, str(marker), shutdown_timeout=2)
    assert time.monotonic() - start < 25  # 30 s and more with torch's own wait
    assert "rank 1 fails" in str(failed.value)
    pid = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
