"""compare: the table's order and marks from job dirs alone; --wandb-report without a server."""

import json
from pathlib import Path

import pytest
import yaml

from hsdp_runner import compare
from hsdp_runner.report import wandb_report


def fake_job(sweep: Path, num: int, overrides: list[str], summary: dict, losses=()) -> None:
    """A job dir as a multirun leaves it: .hydra/overrides.yaml, config, summary, metrics."""
    job = sweep / f"{num}_{','.join(overrides)}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / "config_resolved.yaml").write_text(
        yaml.safe_dump(
            {
                "precision": {"name": "bf16"},
                "parallel": {"dp_replicate": -1, "dp_shard": 8, "tp": 2},
                "logger": {"project": "proj", "entity": None, "group": None, "mode": "offline"},
            }
        )
    )
    (job / "summary.json").write_text(json.dumps(summary))
    (job / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": loss}) + "\n" for i, loss in enumerate(losses))
    )


def ran(tps: float, shape: list[int]) -> dict:
    return {
        "status": "completed",
        "layout": "fsdp_tp",
        "mesh_shape": shape,
        "world_size": 8,
        "median_tps_global": tps,
        "min_tps_global": tps * 0.9,
        "max_tps_global": tps * 1.1,
        "median_tps_per_device": tps / 8,
        "min_tps_per_device": tps / 9,
        "max_tps_per_device": tps / 7,
        "median_mfu": 0.41,
        "mem_peak_gib": 30.5,
        "median_step_time_s": 0.5,
        "comm_bytes_measured": 3 * 2**20,
        "comm_bytes_analytic": 3 * 2**20 - 100,
        "comm_ratio": 1.00003,
    }


@pytest.fixture
def sweep(tmp_path):
    common = "model=llama3_8b"
    fake_job(
        tmp_path,
        0,
        ["parallel.dp_shard=8", "parallel.tp=2", common],
        {
            "status": "skipped",
            "reason": "parallel.dp_replicate=-1 cannot be inferred",
            "requested_degrees": {"dp_replicate": -1, "dp_shard": 8, "tp": 2},
        },
    )
    fake_job(
        tmp_path,
        1,
        ["parallel.dp_shard=4", "parallel.tp=2", common],
        ran(9000.0, [1, 4, 2]),
        losses=[5.0, 4.0, 3.5],
    )
    fake_job(
        tmp_path,
        2,
        ["parallel.dp_shard=2", "parallel.tp=2", common],
        {
            "status": "failed",
            "layout": "hsdp_tp",
            "mesh_shape": [2, 2, 2],
            "world_size": 8,
            "failed_rank": 3,
            "error": "torch.OutOfMemoryError: CUDA out of memory | more\nat",
        },
        losses=[5.0],
    )
    fake_job(
        tmp_path,
        3,
        ["parallel.dp_shard=8", "parallel.tp=1", common],
        ran(12000.0, [1, 8, 1]),
        losses=[5.0, 4.1, 3.6],
    )
    fake_job(
        tmp_path,
        4,
        ["parallel=fsdp_cp", "parallel.cp=4", common],
        {**ran(6000.0, [1, 2, 4, 1]), "layout": "fsdp_cp"},
        losses=[5.0, 4.2],
    )
    return tmp_path


def test_table_is_sorted_by_throughput_with_the_best_marked(sweep):
    rows = compare.table(compare.load_jobs(sweep)).splitlines()[2:]
    assert rows[0].startswith(
        "| **#3 dp_shard=8 tp=1 (best)** | fsdp_tp | 1×8×1×1 | 8 | bf16 | 3.00 (×1.000) |"
    )
    assert (
        "1,500 (1,333–1,714) | 12,000 (10,800–13,200) | 41.00% | 30.50 | 0.5 | — | ok |" in rows[0]
    )
    assert rows[1].startswith("| #1 dp_shard=4 tp=2 |") and "(best)" not in rows[1]
    # A run's context-parallel degree is a column of its degrees; runs from before the cp
    # dim (3-dim meshes, no parallel.cp) show cp = 1.
    assert rows[2].startswith("| #4 parallel=fsdp_cp cp=4 | fsdp_cp | 1×2×4×1 | 8 |")
    assert rows[3].endswith(
        "| failed (rank 3): torch.OutOfMemoryError: CUDA out of memory \\| more |"
    )
    assert rows[4].startswith("| #0 dp_shard=8 tp=2 | — | -1×8×1×2 | — |")
    assert rows[4].endswith("| skipped: parallel.dp_replicate=-1 cannot be inferred |")


def test_compare_cli_writes_table_and_plots_into_the_sweep_dir(sweep, capsys):
    assert compare.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "| **#3 dp_shard=8 tp=1 (best)**" in out and str(sweep / "loss.png") in out
    assert "| **#3 dp_shard=8 tp=1 (best)**" in (sweep / "compare.md").read_text()
    assert (sweep / "throughput_memory.png").stat().st_size > 10_000
    assert (sweep / "loss.png").stat().st_size > 10_000


