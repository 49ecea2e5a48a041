"""Shared fixtures: run the CLI in a subprocess, and start N gloo workers in-process style."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The per-job meters cost a tiny job about a fifth of its CPU (the tensor-memory peak runs
# torch.profiler over a step on every CPU rank; the communication count wraps a step's
# collectives), so the tiny jobs leave them off; the tests about them turn them back on (the
# NaN-skip job in test_faults, test_figures, test_options' accumulation cases, test_comm,
# test_auto, the browser test's sweep).
METERS_OFF = ["metrics.memory_steps=0", "metrics.comm_step=null"]
TINY = ["model=llama3_tiny", "trainer.global_batch_size=8", "trainer.steps=6", "logger=none"]
TINY += METERS_OFF


def pytest_configure(config):
    """The planner measures in children forked from the runner's forkserver, as a job's
    launcher and ``python -m hsdp_runner.plan`` have it do (``forkserver.plan_children``).
    The server preloads what a compiled or float8 job's ranks import (``launch.job_imports``)
    and the tests' own imports (``tests/server_preload.py``): every rank of this process is
    forked from it."""
    from hsdp_runner.core.frozen_imports import pause_collection

    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        # A process that collects (an xdist worker, or pytest without one) imports torch and
        # every test module: no collection until pytest_collection_finish freezes them.
        pause_collection()
    from hsdp_runner.runtime import forkserver, launch

    forkserver.plan_children(
        preload=(*launch.COMPILE_IMPORTS, *launch.FLOAT8_IMPORTS, "server_preload")
    )


def pytest_collection_finish(session):
    """What collection imported (torch, the runner, every test module) is never garbage: left
    out of the collector's passes, as the runner's own processes leave theirs
    (``core.frozen_imports``)."""
    from hsdp_runner.core.frozen_imports import freeze_imports

    freeze_imports()


def cli_env(extra: dict | None = None) -> dict:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    # Subprocesses (and the processes they start, e.g. submitit's) import the checkout under
    # test, whatever their working directory, not another editable install.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra or {})
    return env


_cli_server = None


def cli_server():
    """This pytest process's ``cli_forks.CliServer`` (started on the first call, ended at
    exit): command lines of ``python -m hsdp_runner`` forked from one process that imported the
    CLI once."""
    global _cli_server
    from cli_forks import CliServer

    if _cli_server is None:
        _cli_server = CliServer(cli_env())
        atexit.register(_cli_server.close)
    return _cli_server


def run_cli(
    out_dir: Path,
    *overrides: str,
    timeout: int = 300,
    cwd: Path | None = None,
    prefix: list[str] | None = None,
    pin_dir: bool = True,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -m hsdp_runner`` with overrides, its output dir pinned to ``out_dir``
    (``env``: extra environment variables). Without a ``prefix`` (torchrun's) it runs in a
    process forked from one that imported the CLI once (tests/cli_forks.py), else in a fresh
    interpreter; either way the result is ``subprocess.run``'s."""
    from cli_forks import ENV_READ_AT_IMPORT

    args = [f"hydra.run.dir={out_dir}"] if pin_dir else []
    args += list(overrides)
    full_env = cli_env(env)
    if prefix is None and not set(env or ()) & set(ENV_READ_AT_IMPORT):
        return cli_server().run(args, full_env, cwd or REPO, timeout, Path(out_dir).parent)
    cmd = (prefix or [sys.executable]) + ["-m", "hsdp_runner", *args]
    return subprocess.run(
        cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def run_forked(out_dir: Path, *overrides: str) -> SimpleNamespace:
    """Run one job of ``overrides`` through the runner's job path (``launch.run_job``:
    validation, the resolved config, ``_launch_local``, ``run_worker`` on every rank: metrics,
    summary, logs, checkpoints), its ranks forked by ``distributed.start_ranks`` instead of
    started by torch's elastic launch (``distributed.forked_launcher``), into ``out_dir``.

    For tests about what a job computes and records; a test about the command line or the
    launch itself runs ``run_cli``. Returns (returncode, stdout, stderr) of the launching side,
    like ``run_cli``'s result; the ranks' own output is in ``out_dir/logs``.
    """
    from distributed import forked_launcher

    from hsdp_runner.config.compose import compose
    from hsdp_runner.core.records import RunInfo
    from hsdp_runner.runtime.launch import run_job

    out, err = io.StringIO(), io.StringIO()
    with forked_launcher(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_job(
            compose(list(overrides)),
            RunInfo(
                output_dir=str(out_dir),
                group="tests",
                run_name=Path(out_dir).name,
                tags=[],
                multirun=False,
                overrides=list(overrides),
            ),
        )
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def rank_logs(out_dir: Path) -> str:
    """Every rank's log of a job dir (rank 0's stderr included, through its sidecar)."""
    return "".join(p.read_text() for p in sorted((Path(out_dir) / "logs").glob("rank*.log")))


def read_job(out_dir: Path) -> tuple[list[dict], dict | None]:
    """Return (metrics.jsonl records, summary.json) of a finished job dir."""
    metrics_path, summary_path = out_dir / "metrics.jsonl", out_dir / "summary.json"
    records = (
        [json.loads(line) for line in metrics_path.read_text().splitlines()]
        if metrics_path.exists()
        else []
    )
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return records, summary


# Under pytest-xdist (`make test`: two workers) a worker takes a whole file at a time, so a
# module fixture runs once; files that share a session fixture go to one worker together, or
# each worker would pay for it. The slowest files start first, so the run does not end with one
# worker alone on a long file; the others keep their collection order. The order: each file's
# (or shared fixture's files') time in a `make test` run of 2026-11-26 (314.5 s of pytest,
# docs/testing.md), summed from its --durations table: faults 105 s, parity 74, sweep 53, the
# eight-rank files 44, many_nodes 41, checkpoint 30, torchrun 29, float8 24, gpu_failures 22,
# auto 22, comm 20, hf_jobs (measured alone, 17 s), plan 17, then config, dashboard_browser,
# bad_input, options, wandb.
SHARED_SESSION_FIXTURE = {
    "test_placements.py": "eight_ranks",
    "test_correctness.py": "eight_ranks",
    "test_pipeline.py": "eight_ranks",
    "test_checkpoint_errors.py": "trained_checkpoint",
    "test_hf_export.py": "trained_checkpoint",
}
SLOWEST_FIRST = (
    "test_faults.py",
    "test_parity.py",
    "test_sweep.py",
    "test_correctness.py",
    "test_pipeline.py",
    "test_placements.py",
    "test_many_nodes.py",
    "test_checkpoint.py",
    "test_torchrun.py",
    "test_float8.py",
    "test_gpu_failures.py",
    "test_auto.py",
    "test_comm.py",
    "test_hf_jobs.py",
    "test_plan.py",
    "test_config.py",
    "test_dashboard_browser.py",
    "test_bad_input.py",
    "test_options.py",
    "test_wandb.py",
)


def pytest_collection_modifyitems(items):
    """Start the slowest files first (a stable sort, so each file's tests stay together and in
    order). A test that uses ``trained_checkpoint`` starts a worker (the fixture's job): mark
    it ``multiprocess`` so ``make test-fast`` (``-m "not multiprocess"``) leaves it out."""
    first = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    for item in items:
        if "trained_checkpoint" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a plain run may lack
def pytest_xdist_make_scheduler(config, log):
    """xdist's file-at-a-time scheduling, with the files of ``SHARED_SESSION_FIXTURE`` as one
    unit and the units in collection order (xdist would order them by test count)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_SESSION_FIXTURE.get(Path(path).name, path)

    config.option.loadscopereorder = False
    return FileScheduling(config, log)


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    return tmp_path / "job"


def _eight_rank_cases(configs: dict) -> dict:
    """Every eight-rank in-process case of test_placements, test_correctness and test_pipeline,
    in one set of workers (starting eight workers costs more than all the cases together), each
    from its config composed by the test process (``_eight_rank_configs``)."""
    import test_correctness
    import test_pipeline
    import test_placements
    from distributed import own_groups

    with own_groups():
        out = test_placements._eight_rank_layouts(configs["placements"])
    with own_groups():
        out["state_dicts"] = test_correctness._two_models_state_dicts(configs["state_dicts"])
    out["pipeline"] = test_pipeline._train_cases(configs["pipeline"])
    return out


def _eight_rank_configs() -> dict:
    """The configs of ``_eight_rank_cases``, composed once here rather than on every rank."""
    import test_correctness
    import test_pipeline
    import test_placements
    from test_config import compose

    def composed(cases):
        return {name: compose(overrides) for name, overrides in cases.items()}

    return {
        "placements": composed(test_placements.EIGHT_RANK_LAYOUTS),
        "state_dicts": composed(test_correctness.TWO_MODELS),
        "pipeline": test_pipeline.compose_cases(test_pipeline.EIGHT_RANK_CASES),
    }


@pytest.fixture(scope="session")
def eight_ranks() -> dict:
    """{rank: _eight_rank_cases()} from eight in-process gloo workers."""
    from distributed import run_workers

    return run_workers(_eight_rank_cases, 8, _eight_rank_configs())


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory) -> Path:
    """A finished single-rank tiny job with checkpoints step-1, step-2 and an fp32 HF export
    (its rank forked by ``distributed.start_ranks``)."""
    out = tmp_path_factory.mktemp("trained")
    result = run_forked(
        out,
        *TINY,
        "parallel=single",
        "trainer.steps=2",
        "checkpoint.enable=true",
        "checkpoint.interval=1",
        "checkpoint.export_at_end=true",
        "checkpoint.export_dtype=float32",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out
