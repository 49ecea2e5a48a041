"""Command lines of ``python -m hsdp_runner`` run in processes forked from one that imported the
CLI once, instead of each started afresh.

A fresh interpreter spends ~3 CPU-seconds importing torch, Hydra and the runner before it parses
its first override; the suite runs a few dozen command lines. This module's server (one per
pytest process, started on the first call) imports ``hsdp_runner.runtime.app`` (what
``python -m hsdp_runner`` imports before it reads its arguments) and the modules a job's
forkserver imports once forked from its launcher (``forkserver.WORKER_IMPORTS``, ~0.6 CPU-s a
job), runs no torch op and starts no thread, then forks one child per command line. The child
does what a new process would: it takes the working directory and the whole environment of the
call, reads stdin from /dev/null, writes stdout and stderr to files, runs ``hsdp_runner`` as
``__main__`` with the arguments, and exits through the interpreter's own shutdown (the exit
handlers that stop the runner's forkserver run as in a fresh process). The exit status comes
back to the caller as ``subprocess.run``'s would; or, started with ``CliServer.start``, the
caller holds the child as it would a ``subprocess.Popen`` (pid, poll, wait) and signals it by
pid, in a session of its own when asked (``start_new_session``).

What differs from a fresh process: the launcher holds the workers' modules before its server
forks (the server's own imports then find them there); modules are imported before the call's
environment is set, so a variable read at import time (none in the runner; torch reads a few
debug ones, e.g. ``TORCH_LOGS``) would be the server's, and so is what ``/proc/<pid>/environ``
shows of the child and of every process it forks without exec (an environment marker finds
only the job's exec'd processes: tests/test_faults.py also finds them by session);
``run_cli`` starts a fresh interpreter whenever the call sets one of ``ENV_READ_AT_IMPORT``,
and for any other command (torchrun's prefix). Python's subprocess module cannot fork from an existing process, multiprocessing's
forkserver runs functions rather than command lines with their own stdio and exit, hence this
module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Environment variables torch reads when it is imported: a call that sets one gets a fresh
# interpreter.
ENV_READ_AT_IMPORT = ("TORCH_LOGS", "TORCHDYNAMO_VERBOSE", "TORCH_CPP_LOG_LEVEL")
_POLL_S = 0.02


class CliServer:
    """The caller's handle on the server process: ``run(argv, env, cwd, timeout, out_dir)`` runs
    a command line to its end, ``start(...)`` starts one and returns at once."""

    def __init__(self, env: dict):
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    def _request(self, request: dict) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the CLI server exited (code {self._proc.poll()})")
        return json.loads(line)

    def run(
        self,
        argv: list[str],
        env: dict,
        cwd: Path,
        timeout: float,
        out_dir: Path,
        module: str = "hsdp_runner",
    ):
        """Run ``python -m <module> *argv`` (the runner's CLI, or another of its entry points:
        ``hsdp_runner.export``, ``hsdp_runner.compare``) in a forked child; return a
        ``subprocess.CompletedProcess`` (stdout and stderr as text), or raise
        ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the child is SIGKILLed, as
        ``subprocess.run`` does)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{os.getpid()}_{time.monotonic_ns()}"
        out, err = out_dir / f"cli_{stamp}.out", out_dir / f"cli_{stamp}.err"
        reply = self._request(
            {
                "op": "run",
                "module": module,
                "argv": argv,
                "env": env,
                "cwd": str(cwd),
                "out": str(out),
                "err": str(err),
                "timeout": timeout,
            }
        )
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        cmd = [sys.executable, "-m", module, *argv]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)

    def start(
        self, argv: list[str], env: dict, cwd: Path, out: Path, err: Path, new_session: bool
    ) -> StartedCli:
        """Start ``python -m hsdp_runner *argv`` in a forked child (in a session of its own with
        ``new_session``, as ``subprocess.Popen(start_new_session=True)``), its stdout and stderr
        written to the files ``out`` and ``err``; return at once with its handle."""
        reply = self._request(
            {
                "op": "start",
                "argv": argv,
                "env": env,
                "cwd": str(cwd),
                "out": str(out),
                "err": str(err),
                "new_session": new_session,
            }
        )
        return StartedCli(self, reply["pid"], [sys.executable, "-m", "hsdp_runner", *argv])

    def wait(self, pid: int, timeout: float) -> int | None:
        """The exit status of started child ``pid`` (``subprocess``'s convention), waiting up to
        ``timeout`` seconds for it (0: a poll); None while it runs."""
        return self._request({"op": "wait", "pid": pid, "timeout": timeout})["returncode"]

    def close(self) -> None:
        """End the server (it exits when its stdin closes) and reap it."""
        self._proc.stdin.close()
        self._proc.wait(timeout=30)
        self._proc.stdout.close()


