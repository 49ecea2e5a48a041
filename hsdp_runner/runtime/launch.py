"""From a composed config to running ranks: validate (``prelaunch``), then start workers or
join torchrun. After the checks, either
- not under a distributed launcher: start world-size workers with torch's elastic launcher
  API on this node, or
- under torchrun (RANK and WORLD_SIZE set): this process is one rank; run it directly, or
- in a SLURM task (launcher=slurm / slurm_local, one task per rank): export the
  torch.distributed variables from SLURM's (``slurm.join_submitit_job``), then run it like a
  torchrun rank. Before anything is queued, ``prelaunch.check_before_submit`` validates every
  job of the sweep.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hsdp_runner.checkpoint import start as checkpoint_start
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.config.schema import CheckpointConfig, RunConfig
from hsdp_runner.core.choices import LauncherName, RunStatus
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.core.exit_codes import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from hsdp_runner.core.records import RunInfo, RunSummary
from hsdp_runner.distributed import float8
from hsdp_runner.distributed.hardware import cpu_threads
from hsdp_runner.distributed.parallel_dims import DIM_NAMES, ParallelDims
from hsdp_runner.runtime import forkserver, reaper
from hsdp_runner.runtime.agent_shutdown import stopping_failed_workers_within
from hsdp_runner.runtime.failures import (
    NCCL_ERROR_HANDLING,
    begin_attempt,
    cause_from_log,
    first_failure,
    record_launcher_failure,
    record_stopped_at_once,
    signal_only,
    with_timeout_hint,
)
from hsdp_runner.runtime.prelaunch import under_torchrun, validate
from hsdp_runner.runtime.signals import BASE_SIGNALS, LauncherSignals, signal_name, stop_signals
from hsdp_runner.runtime.slurm import join_submitit_job
from hsdp_runner.train import sinks

log = logging.getLogger("hsdp_runner")

RESOLVED_CONFIG_FILE = sinks.RESOLVED_CONFIG_FILE


def run_job(cfg: DictConfig, run_info: RunInfo) -> int:
    """Validate, launch and wait for one job; return its exit code (0, 1 failed, 2 config).

    Takes the composed config (Hydra's DictConfig); it is checked and converted once, here, to
    the typed ``RunConfig`` that the workers receive (pickled by the launch; converting it
    again on every rank cost each ~0.15 CPU-s)."""
    output_dir = Path(run_info.output_dir)
    try:
        if LauncherName(cfg.launcher.name).submitit:
            join_submitit_job(cfg.launcher.name)
        run = to_run_config(cfg)
        # parallel=auto plans into the composed config: validate it, then convert that.
        dims = validate(
            cfg if run.parallel.auto else run,
            output_dir,
            size_degrees=run_info.size_degrees,
            overrides=run_info.overrides,
        )
        if run.parallel.auto:
            run = to_run_config(cfg)
    except ConfigError as err:
        if run_info.multirun:  # a sweep skips a combination that cannot run, goes on
            _record_skipped(cfg, run_info, str(err))
        else:
            print(f"hsdp_runner: config error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if not under_torchrun() or int(os.environ["RANK"]) == 0:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        (output_dir / RESOLVED_CONFIG_FILE).write_text(OmegaConf.to_yaml(resolved))
        begin_attempt(output_dir)
    if under_torchrun():
        from hsdp_runner.runtime.worker import run_worker

        summary = run_worker(run, dims, run_info)
    else:
        code, summary = _launch_local(run, dims, run_info)
        if code != EXIT_OK:
            return code
    if summary is not None and summary.status is RunStatus.interrupted:
        print(
            f"hsdp_runner: interrupted by {summary.signal} after step "
            f"{summary.interrupted_at_step}; last checkpoint: "
            f"{summary.last_checkpoint or 'none (checkpoint.enable=false)'}; rerun the "
            f"same command to resume. Outputs in {output_dir}",
            file=sys.stderr,
        )
        return 128 + signal.Signals[summary.signal].value
    if summary is not None:
        print(
            f"hsdp_runner: done ({dims.layout}, {dims.world_size} ranks, final loss "
            f"{summary.final_loss:.4f}); outputs in {output_dir}"
        )
    return EXIT_OK


# LaunchConfig fields that older torch releases lack, and the environment variable their
# elastic agent reads instead (torch 2.11, seen on an H100 machine, has no shutdown_timeout).
LAUNCH_FIELD_ENV = {
    "shutdown_timeout": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    "signals_to_handle": "TORCHELASTIC_SIGNALS_TO_HANDLE",
}


def launch_config(config_cls, **fields) -> tuple[object, dict[str, str]]:
    """Build torch's ``LaunchConfig`` (``config_cls``) from ``fields``; return (config, the
    environment variables to set for the launch). A field this torch's LaunchConfig lacks is
    passed through its environment variable (``LAUNCH_FIELD_ENV``) instead of failing the
    launch with a TypeError; an unknown field without one raises TypeError as before."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    env = {
        LAUNCH_FIELD_ENV[name]: str(value)
        for name, value in fields.items()
        if name not in known and name in LAUNCH_FIELD_ENV
    }
    kept = {k: v for k, v in fields.items() if k in known or k not in LAUNCH_FIELD_ENV}
    return config_cls(**kept), env


