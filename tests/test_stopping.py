"""Stopping and restarting, in-process: duplicate vs repeated signals, what a rerun keeps,
safe pruning, failed summaries without stale figures, compare/parity/sweep on interrupted
jobs, the test meshes' collective timeout. The end-to-end signal tests are in test_faults.py."""

import json
import logging
import os
import signal
import time
from argparse import Namespace
from datetime import timedelta

import pytest
from distributed import TEST_TIMEOUT_S, run_workers
from omegaconf import OmegaConf
from test_compare import fake_job

from hsdp_runner import parity
from hsdp_runner.checkpoint import checkpointer as checkpoint
from hsdp_runner.checkpoint import start as checkpoint_start
from hsdp_runner.config.schema import CheckpointConfig, ParallelConfig
from hsdp_runner.core.choices import RunStatus, StartSource
from hsdp_runner.core.records import RunSummary
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.runtime import failures, signals, sweep
from hsdp_runner.train import sinks


@pytest.fixture
def stop():
    request = signals.StopRequest()
    request.install((signal.SIGUSR2, signal.SIGINT))
    yield request
    request.uninstall()


def test_a_signal_repeated_within_the_window_is_one_request(stop):
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGINT)  # e.g. the agent's forwarded copy of a Ctrl-C
    assert stop.signum == signal.SIGUSR2


def test_a_signal_after_the_window_stops_at_once(stop, monkeypatch):
    os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(signals, "DUPLICATE_WINDOW_S", 0.05)
    time.sleep(0.1)
    with pytest.raises(signals.StopNow) as stopped:
        os.kill(os.getpid(), signal.SIGINT)
    assert stopped.value.code == 128 + signal.SIGINT and stop.signum == signal.SIGINT


def test_stop_signals_add_the_configured_time_limit_signal():
    assert signals.stop_signals() == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
    assert signals.stop_signals("USR1")[-1] == signal.SIGUSR1
    assert signals.stop_signals("SIGUSR2") == signals.stop_signals()
    with pytest.raises(ValueError):
        signals.parse_signal("KILL")


def write_metrics(folder, steps):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": float(i), "grad_norm": 1.0}) + "\n"
            for i, s in enumerate(steps)
        )
    )


def test_a_fresh_start_sets_the_earlier_run_aside(tmp_path):
    write_metrics(tmp_path, [1, 2, 3])
    RunSummary(status=RunStatus.interrupted).write(tmp_path)
    assert sinks.set_aside_earlier_run(tmp_path) == tmp_path / "earlier_runs" / "1"
    write_metrics(tmp_path, [1])
    assert sinks.set_aside_earlier_run(tmp_path) == tmp_path / "earlier_runs" / "2"
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "summary.json").exists()
    assert [r["step"] for r in sinks.read_metrics(tmp_path / "earlier_runs" / "1")] == [1, 2, 3]
    assert RunSummary.read(tmp_path / "earlier_runs" / "1").status is RunStatus.interrupted


def test_a_resume_keeps_each_step_up_to_its_checkpoint_once(tmp_path):
    write_metrics(tmp_path, [1, 2, 3, 4, 5, 1, 2, 3])  # a file two runs were appended to
    assert sinks.truncate_metrics(tmp_path, 4) == 4
    records = sinks.read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["loss"] == 5.0  # the later record of a step stays


def pruner(folder, keep_last):
    ckpt = object.__new__(checkpoint.Checkpointer)
    ckpt.folder = folder
    ckpt.ckpt = OmegaConf.create({"keep_last": keep_last})
    return ckpt


