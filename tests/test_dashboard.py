"""compare.html from synthetic job dirs, in-process: table, charts, plan, live reload, callback.

The page rendered in a real browser from a real sweep is tests/test_dashboard_browser.py.
"""

import json
import logging
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from hsdp_runner import compare
from hsdp_runner.report import prediction, runs
from hsdp_runner.report.dashboard import charts as dashboard_charts
from hsdp_runner.report.dashboard import page as dashboard
from hsdp_runner.report.dashboard.callback import DashboardCallback

COMM = {
    "all_gather/dp_shard": {"calls": 3, "bytes": 3 * 2**20},
    "reduce_scatter/dp_shard": {"calls": 2, "bytes": 2**20},
}


def fake_job(
    sweep: Path,
    num: int,
    overrides: list[str],
    summary: dict,
    steps: int = 0,
    config: dict | None = None,
) -> Path:
    """A job dir as a multirun leaves it: .hydra/overrides.yaml, config, summary, metrics."""
    job = sweep / f"{num}_{','.join(overrides)}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    values = dict(o.split("=", 1) for o in overrides)
    (job / "config_resolved.yaml").write_text(
        yaml.safe_dump(
            config
            or {
                "precision": {"name": values.get("precision", "bf16")},
                "parallel": {
                    "dp_replicate": 1,
                    "dp_shard": int(values.get("parallel.dp_shard", 8)),
                    "tp": int(values.get("parallel.tp", 1)),
                },
                "plan": {"source": None},
            }
        )
    )
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))
    (job / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "step_time_s": 0.5 + 0.01 * s}) + "\n"
            for s in range(1, steps + 1)
        )
    )
    return job


def ran(tps: float, shard: int, tp: int, comm: dict | None = COMM) -> dict:
    facts = {
        "status": "completed",
        "layout": "fsdp_tp" if tp > 1 else "fsdp",
        "mesh_shape": [1, shard, tp],
        "world_size": shard * tp,
        "dp_replicate": 1,
        "dp_shard": shard,
        "tp": tp,
        "median_tps_global": tps,
        "min_tps_global": tps * 0.9,
        "max_tps_global": tps * 1.1,
        "median_tps_per_device": tps / 8,
        "min_tps_per_device": tps / 9,
        "max_tps_per_device": tps / 7,
        "median_mfu": 0.4,
        "mem_peak_gib": 30.0,
        "mem_peak_gib_per_rank": [30.0, 29.0, 31.5],
        "median_step_time_s": 0.5,
    }
    if comm:
        facts |= {
            "comm_step": 1,
            "comm_measured": comm,
            "comm_analytic": comm,
            "comm_bytes_measured": 4 * 2**20,
            "comm_bytes_analytic": 4 * 2**20,
            "comm_ratio": 1.0,
        }
    return facts


@pytest.fixture
def sweep(tmp_path):
    """Two completed jobs (one precision differs too), one skipped, one failed, one interrupted."""
    base = ["model=llama3_8b"]
    fake_job(
        tmp_path,
        0,
        ["parallel.dp_shard=8", "parallel.tp=2", "precision=bf16", *base],
        {
            "status": "skipped",
            "reason": "parallel.dp_replicate=-1 cannot be inferred: "
            + "world size 8 is not divisible " * 20,
            "requested_degrees": {"dp_replicate": -1, "dp_shard": 8, "tp": 2},
        },
    )
    fake_job(
        tmp_path,
        1,
        ["parallel.dp_shard=4", "parallel.tp=2", "precision=fp32", *base],
        ran(9000.0, 4, 2),
        steps=4,
    )
    fake_job(
        tmp_path,
        2,
        ["parallel.dp_shard=2", "parallel.tp=4", "precision=bf16", *base],
        {
            "status": "failed",
            "layout": "fsdp_tp",
            "mesh_shape": [1, 2, 4],
            "world_size": 8,
            "failed_rank": 3,
            "error": "torch.OutOfMemoryError: CUDA out",
        },
        steps=1,
    )
    fake_job(
        tmp_path,
        3,
        ["parallel.dp_shard=8", "parallel.tp=1", "precision=bf16", *base],
        ran(12000.0, 8, 1),
        steps=4,
    )
    fake_job(
        tmp_path,
        4,
        ["parallel.dp_shard=1", "parallel.tp=8", "precision=bf16", *base],
        {
            "status": "interrupted",
            "layout": "tp",
            "mesh_shape": [1, 1, 8],
            "world_size": 8,
            "interrupted_at_step": 2,
            "signal": "SIGTERM",
        },
        steps=2,
    )
    return tmp_path


