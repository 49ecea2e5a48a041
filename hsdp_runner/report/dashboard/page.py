"""``compare.html``: a sweep's (or one job's) dashboard in one self-contained HTML file.

No server, no account, no network at view time: plotly's JavaScript is embedded in the page
(plotly.min.js is 4.8 MB, the page about 4.9 MB; writing it took 0.4-2 s on a loaded 2-core
machine), so the file opens from a compute node's shared disk or a laptop copy alike. The page
holds the job table of ``compare.md`` (sortable by clicking a column head), then the
charts of ``dashboard_charts``. While a sweep runs (its ``sweep_state.json`` says so, written
by ``dashboard_callback``) the page reloads itself every few seconds, keeping its scroll
position; the reload can be paused with a checkbox.

Jobs are read by ``runs.load_jobs``; the table is built from the same ``runs.columns`` as
``compare.md`` (each cell's text, and the job's own figure to sort by), so both views always
show the same columns. The page's HTML, CSS and JavaScript are package files in ``assets/``.
"""

from __future__ import annotations

import datetime
import html
import json
import os
import socket
from functools import cache
from importlib import resources
from pathlib import Path

from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.records import RunSummary
from hsdp_runner.report import prediction, runs
from hsdp_runner.report.dashboard import charts as dashboard_charts

HTML_FILE, STATE_FILE = "compare.html", "sweep_state.json"
RELOAD_S = 10

# (div id, heading, chart function); the test of the rendered page relies on these ids.
CHARTS = (
    ("chart-bars", "Throughput and memory", dashboard_charts.bars),
    (
        "chart-parcoords",
        "Degrees and options against throughput, MFU and memory",
        dashboard_charts.parallel_coordinates,
    ),
    ("chart-curves", "Loss and step time", dashboard_charts.curves),
    ("chart-comm", "Communication per step and rank", dashboard_charts.communication),
)
PREDICTED_ID = "chart-predicted"