def test_pruning_touches_only_what_the_runner_wrote_and_never_fails(tmp_path, caplog):
    for name in ("step-1", "step-2", "step-3", "step-4"):
        (tmp_path / name).mkdir()
        (tmp_path / name / checkpoint_start.MANIFEST).write_text("{}")
    for name in ("step-10.bak", "step-x.y", "step-2.partial", "step-9.deleting"):
        (tmp_path / name).mkdir()
    pruner(tmp_path, keep_last=2)._prune(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-10.bak",
        "step-3",
        "step-4",
        "step-x.y",
    ]
    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / checkpoint_start.MANIFEST).write_text("{}")
    os.chmod(tmp_path / "step-3", 0o500)  # its manifest cannot be deleted
    try:
        with caplog.at_level(logging.WARNING):
            pruner(tmp_path, keep_last=1)._prune(5)
    finally:
        for path in tmp_path.iterdir():
            os.chmod(path, 0o700)
    if os.geteuid() != 0:  # root deletes through the permission bits
        assert "could not delete" in caplog.text and (tmp_path / "step-3.deleting").exists()
    assert not (tmp_path / "step-4").exists() and (tmp_path / "step-5").exists()


def test_a_failed_summary_carries_no_figures_of_an_earlier_attempt(tmp_path):
    RunSummary(
        status=RunStatus.interrupted, final_loss=3.2, median_tps_global=1e4, interrupted_at_step=7
    ).write(tmp_path)
    dims = ParallelDims.from_config(
        ParallelConfig(dp_shard=2),
        OmegaConf.create({"n_heads": 4, "n_kv_heads": 2, "seq_len": 32, "dim": 64}),
        2,
        2,
    )
    RunSummary.failed(dims.describe(), 1, "RuntimeError: boom").write(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_rank"] == 1
    assert not {"final_loss", "median_tps_global", "interrupted_at_step"} & set(summary)


def test_only_the_first_rank_to_end_early_writes_the_summary(tmp_path):
    failures.begin_attempt(tmp_path)
    assert failures.record_end(tmp_path, RunSummary(status=RunStatus.failed, failed_rank=1))
    assert not failures.record_end(tmp_path, RunSummary(status=RunStatus.failed, failed_rank=0))
    assert RunSummary.read(tmp_path).failed_rank == 1
    failures.begin_attempt(tmp_path)  # a rerun
    assert failures.record_end(tmp_path, RunSummary(status=RunStatus.failed, failed_rank=0))


def test_compare_shows_an_interrupted_job_and_counts_it(tmp_path):
    from test_compare import ran

    fake_job(tmp_path, 0, ["parallel.tp=1"], ran(100.0, [1, 8, 1]))
    fake_job(
        tmp_path,
        1,
        ["parallel.tp=2"],
        {
            **ran(50.0, [1, 4, 2]),
            "status": "interrupted",
            "interrupted_at_step": 7,
            "signal": "SIGTERM",
        },
    )
    jobs = parity_free_compare(tmp_path)
    assert "interrupted at step 7 (SIGTERM)" in jobs
    assert "2 jobs: 1 completed, 1 interrupted" in (tmp_path / "compare.md").read_text()


def parity_free_compare(sweep_dir):
    from hsdp_runner import compare

    jobs = compare.load_jobs(sweep_dir)
    compare.write_comparison(sweep_dir, jobs)
    return compare.table(jobs)


def test_parity_stops_on_a_signal_and_reports_a_failed_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(parity, "validate", lambda cfg, out: Namespace(world_size=1))
    monkeypatch.setattr(parity, "compose", lambda layout, overrides: layout)
    monkeypatch.setattr(parity, "to_run_config", lambda cfg: cfg)
    monkeypatch.setattr(parity, "unsupported_reason", lambda cfg: None)
    ran_layouts = []

    def job(cfg, info, codes):
        ran_layouts.append(cfg)
        return codes[cfg]

    args = Namespace(
        layouts=["single", "ddp", "fsdp"],
        steps=2,
        rtol=1e-5,
        rtol_why="",
        overrides=[],
        out=tmp_path,
    )
    monkeypatch.setattr(
        parity, "run_job", lambda cfg, info: job(cfg, info, {"single": 0, "ddp": 130})
    )
    assert parity.run_parity(args) == 130 and ran_layouts == ["single", "ddp"]

    monkeypatch.setattr(
        parity, "run_job", lambda cfg, info: job(cfg, info, {"single": 0, "ddp": 1, "fsdp": 0})
    )
    for layout in ("single", "fsdp"):
        write_metrics(tmp_path / layout, [1, 2])
        RunSummary(status=RunStatus.completed).write(tmp_path / layout)
    (tmp_path / "ddp").mkdir()
    RunSummary(status=RunStatus.completed).write(tmp_path / "ddp")  # stale: the job failed
    assert parity.run_parity(args) == 1
    table = (tmp_path / "parity.md").read_text()
    assert "| ddp | 1 |" in table and "FAIL run failed (exit code 1)" in table
    assert "| fsdp | 1 | 0.00e+00" in table


def test_a_sweep_with_an_interrupted_job_exits_with_its_signal_code():
    assert sweep.exit_code([0, 1, 143]) == 143
    assert sweep.exit_code([0, 2]) == 0


def _group_timeouts() -> dict:
    """Per mesh built here (one as in-process tests build it, one with a timeout of its own):
    each world-spanning group's timeout and whether it is the default group."""
    import torch
    import torch.distributed as dist

    dims = ParallelDims.from_config(
        ParallelConfig(dp_shard=2),
        OmegaConf.create({"n_heads": 4, "n_kv_heads": 2, "seq_len": 32, "dim": 64}),
        2,
    )
    found = {}
    # No timeout given (as in-process tests build it), then one the default group lacks.
    for label, timeout_s in (("default", None), ("own", TEST_TIMEOUT_S + 1)):
        world = dims.build_mesh("cpu", timeout_s)
        for name in ("dp_shard", "dp"):
            group = world[name].get_group()
            options = group._get_backend(torch.device("cpu")).options
            found[f"{label}/{name}"] = (
                options._timeout.total_seconds(),
                group is dist.group.WORLD,
            )
    return found


@pytest.mark.multiprocess
def test_every_test_mesh_group_gets_the_short_collective_timeout():
    # A group over every rank with the default group's timeout is the default group (no copy:
    # on a GPU a second communicator over every rank); with another timeout, a group of its own.
    results = run_workers(_group_timeouts, 2)
    assert results[0] == {
        "default/dp_shard": (TEST_TIMEOUT_S, True),
        "default/dp": (TEST_TIMEOUT_S, True),
        "own/dp_shard": (TEST_TIMEOUT_S + 1, False),
        "own/dp": (TEST_TIMEOUT_S + 1, False),
    }
    assert TEST_TIMEOUT_S < timedelta(minutes=30).total_seconds()


def test_a_rerun_keeps_steps_only_when_it_continues_its_own_checkpoint(tmp_path):
    from hsdp_runner.runtime.rank_training import _prepare_metrics

    cfg = CheckpointConfig()
    own = checkpoint_start.Start(
        StartSource.checkpoint, str(tmp_path / "checkpoints" / "step-4"), 4
    )
    write_metrics(tmp_path, [1, 2, 3, 4, 5, 6])
    _prepare_metrics(cfg, tmp_path, own)
    assert [r["step"] for r in sinks.read_metrics(tmp_path)] == [1, 2, 3, 4]
    # Another run's checkpoint, or a fresh start: the earlier run is set aside whole.
    elsewhere = checkpoint_start.Start(StartSource.checkpoint, "/other/job/checkpoints/step-2", 2)
    _prepare_metrics(cfg, tmp_path, elsewhere)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert len(sinks.read_metrics(tmp_path / "earlier_runs" / "1")) == 4
    write_metrics(tmp_path, [1])
    _prepare_metrics(cfg, tmp_path, checkpoint_start.Start(StartSource.fresh))
    assert (tmp_path / "earlier_runs" / "2" / "metrics.jsonl").exists()
