"""Workers forked from the forkserver see the launcher's environment of the moment and
default signal handling, whatever the server inherited when it started. (These are the
launcher's workers, started by ``start_local_workers``; ``run_workers`` forks its own.)"""

from __future__ import annotations

import gc
import os
import signal
import sys

import pytest

from hsdp_runner.runtime.launch import COMPILE_IMPORTS, start_local_workers

pytestmark = pytest.mark.multiprocess


def _what_a_worker_sees() -> dict:
    import torch

    from hsdp_runner.distributed.hardware import set_cpu_threads

    set_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))  # as a runner worker does first
    return {
        "threads": (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]),
        "env": os.environ.get("HSDP_TEST_ENV"),
        "gone": os.environ.get("HSDP_TEST_GONE"),
        "rank": os.environ["RANK"],
        "world": os.environ["WORLD_SIZE"],
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigusr2_default": signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL,
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "preloaded": [name for name in COMPILE_IMPORTS if name in sys.modules],
        # What the server imported, left out of the collector's passes.
        "frozen": gc.get_freeze_count() > 100_000,
        # ... and collecting what its work makes (the server itself never collects).
        "collecting": gc.isenabled(),
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
        assert seen[rank]["threads"][0] == int(seen[rank]["threads"][1])
        assert seen[rank]["preloaded"] == list(COMPILE_IMPORTS)  # conftest's server preloads
        assert seen[rank]["frozen"] and seen[rank]["collecting"]


def _what_a_planning_child_sees() -> dict:
    return {
        "parent": os.getppid(),
        "env": os.environ.get("HSDP_TEST_ENV"),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "collecting": gc.isenabled(),
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
    assert seen["sigterm_default"] and seen["sigint_raises"] and seen["collecting"]


# A fresh ``python -m hsdp_runner`` with a config error (exit 2 once its imports are done),
# each collector pass counted by whether anything was frozen yet.
_CLI_PASSES = """
import gc, json, runpy, sys
passes = []
gc.callbacks.append(lambda phase, info: phase == "start" and passes.append(gc.get_freeze_count()))
sys.argv = ["hsdp_runner", "parallel.no_such_key=1"]
try:
    runpy.run_module("hsdp_runner", run_name="__main__", alter_sys=True)
except SystemExit as stop:
    print(json.dumps([stop.code, sum(1 for n in passes if n == 0), gc.isenabled()]))
"""


def test_the_command_line_imports_without_collecting_and_collects_once_it_runs():
    """``python -m hsdp_runner`` turns the collector off for its imports (about 600 passes that
    found nothing, 0.3-0.4 of 2.0 CPU-s) and on again once they are frozen: at most the one
    pass before its first line, and collection on while it runs."""
    import json
    import subprocess

    from conftest import REPO, cli_env

    done = subprocess.run(
        [sys.executable, "-c", _CLI_PASSES], env=cli_env(), capture_output=True, text=True,
        cwd=REPO, timeout=120,
    )  # fmt: skip
    code, before_freeze, collecting = json.loads(done.stdout.strip().splitlines()[-1])
    assert code == 2 and collecting
    assert before_freeze <= 2, before_freeze


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


# A launcher's first server start, as ``_launch_local`` makes it: first while a second thread
# runs (not safe to fork: the server is spawned when a worker starts, so none is running yet),
# then, as a fresh process's first start, with only the main thread left.
_LAUNCHER = """
import json, os, sys, threading, time
from multiprocessing import forkserver as mp_forkserver
sys.path.insert(0, sys.argv[1])
from hsdp_runner.runtime import forkserver
from hsdp_runner.runtime.launch import COMPILE_IMPORTS, start_local_workers
from test_forkserver import _what_a_worker_sees

thread = threading.Thread(target=time.sleep, args=(0.5,))
thread.start()
forkserver.use_server(from_here=True)
running_with_a_thread = mp_forkserver._forkserver._forkserver_pid is not None
thread.join()
forkserver._first_use[0] = True
os.environ["HSDP_TEST_ENV"] = "set before the workers start"
# As _launch_local does, after torch was imported with another thread count.
import torch
torch.set_num_threads(3)
os.environ["OMP_NUM_THREADS"] = "1"
seen = start_local_workers(
    _what_a_worker_sees, 2, fork_server_here=True, preload=COMPILE_IMPORTS
)
launcher_imported = [name for name in COMPILE_IMPORTS if name in sys.modules]
server = forkserver.server_pids()[0]
stat = open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()
same_command = open(f"/proc/{server}/cmdline").read() == open("/proc/self/cmdline").read()
print(json.dumps({"running_with_a_thread": running_with_a_thread, "server_parent": int(stat[1]),
                  "launcher": os.getpid(), "same_command": same_command, "seen": seen,
                  "launcher_imported": launcher_imported}))
"""


def test_a_launcher_forks_its_server_from_itself_only_when_that_is_safe():
    """The launcher's own fork is the server (its command line, its child) and the workers
    forked from it see what workers of a spawned server see; with a second thread running,
    nothing is forked."""
    import json
    import subprocess
    import sys

    from conftest import REPO, cli_env

    done = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(REPO / "tests")],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert not facts["running_with_a_thread"]
    assert facts["server_parent"] == facts["launcher"] and facts["same_command"]
    for rank in ("0", "1"):
        seen = facts["seen"][rank]
        assert seen["env"] == "set before the workers start" and seen["rank"] == rank
        assert seen["sigterm_default"] and seen["sigusr2_default"] and seen["sigint_raises"]
        assert seen["threads"] == [1, "1"]  # the launcher's variable, not its torch's 3 threads
        # What the job's options import, the server imported once for its workers.
        assert seen["preloaded"] == list(COMPILE_IMPORTS) and seen["frozen"]
        assert seen["collecting"]
    assert facts["launcher_imported"] == []


