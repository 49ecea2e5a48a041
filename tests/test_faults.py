"""Faults end a job in bounded time with a clear status: NaN, a hung rank, SIGTERM, no orphans."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, TINY, cli_env, read_job, run_cli

pytestmark = pytest.mark.multiprocess


def leftover_processes(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker`` (the job's processes)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def run_marked(job_dir, *overrides, timeout=240):
    marker = f"HSDP_TEST_JOB={uuid.uuid4().hex}"
    env = cli_env({marker.split("=")[0]: marker.split("=")[1]})
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "hsdp_runner", f"hydra.run.dir={job_dir}",
                             *overrides], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=timeout)
    return result, time.monotonic() - start, marker


def test_nan_loss_stops_the_run_by_default(job_dir):
    result = run_cli(job_dir, *TINY, "parallel=fsdp", "fault.rank=1", "fault.step=3",
                     "fault.kind=nan")
    assert result.returncode == 1
    assert "step 3: loss nan" in result.stderr and "trainer.on_nan=skip" in result.stderr
    records, summary = read_job(job_dir)
    assert summary["status"] == "failed" and "not finite" in summary["error"]
    assert [r["step"] for r in records] == [1, 2]


def test_nan_step_is_skipped_and_counted_with_on_nan_skip(job_dir):
    result = run_cli(job_dir, *TINY, "parallel=fsdp", "fault.rank=1", "fault.step=3",
                     "fault.kind=nan", "trainer.on_nan=skip")
    assert result.returncode == 0, result.stderr[-2000:]
    records, summary = read_job(job_dir)
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    assert summary["skipped_steps"] == 1 and summary["status"] == "completed"
    assert records[-1]["loss"] == records[-1]["loss"] and records[-1]["loss"] < records[0]["loss"]


def test_hung_rank_ends_the_job_through_the_collective_timeout(job_dir):
    result, seconds, marker = run_marked(job_dir, *TINY, "parallel=hsdp", "fault.rank=3",
                                         "fault.step=2", "fault.kind=hang",
                                         "launcher.timeout_s=10")
    assert result.returncode == 1
    assert "Timed out" in result.stderr and "launcher.timeout_s" in result.stderr
    assert seconds < 120
    _, summary = read_job(job_dir)
    assert summary["status"] == "failed" and "Timed out" in summary["error"]
    assert leftover_processes(marker) == []


def test_sigkilled_rank_ends_the_job_and_leaves_no_orphans(job_dir):
    result, seconds, marker = run_marked(job_dir, *TINY, "parallel=fsdp", "fault.rank=2",
                                         "fault.step=2", "fault.kind=sigkill")
    assert result.returncode == 1 and "rank 2 failed" in result.stderr
    assert "Signal 9" in result.stderr
    assert leftover_processes(marker) == []


def test_sigterm_checkpoints_writes_interrupted_and_a_rerun_resumes(job_dir):
    args = [sys.executable, "-m", "hsdp_runner", f"hydra.run.dir={job_dir}", *TINY,
            "parallel=ddp", "trainer.steps=60", "checkpoint.enable=true"]
    proc = subprocess.Popen(args, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = job_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists()
                                           or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    records, summary = read_job(job_dir)
    stopped = summary["interrupted_at_step"]
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    assert 3 <= stopped < 60 and len(records) == stopped
    assert summary["last_checkpoint"].endswith(f"step-{stopped}")
    assert "rerun the same command to resume" in stderr

    rerun = subprocess.run(args, cwd=REPO, env=cli_env(), capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    records, summary = read_job(job_dir)
    assert summary["status"] == "completed" and summary["start_step"] == stopped
    assert [r["step"] for r in records] == list(range(1, 61))
