"""The dashboard's plotly figures, one function per chart, from ``compare.Job`` records.

Each function returns ``(figure, note)``: the figure, or None when the jobs hold nothing to
draw, and a one-line note saying what the chart shows or why it is absent. plotly is imported
here only, so importing the dashboard (e.g. as a Hydra callback) stays cheap.
"""

from __future__ import annotations

from hsdp_runner.distributed.parallel_dims import DIM_NAMES
from hsdp_runner.distributed.world_mesh import LATER_DIMS
from hsdp_runner.report import prediction
from hsdp_runner.report.runs import LOAD_KEY, Job, balance, degrees

DEGREES = DIM_NAMES
BEST, OTHER = "#e8710a", "#1f77b4"
MIB = 2**20


def _go():
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    return go, make_subplots


def measured(jobs: list[Job]) -> list[Job]:
    """Jobs with steady-state figures (completed, or interrupted after its warm-up)."""
    return [j for j in jobs if j.summary.median_tps_global is not None]


def _name(job: Job) -> str:
    layout, shape, _ = degrees(job)
    return f"{job.label} · {layout} {shape}"


def _short(text: str, limit: int = 44) -> str:
    """An axis label that leaves the plot its width (the full name is in the hover)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _style(fig, height: int):
    fig.update_layout(
        height=height, hovermode="closest", margin=dict(l=10, r=10, t=50, b=10), font=dict(size=12)
    )
    return fig


def bars(jobs: list[Job]):
    """Global tokens/s (median, whiskers min-max over the steady steps) and peak memory (rank 0,
    whiskers min-max over the ranks) per job, best first."""
    go, make_subplots = _go()
    done = measured(jobs)
    if not done:
        return None, "no job has steady-state figures yet"
    names = [_short(_name(j)) for j in done]
    colors = [BEST if i == 0 else OTHER for i in range(len(done))]
    tps = [j.summary.median_tps_global for j in done]
    mem = [j.summary.mem_peak_gib for j in done]
    ranks = [j.summary.mem_peak_gib_per_rank or [m] for j, m in zip(done, mem)]
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.03,
        subplot_titles=(
            "tokens/s global (median, min–max)",
            "peak memory GiB (rank 0; min–max of ranks)",
        ),
    )
    high = [j.summary.get("max_tps_global", t) - t for j, t in zip(done, tps)]
    low = [t - j.summary.get("min_tps_global", t) for j, t in zip(done, tps)]
    fig.add_trace(
        go.Bar(
            y=names,
            x=tps,
            orientation="h",
            marker_color=colors,
            name="tokens/s",
            error_x=dict(type="data", symmetric=False, array=high, arrayminus=low),
            customdata=[_name(j) for j in done],
            hovertemplate="%{customdata}<br>%{x:,.0f} tokens/s<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Bar(
            y=names,
            x=mem,
            orientation="h",
            marker_color=colors,
            name="peak memory",
            error_x=dict(
                type="data",
                symmetric=False,
                array=[max(r) - (m or 0) for r, m in zip(ranks, mem)],
                arrayminus=[(m or 0) - min(r) for r, m in zip(ranks, mem)],
            ),
            customdata=[_name(j) for j in done],
            hovertemplate="%{customdata}<br>%{x:.3f} GiB<extra></extra>",
        ),
        row=1,
        col=2,
    )
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_layout(showlegend=False)
    return _style(fig, 140 + 42 * len(done)), "best in orange"


def _option_values(done: list[Job]) -> dict[str, list[str]]:
    """{override key: value per job} for the non-degree overrides that differ between jobs."""
    per_job = [dict(o.lstrip("+~").split("=", 1) for o in j.overrides if "=" in o) for j in done]
    keys = sorted({k for d in per_job for k in d})
    options = {}
    for key in keys:
        if key.removeprefix("parallel.") in DEGREES or key.startswith("hydra."):
            continue
        values = [d.get(key, "(default)") for d in per_job]
        if len(set(values)) > 1:
            options[key.removeprefix("parallel.")] = values
    return options


def _axis(label: str, values: list) -> dict:
    """A parcoords dimension: numeric when every value is a number, else categorical."""
    try:
        numbers = [float(v) for v in values]
        ticks = sorted(set(numbers))  # degrees are few integers: no ticks in between
        return dict(label=label, values=numbers, tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])
    except (TypeError, ValueError):
        cats = sorted({str(v) for v in values})
        return dict(
            label=label,
            values=[cats.index(str(v)) for v in values],
            tickvals=list(range(len(cats))),
            ticktext=cats,
        )


def parallel_coordinates(jobs: list[Job]):
    """One line per measured job across its degrees, the options that vary, tokens/s, MFU and
    peak memory (a metric axis is left out when some job lacks it, e.g. MFU of an unknown GPU)."""
    go, _ = _go()
    done = measured(jobs)
    if not done:
        return None, "no job has steady-state figures yet"
    # A run from before the pipeline or context-parallel dim lacks it in its summary: it ran 1.
    dims = [
        _axis(name, [j.summary.get(name, 1 if name in LATER_DIMS else "?") for j in done])
        for name in DEGREES
    ]
    dims += [_axis(key, values) for key, values in _option_values(done).items()]
    metrics = {
        "tokens/s global": [j.summary.median_tps_global for j in done],
        "MFU %": [
            None if j.summary.median_mfu is None else 100 * j.summary.median_mfu for j in done
        ],
        "peak mem GiB": [j.summary.mem_peak_gib for j in done],
    }
    left_out = [name for name, values in metrics.items() if None in values]
    dims += [
        dict(label=name, values=values) for name, values in metrics.items() if name not in left_out
    ]
    fig = go.Figure(
        go.Parcoords(
            dimensions=dims,
            line=dict(
                color=metrics["tokens/s global"],
                colorscale="Viridis",
                showscale=True,
                colorbar=dict(title="tokens/s"),
            ),
        )
    )
    fig.update_layout(margin=dict(l=60, r=60, t=60, b=30))
    note = "drag along an axis to filter; colour = global tokens/s"
    if left_out:
        note += f"; left out (some job has none): {', '.join(left_out)}"
    return _style(fig, 420).update_layout(margin=dict(l=70, r=40, t=70, b=30)), note


def curves(jobs: list[Job]):
    """Loss and step time against step of every job that logged a step, overlaid, and the
    experts' balance (busiest expert's load over the mean, the largest over the MoE layers)
    when a job has experts; jobs that did not complete are dashed; validation losses
    (``trainer.val_every``) are dotted, with markers, beside their job's training loss."""
    go, make_subplots = _go()
    logged = sorted((j for j in jobs if j.records), key=lambda j: j.num)
    if not logged:
        return None, "no job has logged a step yet"
    panels = [
        ("loss", ".4f", "training loss (dotted: validation)"),
        ("step_time_s", ".3f", "step time s (log scale)"),
    ]
    if any(balance(j) for j in logged):
        panels.append((LOAD_KEY, ".3f", "experts: busiest load / mean (1 = balanced)"))
    fig = make_subplots(
        rows=len(panels),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=[title for _, _, title in panels],
    )
    palette = (
        "#1f77b4",
        "#e8710a",
        "#2ca02c",
        "#d62728",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
        "#bcbd22",
        "#17becf",
    )
    for i, job in enumerate(logged):
        name = job.label + ("" if job.status == "completed" else f" ({job.status})")
        line = dict(
            color=palette[i % len(palette)], dash="solid" if job.status == "completed" else "dash"
        )
        steps = [r["step"] for r in job.records]
        for row, (key, fmt, _) in enumerate(panels, start=1):
            fig.add_trace(
                go.Scatter(
                    x=steps,
                    y=[r.get(key) for r in job.records],
                    name=name,
                    legendgroup=name,
                    showlegend=row == 1,
                    mode="lines+markers",
                    line=line,
                    marker=dict(size=4),
                    hovertemplate=f"<b>{name}</b><br>step %{{x}}<br>{key} %{{y:{fmt}}}<extra></extra>",
                ),
                row=row,
                col=1,
            )
        val = [(r["step"], r["val_loss"]) for r in job.records if r.get("val_loss") is not None]
        if val:
            fig.add_trace(
                go.Scatter(
                    x=[s for s, _ in val],
                    y=[v for _, v in val],
                    name=f"{name} val",
                    legendgroup=name,
                    showlegend=False,
                    mode="lines+markers",
                    line={**line, "dash": "dot"},
                    marker=dict(size=7),
                    hovertemplate=f"<b>{name}</b><br>step %{{x}}<br>val_loss %{{y:.4f}}<extra></extra>",
                ),
                row=1,
                col=1,
            )
    fig.update_yaxes(type="log", row=2, col=1)
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    fig.update_layout(legend=dict(orientation="h", y=-0.15))
    return _style(
        fig, 310 * len(panels)
    ), "hover a line for its job; click a legend entry to hide it"


