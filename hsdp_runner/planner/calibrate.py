"""``python -m hsdp_runner.plan --calibrate <sweep dir>``: fit a cluster's figures to a sweep.

For every completed job of a planned sweep (its ``plan.source``), the plan says how its
predicted step splits into compute and exposed communication, and how much of that is
per-call latency. The measured steady-state step time, less the predicted step end (clipping
and AdamW, priced from a measured or datasheet memory bandwidth), is fitted by non-negative
least squares as ``a x compute + b x bandwidth time + c x latency time``; then the compute
efficiency becomes ``efficiency / a``, every bandwidth is divided by ``b`` (``link_scale``)
and every latency multiplied by ``c`` (``latency_scale``). On CPU the latency term also absorbs
the per-call dispatch cost of DTensor's collectives, which a bare collective does not show.
The fitted figures go into ``cluster_calibrated.yaml`` in the sweep dir (a new name if that
exists), which later plans read with ``cluster.calibration=<file>``. This is a fit: a plan
made with it and compared with the same sweep is no longer an independent check.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.report.prediction import predictions_for


def _solve(rows: list[list[float]], ys: list[float], cols: tuple[int, ...]) -> list[float] | None:
    """Least squares on the columns ``cols`` (normal equations, Gaussian elimination)."""
    n = len(cols)
    a = [
        [sum(r[i] * r[j] for r in rows) for j in cols] + [sum(r[i] * y for r, y in zip(rows, ys))]
        for i in cols
    ]
    scale = max(abs(a[k][k]) for k in range(n)) or 1.0
    for k in range(n):
        pivot = max(range(k, n), key=lambda r: abs(a[r][k]))
        if abs(a[pivot][k]) < 1e-12 * scale:  # collinear terms: a smaller subset decides
            return None
        a[k], a[pivot] = a[pivot], a[k]
        for r in range(n):
            if r != k:
                f = a[r][k] / a[k][k]
                a[r] = [x - f * y for x, y in zip(a[r], a[k])]
    return [a[k][n] / a[k][k] for k in range(n)]


def fit_nonnegative(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares for y = sum_k c_k x_k with few terms: the best fit over every
    subset of terms whose solution is non-negative (written out because numpy/scipy are not
    dependencies and three terms make the exhaustive search trivial)."""
    width = len(rows[0])
    best, best_res = [0.0] * width, float("inf")
    for mask in range(1, 1 << width):
        cols = tuple(k for k in range(width) if mask >> k & 1)
        sol = _solve(rows, ys, cols)
        if sol is None or min(sol) < 0:
            continue
        coef = [0.0] * width
        for k, v in zip(cols, sol):
            coef[k] = v
        res = sum((y - sum(c * x for c, x in zip(coef, r))) ** 2 for r, y in zip(rows, ys))
        if res < best_res:
            best, best_res = coef, res
    return best


def _terms(entry: dict) -> list[float]:
    """(compute, exposed bandwidth time, exposed latency time) of a plan entry: the exposed
    communication split in the proportion of latency to bandwidth in all of it."""
    exposed = sum(entry["exposed_comm_s"].values())
    total = entry["comm_total_s"] or 1.0
    latency = exposed * entry["comm_latency_s"] / total
    return [entry["compute_s"], exposed - latency, latency]


def calibrate(sweep_dir: Path, plan_file: Path | None = None) -> str:
    """Fit and write the calibration file for ``sweep_dir``; return a report for the console.

    Predictions come from each job's ``plan.source``, or from ``plan_file`` for a sweep the
    planner did not write.
    """
    from hsdp_runner.report.runs import load_jobs

    jobs = (
        [
            j
            for j in load_jobs(sweep_dir)
            if j.status is RunStatus.completed and j.summary.median_step_time_s
        ]
        if sweep_dir.is_dir()
        else []
    )
    found = predictions_for([j.path for j in jobs], plan_file)
    pairs = [(found[j.path], j.summary.median_step_time_s) for j in jobs if j.path in found]
    if len(pairs) < 2:
        raise ConfigError(
            f"--calibrate {sweep_dir}: {len(pairs)} completed job(s) with a "
            "prediction (plan.source, or --plan FILE); run a sweep written by "
            "plan.write_sweep with at least 2 layouts first"
        )
    # The step end is priced from a measured bandwidth and not fitted: it comes off first.
    a, b, c = fit_nonnegative(
        [_terms(e) for e, _ in pairs], [m - e.get("step_end_s", 0.0) for e, m in pairs]
    )
    if a <= 0:
        raise ConfigError(
            f"--calibrate {sweep_dir}: the measured times do not grow with "
            "compute; the sweep cannot calibrate the efficiency"
        )
    source = plan_file or next(j.config["plan"]["source"] for j in jobs if j.path in found)
    plan = json.loads(Path(source).read_text())
    cluster = plan["cluster"]
    # A term the fit drops (coefficient 0) keeps its old figure rather than becoming free.
    fitted = {
        "compute_efficiency": cluster["compute_efficiency"] / a,
        "link_scale": cluster["link_scale"] / b if b > 0 else cluster["link_scale"],
        "latency_scale": cluster["latency_scale"] * c if c > 0 else cluster["latency_scale"],
    }
    path = _fresh(sweep_dir / "cluster_calibrated.yaml")
    header = (
        f"# Fitted by python -m hsdp_runner.plan --calibrate {sweep_dir} to {len(pairs)} "
        f"jobs on cluster {cluster['name']}\n# use: python -m hsdp_runner.plan "
        f"cluster={cluster['name']} cluster.calibration={path.resolve()}\n"
    )
    path.write_text(header + yaml.safe_dump(fitted, sort_keys=False))
    return (
        f"calibrate: compute x {a:.3g}, bandwidth time x {b:.3g}, latency time x {c:.3g} "
        f"over {len(pairs)} jobs -> "
        f"compute_efficiency {fitted['compute_efficiency']:.3g}, link_scale "
        f"{fitted['link_scale']:.3g}, latency_scale {fitted['latency_scale']:.3g}; wrote "
        f"{path}\nuse it: python -m hsdp_runner.plan cluster={cluster['name']} "
        f"cluster.calibration={path.resolve()}"
    )


def _fresh(path: Path) -> Path:
    """``path`` if free, else ``<stem>_<n><suffix>`` with the first free n (never overwrite)."""
    n = 1
    candidate = path
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}_{n}{path.suffix}")
        n += 1
    return candidate
