"""Sweeps: a 4-job CPU multirun end to end, and every ready sweep file in sweeps/."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import METERS_OFF, REPO, cli_env, cli_server, read_job, run_cli
from wandb_records import iter_records, read_run

from hsdp_runner.runtime import sweep

# tests/sweep_conf/four_jobs.yaml: one job per `case`, 2 CPU ranks each (the ddp preset's).
FOUR_JOBS = [
    "--config-dir",
    "tests/sweep_conf",
    "--config-name",
    "four_jobs",
    "model=llama3_tiny",
    "trainer.steps=4",
    "metrics.warmup_steps=1",
    "logger=wandb",
    *METERS_OFF,
]


def job_dirs(sweep_dir: Path) -> dict[str, Path]:
    """{case name: job dir} of a four_jobs sweep."""
    jobs = {}
    for job in (d for d in sweep_dir.iterdir() if (d / ".hydra").is_dir()):
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        jobs[next(o for o in overrides if o.startswith("case=")).removeprefix("case=")] = job
    return jobs


@pytest.fixture(scope="module")
def four_jobs(tmp_path_factory):
    sweep_dir = tmp_path_factory.mktemp("sweep") / "four_jobs"
    result = run_cli(
        sweep_dir, *FOUR_JOBS, f"hydra.sweep.dir={sweep_dir}", pin_dir=False, timeout=600
    )
    return result, sweep_dir, job_dirs(sweep_dir)


@pytest.mark.multiprocess
def test_sweep_runs_every_job_and_exits_1_because_one_failed(four_jobs):
    result, sweep_dir, jobs = four_jobs
    assert result.returncode == 1, result.stderr[-3000:]
    assert sorted(jobs) == ["crash", "ddp", "fsdp", "too_big"]
    assert "sweep done (4 jobs: 2 completed, 1 failed, 1 skipped)" in result.stdout
    assert f"python -m hsdp_runner.compare {sweep_dir}" in result.stdout


@pytest.mark.multiprocess
def test_combination_that_does_not_fit_the_sweeps_world_size_is_skipped(four_jobs):
    result, _, jobs = four_jobs
    # 2 x 2 x 1 would be a valid 4-rank single run; in the sweep the ddp preset fixes 2 ranks.
    records, summary = read_job(jobs["too_big"])
    assert summary["status"] == "skipped" and summary["error"] is None
    assert "parallel.dp_shard=2" in summary["reason"] and "world size is 2" in summary["reason"]
    assert summary["requested_degrees"] == {
        "pp": 1,
        "dp_replicate": 2,
        "dp_shard": 2,
        "cp": 1,
        "tp": 1,
    }
    assert (
        "skipped (not counted as a failure): parallel.pp=1 x parallel.dp_replicate=2"
        in result.stdout
    )
    assert records == [] and not (jobs["too_big"] / "logs").exists()  # nothing started
    assert (jobs["too_big"] / "config_resolved.yaml").exists()


@pytest.mark.multiprocess
def test_failed_job_is_recorded_and_the_sweep_goes_on(four_jobs):
    result, _, jobs = four_jobs
    records, summary = read_job(jobs["crash"])
    assert summary["status"] == "failed" and summary["failed_rank"] == 1
    assert "injected fault (fault.kind=exception) on rank 1 at step 2" in summary["error"]
    assert summary["mesh_shape"] == [1, 1, 1, 1, 2]
    # Step 1's figures would have been read once step 2's work was queued (docs/
    # figures_and_performance.md, Performance); rank 0 was inside step 2 when rank 1 failed.
    assert records == []
    assert "rank 1 failed" in result.stderr
    _, after = read_job(jobs["fsdp"])  # the job after the failure ran
    assert after["status"] == "completed"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, mesh", [("ddp", [1, 2, 1, 1, 1]), ("fsdp", [1, 1, 2, 1, 1])])
def test_good_jobs_have_metrics_and_steady_state_figures(four_jobs, case, mesh):
    _, _, jobs = four_jobs
    records, summary = read_job(jobs[case])
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert summary["status"] == "completed" and summary["mesh_shape"] == mesh
    assert summary["world_size"] == 2 and summary["steady_steps"] == 3
    assert (
        summary["min_tps_per_device"]
        <= summary["median_tps_per_device"]
        <= summary["max_tps_per_device"]
    )


@pytest.mark.multiprocess
def test_wandb_runs_of_a_sweep_share_one_group(four_jobs):
    _, sweep_dir, jobs = four_jobs
    runs = {
        case: [read_run(f) for f in d.glob("wandb/offline-run-*/run-*.wandb")]
        for case, d in jobs.items()
    }
    assert {case: len(found) for case, found in runs.items()} == {
        "ddp": 1,
        "fsdp": 1,
        "crash": 1,
        "too_big": 0,
    }  # a skipped job starts no run
    for case in ("ddp", "fsdp", "crash"):
        run = runs[case][0]
        assert run["group"] == sweep_dir.name
        assert run["name"].startswith(f"case={case},") and f"case={case}" in run["tags"]
        assert run["config"]["derived"]["world_size"] == 2
    _, summary = read_job(jobs["fsdp"])
    assert runs["fsdp"][0]["summary"]["median_tps_global"] == pytest.approx(
        summary["median_tps_global"]
    )
    crash_file = next(jobs["crash"].glob("wandb/offline-run-*/run-*.wandb"))
    exits = [
        record.exit.exit_code
        for record in iter_records(crash_file)
        if record.WhichOneof("record_type") == "exit"
    ]
    assert exits == [1]  # the failed job's run is closed and marked failed, not cut off


@pytest.mark.multiprocess
def test_compare_writes_the_table_and_both_plots(four_jobs):
    _, sweep_dir, _ = four_jobs
    result = cli_server().run(
        [str(sweep_dir)], cli_env(), REPO, 120, sweep_dir.parent, module="hsdp_runner.compare"
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 4
    assert "(best)**" in rows[0] and rows[0].endswith("| ok |")
    assert "case=ddp" in rows[0] + rows[1] and "case=fsdp" in rows[0] + rows[1]
    assert "case=crash" in rows[2] and "failed (rank 1): RuntimeError: injected fault" in rows[2]
    assert (
        "case=too_big" in rows[3] and "skipped: parallel.pp=1 x parallel.dp_replicate=2" in rows[3]
    )
    assert "\n".join(rows) in (sweep_dir / "compare.md").read_text()
    for name in ("throughput_memory.png", "loss.png"):
        png = (sweep_dir / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, name
    assert f"wrote {sweep_dir / 'compare.md'}" in result.stdout


@pytest.mark.parametrize(
    "codes, expected",
    [
        ([0, 2, 0], 0),  # skipped jobs are not failures
        ([0, 1, 2], 1),  # any failed job fails the multirun
        ([2, 2], 2),  # nothing ran: a config error in every combination
    ],
)
def test_multirun_exit_code_counts_failures_not_skips(codes, expected):
    assert sweep.exit_code(codes) == expected


def sweep_jobs(sweep_file: Path) -> int:
    """Number of combinations the sweep file's sweeper params make."""
    params = yaml.safe_load(sweep_file.read_text())["hydra"]["sweeper"]["params"]
    return len(list(itertools.product(*(str(v).split(",") for v in params.values()))))


