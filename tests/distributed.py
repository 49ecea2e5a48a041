"""The one helper tests use to run a function on N gloo ranks: a pool of worker processes that
lives as long as the pytest process, fed one task at a time.

Starting ranks costs more than what tiny-model tests do in them: torch's elastic launch (agent,
c10d rendezvous, monitor), a fork per rank, the process group, the teardown. The pool pays the
process start once per pytest process (xdist worker) and keeps the rest per task, so a task
sees what a freshly launched rank sees:
- a fresh process group per task (``dist.init_process_group`` over a TCPStore the test process
  hosts for that task alone, as torch's agent hosts one per launch: the same ``env://``
  variables, RANK, WORLD_SIZE, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, ...), torn down after
  it, so meshes and their groups are rebuilt per task;
- the test process's environment of the moment (monkeypatched variables included);
- the state the worker had when it started, put back after every task: signal handlers, file
  descriptors 1 and 2 and ``sys.stdout``/``sys.stderr``, root logging handlers, warning filters,
  working directory, torch's RNG, default dtype and thread count, dynamo's caches, faulthandler.
A task on n ranks runs on the pool's first n workers (the pool grows to the largest n asked).
A rank that raises, dies or outlives ``TASK_DEADLINE_S`` ends the whole pool (the others may
be waiting in a collective for it) and the call raises ``ChildFailedError`` naming the rank
and its error, as the elastic launcher's did; the next call starts a fresh pool. The pool is
closed in order at the end of the session (``close_pool``, called by conftest).

Workers are forked from the runner's forkserver (``hsdp_runner.runtime.forkserver``), which
imported torch and the runner once. Tests that prove the launcher itself call
``hsdp_runner.runtime.launch.start_local_workers``; ``pool_launcher`` runs the runner's own job
path (``run_job`` -> ``_launch_local`` -> ``run_worker``) with the pool in place of the elastic
launch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
import uuid
import warnings
from datetime import timedelta
from multiprocessing.connection import wait

# Short collective timeout: a test that deadlocks fails in minutes instead of hanging. Meshes
# built without a timeout (ParallelDims.build_mesh) give every group the default group's.
TEST_TIMEOUT_S = 120
# A task whose ranks are all still running after this long ends the pool (a rank stuck outside
# a collective, where TEST_TIMEOUT_S cannot reach it).
TASK_DEADLINE_S = 900
# After one rank fails, how long the others get to report their own error before the pool ends.
FAILURE_GRACE_S = 2.0
_RESTORED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
)


# In a worker: when the task's own error was raised (None: when it reached the pool).
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


def run_workers(fn, nproc: int, *args) -> dict:
    """Run ``fn(*args)`` on ``nproc`` gloo ranks with a process group set up and torn down.

    ``fn`` must live in an importable module (a test module is). Returns {rank: fn's return
    value}; a rank that fails raises ``ChildFailedError`` with its error.
    """
    return _pool().run(_wrapped, nproc, (fn, args))


# --- the worker side ------------------------------------------------------------------------


class _Baseline:
    """What a worker had when it started, put back after every task."""

    def __init__(self):
        import torch

        self.signals = {s: signal.getsignal(s) for s in _RESTORED_SIGNALS}
        sys.stdout.flush()
        sys.stderr.flush()
        self.fds = {fd: os.dup(fd) for fd in (1, 2)}
        self.streams = (sys.stdout, sys.stderr)
        root = logging.getLogger()
        self.log_handlers, self.log_level = list(root.handlers), root.level
        self.warning_filters = list(warnings.filters)
        self.cwd = os.getcwd()
        self.rng = torch.get_rng_state()
        self.py_rng = random.getstate()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.faulthandler = faulthandler.is_enabled()

    def restore(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_initialized():  # a task that left its group (it failed, or forgot)
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        for signum, handler in self.signals.items():
            signal.signal(signum, handler)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, saved in self.fds.items():
            os.dup2(saved, fd)
        sys.stdout, sys.stderr = self.streams
        root = logging.getLogger()
        for handler in root.handlers:
            if handler not in self.log_handlers:
                handler.close()
        root.handlers[:] = self.log_handlers
        root.setLevel(self.log_level)
        warnings.filters[:] = self.warning_filters
        # Warnings shown once per place are shown again in the next task, as in a new process.
        warnings._filters_mutated()
        os.chdir(self.cwd)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        _clear_dtensor_caches()
        torch.set_rng_state(self.rng)
        random.setstate(self.py_rng)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        if not self.faulthandler and faulthandler.is_enabled():
            faulthandler.disable()
        gc.collect()


def _clear_dtensor_caches() -> None:
    """Empty DTensor's caches keyed by device mesh. A mesh compares equal to any mesh of the
    same shape and names (torch 2.13's ``DeviceMesh.__eq__``), so a later task's mesh would
    hit entries holding an earlier task's mesh, whose process groups are gone ("Could not
    resolve the process group registered under the name 4"): a new process has none."""
    from torch.distributed.tensor import _redistribute, _sharding_prop
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python and the C++ fast-path sharding caches
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def _serve(conn) -> None:
    """A pool worker: run each task received on ``conn`` and send back its outcome, until the
    pool closes the connection or sends None."""
    # Forked from the runner's forkserver, which ignores stop signals: a worker starts with the
    # defaults, as a launched rank does (forkserver.run_forked).
    for signum in _RESTORED_SIGNALS:
        signal.signal(
            signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        )
    baseline = _Baseline()
    # What the worker holds now (torch, the runner, dynamo, sympy: ~1M objects) is never
    # garbage; frozen, it is left out of every collection (the teardown's gc.collect() took
    # ~0.25 CPU-seconds a rank without this).
    gc.collect()
    gc.freeze()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        fn, args, env = task
        os.environ.clear()
        os.environ.update(env)
        _raised_at[0] = None
        try:
            reply = ("ok", fn(*args))
        except BaseException as err:  # SystemExit and KeyboardInterrupt fail the task too
            when = _raised_at[0] or time.time()  # stamped when raised, as torch's error file
            reply = ("error", f"{type(err).__name__}: {err}", traceback.format_exc(), when)
        finally:
            baseline.restore()
        try:
            conn.send(reply)
        except Exception as err:  # an unpicklable result
            conn.send(("error", f"its result could not be sent back: {err!r}", "", time.time()))


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


class WorkerPool:
    """Worker processes of this pytest process; ``run`` hands one task to the first n."""

    def __init__(self):
        self._workers: list[tuple[multiprocessing.Process, object]] = []

    def _grow(self, nproc: int) -> None:
        from hsdp_runner.runtime import forkserver

        ctx = multiprocessing.get_context(forkserver.use_server())
        while len(self._workers) < nproc:
            ours, theirs = ctx.Pipe()
            # Not daemonic: a task may start processes of its own (rank 0's sidecar, the
            # planner's measuring children); close_pool ends the workers.
            proc = ctx.Process(
                target=_serve, args=(theirs,), name=f"test-rank-{len(self._workers)}"
            )
            proc.start()
            theirs.close()
            self._workers.append((proc, ours))

    def run(self, fn, nproc: int, args: tuple, launcher_env: dict | None = None) -> dict:
        """Run ``fn(*args)`` on ranks 0..nproc-1, each with the ``env://`` variables of a torch
        launch over ``launcher_env`` (default: this process's environment); return {rank:
        result} or raise ``ChildFailedError`` after ending the pool."""
        from torch.distributed import TCPStore
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        from hsdp_runner.runtime.failures import NCCL_ERROR_HANDLING

        self._grow(nproc)
        store = TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=TEST_TIMEOUT_S),
        )
        env = dict(os.environ if launcher_env is None else launcher_env)
        env.setdefault(*NCCL_ERROR_HANDLING)  # as start_local_workers gives its workers
        run_id = uuid.uuid4().hex
        ranks = {}
        for rank, (proc, conn) in enumerate(self._workers[:nproc]):
            rank_env = {
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
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
            try:
                conn.send((fn, args, {**env, **rank_env}))
            except (BrokenPipeError, OSError):  # died between tasks
                self.close(kill=True)
                raise
            ranks[conn] = rank
            ranks[proc.sentinel] = rank
        results, failures = {}, {}
        deadline = time.monotonic() + TASK_DEADLINE_S
        pending = set(range(nproc))
        while pending:
            limit = deadline - time.monotonic()
            if failures:
                limit = min(limit, FAILURE_GRACE_S)
            waitables = [w for w, r in ranks.items() if r in pending]
            ready = wait(waitables, timeout=max(0.0, limit))
            if not ready:
                if not failures:
                    for rank in sorted(pending):
                        failures[rank] = _failure(
                            rank,
                            self._workers[rank][0].pid,
                            -signal.SIGKILL,
                            f"still running after {TASK_DEADLINE_S} s (tests/distributed."
                            "TASK_DEADLINE_S); the pool was ended",
                        )
                break
            for obj in ready:
                rank = ranks[obj]
                if rank not in pending:
                    continue
                pending.discard(rank)
                proc, conn = self._workers[rank]
                reply = None
                if conn.poll():  # a worker that replied and then died has still replied
                    with contextlib.suppress(EOFError, OSError):
                        reply = conn.recv()
                if reply is None:  # it died mid-task
                    proc.join(5)
                    code = proc.exitcode if proc.exitcode is not None else 1
                    failures[rank] = _failure(
                        rank,
                        proc.pid,
                        code,
                        "" if code < 0 else f"the worker exited with code {code} mid-task",
                    )
                elif reply[0] == "ok":
                    results[rank] = reply[1]
                else:
                    failures[rank] = _failure(rank, proc.pid, 1, *reply[1:])
        del store
        if failures:
            self.close(kill=True)
            # In the order they happened: of errors stamped in the same second, torch's
            # launcher (and ours, failures.first_failure) names the first in the dict.
            ordered = dict(sorted(failures.items(), key=lambda item: item[1].when))
            raise ChildFailedError(getattr(fn, "__name__", str(fn)), ordered)
        return dict(sorted(results.items()))  # rank order, as the elastic launcher's

    def close(self, kill: bool = False) -> None:
        """End the workers: ask each to leave and wait (``kill``: at once, mid-task)."""
        workers, self._workers = self._workers, []
        for _, conn in workers:
            if not kill:
                with contextlib.suppress(OSError):
                    conn.send(None)
            conn.close()
        for proc, _ in workers:
            if kill:
                proc.kill()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


_POOL: WorkerPool | None = None


def _pool() -> WorkerPool:
    global _POOL
    if _POOL is None:
        import atexit

        _POOL = WorkerPool()
        # Before multiprocessing's own exit handler, which would wait for the workers.
        atexit.register(close_pool)
    return _POOL


def close_pool() -> None:
    """End this process's pool in order (pytest's session end); a later call starts another."""
    if _POOL is not None:
        _POOL.close()


def start_pool_workers(fn, nproc: int, *args, shutdown_timeout: int = 30, agent_signals=""):
    """``launch.start_local_workers`` with the pool in place of torch's elastic launch (same
    arguments and result; the shutdown and signal arguments belong to the elastic agent)."""
    return _pool().run(fn, nproc, args)


@contextlib.contextmanager
def pool_launcher():
    """Within it, the runner's local launcher (``run_job`` -> ``_launch_local``) starts its
    ranks in the pool; this process's environment is put back afterwards (the launcher sets
    OMP_NUM_THREADS for its workers)."""
    from hsdp_runner.runtime import launch

    saved_env = dict(os.environ)
    original = launch.start_local_workers
    launch.start_local_workers = start_pool_workers
    try:
        yield
    finally:
        launch.start_local_workers = original
        os.environ.clear()
        os.environ.update(saved_env)
