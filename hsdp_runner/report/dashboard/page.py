"""``compare.html``: a sweep's (or one job's) dashboard in one self-contained HTML file.

No server, no account, no network at view time: plotly's JavaScript is embedded in the page
(plotly.min.js is 4.8 MB, the page about 4.9 MB; writing it took 0.4-2 s on a loaded 2-core
machine), so the file opens from a compute node's shared disk or a laptop copy alike. The page
holds the job table of ``compare.md`` (sortable by clicking a column head), then the
charts of ``dashboard_charts``. While a sweep runs (its ``sweep_state.json`` says so, written
by ``dashboard_callback``) the page reloads itself every few seconds, keeping its scroll
position; the reload can be paused with a checkbox.

Jobs are read by ``runs.load_jobs``; the table is ``runs.table`` rendered as HTML, so
both views always show the same columns.
"""

from __future__ import annotations

import datetime
import html
import json
import os
import re
import socket
from pathlib import Path

from hsdp_runner.core.records import RunStatus, RunSummary
from hsdp_runner.report import prediction, runs
from hsdp_runner.report.dashboard import charts as dashboard_charts

HTML_FILE, STATE_FILE = "compare.html", "sweep_state.json"
RELOAD_S = 10

# (div id, heading, chart function); the test of the rendered page relies on these ids.
CHARTS = (("chart-bars", "Throughput and memory", dashboard_charts.bars),
          ("chart-parcoords", "Degrees and options against throughput, MFU and memory",
           dashboard_charts.parallel_coordinates),
          ("chart-curves", "Loss and step time", dashboard_charts.curves),
          ("chart-comm", "Communication per step and rank", dashboard_charts.communication))
PREDICTED_ID = "chart-predicted"


def mark_sweep(sweep_dir: Path, running: bool) -> None:
    """Record in ``sweep_dir/sweep_state.json`` whether the sweep is running (with this
    process's id and host, so a sweep that died without saying so is not taken as running)."""
    state = {"running": running, "pid": os.getpid(), "host": socket.gethostname(),
             "at": datetime.datetime.now().isoformat(timespec="seconds")}
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


def _cells(row: str) -> list[str]:
    """The cells of one markdown table row (``\\|`` is a literal bar inside a cell)."""
    parts = re.split(r"(?<!\\)\|", row.strip())[1:-1]
    return [p.strip().replace("\\|", "|") for p in parts]


def _sort_key(text: str) -> str:
    match = re.match(r"[#(]?(-?[\d,]*\.?\d+)", text.replace("**", ""))
    return match.group(1).replace(",", "") if match else text.lower()


def _why(summary: RunSummary) -> str:
    """The whole reason a job did not complete, for the status cell's tooltip."""
    if summary.status is RunStatus.interrupted:
        return (f"interrupted by {summary.signal} after step "
                f"{summary.interrupted_at_step}; rerun the same command to resume")
    return str(summary.reason or summary.error or "")