def test_a_jobs_options_name_what_its_workers_import_and_only_a_cpu_build_preloads_it(
    monkeypatch,
):
    """Compile and float8 each add their modules (all importable: multiprocessing's preload
    would skip a renamed one in silence); with an accelerator the server preloads only its
    own module, whose imports are checked for a touched driver."""
    import importlib

    import torch

    from hsdp_runner.config.compose import compose, to_run_config
    from hsdp_runner.runtime import forkserver
    from hsdp_runner.runtime.launch import FLOAT8_IMPORTS, job_imports

    def imports(*overrides):
        return job_imports(to_run_config(compose(["model=llama3_tiny", *overrides])))

    assert imports() == ()
    assert imports("parallel.compile=true") == COMPILE_IMPORTS
    assert imports("precision=float8") == FLOAT8_IMPORTS
    both = imports("parallel.compile=true", "precision=float8")
    assert both == COMPILE_IMPORTS + FLOAT8_IMPORTS
    for name in both:
        importlib.import_module(name)
    monkeypatch.setattr(forkserver, "_extra_preload", list(both))
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    assert forkserver.preload_modules() == [forkserver.SERVER_MODULE, *both]
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    assert forkserver.preload_modules() == [forkserver.SERVER_MODULE]


def test_forking_the_server_is_refused_with_an_accelerator_build_a_thread_a_server_or_a_key(
    monkeypatch,
):
    import threading
    from multiprocessing import forkserver as mp_forkserver

    import torch

    from hsdp_runner.runtime import forkserver

    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(mp_forkserver._forkserver, "_forkserver_pid", None)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    assert forkserver.fork_is_safe()
    with monkeypatch.context() as m:
        m.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
        assert not forkserver.fork_is_safe()
    with monkeypatch.context() as m:
        m.setattr(threading, "active_count", lambda: 2)
        assert not forkserver.fork_is_safe()
    with monkeypatch.context() as m:
        m.setattr(mp_forkserver._forkserver, "_forkserver_pid", 12345)
        assert not forkserver.fork_is_safe()
    with monkeypatch.context() as m:  # a Python whose forkserver clients authenticate
        m.setattr(mp_forkserver._forkserver, "_forkserver_authkey", b"key", raising=False)
        assert not forkserver.fork_is_safe()
