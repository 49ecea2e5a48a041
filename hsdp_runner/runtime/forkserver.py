"""Workers forked from a server that imported torch once, instead of each spawned afresh.

A spawned worker imports torch and the runner anew, several CPU-seconds each: a 4-rank job on
2 cores waits ~15 s before its first step, and a test suite pays that for every job.
multiprocessing's forkserver imports them once (``SERVER_MODULE``) and forks every worker from
that clean, single-threaded process. torch's elastic launcher takes the start method; what it
does not do is done here:
- Where it is safe, the launcher forks the server from itself instead (``use_server(
  from_here=True)``), which imported torch already: a job's start costs about 1.4 CPU-seconds
  less (the server then only imports what the launcher had not, ~0.4 s). Safe means: a torch
  build without an accelerator (a driver the launcher touched, e.g. a GPU check, does not
  survive fork, and a CUDA build cannot tell from Python whether the driver was touched), no
  thread but the main one, and the first server this process starts (before the elastic
  agent's TCPStore thread and anything a job leaves behind). Anything else spawns the server,
  as multiprocessing does. The forked server closes its copy of the launcher's end of the
  pipe it watches, and ignores the stop signals before they are unblocked.
- A job's options add imports of their own (a compiled model's backends, float8's Inductor
  codegen: about a CPU-second a worker); the launcher names them (``launch.job_imports``) and
  the server imports them once (``use_server``'s ``preload``), on a build without an
  accelerator only.
- The server must outlive the signals meant for the job: Ctrl-C signals the whole process
  group and a scheduler signals every process, the server included, and a dead server makes
  the launcher read every worker as exited with code 255 while they still run. The server
  ignores the stop signals; each worker restores the defaults before anything else
  (``run_forked``) and then installs its own handlers as a spawned one would.
- A forked worker starts with the environment the server had when it started (the first job
  of a process); the launcher's environment at the time of each start travels with the call.
- A CUDA context does not survive fork: a server that initialised CUDA (or touched the driver:
  ``torch.cuda.is_available()`` does, read in torch 2.13's ``torch/cuda/__init__.py``) forks
  workers that cannot use their GPU. The server notes which import initialised it and every
  forked worker checks before its device setup (``check_cuda_untouched``), failing with an
  error that names the import. It is the worker that raises: an exception in the server kills
  multiprocessing's forkserver, and every worker start then fails with an EOFError that names
  nothing.
- The server (and multiprocessing's resource tracker, started with it) is kept for the life of
  the process, so later jobs (a sweep, parity) fork from it too; each ends when it reads EOF on
  a pipe whose end the launcher holds, which is only after the launcher has exited, and init
  reaps it. So the launcher stops both and waits for them at exit (``stop_server``, run by
  multiprocessing's own exit handler after its other exit finalizers, which unlink the
  semaphores the tracker would otherwise unlink first; while workers run, the launcher handles
  the stop signals, so a job stopped by one exits through Python too; a launcher killed
  outright, SIGKILL, cannot wait for anything).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Sequence
from multiprocessing import connection, resource_tracker, util
from multiprocessing import forkserver as mp_forkserver

from hsdp_runner.core.frozen_imports import freeze_imports, pause_collection
from hsdp_runner.runtime.reaper import wait_or_kill

START_METHOD = "forkserver"
SERVER_MODULE = "hsdp_runner.runtime.forkserver_server"
STOP_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

# What every worker imports, at module level or on first use (FSDP2 pulls in torch._dynamo and
# sympy): ~2 CPU-seconds a worker when each imports them after the fork.
WORKER_IMPORTS = (
    "hsdp_runner.runtime.worker",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.tensor.parallel",
    "torch.utils.flop_counter",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "hsdp_runner.models.llama",
    "hsdp_runner.models.gpt2",
    "safetensors.torch",
)

# The environment the server started with; set only inside the server (and so in every worker
# forked from it), None in any other process.
_server_env: dict[str, str] | None = None
# What initialised CUDA in the server ("importing <module>"), None while nothing did.
_cuda_initialised_by: str | None = None
# How long the launcher waits at exit for the server and the tracker before it SIGKILLs them
# (each ends at once when no worker is left).
STOP_TIMEOUT_S = 10.0
# multiprocessing runs exit finalizers from the highest priority down; a SemLock's is 0.
STOP_EXIT_PRIORITY = -100
_stop_at_exit: util.Finalize | None = None
# Modules asked for by ``use_server``'s callers beyond ``SERVER_MODULE``'s. Only a build
# without an accelerator preloads them: ``check_cuda_untouched`` guards ``WORKER_IMPORTS``
# alone, and an import in the server that touched a GPU driver would leave every worker
# forked from it without its GPU.
_extra_preload: list[str] = []
# Whether ``use_server`` has not been called in this process yet (only the first call forks).
_first_use: list[bool] = [True]


def prepare_server() -> None:
    """In the forkserver, at start: ignore the stop signals, remember the environment, and
    import what every worker needs (torch with it). Takes and returns nothing."""
    global _server_env
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _server_env = dict(os.environ)
    # The server only imports and forks, so it never collects; each child turns collection
    # back on when it freezes what it inherited (adopt_launcher_state, run_worker).
    pause_collection()
    import_worker_modules()


def import_worker_modules(modules=WORKER_IMPORTS) -> str | None:
    """Import ``modules`` (the imports this server exists to pay once), noting the first whose
    import initialised CUDA; return that note ("importing <module>"), None when none did."""
    global _cuda_initialised_by
    import torch  # here, not at the top: the server ignores stop signals before heavy imports

    for module in modules:
        importlib.import_module(module)
        if _cuda_initialised_by is None and torch.cuda.is_initialized():
            _cuda_initialised_by = f"importing {module}"
    return _cuda_initialised_by


def check_cuda_untouched() -> None:
    """In a worker forked from the server, before its device setup: raise RuntimeError when
    the server had initialised CUDA (a context does not survive fork), naming what did."""
    import torch

    if not (torch.cuda.is_initialized() or torch.cuda._is_in_bad_fork()):
        return
    cause = _cuda_initialised_by or (
        "a CUDA call while it imported its modules, e.g. "
        "torch.cuda.is_available(), which initialises the driver"
    )
    raise RuntimeError(
        f"CUDA was initialised in the forkserver ({cause}) before this worker was forked from "
        f"it; a CUDA context does not survive fork, so no rank could use its GPU. Keep CUDA "
        f"calls out of module import time in {SERVER_MODULE}'s imports (forkserver."
        "WORKER_IMPORTS)"
    )


def use_server(from_here: bool = False, preload: Sequence[str] = ()) -> str:
    """Name the modules the forkserver preloads and have it stopped at exit; return the start
    method for torch's launcher. Call before the first worker of this process starts (later
    calls change nothing). ``from_here``: the caller is a launcher that may be forked into
    the server (``fork_server_here``), done now where it is safe; else the server is spawned
    when the first worker starts. ``preload``: modules the workers will import beyond
    ``SERVER_MODULE``'s (a job's options: ``launch.job_imports``), imported once by the
    server instead of by each worker; kept from every call before the server starts, and
    only on a torch build without an accelerator (``_extra_preload``)."""
    global _stop_at_exit
    _extra_preload.extend(name for name in preload if name not in _extra_preload)
    multiprocessing.set_forkserver_preload(preload_modules())
    if _stop_at_exit is None:  # once, however many jobs the process launches
        _stop_at_exit = util.Finalize(None, stop_server, exitpriority=STOP_EXIT_PRIORITY)
    first, _first_use[0] = _first_use[0], False
    if from_here and first and fork_is_safe():
        fork_server_here()
    return START_METHOD


def preload_modules() -> list[str]:
    """The modules the server imports when it starts: ``SERVER_MODULE``, then the extra ones
    asked for (``use_server``'s ``preload``) where the torch build has no accelerator."""
    import torch

    if torch.accelerator.current_accelerator() is not None:
        return [SERVER_MODULE]
    return [SERVER_MODULE, *_extra_preload]


def fork_is_safe() -> bool:
    """Whether this process may fork the forkserver from itself now (see the module
    docstring): a torch build without an accelerator, only the main thread, no server yet,
    and multiprocessing's server protocol as ``fork_server_here`` speaks it (the Pythons
    whose clients authenticate to the server, with a key it is handed, are left to spawn)."""
    import torch

    return (
        torch.accelerator.current_accelerator() is None  # compile time: touches no driver
        and threading.active_count() == 1
        and mp_forkserver._forkserver._forkserver_pid is None
        and not hasattr(mp_forkserver._forkserver, "_forkserver_authkey")
    )


def fork_server_here() -> int:
    """Start multiprocessing's forkserver as a fork of this process, in its place; return the
    server's pid. What multiprocessing's ``ForkServer.ensure_running`` does, with a fork for
    its exec: the same listening socket and alive pipe, the same server loop
    (``multiprocessing.forkserver.main``), so every later worker start finds it running."""
    server = mp_forkserver._forkserver
    with server._lock:
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            # Buffered output would be written again by every process forked from the server.
            sys.stdout.flush()
            sys.stderr.flush()
            # A stop signal between the fork and the server's SIG_IGN would run the launcher's
            # handler in the server; blocked, it waits for the launcher's own copy.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            pid = os.fork()
            if pid == 0:
                _serve(server, listener.fileno(), alive_r, alive_w, mask)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return pid


def _serve(server, listener_fd: int, alive_r: int, alive_w: int, mask) -> None:
    """In the forked server: ignore the stop signals, drop the launcher's end of the alive
    pipe and a lock held at the fork, and run multiprocessing's server loop until the
    launcher's end closes. Never returns."""
    code = 0
    try:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(alive_w)
        server._lock = threading.Lock()  # the copy is held: the launcher forked inside it
        mp_forkserver.main(listener_fd, alive_r, preload_modules())
    except SystemExit:  # the loop's way out: no process holds the alive pipe any more
        pass
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def server_pids() -> list[int]:
    """PIDs of multiprocessing's forkserver and resource tracker where this process started
    them (kept between launches), else none."""
    pids = [mp_forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid]
    return [pid for pid in pids if pid is not None]


def stop_server(timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop multiprocessing's forkserver and resource tracker if this process started them,
    and reap them: close the pipe each watches (it exits on EOF once no worker holds its
    copy), wait up to ``timeout_s``, then SIGKILL. A later worker start starts new ones.

    Python 3.11's multiprocessing stops them only in its own tests (``ForkServer._stop``,
    ``ResourceTracker._stop``), which wait without a bound; this does what they do, bounded.
    """
    server = mp_forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            os.close(server._forkserver_alive_fd)
            wait_or_kill(server._forkserver_pid, timeout_s)
            address = server._forkserver_address
            if address and not util.is_abstract_socket_namespace(address):
                with contextlib.suppress(OSError):
                    os.unlink(address)
            server._forkserver_pid = server._forkserver_alive_fd = None
            server._forkserver_address = None
    tracker = resource_tracker._resource_tracker
    with tracker._lock:
        if tracker._fd is not None:
            os.close(tracker._fd)
            if tracker._pid is not None:
                wait_or_kill(tracker._pid, timeout_s)
            tracker._fd = tracker._pid = None


def run_forked(launcher_env: dict[str, str], fn, *args):
    """A worker's entry point: take ``launcher_env`` (the launcher's ``os.environ`` when it
    started the workers) and default signal handling, then return ``fn(*args)``.

    What torch's agent set for this rank (RANK, MASTER_PORT, ...) is what differs from the
    server's own start environment; it is laid over ``launcher_env``. In a process not forked
    from the server (spawned) everything is already in place and ``fn`` runs as it is.
    """
    adopt_launcher_state(launcher_env)
    return fn(*args)


def adopt_launcher_state(launcher_env: dict[str, str]) -> None:
    """In a process forked from the server: take ``launcher_env`` (what the server's own start
    environment lacks or differs in stays: torch's agent's settings for a rank) and the default
    handling of the stop signals the server ignores, and leave what the server imported out of
    the collector's passes (``frozen_imports``). Does nothing in any other process.
    Also the initializer of the planner's measuring children (``plan_children``)."""
    if _server_env is None:
        return
    freeze_imports()
    check_cuda_untouched()
    own_env = {k: v for k, v in os.environ.items() if _server_env.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(own_env)
    for signum in STOP_SIGNALS:
        signal.signal(
            signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        )


def plan_children(from_here: bool = False, preload: Sequence[str] = ()) -> None:
    """Have the planner's measuring children forked from this process's server (started here
    if it is not yet, and stopped at exit like the workers'), instead of each spawned afresh.
    ``from_here`` and ``preload``: as ``use_server``'s (a launcher, or ``python -m
    hsdp_runner.plan``)."""
    from hsdp_runner.planner import memory

    memory.start_children_in(
        use_server(from_here, preload), adopt_launcher_state, (dict(os.environ),)
    )