def table_html(jobs: list[runs.Job]) -> str:
    """``runs.table(jobs)`` as an HTML table: a sort key per cell, a status class per row,
    the full reason or error of a job that did not complete as the status cell's tooltip."""
    lines = runs.table(jobs).splitlines()
    head = "".join(f'<th title="click to sort">{html.escape(c)}</th>' for c in _cells(lines[0]))
    rows = []
    for job, line in zip(jobs, lines[2:]):
        cells = _cells(line)
        why = _why(job.summary)
        tds = [f'<td data-key="{html.escape(_sort_key(c))}">'
               f'{html.escape(c.replace("**", ""))}</td>' for c in cells[:-1]]
        tds.append(f'<td data-key="{html.escape(cells[-1].lower())}" '
                   f'title="{html.escape(str(why))}">{html.escape(cells[-1])}</td>')
        best = " best" if "(best)" in cells[0] else ""
        rows.append(f'<tr class="{html.escape(job.status)}{best}">{"".join(tds)}</tr>')
    return (f'<table id="jobs"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def _figure_html(div_id: str, fig) -> str:
    import plotly.io as pio

    return pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def _section(div_id: str, heading: str, fig, note: str) -> str:
    body = _figure_html(div_id, fig) if fig is not None else \
        f'<p class="empty" id="{div_id}-empty">{html.escape(note)}</p>'
    caption = f'<p class="note">{html.escape(note)}</p>' if fig is not None else ""
    return f'<section><h2>{html.escape(heading)}</h2>{caption}{body}</section>'


def render(title: str, jobs: list[runs.Job], predictions: dict, live: bool,
           reload_s: int = RELOAD_S) -> str:
    """Return the whole page for ``jobs`` (``predictions``: job dir -> plan layout entry;
    ``live``: reload every ``reload_s`` seconds)."""
    import plotly.offline

    statuses = sorted({j.status for j in jobs}, key=lambda s: runs.ORDER.get(s, 9))
    counts = ", ".join(f"{sum(j.status == s for j in jobs)} {s}" for s in statuses)
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    state = (f'<label class="live"><input type="checkbox" id="auto-reload" checked> sweep '
             f'running: reload every {reload_s} s</label>' if live else "")
    sections = [_section(i, h, *chart(jobs)) for i, h, chart in CHARTS]
    if predictions:
        sections.append(_section(PREDICTED_ID, "Predicted against measured",
                                 *dashboard_charts.predicted(jobs, predictions)))
    table = table_html(jobs) if jobs else '<p class="empty">no job dir yet</p>'
    return _PAGE.format(
        title=html.escape(title), errors_js=_ERRORS_JS, plotly_js=plotly.offline.get_plotlyjs(),
        summary=html.escape(f"{len(jobs)} jobs: {counts or 'none yet'} · updated {now}"),
        state=state, table=table, sections="".join(sections),
        reload_js=_RELOAD_JS.replace("RELOAD_MS", str(1000 * reload_s)) if live else "",
        sort_js=_SORT_JS, style=_STYLE)


def write_dashboard(out_dir: Path, jobs: list[runs.Job], plan_file: Path | None = None,
                    live: bool | None = None, reload_s: int = RELOAD_S) -> Path:
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


# Errors are kept on the page (and so in its DOM) as well as in the console: a chart that did
# not draw then says why, and the browser test reads them from the rendered DOM.
_ERRORS_JS = """
window.dashErrors = [];
function showDashErrors() {
  var box = document.getElementById('js-errors');
  if (!box || !window.dashErrors.length) return;
  box.hidden = false;
  box.textContent = 'JavaScript errors: ' + window.dashErrors.join(' | ');
}
function dashError(message) { window.dashErrors.push(String(message)); showDashErrors(); }
window.addEventListener('error', function (e) { dashError(e.message); });
window.addEventListener('unhandledrejection', function (e) { dashError(e.reason); });
document.addEventListener('DOMContentLoaded', showDashErrors);
"""

# A dozen lines of sorting, rather than a table library embedded next to plotly.
_SORT_JS = """
document.querySelectorAll('#jobs th').forEach(function (th, col) {
  th.addEventListener('click', function () {
    var body = th.closest('table').tBodies[0], up = th.dataset.dir !== 'asc';
    th.parentNode.querySelectorAll('th').forEach(function (h) { delete h.dataset.dir; });
    th.dataset.dir = up ? 'asc' : 'desc';
    var key = function (tr) { return tr.cells[col].dataset.key; };
    Array.from(body.rows).sort(function (a, b) {
      var x = key(a), y = key(b), nx = parseFloat(x), ny = parseFloat(y);
      var order = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
      return up ? order : -order;
    }).forEach(function (tr) { body.appendChild(tr); });
  });
});
"""

_RELOAD_JS = """
(function () {
  var box = document.getElementById('auto-reload'), where = 'hsdp-dashboard:' + location.pathname;
  try {
    box.checked = localStorage.getItem(where + ':paused') !== '1';
    var y = sessionStorage.getItem(where + ':y');
    if (y !== null) window.scrollTo(0, Number(y));
  } catch (e) { /* storage may be off for file:// pages */ }
  box.addEventListener('change', function () {
    try { localStorage.setItem(where + ':paused', box.checked ? '0' : '1'); } catch (e) {}
  });
  setInterval(function () {
    if (!box.checked) return;
    try { sessionStorage.setItem(where + ':y', String(window.scrollY)); } catch (e) {}
    location.reload();
  }, RELOAD_MS);
})();
"""

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.1em; margin: 1.6em 0 0.2em; }
.summary, .note, .empty { color: #666; margin: 0.2em 0; } .empty { font-style: italic; }
.live { background: #fff4d6; padding: 0.2em 0.6em; border-radius: 4px; margin-left: 1em; }
#js-errors { background: #fde2e1; color: #900; padding: 0.5em; white-space: pre-wrap; }
table { border-collapse: collapse; font-size: 0.8em; width: 100%; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; cursor: pointer; position: sticky; top: 0; }
th[data-dir=asc]::after { content: ' \\25B2'; } th[data-dir=desc]::after { content: ' \\25BC'; }
td:first-child { min-width: 11em; } td:last-child { min-width: 14em; }
.table-box { overflow-x: auto; } tr.best td { font-weight: 600; background: #fff1e6; }
tr.failed td { background: #fdecea; } tr.interrupted td { background: #fff8e1; }
tr.skipped td, tr.unfinished td { color: #777; background: #f7f7f7; }
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title} · hsdp_runner</title>
<style>{style}</style>
<script>{errors_js}</script>
<script>{plotly_js}</script>
</head><body>
<div id="js-errors" hidden></div>
<h1>{title}</h1>
<p class="summary">{summary}{state}</p>
<section><h2>Jobs</h2><p class="note">click a column head to sort; hover a status for the
full reason</p><div class="table-box">{table}</div></section>
{sections}
<script>{sort_js}</script>
<script>{reload_js}</script>
</body></html>
"""
