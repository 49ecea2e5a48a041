"""compare.html of a real 2-job sweep, rendered in headless Chromium: every chart drew its
traces, and the page logged no JavaScript error.

Chromium runs the page's scripts (``--virtual-time-budget`` lets plotly finish), then
``--dump-dom`` prints the DOM as rendered: plotly's SVG (``g.trace.bars``, ``g.trace.scatter``,
the parallel-coordinates axes) is in it only if the chart drew. Console messages come on
stderr (``--enable-logging=stderr``), and the page itself keeps uncaught errors in
``#js-errors``. Skipped, saying why, only when no Chromium is installed (``.ci/run`` installs
Debian's ``chromium``).
"""

import json
import shutil
import subprocess
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import run_cli

from hsdp_runner import compare
from hsdp_runner.report import runs

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Two layouts of the same 2 ranks: FSDP (1 x 2) and DDP (2 x 1); tiny and short.
SWEEP = [
    "-m",
    "parallel=ddp",
    "parallel.dp_replicate=1,2",
    "parallel.dp_shard=-1",
    "model=llama3_tiny",
    "model.n_layers=1",
    "trainer.steps=3",
    "metrics.warmup_steps=1",
    "logger=none",
]
VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}


def browser() -> str:
    found = next(filter(None, map(shutil.which, BROWSERS)), None)
    if found is None:
        pytest.skip(
            "no Chromium installed (Debian/Ubuntu: apt-get install -y chromium; "
            ".ci/run does it), so compare.html cannot be rendered in a browser"
        )
    return found


class RenderedDom(HTMLParser):
    """Per element id of interest (``chart-*``, ``jobs``, ``js-errors``): the class sets of
    the elements inside it and their text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, str | None]] = []
        self.classes: dict[str, list[set]] = defaultdict(list)
        self.text: dict[str, list[str]] = defaultdict(list)
        self.attrs: dict[str, dict] = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        own = attrs.get("id") or ""
        region = (
            own
            if own.startswith(("chart-", "jobs", "js-errors"))
            else (self.stack[-1][1] if self.stack else None)
        )
        if own == region and own:
            self.attrs[own] = attrs
        if region:
            self.classes[region].append({tag, *(attrs.get("class") or "").split()})
        if tag not in VOID:
            self.stack.append((tag, region))

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if self.stack and self.stack[-1][1] and data.strip():
            self.text[self.stack[-1][1]].append(data.strip())

    def count(self, region: str, *classes: str) -> int:
        return sum(1 for found in self.classes[region] if set(classes) <= found)


def render(chromium: str, page: Path, profile: Path) -> tuple[RenderedDom, list[str]]:
    """(the rendered DOM, the console messages) of ``page`` after its scripts ran."""
    result = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--enable-unsafe-swiftshader",
            "--use-angle=swiftshader",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1400,3000",
            "--virtual-time-budget=15000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    dom = RenderedDom()
    dom.feed(result.stdout)
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    return dom, console


@pytest.fixture(scope="session")
def small_sweep(tmp_path_factory):
    """A real 2-job multirun (2 CPU ranks each), run once for the session."""
    sweep_dir = tmp_path_factory.mktemp("dash") / "sweep"
    result = run_cli(sweep_dir, *SWEEP, f"hydra.sweep.dir={sweep_dir}", pin_dir=False, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, sweep_dir


@pytest.mark.multiprocess
def test_sweep_says_where_its_live_dashboard_is_and_ends_it_static(small_sweep):
    result, sweep_dir = small_sweep
    out = result.stdout
    assert f"hsdp_runner: live dashboard: {sweep_dir / 'compare.html'}" in out
    assert out.index("live dashboard") < out.index("hsdp_runner: done")  # before the first job
    assert json.loads((sweep_dir / "sweep_state.json").read_text())["running"] is False
    page = (sweep_dir / "compare.html").read_text()
    assert "2 jobs: 2 completed" in page and "location.reload()" not in page


@pytest.mark.multiprocess
def test_every_chart_of_a_real_sweep_draws_in_chromium_without_errors(small_sweep, tmp_path):
    chromium = browser()
    _, sweep_dir = small_sweep
    jobs = runs.load_jobs(sweep_dir)
    plan = tmp_path / "plan.json"  # a plan whose layouts name both jobs by their overrides
    plan.write_text(
        json.dumps(
            {
                "version": 1,
                "layouts": [
                    {
                        "overrides": {"parallel.dp_replicate": r},
                        "valid": True,
                        "reason": None,
                        "fits": True,
                        "mem_gib": 0.3,
                        "step_time_s": 0.05,
                        "tps_per_device": tps,
                        "mfu": 0.1,
                        "dominant": "compute",
                        "rank": rank,
                    }
                    for r, tps, rank in ((1, 3000.0, 2), (2, 5000.0, 1))
                ],
            }
        )
    )
    assert compare.main([str(sweep_dir), "--plan", str(plan)]) == 0

    dom, console = render(chromium, sweep_dir / "compare.html", tmp_path / "profile")

    assert [m for m in console if "Uncaught" in m or "Error" in m] == []
    assert "hidden" in dom.attrs["js-errors"] and dom.text["js-errors"] == []
    assert dom.count("jobs", "tr") == 1 + len(jobs)  # head + one row per job
    for chart in ("chart-bars", "chart-parcoords", "chart-curves", "chart-comm", "chart-predicted"):
        assert dom.count(chart, "js-plotly-plot") == 1, f"{chart} was not drawn"
    assert dom.count("chart-bars", "trace", "bars") == 2  # tokens/s, memory
    assert dom.count("chart-bars", "point") == 2 * len(jobs)
    # parallel coordinates: 4 degrees + tokens/s, MFU, memory (no other override varies)
    assert dom.count("chart-parcoords", "parcoords") == 1
    assert dom.count("chart-parcoords", "y-axis") == 8
    # loss and step time: one line each per job, the legend naming every job
    assert dom.count("chart-curves", "trace", "scatter") == 2 * len(jobs)
    labels = {j.label for j in jobs}
    assert labels <= set(dom.text["chart-curves"])
    # communication: one stacked bar trace per collective/mesh dim the jobs counted
    kinds = {
        k
        for j in jobs
        for src in ("comm_measured", "comm_analytic")
        for k in getattr(j.summary, src)
    }
    assert kinds >= {"all_gather/dp_shard", "reduce_scatter/dp_shard", "all_reduce/dp_replicate"}
    assert dom.count("chart-comm", "trace", "bars") == len(kinds)
    assert kinds <= set(dom.text["chart-comm"])
    # predicted vs measured: points and diagonal in both panels, the correlation in the title
    assert dom.count("chart-predicted", "trace", "scatter") == 4
    title = "Spearman ρ tokens/s per device: "
    assert any(t.startswith(title) for t in dom.text["chart-predicted"])