def test_compare_writes_one_self_contained_page_next_to_compare_md(sweep, capsys):
    assert compare.main([str(sweep)]) == 0
    page = (sweep / "compare.html").read_text()
    assert f"wrote {sweep / 'compare.md'}" in capsys.readouterr().out
    # plotly's JavaScript is in the page; nothing is fetched at view time
    assert 4_000_000 < len(page) < 6_000_000
    assert re.search(r"<(script|link|img)[^>]+(src|href)=", page) is None
    assert "window.Plotly" in page or "Plotly.newPlot" in page
    for div in ("chart-bars", "chart-parcoords", "chart-curves", "chart-comm"):
        assert f'id="{div}"' in page, div
    assert 'id="chart-predicted"' not in page  # no plan applies
    assert "auto-reload" not in page  # a finished sweep's page does not reload itself


def test_html_table_has_the_rows_and_columns_of_compare_md(sweep):
    jobs = runs.load_jobs(sweep)
    md_rows = runs.table(jobs).splitlines()
    table = dashboard.table_html(jobs)
    assert table.count("<th ") == md_rows[0].count(" | ") + 1
    rows = re.findall(r'<tr class="([^"]+)">(.*?)</tr>', table)
    # compare's order: completed by throughput, then interrupted, failed, skipped
    assert [cls for cls, _ in rows] == [
        "completed best",
        "completed",
        "interrupted",
        "failed",
        "skipped",
    ]
    assert ">#3 dp_shard=8 tp=1 precision=bf16 (best)</td>" in rows[0][1]
    assert "failed (rank 3): torch.OutOfMemoryError: CUDA out" in rows[3][1]
    skipped = dict(rows)["skipped"]
    # the cell holds compare.md's shortened reason, the tooltip the whole of it
    assert "skipped: parallel.dp_replicate=-1 cannot be inferred" in skipped
    assert 'title="parallel.dp_replicate=-1 cannot be inferred: world size 8' in skipped
    assert skipped.count("is not divisible") > 19
    assert 'title="interrupted by SIGTERM after step 2; rerun' in dict(rows)["interrupted"]
    # numeric cells sort by their number, e.g. "12,000 (10,800–13,200)" by 12000
    assert '<td data-key="12000">12,000 (10,800–13,200)</td>' in rows[0][1]


def test_bars_show_min_max_of_throughput_and_of_memory_over_ranks(sweep):
    fig, _ = dashboard_charts.bars(runs.load_jobs(sweep))
    tps, mem = fig.data
    assert list(tps.x) == [12000.0, 9000.0] and "dp_shard=8" in tps.y[0]
    assert list(tps.error_x.array) == pytest.approx([1200.0, 900.0])
    assert list(tps.error_x.arrayminus) == pytest.approx([1200.0, 900.0])
    assert list(mem.error_x.array) == [1.5, 1.5] and list(mem.error_x.arrayminus) == [1.0, 1.0]


def test_parallel_coordinates_have_degrees_varying_options_and_figures(sweep):
    fig, note = dashboard_charts.parallel_coordinates(runs.load_jobs(sweep))
    dims = {d.label: d for d in fig.data[0].dimensions}
    assert list(dims) == [
        "pp",
        "dp_replicate",
        "dp_shard",
        "cp",
        "tp",
        "precision",
        "tokens/s global",
        "MFU %",
        "peak mem GiB",
    ]
    assert list(dims["dp_shard"].values) == [8, 4] and list(dims["tp"].values) == [1, 2]
    assert list(dims["cp"].values) == [1, 1]  # summaries from before the cp dim: cp = 1
    assert list(dims["precision"].ticktext) == ["bf16", "fp32"]
    assert list(dims["precision"].values) == [0, 1]
    assert list(dims["MFU %"].values) == [40.0, 40.0]