def start_local_workers(
    fn,
    nproc: int,
    *args,
    shutdown_timeout: int = 30,
    agent_signals: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    fork_server_here: bool = False,
    preload: tuple[str, ...] = (),
) -> dict:
    """Run ``fn(*args)`` in ``nproc`` processes on this node with torch's elastic launcher,
    forked from a server that imported torch once (``forkserver``). Returns once what the
    workers started has ended too (``reaper``: at most ``shutdown_timeout`` after them).

    ``fn`` must live in an importable module. Returns {rank: return value}; a failing rank
    raises ``ChildFailedError`` (the others get SIGTERM, then at most ``shutdown_timeout``,
    never more than torch's 30 s, before SIGKILL: ``agent_shutdown``). On a signal named in
    ``agent_signals`` torch's agent passes it on, gives the workers ``shutdown_timeout``
    seconds to stop before killing them, then raises ``SignalException``; ``_launch_local``
    leaves SIGTERM/SIGINT out and handles them itself. ``fork_server_here``: this process is
    a job's launcher, which may fork the server from itself (``forkserver.use_server``).
    ``preload``: modules the workers will import that the server should import once for them
    (``job_imports``).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config, agent_env = launch_config(
        LaunchConfig,
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        start_method=forkserver.use_server(from_here=fork_server_here, preload=preload),
        monitor_interval=0.1,
        shutdown_timeout=shutdown_timeout,
        signals_to_handle=agent_signals,
    )
    # torch's agent writes TORCH_NCCL_ASYNC_ERROR_HANDLING into every worker's environment,
    # its own default (1) unless the launching process has one (local_elastic_agent.py), so
    # a worker cannot set ours; the launcher can, for the launch only. A user's value wins.
    key, value = NCCL_ERROR_HANDLING
    launch_env = {**agent_env, key: os.environ.get(key, value)}
    saved = {name: os.environ.get(name) for name in launch_env}
    os.environ.update(launch_env)
    try:
        with (
            reaper.adopting_orphans(shutdown_timeout, keep=forkserver.server_pids),
            stopping_failed_workers_within(shutdown_timeout),
        ):
            return elastic_launch(config, forkserver.run_forked)(dict(os.environ), fn, *args)
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


# What a job's option makes each worker import beyond the forkserver's WORKER_IMPORTS, about
# a CPU-second a worker (measured in a worker forked from the server, torch 2.13): a compiled
# model's first compile imports Dynamo's AOT backends and Inductor's pattern matcher (for the
# graph's CSE, aot_eager's too); torchao's float8 conversion patches Inductor's Triton codegen,
# importing it (torchao itself the launcher imports in its checks: ``prelaunch``). HF datasets
# is left out: importing it starts a native thread, and a server forks its workers from one
# thread.
COMPILE_IMPORTS = ("torch._dynamo.backends.common", "torch._inductor.pattern_matcher")
FLOAT8_IMPORTS = ("torch._inductor.codegen.triton",)


def job_imports(cfg: RunConfig) -> tuple[str, ...]:
    """The modules ``cfg``'s workers will import that the forkserver can import once for them
    (``forkserver.use_server``'s ``preload``): ``COMPILE_IMPORTS`` for a compiled model,
    ``FLOAT8_IMPORTS`` for float8 training; () for neither."""
    compiled = COMPILE_IMPORTS if cfg.parallel.compile else ()
    return compiled + (FLOAT8_IMPORTS if float8.enabled(cfg.precision) else ())


def _launch_local(
    cfg: RunConfig, dims: ParallelDims, run_info: RunInfo
) -> tuple[int, RunSummary | None]:
    """Start ``dims.world_size`` workers on this node, each given ``cfg``, and wait; return
    (exit code, summary)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hsdp_runner.runtime.worker import run_worker

    # Our own message names the failed rank and error; the elastic agent would repeat the
    # whole traceback (it is in the rank's log).
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # torch's launcher sets 1 thread per worker when OMP_NUM_THREADS is unset, with a warning;
    # share out the CPUs this process may use instead. The workers are this process's
    # children and share its CPUs even inside a SLURM task bound to its own (env={}: the
    # task's whole-mask rule is for a task that is one rank). The share is this launch's
    # alone: a sweep or parity run launches its jobs from one process, and a 1-rank job's
    # share (every CPU) left behind would give each rank of the next 8-rank job every CPU.
    share = "OMP_NUM_THREADS" not in os.environ
    if share:
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads(dims.world_size, env={}))
    # Stop signals are ours, not the agent's: it would pass the first on and then stop
    # collecting the workers' results (and die mid-shutdown on a second one).
    signals = LauncherSignals()
    signals.install(stop_signals(cfg.launcher.signal))
    try:
        results = start_local_workers(
            run_worker,
            dims.world_size,
            cfg,
            dims,
            dataclasses.replace(run_info, local_launch=True),
            shutdown_timeout=cfg.launcher.timeout_s,
            agent_signals="SIGHUP,SIGQUIT",
            fork_server_here=True,
            preload=job_imports(cfg),
        )
    except SignalException as err:  # a stop signal while no worker was running
        print(
            f"hsdp_runner: stopped by {signal.Signals(err.sigval).name} while no worker was "
            "running",
            file=sys.stderr,
        )
        return 128 + err.sigval, None
    except ChildFailedError as err:
        rank, failure = first_failure(err.failures)
        stopped = signals.insisted or _stop_exit_signal(failure.exitcode)
        if stopped:
            return _stopped_at_once(cfg.checkpoint, dims, run_info.output_dir, stopped), None
        message = _failure_message(failure, Path(run_info.output_dir) / "logs", rank)
        print(
            f"hsdp_runner: rank {rank} failed (exit code {failure.exitcode}): {message}\n"
            f"rank logs: {Path(run_info.output_dir) / 'logs'}",
            file=sys.stderr,
        )
        record_launcher_failure(run_info.output_dir, dims.describe(), rank, message)
        return EXIT_FAILED, None
    finally:
        signals.uninstall()
        if share:
            os.environ.pop("OMP_NUM_THREADS", None)
    return EXIT_OK, results.get(0)


