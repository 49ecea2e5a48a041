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