class StartedCli:
    """A command line started by ``CliServer.start``, held as a ``subprocess.Popen`` is: ``pid``,
    ``poll()``, ``wait(timeout)``, ``returncode``. The server is its parent and reaps it; the
    caller may signal it (and its process group) by pid."""

    def __init__(self, server: CliServer, pid: int, args: list[str]):
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.wait(self.pid, 1e9 if timeout is None else timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


# --- the server's side ------------------------------------------------------------------------


def _child(request: dict, channels) -> None:
    """In the forked child: close the server's ``channels`` (file objects) and become the
    command line of ``request``. Does not return."""
    for channel in channels:
        channel.close()
    if request.get("new_session"):
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    streams = (
        os.open(os.devnull, os.O_RDONLY),
        os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
        os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
    )
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    import random
    import runpy

    random.seed()  # not the server's sequence: temp file names differ between children
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module(request.get("module", "hsdp_runner"), run_name="__main__", alter_sys=True)
    sys.exit(0)  # __main__ returned without sys.exit


def _wait_child(pid: int, timeout: float, kill_past_timeout: bool) -> tuple[int | None, bool]:
    """Wait up to ``timeout`` seconds for child ``pid``: (its exit status, or None while it
    runs; whether it was SIGKILLed for running past ``timeout``)."""
    deadline = time.monotonic() + timeout
    killed = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), killed
        if time.monotonic() > deadline:
            if not kill_past_timeout:
                return None, False
            if not killed:
                os.kill(pid, signal.SIGKILL)
                killed = True
        time.sleep(_POLL_S)


def _serve() -> None:
    """Read one JSON request a line from stdin and answer it a line on stdout; exit when stdin
    closes. ``run``: fork a child for the command line, wait for it (SIGKILL past its
    timeout), reply {returncode, timed_out}. ``start``: fork a child, reply {pid} at once.
    ``wait``: reply {returncode} of a started child once it ends, or null after ``timeout``
    seconds."""
    from hsdp_runner.core.frozen_imports import freeze_imports, pause_collection

    pause_collection()  # as ``python -m hsdp_runner`` does before its imports
    import hsdp_runner.runtime.app  # noqa: F401  (what every child would import first)
    from hsdp_runner.runtime import forkserver

    forkserver.import_worker_modules()  # what a child's forkserver would import after the fork
    freeze_imports()

    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    ended: dict[int, int] = {}  # started children reaped: their exit status
    for line in requests:
        request = json.loads(line)
        if request["op"] == "wait":
            pid = request["pid"]
            if pid not in ended:
                code, _ = _wait_child(pid, request["timeout"], kill_past_timeout=False)
                if code is not None:
                    ended[pid] = code
            reply = {"returncode": ended.get(pid)}
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, (requests, replies))
            if request["op"] == "start":
                reply = {"pid": pid}
            else:
                code, timed_out = _wait_child(pid, request["timeout"], kill_past_timeout=True)
                reply = {"returncode": code, "timed_out": timed_out}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