def test_a_context_parallel_job_shows_its_cp_degree_in_the_table_and_the_chart(tmp_path):
    fake_job(
        tmp_path,
        0,
        ["parallel.cp=2", "parallel.dp_shard=4"],
        {**ran(8000.0, 4, 1), "layout": "fsdp_cp", "mesh_shape": [1, 4, 2, 1], "cp": 2},
    )
    fake_job(
        tmp_path,
        1,
        ["parallel.cp=1", "parallel.dp_shard=8"],
        {**ran(9000.0, 8, 1), "mesh_shape": [1, 8, 1, 1], "cp": 1},
    )
    fig, _ = dashboard_charts.parallel_coordinates(runs.load_jobs(tmp_path))
    dims = {d.label: d for d in fig.data[0].dimensions}
    assert list(dims["cp"].values) == [1, 2] and "parallel.cp" not in dims  # a degree axis
    assert compare.main([str(tmp_path)]) == 0
    page = (tmp_path / "compare.html").read_text()
    assert "rep×shard×cp×tp" in page and "fsdp_cp" in page and "1×4×2×1" in page


def test_a_moe_job_adds_its_balance_to_the_curves_and_the_table(tmp_path):
    """A job with experts: the curves get a third panel, the busiest expert's load over the
    mean per step, and the HTML table the balance column (sorted by the load)."""
    job = fake_job(tmp_path, 0, ["parallel.ep=2"], {**ran(900.0, 4, 1), "ep": 2}, steps=2)
    records = [
        {"step": s, "loss": 5.0, "step_time_s": 0.5, "moe/load_max_over_mean": 1.5 / s}
        for s in (1, 2)
    ]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    jobs = runs.load_jobs(tmp_path)
    fig, _ = dashboard_charts.curves(jobs)
    assert [t.yaxis for t in fig.data] == ["y", "y2", "y3"]
    assert list(fig.data[2].y) == [1.5, 0.75]
    assert "experts: busiest load / mean" in fig.layout.annotations[2].text
    table = dashboard.table_html(jobs)
    assert "expert load max/mean" in table and '<td data-key="0.75">0.75</td>' in table
    assert ">1×4×1×1 ep2</td>" in table


def test_curves_overlay_loss_and_step_time_of_every_job_named_on_hover(sweep):
    fig, _ = dashboard_charts.curves(runs.load_jobs(sweep))
    names = [t.name for t in fig.data]
    # two traces per job that logged a step (loss, step time), in job order
    assert names == [
        n
        for n in [
            "#1 dp_shard=4 tp=2 precision=fp32",
            "#2 dp_shard=2 tp=4 precision=bf16 (failed)",
            "#3 dp_shard=8 tp=1 precision=bf16",
            "#4 dp_shard=1 tp=8 precision=bf16 (interrupted)",
        ]
        for _ in (0, 1)
    ]
    assert all(f"<b>{t.name}</b>" in t.hovertemplate for t in fig.data)
    assert fig.data[2].line.dash == "dash" and fig.data[0].line.dash == "solid"
    assert list(fig.data[1].y) == pytest.approx([0.51, 0.52, 0.53, 0.54])


def test_communication_stacks_each_collective_measured_next_to_the_model(sweep):
    fig, note = dashboard_charts.communication(runs.load_jobs(sweep))
    assert [t.name for t in fig.data] == ["all_gather/dp_shard", "reduce_scatter/dp_shard"]
    gather = fig.data[0]
    assert [list(level) for level in gather.x] == [
        ["#3 dp_shard=8 tp=1 precision=bf16"] * 2 + ["#1 dp_shard=4 tp=2 precision=fp32"] * 2,
        ["measured", "model", "measured", "model"],
    ]
    assert list(gather.y) == [3.0] * 4 and list(gather.customdata) == [3] * 4
    assert fig.layout.barmode == "stack" and note == "counted on step 1"


