"""Shared fixtures: run the CLI in a subprocess, and start N gloo workers in-process style."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

TINY = ["model=llama3_tiny", "trainer.global_batch_size=8", "trainer.steps=6", "logger=none"]


def cli_env(extra: dict | None = None) -> dict:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    # Subprocesses (and the processes they start, e.g. submitit's) import the checkout under
    # test, whatever their working directory, not another editable install.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra or {})
    return env


def run_cli(out_dir: Path, *overrides: str, timeout: int = 300, cwd: Path | None = None,
            prefix: list[str] | None = None, pin_dir: bool = True,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m hsdp_runner`` with overrides, its output dir pinned to ``out_dir``
    (``env``: extra environment variables)."""
    cmd = (prefix or [sys.executable]) + ["-m", "hsdp_runner"]
    if pin_dir:
        cmd.append(f"hydra.run.dir={out_dir}")
    cmd += list(overrides)
    return subprocess.run(cmd, cwd=cwd or REPO, env=cli_env(env), capture_output=True, text=True,
                          timeout=timeout)


def read_job(out_dir: Path) -> tuple[list[dict], dict | None]:
    """Return (metrics.jsonl records, summary.json) of a finished job dir."""
    metrics_path, summary_path = out_dir / "metrics.jsonl", out_dir / "summary.json"
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()] \
        if metrics_path.exists() else []
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return records, summary


def pytest_collection_modifyitems(items):
    """A test that uses ``trained_checkpoint`` starts a worker (the fixture's job): mark it
    ``multiprocess`` so ``make test-fast`` (``-m "not multiprocess"``) leaves it out."""
    for item in items:
        if "trained_checkpoint" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    return tmp_path / "job"


def _eight_rank_cases() -> dict:
    """Every eight-rank in-process case of test_placements and test_correctness, in one set
    of workers (starting eight workers costs more than all the cases together)."""
    import test_correctness
    import test_placements

    return {**test_placements._eight_rank_layouts(),
            "state_dicts": test_correctness._two_models_state_dicts(test_correctness.TWO_MODELS)}


@pytest.fixture(scope="session")
def eight_ranks() -> dict:
    """{rank: _eight_rank_cases()} from eight in-process gloo workers."""
    from distributed import run_workers

    return run_workers(_eight_rank_cases, 8)


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory) -> Path:
    """A finished single-rank tiny job with checkpoints step-1, step-2 and an fp32 HF export."""
    out = tmp_path_factory.mktemp("trained")
    result = run_cli(out, *TINY, "parallel=single", "trainer.steps=2", "checkpoint.enable=true",
                     "checkpoint.interval=1", "checkpoint.export_at_end=true",
                     "checkpoint.export_dtype=float32")
    assert result.returncode == 0, result.stderr[-3000:]
    return out