def communication(jobs: list[Job]):
    """MiB per step and rank of the counted step, stacked by ``<collective>/<mesh dim>``:
    measured next to the analytic model, per job."""
    go, _ = _go()
    counted = [j for j in jobs if j.summary.comm_measured is not None]
    if not counted:
        return None, "no job counted its communication (metrics.comm_step=null, or none ran)"
    keys = sorted(
        {
            k
            for j in counted
            for source in ("comm_measured", "comm_analytic")
            for k in (j.summary.get(source) or {})
        }
    )
    x = [[_short(j.label) for j in counted for _ in (0, 1)], ["measured", "model"] * len(counted)]
    fig = go.Figure()
    for key in keys:
        cells = [
            (j.summary.get(source) or {}).get(key, {})
            for j in counted
            for source in ("comm_measured", "comm_analytic")
        ]
        fig.add_trace(
            go.Bar(
                x=x,
                y=[c.get("bytes", 0) / MIB for c in cells],
                name=key,
                customdata=[c.get("calls", 0) for c in cells],
                hovertemplate=f"<b>{key}</b><br>%{{x}}<br>%{{y:,.3f}} MiB in %{{customdata}} calls"
                "<extra></extra>",
            )
        )
    fig.update_xaxes(tickangle=0)
    fig.update_layout(
        barmode="stack",
        yaxis_title="MiB per step and rank",
        legend=dict(title="collective/mesh dim"),
    )
    steps = sorted({j.summary.comm_step for j in counted} - {None})
    return _style(fig, 460), f"counted on step {', '.join(map(str, steps))}"