def test_a_single_job_dir_gets_its_own_dashboard(sweep):
    job = next(sweep.glob("3_*"))
    assert compare.main([str(job)]) == 0
    page = (job / "compare.html").read_text()
    assert "#0 dp_shard=8 tp=1 precision=bf16 model=llama3_8b" in page  # all its overrides
    assert 'id="chart-curves"' in page and 'id="chart-comm"' in page


def write_plan(path: Path, rows: list[tuple[int, int, float, float | None]]) -> Path:
    """A plan.json with one layout per (dp_shard, tp, tps_per_device, mem_gib)."""
    layouts = [
        {
            "overrides": {"parallel.dp_shard": s, "parallel.tp": t},
            "valid": tps is not None,
            "reason": None if tps else "does not fit",
            "fits": True,
            "mem_gib": mem,
            "step_time_s": 1.0,
            "tps_per_device": tps,
            "mfu": 0.4,
            "dominant": "compute",
            "rank": i + 1,
        }
        for i, (s, t, tps, mem) in enumerate(rows)
    ]
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "model": "llama3_8b",
                "world_size": 8,
                "cluster": {"name": "h100_sxm"},
                "layouts": layouts,
            }
        )
    )
    return path


def test_a_pipeline_jobs_unset_micro_batches_match_the_plan_rows_resolved_ones():
    """A plan row states ``parallel.pp_microbatches`` resolved (2 x pp by default); a job that
    left it null matches it, and its degree left at -1 reads the mesh it ran."""
    config = {"parallel": {"pp": -1, "pp_microbatches": None, "pp_schedule": "gpipe"}}
    values = prediction._job_values(config, [2, 1, 2, 1, 1])
    assert values("parallel.pp") == 2 and values("parallel.pp_microbatches") == 4
    assert values("parallel.pp_schedule") == "gpipe" and values("parallel.dp_shard") is None
    plan = {"layouts": [{"overrides": {"parallel.pp": 2, "parallel.pp_microbatches": 4}}]}
    assert prediction.layout_of(plan, values) is plan["layouts"][0]
    no_pp = prediction._job_values({"parallel": {"pp": 1}}, None)
    assert no_pp("parallel.pp_microbatches") is None


def test_predictions_match_a_layout_by_every_override_key(sweep, tmp_path_factory):
    plan = write_plan(
        tmp_path_factory.mktemp("plan") / "plan.json",
        [(8, 1, 1600.0, 28.0), (4, 2, 1000.0, 31.0), (2, 4, None, None)],
    )
    jobs = runs.load_jobs(sweep)
    found = prediction.predictions_for([j.path for j in jobs], plan)
    by_num = {j.num: found.get(j.path) for j in jobs}
    assert by_num[3]["rank"] == 1 and by_num[1]["rank"] == 2
    assert by_num[2]["valid"] is False  # matched; the chart leaves invalid layouts out
    assert by_num[0] is None and by_num[4] is None  # (8, 2), (1, 8): not in the plan
    fig, _ = dashboard_charts.predicted(jobs, found)
    points = fig.data[0]
    assert list(points.x) == [1600.0, 1000.0] and list(points.y) == [1500.0, 1125.0]
    assert "Spearman ρ tokens/s per device: +1.00" in fig.layout.title.text
    assert "Spearman ρ peak memory GiB: n/a" in fig.layout.title.text  # measured all 30 GiB


def test_a_jobs_plan_source_names_its_plan_and_the_page_shows_it(tmp_path):
    plan = write_plan(tmp_path / "plan.json", [(8, 1, 1400.0, 28.0), (4, 2, 1200.0, 31.0)])
    sweep = tmp_path / "sweep"
    for num, (shard, tp, tps) in enumerate([(8, 1, 12000.0), (4, 2, 9000.0)]):
        fake_job(
            sweep,
            num,
            [f"parallel.dp_shard={shard}", f"parallel.tp={tp}"],
            ran(tps, shard, tp),
            steps=2,
            config={
                "parallel": {"dp_shard": shard, "tp": tp},
                "plan": {"source": str(plan)},
                "precision": {"name": "bf16"},
            },
        )
    path = dashboard.write_dashboard(sweep, runs.load_jobs(sweep))
    page = path.read_text()
    assert 'id="chart-predicted"' in page
    assert r"Spearman \u03c1 tokens\u002fs per device: +1.00" in page  # as plotly escapes it


