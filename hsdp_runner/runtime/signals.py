"""Stopping on a signal at a step boundary on every rank, or at once when the user insists.

How stop signals arrive in real life:
- Ctrl-C: SIGINT to the whole foreground process group (the launcher and every worker);
- SLURM preemption, ``scancel``: SIGTERM to every process of the job step;
- SLURM's time limit: the signal of ``sbatch --signal`` (submitit asks for USR2, 120 s before
  the limit; ``launcher.signal``) to every task;
- ``kill <pid>``: one process (the launcher, or a rank).
torch's elastic agent also forwards SIGINT/SIGTERM to its workers, so a worker often sees the
same signal twice within milliseconds.

Rules, the same in every process (``StopRequest``): the first stop signal is remembered;
another one within ``DUPLICATE_WINDOW_S`` of it is the same request; one arriving later means
"stop now" (``StopNow``). Workers only remember the signal: the trainer carries ``signum`` in
each step's one all-reduce of step statistics (``step_stats``), so all ranks learn whether any
of them was signalled, stop after the same step and save one checkpoint together. The process
that started the workers (``launcher=local``) owns its signals instead of torch's agent
(``LauncherSignals``): it passes the first one on to the workers and, when the user insists,
kills them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hsdp_runner.core.signal_names import parse_signal, signal_name

# A second signal within this many seconds of the first is a duplicate (the same Ctrl-C seen
# directly and forwarded by an agent); a later one is a user insisting.
DUPLICATE_WINDOW_S = 1.0
BASE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)


def stop_signals(extra: str | None = None) -> tuple[signal.Signals, ...]:
    """SIGTERM, SIGINT and SIGUSR2 (submitit's time-limit signal), plus ``extra`` (the name in
    ``launcher.signal``) when given."""
    sigs = list(BASE_SIGNALS)
    if extra:
        sig = parse_signal(extra)
        if sig not in sigs:
            sigs.append(sig)
    return tuple(sigs)


class StopNow(SystemExit):
    """Raised by a signal handler when a stop signal follows the first one too late to be a
    duplicate: the user wants the process to end now. Exit code 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class StopRequest:
    """One process's stop request: ``install()``, then read ``signum``.

    ``signum`` is the first stop signal this process received (None before any), and stays
    set; ``previous`` holds the handlers ``install`` replaced (e.g. submitit's requeue handler).
    """

    def __init__(self):
        self.signum: int | None = None
        self.first_at: float | None = None
        self.previous: dict[int, object] = {}

    def install(self, signals=BASE_SIGNALS) -> None:
        """Route ``signals`` of this process to the request (main thread only)."""
        for sig in signals:
            self.previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Put back the handlers ``install`` replaced."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first_at = signum, now
            self.on_first(signum)
        elif now - self.first_at >= DUPLICATE_WINDOW_S:
            self.on_insist(signum)

    def on_first(self, signum: int) -> None:
        """Called for the first stop signal; a worker only remembers it."""

    def on_insist(self, signum: int) -> None:
        """Called for a stop signal that is not a duplicate of the first: stop now."""
        raise StopNow(signum)


class LauncherSignals(StopRequest):
    """The stop request of the process that started the workers on this node.

    The first signal is passed on to the workers (a ``kill`` of the launcher alone must reach
    them; when they got it too, they take it as a duplicate); while no worker runs (before
    they start, after they end) it raises torch's ``SignalException``, which the elastic
    agent handles by shutting down. A later signal
    SIGKILLs the workers (a rank blocked in a collective cannot run a Python handler) and
    ``insisted`` records it.
    """

    def __init__(self):
        super().__init__()
        self.insisted: int | None = None

    def on_first(self, signum: int) -> None:
        pids = worker_pids()
        if not pids:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            raise SignalException(
                f"got {signal_name(signum)} before the workers started",
                sigval=signal.Signals(signum),
            )
        _send(pids, signum)

    def on_insist(self, signum: int) -> None:
        self.insisted = signum
        _send(worker_pids(), signal.SIGKILL)


def _send(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def worker_pids(parent: int | None = None) -> list[int]:
    """PIDs of the worker processes torch's launcher started from ``parent`` (default: this
    process): the children of its forkserver (or, started by spawn, its children that run
    multiprocessing's ``spawn_main``), which leaves out the resource tracker and anything a
    worker starts. The forkserver is the child that runs multiprocessing's server, spawned, or
    the parent's own command line, forked from it (``forkserver.fork_server_here``). Read from
    /proc (psutil is not a dependency); [] where there is none."""
    parent = os.getpid() if parent is None else parent
    children: dict[int, list[tuple[int, bytes]]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append((int(proc.name), (proc / "cmdline").read_bytes()))
        except (OSError, IndexError, ValueError):
            continue
    try:
        own = Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        return []
    found = []
    for pid, cmdline in children.get(parent, []):
        if b"spawn_main" in cmdline:
            found.append(pid)
        elif b"multiprocessing.forkserver" in cmdline or cmdline == own:
            found += [child for child, _ in children.get(pid, [])]
    return found
