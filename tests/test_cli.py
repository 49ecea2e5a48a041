"""The command line: config printing, config errors (exit 2, nothing started), crashes (exit 1)."""

import pytest

from conftest import TINY, read_job, run_cli


def test_cfg_job_prints_the_composed_config(job_dir):
    result = run_cli(job_dir, "parallel=hsdp_tp", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "dp_replicate: 2" in result.stdout and "tp: 2" in result.stdout
    assert "global_batch_size: 8" in result.stdout


@pytest.mark.parametrize("overrides, words", [
    (["parallel.tp=3"], "parallel.tp=3 does not divide model.n_heads=4"),
    (["parallel=fsdp", "launcher.nproc_per_node=3"], "world size is 3"),
    (["trainer.global_batch_size=6"], "trainer.global_batch_size=6 is not divisible"),
    (["data=text", "data.path=/no/such/file.txt"], "data.path='/no/such/file.txt' does not exist"),
    (["parallel.dp_shard=-1"], "launcher.nproc_per_node"),
    (["parallel.tpp=2"], "tpp"),
    (["parallel.tp=two"], "two"),
    (["hydra.run.dir=/proc/hsdp_runner_test"], "not writable"),
])
def test_config_error_exits_2_before_any_worker(overrides, words, job_dir):
    result = run_cli(job_dir, *TINY, *overrides, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert words in result.stderr
    assert not (job_dir / "logs").exists()


@pytest.mark.multiprocess
def test_crashing_rank_fails_the_job_with_its_error(job_dir):
    result = run_cli(job_dir, *TINY, "parallel=fsdp", "fault.rank=2", "fault.step=2")
    assert result.returncode == 1
    assert "rank 2 failed" in result.stderr
    assert "injected fault (fault.kind=exception) on rank 2 at step 2" in result.stderr
    records, summary = read_job(job_dir)
    assert summary["status"] == "failed" and summary["failed_rank"] == 2
    assert "injected fault" in summary["error"]
    assert [r["step"] for r in records] == [1]


@pytest.mark.multiprocess
def test_killed_rank_fails_the_job_naming_the_rank(job_dir):
    result = run_cli(job_dir, *TINY, "parallel=ddp", "fault.rank=1", "fault.kind=sigkill")
    assert result.returncode == 1
    assert "rank 1 failed" in result.stderr and "Signal 9" in result.stderr
    _, summary = read_job(job_dir)
    assert summary["status"] == "failed" and summary["failed_rank"] == 1