def _stop_exit_signal(exitcode: int) -> int | None:
    """The stop signal a worker's exit code 128 + signal says it stopped at once on, or None."""
    return exitcode - 128 if exitcode - 128 in {int(s) for s in BASE_SIGNALS} else None


def _stopped_at_once(
    ckpt: CheckpointConfig, dims: ParallelDims, output_dir: str, signum: int
) -> int:
    """A repeated stop signal ended the workers mid-step: record and report it; exit code."""
    last_ckpt = checkpoint_start.newest_checkpoint(ckpt, Path(output_dir))
    step = sinks.last_step(output_dir)
    record_stopped_at_once(
        output_dir, dims.describe(), signal_name(signum), step, last_ckpt, first_only=False
    )
    print(
        f"hsdp_runner: stopped at once by a repeated {signal_name(signum)} during step "
        f"{step + 1}; last checkpoint: {last_ckpt or 'none'}. Outputs in {output_dir}",
        file=sys.stderr,
    )
    return 128 + signum


def _failure_message(failure, log_dir: Path | None = None, rank: int | None = None) -> str:
    message = failure.message
    if isinstance(message, dict):  # the error file's JSON: {"message": ..., "extraInfo": ...}
        message = message.get("message", message)
    message = str(message).strip() or f"exit code {failure.exitcode}"
    # Killed in C++ (e.g. NCCL's watchdog on a timeout: SIGABRT): the cause is in its log.
    cause = cause_from_log(log_dir, rank) if log_dir and signal_only(message) else None
    if cause:
        message = f"{message}: {cause}"
    return with_timeout_hint(message)


def _record_skipped(cfg: DictConfig, run_info: RunInfo, reason: str) -> None:
    """A sweep's job that cannot run: print why; write its resolved config and its summary
    (``status: skipped``, the reason, its overrides and the degrees it asked for)."""
    output_dir = Path(run_info.output_dir)
    print(f"hsdp_runner: skipped (not counted as a failure): {reason}", flush=True)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RESOLVED_CONFIG_FILE).write_text(OmegaConf.to_yaml(cfg, resolve=True))
        RunSummary.skipped(
            reason, run_info.overrides, {name: cfg.parallel[name] for name in DIM_NAMES}
        ).write(output_dir)
    except OSError as err:  # e.g. the reason itself is an unwritable output dir
        print(
            f"hsdp_runner: could not record the skipped job in {output_dir}: {err}", file=sys.stderr
        )