def predicted(jobs: list[Job], predictions: dict) -> tuple:
    """Predicted against measured tokens/s per device and peak memory, one point per measured
    job the plan predicts, with the diagonal and Spearman's rank correlation in the title."""
    go, make_subplots = _go()
    pairs = [
        (j, predictions[j.path])
        for j in measured(jobs)
        if j.path in predictions and predictions[j.path].get("valid", True)
    ]
    if not pairs:
        return None, "no measured job matches a layout of the plan"
    panels = (
        ("tps_per_device", "median_tps_per_device", "tokens/s per device"),
        ("mem_gib", "mem_peak_gib", "peak memory GiB"),
    )
    rhos = {}
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=[p[2] for p in panels]
    )
    for col, (want, got, title) in enumerate(panels, start=1):
        pts = [
            (p[want], j.summary.get(got), j)
            for j, p in pairs
            if p.get(want) is not None and j.summary.get(got) is not None
        ]
        rhos[title] = prediction.spearman([a for a, _, _ in pts], [b for _, b, _ in pts])
        fig.add_trace(
            go.Scatter(
                x=[a for a, _, _ in pts],
                y=[b for _, b, _ in pts],
                mode="markers+text",
                text=[j.label.split(" ", 1)[0] for _, _, j in pts],
                textposition="top center",
                customdata=[
                    f"{j.label} (predicted rank {predictions[j.path].get('rank')})"
                    for _, _, j in pts
                ],
                name=title,
                marker=dict(size=10),
                hovertemplate="%{customdata}<br>predicted %{x:,.4g}<br>measured %{y:,.4g}"
                "<extra></extra>",
            ),
            row=1,
            col=col,
        )
        span = [v for a, b, _ in pts for v in (a, b)] or [0, 1]
        fig.add_trace(
            go.Scatter(
                x=[min(span), max(span)],
                y=[min(span), max(span)],
                mode="lines",
                line=dict(dash="dot", color="grey"),
                name="measured = predicted",
                hoverinfo="skip",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text="predicted", row=1, col=col)
        fig.update_yaxes(title_text="measured", row=1, col=col)
    fig.update_layout(
        showlegend=False,
        title=" · ".join(
            f"Spearman ρ {title}: " + ("n/a" if rho is None else f"{rho:+.2f}")
            for title, rho in rhos.items()
        )
        + f" ({len(pairs)} jobs)",
    )
    return _style(fig, 460).update_layout(
        margin=dict(t=80)
    ), "ρ = +1: the plan ranks the layouts as they measured"
