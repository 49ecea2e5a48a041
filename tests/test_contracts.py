"""The typed records between processes and files: RunSummary reads what any runner wrote,
writes the keys the dashboard and old readers expect; every sink speaks the Tracker interface."""

import json
import pickle

from omegaconf import OmegaConf

from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.records import RunInfo, RunSummary
from hsdp_runner.report.runs import load_jobs, table
from hsdp_runner.train import sinks


def test_a_summary_round_trips_through_its_file(tmp_path):
    summary = RunSummary(
        status=RunStatus.completed,
        steps=3,
        final_loss=2.5,
        layout="fsdp",
        mesh_shape=[1, 2, 1],
        median_tps_global=1234.5,
        comm_measured={"all_gather/dp_shard": {"calls": 4, "bytes": 1024}},
    )
    summary.write(tmp_path)
    again = RunSummary.read(tmp_path)
    assert again == summary and again.status is RunStatus.completed
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["status"] == "completed" and on_disk["median_tps_global"] == 1234.5
    # A trained run writes its figures even when null; figures it never had are left out.
    assert on_disk["eval_loss"] is None and on_disk["error"] is None
    assert "signal" not in on_disk and "comm_ratio" not in on_disk


def test_an_older_summary_missing_fields_still_reads(tmp_path):
    older = {
        "status": "failed",
        "layout": "hsdp",
        "world_size": 4,
        "failed_rank": 2,
        "error": "RuntimeError: boom",
        "field_of_a_newer_runner": 1,
    }
    (tmp_path / "summary.json").write_text(json.dumps(older))
    summary = RunSummary.read(tmp_path)
    assert summary.status is RunStatus.failed and summary.failed_rank == 2
    assert summary.final_loss is None and summary.median_tps_global is None
    assert summary.get("min_tps_global", 7.0) == 7.0
    assert RunSummary.read(tmp_path / "no_such_job") is None


def test_a_failed_or_skipped_record_carries_only_its_own_facts(tmp_path):
    RunSummary.skipped(
        "parallel.tp=3 does not divide",
        ["parallel.tp=3"],
        {"dp_replicate": 1, "dp_shard": 1, "tp": 3},
    ).write(tmp_path)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == {
        "status": "skipped",
        "error": None,
        "reason": "parallel.tp=3 does not divide",
        "overrides": ["parallel.tp=3"],
        "requested_degrees": {"dp_replicate": 1, "dp_shard": 1, "tp": 3},
    }


def test_the_sweep_table_reads_summaries_through_the_type(tmp_path):
    job = tmp_path / "0_parallel.tp=3"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- parallel.tp=3\n")
    RunSummary.failed(
        {"layout": "tp", "mesh_shape": [1, 1, 3], "world_size": 3}, 1, "RuntimeError: boom"
    ).write(job)
    (unfinished := tmp_path / "1_x").mkdir()
    (unfinished / ".hydra").mkdir()
    jobs = load_jobs(tmp_path)
    assert [j.status for j in jobs] == ["failed", "unfinished"]
    assert "failed (rank 1): RuntimeError: boom" in table(jobs)


def test_run_info_crosses_to_spawned_workers():
    info = RunInfo(
        output_dir="/tmp/job",
        group="g",
        run_name="r",
        tags=["parallel=fsdp"],
        multirun=False,
        overrides=[],
    )
    assert pickle.loads(pickle.dumps(info)) == info


def test_every_sink_is_a_tracker_and_logger_none_keeps_only_the_files(tmp_path):
    info = RunInfo(
        output_dir=str(tmp_path), group="g", run_name="r", tags=[], multirun=False, overrides=[]
    )
    trackers = sinks.open_trackers(
        OmegaConf.create({"name": "none", "mode": "offline"}), info, {}, tmp_path
    )
    assert [type(s) for s in trackers] == [sinks.MetricsFile]
    for sink in trackers:
        sink.log_step({"step": 1, "loss": 2.0})
        sink.log_summary(RunSummary(status=RunStatus.completed, steps=1, final_loss=2.0))
        sink.finish()
    assert sinks.read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
    assert RunSummary.read(tmp_path).final_loss == 2.0
    assert {"log_step", "log_summary", "finish"} <= set(dir(sinks.WandbRun))
