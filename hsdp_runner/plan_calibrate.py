"""``python -m hsdp_runner.plan --calibrate <sweep dir>``: fit a cluster's figures to a sweep.

For every completed job of a planned sweep (its ``plan.source``), the plan says how its
predicted step splits into compute and exposed communication. The measured steady-state step
time is fitted by least squares (non-negative, two coefficients) as
``measured = a x compute + b x communication``; then the compute efficiency becomes
``efficiency / a`` and every bandwidth is divided by ``b``, every latency multiplied by it.
The fitted figures go into ``cluster_calibrated.yaml`` in the sweep dir (a new name if that
exists), which later plans read with ``cluster.calibration=<file>``. This is a fit: a plan
made with it and compared with the same sweep is no longer an independent check.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from hsdp_runner.config import ConfigError
from hsdp_runner.prediction import predictions_for


def fit_two(xs: list[tuple[float, float]], ys: list[float]) -> tuple[float, float]:
    """Non-negative least squares for y = a x0 + b x1 (two unknowns, solved directly)."""
    s00 = sum(x[0] * x[0] for x in xs)
    s01 = sum(x[0] * x[1] for x in xs)
    s11 = sum(x[1] * x[1] for x in xs)
    t0 = sum(x[0] * y for x, y in zip(xs, ys))
    t1 = sum(x[1] * y for x, y in zip(xs, ys))
    det = s00 * s11 - s01 * s01
    if det > 1e-30 * max(s00 * s11, 1e-300):
        a, b = (t0 * s11 - t1 * s01) / det, (t1 * s00 - t0 * s01) / det
        if a >= 0 and b >= 0:
            return a, b
    # One coefficient at zero: keep the single-term fit with the smaller residual.
    only_a = (t0 / s00 if s00 else 0.0, 0.0)
    only_b = (0.0, t1 / s11 if s11 else 0.0)

    def residual(ab):
        return sum((y - ab[0] * x[0] - ab[1] * x[1]) ** 2 for x, y in zip(xs, ys))
    return min((only_a, only_b), key=residual)


def calibrate(sweep_dir: Path, plan_file: Path | None = None) -> str:
    """Fit and write the calibration file for ``sweep_dir``; return a report for the console.

    Predictions come from each job's ``plan.source``, or from ``plan_file`` for a sweep the
    planner did not write.
    """
    from hsdp_runner.compare import load_jobs

    jobs = [j for j in load_jobs(sweep_dir) if j.status == "completed"
            and j.summary.get("median_step_time_s")] if sweep_dir.is_dir() else []
    found = predictions_for([j.path for j in jobs], plan_file)
    pairs = [(found[j.path], j.summary["median_step_time_s"]) for j in jobs if j.path in found]
    if len(pairs) < 2:
        raise ConfigError(f"--calibrate {sweep_dir}: {len(pairs)} completed job(s) with a "
                          "prediction (plan.source, or --plan FILE); run a sweep written by "
                          "plan.write_sweep with at least 2 layouts first")
    xs = [(e["compute_s"], sum(e["exposed_comm_s"].values())) for e, _ in pairs]
    a, b = fit_two(xs, [m for _, m in pairs])
    if a <= 0:
        raise ConfigError(f"--calibrate {sweep_dir}: the measured times do not grow with "
                          "compute; the sweep cannot calibrate the efficiency")
    source = plan_file or next(j.config["plan"]["source"] for j in jobs if j.path in found)
    plan = json.loads(Path(source).read_text())
    cluster = plan["cluster"]
    fitted = {"compute_efficiency": cluster["compute_efficiency"] / a,
              "link_scale": cluster.get("link_scale", 1.0) / b if b > 0 else
              cluster.get("link_scale", 1.0),
              "latency_scale": cluster.get("latency_scale", 1.0) * b if b > 0 else
              cluster.get("latency_scale", 1.0)}
    path = _fresh(sweep_dir / "cluster_calibrated.yaml")
    header = (f"# Fitted by python -m hsdp_runner.plan --calibrate {sweep_dir} to {len(pairs)} "
              f"jobs on cluster {cluster['name']}\n# use: python -m hsdp_runner.plan "
              f"cluster={cluster['name']} cluster.calibration={path.resolve()}\n")
    path.write_text(header + yaml.safe_dump(fitted, sort_keys=False))
    return (f"calibrate: compute x {a:.3g}, communication x {b:.3g} over {len(pairs)} jobs -> "
            f"compute_efficiency {fitted['compute_efficiency']:.3g}, link_scale "
            f"{fitted['link_scale']:.3g}, latency_scale {fitted['latency_scale']:.3g}; wrote "
            f"{path}\nuse it: python -m hsdp_runner.plan cluster={cluster['name']} "
            f"cluster.calibration={path.resolve()}")


def _fresh(path: Path) -> Path:
    """``path`` if free, else ``<stem>_<n><suffix>`` with the first free n (never overwrite)."""
    n = 1
    candidate = path
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}_{n}{path.suffix}")
        n += 1
    return candidate
