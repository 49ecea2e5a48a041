"""Under torchrun the runner joins as a rank instead of starting workers, into one output dir."""

import sys

import pytest
from conftest import TINY, read_job, run_cli

pytestmark = pytest.mark.multiprocess


def test_torchrun_fsdp_trains_into_exactly_one_output_dir(tmp_path):
    # Two ranks: each torchrun rank composes the config itself, a full CLI start-up.
    prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    result = run_cli(
        tmp_path,
        "parallel=fsdp",
        "parallel.dp_shard=2",
        *TINY,
        prefix=prefix,
        pin_dir=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    dirs = list((tmp_path / "outputs" / "torchrun").iterdir())
    assert len(dirs) == 1, dirs
    records, summary = read_job(dirs[0])
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert len(records) == 6
    assert sorted(p.name for p in (dirs[0] / "logs").iterdir()) == [
        f"rank{r}.log" for r in range(2)
    ]
    assert not (tmp_path / "outputs").joinpath("2026").exists()


# --standalone: a free rendezvous port, so parallel test runs on one machine do not collide.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_ctrl_c_to_torchrun_checkpoints_and_the_rerun_resumes(tmp_path):
    # Ctrl-C in the terminal signals torchrun's process group; torch's agent passes SIGINT on
    # to each rank (every rank runs in a session of its own).
    import os
    import signal

    from test_faults import (
        descendants,
        finish,
        parent_pid,
        paused,
        start_job,
        steps_once,
        wait_for_steps,
        wait_pending,
    )

    job_dir = tmp_path / "job"
    steps = 16  # a signal after step 3 stops the job long before its end
    run = [*TINY, "parallel=ddp", f"trainer.steps={steps}", "checkpoint.enable=true"]
    proc = start_job(job_dir, *run, prefix=TORCHRUN)
    wait_for_steps(job_dir / "metrics.jsonl", 3, proc)
    # The agent's workers: its children (`python -u -m hsdp_runner ...`, each in a session of
    # its own; rank 0's own helper process below it is left running).
    ranks = [pid for pid, _ in descendants(proc.pid) if parent_pid(pid) == proc.pid]
    assert len(ranks) == 2, descendants(proc.pid)
    with paused(ranks):  # resumed once the agent has passed the signal on to each
        os.killpg(proc.pid, signal.SIGINT)
        wait_pending(ranks, signal.SIGINT)
    code, stderr = finish(proc, job_dir)
    # The ranks exit 130; torchrun exits 1: its agent raises SignalException out of main.
    assert code == 1 and "SignalException" in stderr, stderr[-3000:]
    _, summary = read_job(job_dir)
    stopped = summary["interrupted_at_step"]
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT", summary
    assert 3 <= stopped < steps and steps_once(job_dir, stopped)
    assert summary["last_checkpoint"].endswith(f"step-{stopped}")
    assert "interrupted by SIGINT" in stderr and "rerun the same command to resume" in stderr

    rerun = run_cli(job_dir, *run, prefix=TORCHRUN)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _, summary = read_job(job_dir)
    assert summary["status"] == "completed" and summary["start_step"] == stopped
    assert steps_once(job_dir, steps)


def test_rank_aborted_by_the_nccl_watchdog_under_torchrun_is_recorded_with_its_cause(tmp_path):
    # Rank 1 dies as NCCL's watchdog ends a rank (its message in C++, then SIGABRT); no
    # launcher of ours is there to read its log: rank 0, failing next, names rank 1 and why.
    job_dir = tmp_path / "job"
    result = run_cli(
        job_dir,
        *TINY,
        "parallel=ddp",
        "fault.rank=1",
        "fault.step=2",
        "fault.kind=abort",
        prefix=TORCHRUN,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    _, summary = read_job(job_dir)
    assert summary["status"] == "failed" and summary["failed_rank"] == 1, summary
    assert summary["error"].startswith(
        "rank 1 died in C++: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2"
    )
    assert "launcher.timeout_s" in summary["error"]  # the timeout hint shows
    assert "rank 1 failed first: rank 1 died in C++" in result.stdout + result.stderr
