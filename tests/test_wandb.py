"""W&B: offline run with the right group, name, tags, config and history; failures never fatal."""

from types import SimpleNamespace

import pytest
from conftest import TINY, read_job, run_cli
from wandb_records import read_run

from hsdp_runner.core.records import RunInfo, RunStatus, RunSummary
from hsdp_runner.train.sinks import WandbRun


@pytest.mark.multiprocess
def test_offline_wandb_run_has_group_config_and_steps(job_dir):
    overrides = [o for o in TINY if o != "logger=none"]
    result = run_cli(
        job_dir,
        "parallel=ddp",
        *overrides,
        "logger=wandb",
        "logger.group=my-sweep",
        "precision=bf16",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_files = list(job_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    run = read_run(run_files[0])
    assert run["group"] == "my-sweep"
    assert "parallel=ddp" in run["name"] and "precision=bf16" in run["name"]
    assert "parallel=ddp" in run["tags"] and "model=llama3_tiny" in run["tags"]
    assert run["config"]["parallel"]["dp_replicate"] == 2
    assert run["config"]["derived"]["mesh_shape"] == [1, 2, 1, 1, 1]
    assert run["config"]["derived"]["world_size"] == 2
    assert run["config"]["derived"]["ep"] == 1  # expert parallel: a degree, not a mesh dim
    assert run["config"]["derived"]["precision"] == "bf16"  # compare's label (recipe, +compile)
    assert [h["step"] for h in run["history"]] == list(range(1, 7))
    _, summary = read_job(job_dir)
    assert run["summary"]["median_tps_global"] == pytest.approx(summary["median_tps_global"])


@pytest.mark.multiprocess
def test_wandb_that_cannot_start_only_warns(job_dir):
    overrides = [o for o in TINY if o != "logger=none"]
    # An entity with a bad character and online mode without credentials: W&B falls back
    # or fails, training must go on regardless.
    result = run_cli(
        job_dir,
        "parallel=single",
        *overrides,
        "logger=wandb",
        "logger.mode=online",
        "logger.project=bad/project/name",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _, summary = read_job(job_dir)
    assert summary["status"] == "completed"
    assert "W&B" in result.stdout + result.stderr


def test_wandb_summary_holds_each_comm_figure_once(tmp_path):
    wandb = pytest.importorskip("wandb")
    # The counted step's record carries the breakdowns as dicts; the summary gets them flat.
    breakdown = {"all_gather/dp_shard": {"bytes": 4096, "calls": 3}}
    logger = SimpleNamespace(mode="offline", project="test", entity=None)
    run = WandbRun(logger, RunInfo(str(tmp_path), "g", "n", [], False, []), {}, tmp_path)
    run.log_step(
        {
            "step": 1,
            "loss": 2.0,
            "comm_ratio": 1.0,
            "comm_measured": breakdown,
            "comm_analytic": breakdown,
        }
    )
    run.log_step({"step": 2, "loss": 1.5})
    run.log_summary(
        RunSummary(
            status=RunStatus.completed,
            comm_ratio=1.0,
            comm_measured=breakdown,
            comm_analytic=breakdown,
        )
    )
    run.finish()
    wandb.teardown()  # the service writes the run file behind finish(): let it close the file
    found = read_run(next(tmp_path.glob("wandb/offline-run-*/run-*.wandb")))
    comm = sorted(k for k in found["summary"] if k.startswith("comm_"))
    assert comm == [
        "comm_analytic/all_gather/dp_shard/bytes",
        "comm_analytic/all_gather/dp_shard/calls",
        "comm_measured/all_gather/dp_shard/bytes",
        "comm_measured/all_gather/dp_shard/calls",
        "comm_ratio",
    ]
    assert found["summary"]["comm_measured/all_gather/dp_shard/bytes"] == 4096
    assert [h["loss"] for h in found["history"]] == [2.0, 1.5]