SWEEP_FILES = sorted((REPO / "sweeps").glob("*.yaml"))


@pytest.fixture(scope="module")
def ready_sweeps(tmp_path_factory):
    """Every sweep file's multirun, each through the command-line entry point with a missing
    corpus, in one process (tests/sweep_files.py): (its exit codes by stem, the output root)."""
    root = tmp_path_factory.mktemp("ready_sweeps")
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "sweep_files.py"), str(root), *map(str, SWEEP_FILES)],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1]), root


@pytest.mark.multiprocess  # a CLI multirun per sweep file (no worker starts)
@pytest.mark.parametrize("sweep_file", SWEEP_FILES, ids=lambda p: p.stem)
def test_ready_sweep_composes_every_job_and_skips_only_misfits(sweep_file, ready_sweeps):
    text = sweep_file.read_text()
    assert text.startswith("# Question:"), "each sweep says which question it answers"
    # A missing corpus is checked after the degrees: jobs with fitting degrees are skipped for
    # it, so every combination is composed and validated without starting a process.
    codes, root = ready_sweeps
    assert codes[sweep_file.stem] == 2  # no job ran
    sweep_dir = root / sweep_file.stem
    reasons = [read_job(d)[1]["reason"] for d in sorted(sweep_dir.iterdir()) if d.is_dir()]
    assert len(reasons) == sweep_jobs(sweep_file)
    misfits = [r for r in reasons if "data.path" not in r]
    if sweep_file.stem == "degrees_8":  # dp_shard x tp = 16, 16, 32 do not divide 8 ranks
        assert len(misfits) == 3 and all("world size 8 is not divisible" in r for r in misfits)
    else:
        assert misfits == []
