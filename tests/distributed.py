"""The one helper tests use to run a function on N gloo ranks, started for a fraction of what
torch's elastic launch costs.

``run_workers(fn, nproc, *args)`` forks one process per rank from the runner's forkserver
(``hsdp_runner.runtime.forkserver``: torch, FSDP, dynamo and the runner imported once per
pytest process), runs ``fn(*args)`` in each with a fresh process group and returns {rank:
result}. What it leaves out of a launch is what cost the time: torch's elastic agent (its c10d
rendezvous, a monitor polling every 0.1 s, its shutdown), a collection of every object the
server imported at the teardown (frozen instead: ``gc.freeze``), and the interpreter's own
teardown (a forked rank leaves with ``os._exit``, as multiprocessing's children do). The
ranks rendezvous over a TCPStore the test process hosts for that call, with the ``env://``
variables torch's agent gives a rank (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_PORT,
``TORCHELASTIC_USE_AGENT_STORE``, ...), and get the test process's environment of the moment.

Each call gets new processes, so nothing a task changes (signal handlers, module globals of the
runner, DTensor's mesh-keyed caches, dynamo's caches, RNG, logging) reaches the next one: a
pool of long-lived ranks fed tasks was tried and leaked exactly that state (a checkpoint's
rank-0 call counter kept per process deadlocked the next job's save).

A rank that raises, dies or outlives ``TASK_DEADLINE_S`` ends the others (they may wait in a
collective for it) and the call raises ``ChildFailedError`` with ``failures[rank]`` as the
elastic launcher gave it. ``forked_launcher`` runs the runner's own job path (``run_job`` ->
``_launch_local`` -> ``run_worker``) with these ranks in place of the elastic launch; tests
that prove the launcher itself call ``hsdp_runner.runtime.launch.start_local_workers``.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import signal
import time
import traceback
import uuid
from datetime import timedelta
from multiprocessing.connection import wait

from hsdp_runner.core.frozen_imports import freeze_imports
from hsdp_runner.runtime.forkserver import STOP_SIGNALS

# Short collective timeout: a test that deadlocks fails in minutes instead of hanging. Meshes
# built without a timeout (ParallelDims.build_mesh) give every group the default group's.
TEST_TIMEOUT_S = 120
# A call whose ranks are still running after this long ends them (a rank stuck outside a
# collective, where TEST_TIMEOUT_S cannot reach it).
TASK_DEADLINE_S = 900
# After one rank fails, how long the others get to report their own error before they are ended.
FAILURE_GRACE_S = 2.0
# The stop signals the forkserver ignores, and the alarm a test may have set.
_RESTORED_SIGNALS = (*STOP_SIGNALS, signal.SIGALRM)


# In a rank: when fn's own error was raised (before the teardown; None: not through _wrapped).
_raised_at: list[float | None] = [None]


def _wrapped(fn, args):
    import torch.distributed as dist

    from hsdp_runner.distributed.hardware import set_cpu_threads

    # As a runner worker does: share the CPUs among the ranks (unless OMP_NUM_THREADS says).
    set_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=TEST_TIMEOUT_S))
    try:
        result = fn(*args)
    except BaseException:
        _raised_at[0] = time.time()  # before the teardown makes its peers fail
        dist.destroy_process_group()
        raise
    # Orderly teardown avoids the gloo abort at exit after DeviceMesh use (TORCH_NOTES).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return result


@contextlib.contextmanager
def own_groups():
    """In a rank: destroy, on leaving without an error, the process groups made inside (one
    layout's world mesh, in a task that builds one layout after another).

    Each gloo group keeps a thread that wakes every 10 ms for as long as the group lives (its
    device's event loop), and nothing else ends them before the rank does: a 2-D mesh of 4
    ranks makes 15 a rank, and a task that trained 21 layouts in turn kept 360 threads a rank
    waking. A group lives while a mesh holds it, and DTensor's sharding caches hold the meshes
    they saw, so those are cleared too (the planner's measuring child does the same between
    worlds)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from hsdp_runner.planner.memory import _forget_dtensor_caches

    before = set(distributed_c10d._world.pg_map)
    yield
    for group in [g for g in distributed_c10d._world.pg_map if g not in before]:
        dist.destroy_process_group(group)
    _forget_dtensor_caches()
    gc.collect()


def run_workers(fn, nproc: int, *args) -> dict:
    """Run ``fn(*args)`` on ``nproc`` gloo ranks with a process group set up and torn down.

    ``fn`` must live in an importable module (a test module is). Returns {rank: fn's return
    value}; a rank that fails raises ``ChildFailedError`` with its error.
    """
    return start_ranks(_wrapped, nproc, fn, args)


# --- a rank's side -------------------------------------------------------------------------


def _rank_main(conn, fn, args, env) -> None:
    """One rank, forked from the server: take ``env`` and default signal handling (the server
    ignores stop signals: ``forkserver.run_forked``), run ``fn(*args)``, send back its
    outcome."""
    for signum in _RESTORED_SIGNALS:
        signal.signal(
            signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        )
    os.environ.clear()
    os.environ.update(env)
    # What the server imported (torch, the runner, dynamo, sympy: ~1M objects) is never
    # garbage; frozen, it is left out of every collection (the teardown's gc.collect() took
    # ~0.25 CPU-seconds a rank without this). The server never collects; the rank does, as a
    # job's rank does (``frozen_imports``).
    freeze_imports()
    try:
        reply = ("ok", fn(*args))
    except BaseException as err:  # SystemExit and KeyboardInterrupt fail the task too
        when = _raised_at[0] or time.time()  # stamped when raised, as torch's error file
        reply = ("error", f"{type(err).__name__}: {err}", traceback.format_exc(), when)
    # Plain pickle, by value: multiprocessing's own pickler sends a tensor as a handle on this
    # process's shared memory, which is gone once the rank has exited.
    try:
        data = pickle.dumps(reply)
    except Exception as err:  # an unpicklable result
        data = pickle.dumps(
            ("error", f"its result could not be sent back: {err!r}", "", time.time())
        )
    conn.send_bytes(data)
    conn.close()


# --- the test process's side ----------------------------------------------------------------


def _failure(
    rank: int, pid: int, exitcode: int, error: str = "", stack: str = "", when: float | None = None
):
    """A torch ``ProcessFailure`` as the elastic launcher reports one: a Python ``error``
    ("Type: text") with its ``stack`` in the form torch's error file gives, else torch's own
    message ("Signal 9 (SIGKILL) received by PID ..." for a killed worker)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file="")
    failure.when = time.time() if when is None else when  # to order failures within a second
    failure.timestamp = int(failure.when)
    if error:
        failure.message = {
            "message": error,
            "extraInfo": {"py_callstack": stack, "timestamp": str(failure.timestamp)},
        }
    return failure


def _rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict:
    """What torch's elastic agent sets for a rank (local_elastic_agent.py), one node."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def start_ranks(
    fn,
    nproc: int,
    *args,
    shutdown_timeout: int = 30,
    agent_signals="",
    fork_server_here=False,
    preload=(),
) -> dict:
    """Run ``fn(*args)`` on ``nproc`` new processes forked from the runner's forkserver, with
    the ``env://`` variables of a torch launch; return {rank: result} in rank order or raise
    ``ChildFailedError``. Takes ``launch.start_local_workers``'s arguments (the shutdown and
    signal ones belong to torch's agent and are not used; the test process keeps its own
    server, which preloads what every job's options import, so ``fork_server_here`` and
    ``preload`` are not either)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hsdp_runner.runtime import forkserver
    from hsdp_runner.runtime.failures import NCCL_ERROR_HANDLING

    ctx = multiprocessing.get_context(forkserver.use_server())
    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=TEST_TIMEOUT_S),
    )
    env = dict(os.environ)
    env.setdefault(*NCCL_ERROR_HANDLING)  # as start_local_workers gives its workers
    run_id = uuid.uuid4().hex
    ranks, procs = {}, []
    try:
        for rank in range(nproc):
            ours, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(theirs, fn, args, {**env, **_rank_env(rank, nproc, store.port, run_id)}),
                name=f"test-rank-{rank}",
            )
            proc.start()
            theirs.close()
            procs.append((proc, ours))
            ranks[ours] = ranks[proc.sentinel] = rank
        results, failures = _collect(procs, ranks)
    finally:
        for proc, conn in procs:  # every rank left, or is ended: its peers may wait for it
            if proc.is_alive() and proc.exitcode is None:
                proc.join(0.5)
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            conn.close()
        del store
    if failures:
        # In the order they happened: of errors stamped in the same second, torch's launcher
        # (and ours, failures.first_failure) names the first in the dict.
        ordered = dict(sorted(failures.items(), key=lambda item: item[1].when))
        raise ChildFailedError(getattr(fn, "__name__", str(fn)), ordered)
    return dict(sorted(results.items()))


def _collect(procs: list, ranks: dict) -> tuple[dict, dict]:
    """Wait for every rank's reply or death; after the first failure, FAILURE_GRACE_S more for
    the others. Returns ({rank: result}, {rank: ProcessFailure})."""
    results, failures = {}, {}
    deadline = time.monotonic() + TASK_DEADLINE_S
    pending = set(range(len(procs)))
    while pending:
        limit = deadline - time.monotonic()
        if failures:
            limit = min(limit, FAILURE_GRACE_S)
        ready = wait([w for w, r in ranks.items() if r in pending], timeout=max(0.0, limit))
        if not ready:
            if not failures:
                for rank in sorted(pending):
                    failures[rank] = _failure(
                        rank,
                        procs[rank][0].pid,
                        -signal.SIGKILL,
                        f"still running after {TASK_DEADLINE_S} s (tests/distributed."
                        "TASK_DEADLINE_S); ended",
                    )
            break
        for obj in ready:
            rank = ranks[obj]
            if rank not in pending:
                continue
            pending.discard(rank)
            proc, conn = procs[rank]
            reply = None
            if conn.poll():  # a rank that replied and then died has still replied
                try:
                    reply = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    pass
                except Exception as err:  # e.g. a result of a class this process cannot import
                    reply = ("error", f"its result could not be read: {err!r}", "", time.time())
            if reply is None:  # it died before replying
                proc.join(5)
                code = proc.exitcode if proc.exitcode is not None else 1
                failures[rank] = _failure(
                    rank,
                    proc.pid,
                    code,
                    "" if code < 0 else f"the rank exited with code {code} before replying",
                )
            elif reply[0] == "ok":
                results[rank] = reply[1]
            else:
                failures[rank] = _failure(rank, proc.pid, 1, *reply[1:])
    return results, failures


@contextlib.contextmanager
def forked_launcher():
    """Within it, the runner's local launcher (``run_job`` -> ``_launch_local``) starts its
    ranks with ``start_ranks``; this process's environment is put back afterwards (the
    launcher sets OMP_NUM_THREADS for its workers)."""
    from hsdp_runner.runtime import launch

    saved_env = dict(os.environ)
    original = launch.start_local_workers
    launch.start_local_workers = start_ranks
    try:
        yield
    finally:
        launch.start_local_workers = original
        os.environ.clear()
        os.environ.update(saved_env)