@pytest.mark.parametrize(
    "xs, ys, rho",
    [
        ([1, 2, 3, 4], [10, 20, 30, 40], 1.0),
        ([1, 2, 3, 4], [4, 3, 2, 1], -1.0),
        ([1, 2, 3, 4, 5], [2, 1, 4, 3, 5], 0.8),
        ([1, 2, 2, 3], [1, 2, 3, 4], 0.9486832980505138),  # a tie takes the average rank
        ([1, 1, 1], [1, 2, 3], None),  # constant: undefined
        ([1], [1], None),
    ],
)
def test_spearman_rank_correlation(xs, ys, rho):
    assert prediction.spearman(xs, ys) == (None if rho is None else pytest.approx(rho))


def test_page_reloads_itself_only_while_its_sweep_runs(sweep):
    jobs = runs.load_jobs(sweep)
    dashboard.mark_sweep(sweep, running=True)
    page = dashboard.write_dashboard(sweep, jobs).read_text()
    assert 'id="auto-reload"' in page and "location.reload()" in page
    assert "setInterval" in page and "10000" in page
    dashboard.mark_sweep(sweep, running=False)
    assert "location.reload()" not in dashboard.write_dashboard(sweep, jobs).read_text()
    # a sweep whose process died without marking the end is not taken as running
    state = json.loads((sweep / "sweep_state.json").read_text())
    (sweep / "sweep_state.json").write_text(
        json.dumps(state | {"running": True, "pid": 2**22 + 12345})
    )
    assert not dashboard.sweep_running(sweep)


def test_callback_rewrites_the_page_after_every_job_and_ends_it_static(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    callback = DashboardCallback(reload_s=7)
    callback.on_multirun_start(config)
    assert f"live dashboard: {sweep / 'compare.html'}" in capsys.readouterr().out
    page = (sweep / "compare.html").read_text()
    assert "0 jobs: none yet" in page and "reload every 7 s" in page
    fake_job(sweep, 0, ["parallel.dp_shard=8", "parallel.tp=1"], ran(12000.0, 8, 1), steps=3)
    callback.on_job_end(config, job_return=None)
    page = (sweep / "compare.html").read_text()
    assert "1 jobs: 1 completed" in page and "#0 dp_shard=8 tp=1" in page
    assert "location.reload()" in page and "7000" in page
    callback.on_multirun_end(config)
    assert "location.reload()" not in (sweep / "compare.html").read_text()
    assert json.loads((sweep / "sweep_state.json").read_text())["running"] is False
    assert f"hsdp_runner: dashboard: {sweep / 'compare.html'}" in capsys.readouterr().out


def test_callback_failure_is_a_warning_and_the_sweep_goes_on(tmp_path, monkeypatch, caplog):
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}})
    callback = DashboardCallback()
    callback.on_multirun_start(config)

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dashboard, "refresh", broken)
    with caplog.at_level(logging.WARNING):
        callback.on_job_end(config, job_return=None)
        callback.on_multirun_end(config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert (
        "could not be written (OSError: [Errno 28] No space left on device); the sweep "
        "goes on" in warnings[0]
    )


def test_callback_does_nothing_when_disabled_or_in_another_process(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    off = DashboardCallback(enable=False)
    off.on_multirun_start(config)
    off.on_job_end(config, job_return=None)
    off.on_multirun_end(config)
    assert not sweep.exists()
    # a submitit task that is not global rank 0 (here: no submitit job at all) writes nothing
    callback = DashboardCallback()
    callback.on_multirun_start(config)
    before = (sweep / "compare.html").stat().st_mtime_ns
    fake_job(sweep, 0, ["parallel.dp_shard=8", "parallel.tp=1"], ran(12000.0, 8, 1), steps=3)
    monkeypatch.setattr("os.getpid", lambda: -1)
    callback.on_job_end(config, job_return=None)
    callback.on_multirun_end(config)
    assert (sweep / "compare.html").stat().st_mtime_ns == before
    monkeypatch.undo()
    callback.on_multirun_end(config)  # the launching process ends it
    assert "location.reload()" not in (sweep / "compare.html").read_text()