def test_a_moe_sweep_shows_ep_in_the_degrees_and_the_experts_balance(tmp_path_factory, sweep):
    """An ep sweep's table names each job's ep next to its mesh and the balance figures its
    last step logged; a sweep of dense models has no balance column."""
    moe = tmp_path_factory.mktemp("moe_sweep")
    for num, ep in ((0, 1), (1, 2)):
        layout = "fsdp_ep" if ep > 1 else "fsdp"
        summary = {**ran(1000.0 * (1 + ep), [1, 4, 1]), "layout": layout, "ep": ep}
        fake_job(moe, num, ["model=moe_debug", f"parallel.ep={ep}"], summary)
        records = [
            {"step": step, "loss": 5.0, "moe/load_max_over_mean": load, "moe/aux_loss": 0.0123}
            for step, load in ((1, 3.5), (2, 1.25 * ep))
        ]
        job = next(moe.glob(f"{num}_*"))
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # A skipped job records the mesh degrees it asked for; its ep is in its resolved config.
    reason = "parallel.ep=3 does not divide dp_shard x cp x tp = 4"
    asked = {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}
    skipped = {"status": "skipped", "reason": reason, "requested_degrees": asked}
    fake_job(moe, 2, ["model=moe_debug", "parallel.ep=3"], skipped)
    config = next(moe.glob("2_*")) / "config_resolved.yaml"
    config.write_text(yaml.safe_dump({"parallel": {**asked, "ep": 3}}))
    head, _, fast, slow, misfit = compare.table(compare.load_jobs(moe)).splitlines()
    assert misfit.startswith("| #2 ep=3 | — | 1×4×1×1 ep3 | — |")
    assert "| expert load max/mean (aux loss), last step | status |" in head
    assert fast.startswith("| **#1 ep=2 (best)** | fsdp_ep | 1×4×1×1 ep2 | 8 |")
    assert fast.endswith("| 2.50 (aux 0.0123) | ok |")
    assert slow.startswith("| #0 ep=1 | fsdp | 1×4×1×1 | 8 |")
    assert slow.endswith("| 1.25 (aux 0.0123) | ok |")
    assert "expert load" not in compare.table(compare.load_jobs(sweep)).splitlines()[0]


def test_compare_of_a_dir_without_jobs_exits_2(tmp_path, capsys):
    assert compare.main([str(tmp_path)]) == 2
    assert "holds no job dirs" in capsys.readouterr().err


def test_wandb_report_offline_explains_what_it_needs(sweep, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(sweep / "no_netrc"))
    assert compare.main([str(sweep), "--wandb-report"]) == 2
    out = capsys.readouterr().out
    assert "--wandb-report needs" in out and "WANDB_MODE is 'offline'" in out
    assert "WANDB_API_KEY or run `wandb login`" in out
    assert "wandb sync <sweep dir>/*/wandb/offline-run-*" in out
    assert (sweep / "compare.md").exists()  # the table is written regardless


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # wandb-workspaces' pydantic v1 style
def test_wandb_report_is_built_for_the_sweeps_group_without_a_server():
    import wandb_workspaces.reports.v2 as wr

    report = wandb_report.build_report("proj", "team", "2025-01-01_12-00-00_degrees_8", "t")
    grid = next(b for b in report.blocks if isinstance(b, wr.PanelGrid))
    runset = grid.runsets[0]
    assert (runset.entity, runset.project) == ("team", "proj")
    assert runset.filters == "Group = '2025-01-01_12-00-00_degrees_8'"
    kinds = [type(p).__name__ for p in grid.panels]
    assert kinds == ["BarPlot", "BarPlot", "ParallelCoordinatesPlot", "LinePlot"]
    degrees = [c.metric.name for c in grid.panels[2].columns][:6]
    assert degrees == [f"derived.{d}" for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")]
    assert list(grid.panels[3].y) == ["loss", "val_loss"]


@pytest.mark.parametrize(
    "precision, parallel, label",
    [
        ({"name": "bf16", "float8": "none"}, {"compile": False}, "bf16"),
        # Runs from before the float8 keys and the backend key.
        ({"name": "bf16"}, {"compile": True}, "bf16 +compile"),
        (
            {"name": "float8", "float8": "tensorwise"},
            {"compile": True, "compile_backend": "inductor"},
            "float8 (tensorwise) +compile",
        ),
        (
            {"name": "bf16", "float8": "none"},
            {"compile": True, "compile_backend": "aot_eager"},
            "bf16 +compile(aot_eager)",
        ),
        (
            {"name": "float8_rowwise", "float8": "rowwise"},
            {"compile": False, "compile_backend": "eager"},
            "float8_rowwise (rowwise)",
        ),
    ],
)
def test_the_precision_column_names_the_float8_recipe_and_compile(precision, parallel, label):
    from hsdp_runner.core.records import precision_label
    from hsdp_runner.report.runs import COLUMNS, Job

    backend = parallel.get("compile_backend", "inductor")
    assert precision_label(precision, parallel["compile"], backend) == label
    cell = dict((name, text) for name, text, _ in COLUMNS)["precision"]
    config = {"precision": precision, "parallel": parallel}
    assert cell(Job(Path("."), 0, [], config, None, [])) == label


def test_the_table_and_the_loss_plot_show_validation_losses(tmp_path):
    """A job that validated during training: its last validation loss in the table's "val
    loss" column, its validation points in loss.png and in the dashboard's loss chart."""
    from hsdp_runner.report.dashboard import charts

    fake_job(tmp_path, 0, ["parallel.tp=1"], {**ran(9000.0, [1, 8, 1]), "val_loss": 3.7125})
    job_dir = next(tmp_path.iterdir())
    (job_dir / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": 5.0 - s, **({"val_loss": 4.5 - s} if s % 2 else {})})
            + "\n"
            for s in (1, 2, 3)
        )
    )
    fake_job(tmp_path, 1, ["parallel.tp=2"], ran(8000.0, [1, 4, 2]), losses=[5.0, 4.0])
    jobs = compare.load_jobs(tmp_path)
    rows = compare.table(jobs).splitlines()[2:]
    assert rows[0].endswith("| 0.5 | 3.7125 | ok |") and rows[1].endswith("| 0.5 | — | ok |")
    fig, _ = charts.curves(jobs)
    val = [trace for trace in fig.data if trace.name.endswith(" val")]
    assert len(val) == 1 and list(val[0].x) == [1, 3] and list(val[0].y) == [3.5, 1.5]
    compare.plot_loss(jobs, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0