def mark_sweep(sweep_dir: Path, running: bool) -> None:
    """Record in ``sweep_dir/sweep_state.json`` whether the sweep is running (with this
    process's id and host, so a sweep that died without saying so is not taken as running)."""
    state = {
        "running": running,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "at": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    _write_atomic(Path(sweep_dir) / STATE_FILE, json.dumps(state) + "\n")


def sweep_running(sweep_dir: Path) -> bool:
    """True when ``sweep_state.json`` says running and, on this host, its process is alive."""
    try:
        state = json.loads((Path(sweep_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not state.get("running"):
        return False
    if state.get("host") != socket.gethostname():
        return True  # another node's process: cannot check, trust the file
    try:
        os.kill(int(state["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        pass
    return True


def _write_atomic(path: Path, text: str) -> None:
    # A unique temp name: several writers (a job array's tasks) may rewrite the page at once.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@cache
def asset(name: str) -> str:
    """The text of the page file ``name`` (``page.html``, ``page.css``, ``page.js``,
    ``reload.js``) shipped in this package's ``assets/``."""
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def _sort_key(value) -> str:
    """A cell's ``data-key``: a number as digits (the page compares those as numbers)."""
    if value is None:
        return ""
    if isinstance(value, (int, float)):
        return format(value, ".12g")
    return str(value).lower()


def _why(summary: RunSummary) -> str:
    """The whole reason a job did not complete, for the status cell's tooltip."""
    if summary.status is RunStatus.interrupted:
        return (
            f"interrupted by {summary.signal} after step "
            f"{summary.interrupted_at_step}; rerun the same command to resume"
        )
    return str(summary.reason or summary.error or "")


def table_html(jobs: list[runs.Job]) -> str:
    """The job table (``runs.columns(jobs)``, in ``jobs`` order) as HTML: each cell's sort key
    from the job's own figures, a status class per row, the full reason or error of a job that
    did not complete as the status cell's tooltip."""
    cols = runs.columns(jobs)
    head = "".join(f'<th title="click to sort">{html.escape(name)}</th>' for name, _, _ in cols)
    best = runs.best(jobs)
    rows = []
    for job in jobs:
        cells = runs.cells(job, cols)
        if job is best:
            cells[0] = (f"{cells[0][0]} (best)", cells[0][1])
        tds = [
            f'<td data-key="{html.escape(_sort_key(key))}">{html.escape(text)}</td>'
            for text, key in cells[:-1]
        ]
        text, key = cells[-1]
        tds.append(
            f'<td data-key="{html.escape(_sort_key(key))}" '
            f'title="{html.escape(_why(job.summary))}">{html.escape(text)}</td>'
        )
        cls = job.status + (" best" if job is best else "")
        rows.append(f'<tr class="{html.escape(cls)}">{"".join(tds)}</tr>')
    return f'<table id="jobs"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _figure_html(div_id: str, fig) -> str:
    import plotly.io as pio

    return pio.to_html(
        fig,
        include_plotlyjs=False,
        full_html=False,
        div_id=div_id,
        config={"displaylogo": False, "responsive": True},
    )


def _section(div_id: str, heading: str, fig, note: str) -> str:
    body = (
        _figure_html(div_id, fig)
        if fig is not None
        else f'<p class="empty" id="{div_id}-empty">{html.escape(note)}</p>'
    )
    caption = f'<p class="note">{html.escape(note)}</p>' if fig is not None else ""
    return f"<section><h2>{html.escape(heading)}</h2>{caption}{body}</section>"


def render(
    title: str, jobs: list[runs.Job], predictions: dict, live: bool, reload_s: int = RELOAD_S
) -> str:
    """Return the whole page for ``jobs`` (``predictions``: job dir -> plan layout entry;
    ``live``: reload every ``reload_s`` seconds)."""
    import plotly.offline

    statuses = sorted({j.status for j in jobs}, key=lambda s: s.rank)
    counts = ", ".join(f"{sum(j.status == s for j in jobs)} {s}" for s in statuses)
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    state = (
        f'<label class="live"><input type="checkbox" id="auto-reload" checked '
        f'data-reload-ms="{1000 * reload_s}"> sweep running: reload every {reload_s} s'
        "</label>"
        if live
        else ""
    )
    sections = [_section(i, h, *chart(jobs)) for i, h, chart in CHARTS]
    if predictions:
        sections.append(
            _section(
                PREDICTED_ID,
                "Predicted against measured",
                *dashboard_charts.predicted(jobs, predictions),
            )
        )
    table = table_html(jobs) if jobs else '<p class="empty">no job dir yet</p>'
    return asset("page.html").format(
        title=html.escape(title),
        style=asset("page.css"),
        page_js=asset("page.js"),
        plotly_js=plotly.offline.get_plotlyjs(),
        summary=html.escape(f"{len(jobs)} jobs: {counts or 'none yet'} · updated {now}"),
        state=state,
        table=table,
        sections="".join(sections),
        reload_js=asset("reload.js") if live else "",
    )


def write_dashboard(
    out_dir: Path,
    jobs: list[runs.Job],
    plan_file: Path | None = None,
    live: bool | None = None,
    reload_s: int = RELOAD_S,
) -> Path:
    """Write ``out_dir/compare.html`` for ``jobs`` and return its path.

    ``plan_file``: a ``plan.json`` to compare with, instead of each job's ``plan.source``;
    ``live``: whether the page reloads itself (default: whether ``out_dir``'s sweep runs).
    """
    out_dir = Path(out_dir)
    live = sweep_running(out_dir) if live is None else live
    planned = plan_file or any((j.config.get("plan") or {}).get("source") for j in jobs)
    predictions = prediction.predictions_for([j.path for j in jobs], plan_file) if planned else {}
    page = render(f"{out_dir.name}", jobs, predictions, live, reload_s)
    path = out_dir / HTML_FILE
    _write_atomic(path, page)
    return path


def refresh(sweep_dir: Path, live: bool, reload_s: int = RELOAD_S) -> Path:
    """Read the jobs in ``sweep_dir`` as they are now and rewrite its dashboard."""
    sweep_dir = Path(sweep_dir)
    jobs = runs.load_jobs(sweep_dir) if sweep_dir.is_dir() else []
    return write_dashboard(sweep_dir, jobs, live=live, reload_s=reload_s)
