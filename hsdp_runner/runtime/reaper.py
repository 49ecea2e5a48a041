"""The launcher waits for every process its launches leave behind, so none outlives it.

The workers are the forkserver's children, and it reaps them. What a worker starts (rank 0's
sidecar) is orphaned when that worker ends first (a SIGKILLed rank 0, or a sidecar still
copying when rank 0 stopped waiting for it), and an orphan goes to init, which reaps it only
after the launcher has exited (seen as a ``<defunct>`` process whose parent is 1). So while
its workers run, the launching process is a child subreaper (Linux's
``PR_SET_CHILD_SUBREAPER``): the job's orphans become its children, and it waits for them once
the workers have ended (``adopting_orphans``). The forkserver and multiprocessing's resource
tracker, also its children, are stopped at exit (``forkserver.stop_server``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
PR_GET_CHILD_SUBREAPER = 37
_POLL_S = 0.05


def _prctl(option: int, arg) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, arg, 0, 0, 0) == 0


def _set_subreaper(on: bool) -> bool | None:
    """Make this process a child subreaper (or stop being one); return whether it was one
    before, None where the system has no subreapers (not Linux) or refused."""
    if not sys.platform.startswith("linux"):
        return None
    was = ctypes.c_int(0)
    if not _prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was)):
        return None
    if bool(was.value) != on and not _prctl(PR_SET_CHILD_SUBREAPER, int(on)):
        return None
    return bool(was.value)


def child_pids() -> set[int]:
    """PIDs of this process's children, in any state (zombies too), read from /proc."""
    me, found = os.getpid(), set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                found.add(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def wait_or_kill(pid: int, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for child ``pid`` to end, then SIGKILL it; reap it either
    way. A pid that is not (or no longer) this process's child is left alone."""
    deadline = time.monotonic() + timeout_s
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(_POLL_S)
    except ChildProcessError:  # reaped already (by us or by its own Popen)
        pass


@contextlib.contextmanager
def adopting_orphans(timeout_s: float, keep=lambda: ()):
    """Around a launch: adopt the orphans of this process's descendants (subreaper), and on
    the way out wait for the children that appeared meanwhile, except ``keep()`` (the pids
    of the servers kept for the next launch), each at most ``timeout_s`` (rank 0's sidecar
    ends at the latest ``launcher.timeout_s`` after rank 0), then SIGKILL. Children that
    existed before are not touched; a child the process starts meanwhile in another thread
    would be waited for too (the launcher starts none)."""
    before = child_pids()
    was = _set_subreaper(True)
    try:
        yield
    finally:
        deadline = time.monotonic() + timeout_s
        try:
            for pid in sorted(child_pids() - before - set(keep())):
                wait_or_kill(pid, max(0.0, deadline - time.monotonic()))
        finally:
            if was is not None:
                _set_subreaper(was)
