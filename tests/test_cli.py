"""The command line: config printing and a crashing rank (exit 1). Bad input: test_bad_input.py;
other faults: test_faults.py."""

import pytest
from conftest import TINY, read_job, run_cli


def test_cfg_job_prints_the_composed_config(job_dir):
    result = run_cli(job_dir, "parallel=hsdp_tp", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "dp_replicate: 2" in result.stdout and "tp: 2" in result.stdout
    assert "global_batch_size: 8" in result.stdout


@pytest.mark.multiprocess
def test_crashing_rank_fails_the_job_with_its_error(job_dir):
    result = run_cli(
        job_dir, *TINY, "parallel=fsdp", "parallel.dp_shard=2", "fault.rank=1", "fault.step=3"
    )
    assert result.returncode == 1
    assert "rank 1 failed" in result.stderr
    assert "injected fault (fault.kind=exception) on rank 1 at step 3" in result.stderr
    records, summary = read_job(job_dir)
    assert summary["status"] == "failed" and summary["failed_rank"] == 1
    assert "injected fault" in summary["error"]
    # A step's figures are read once the next step's work is queued (docs/figures_and_performance.md, Performance):
    # rank 0 was inside step 3 when rank 1 failed, so step 2 was never read.
    assert [r["step"] for r in records] == [1]
