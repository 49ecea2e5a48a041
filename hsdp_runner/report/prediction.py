"""Predicted next to measured: which plan.json layout a job is, and how well the plan ranked.

A job's prediction is the layout in its plan.json (``plan.source`` in the job's resolved
config, or a file named with ``compare --plan``) whose every ``overrides`` key equals the job's
resolved config value at that dotted key (a degree the job left at -1 is read from the mesh
shape in its summary.json). ``compare`` calls ``comparison_section`` for the
predicted-vs-measured table: per job the predicted and measured steady-state step time, the
error, both ranks, and for the sweep Spearman's rank correlation, whether the measured best is
in the predicted top 2, and the median absolute error; and per job the predicted memory per
rank next to the measured one (the largest rank's peak of tensor memory added since just before
the model was built, ``measured_memory_gib``), with the error against the 15% target.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import yaml

from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.records import RunSummary
from hsdp_runner.distributed.parallel_dims import DIM_NAMES
from hsdp_runner.distributed.pipeline_settings import PIPELINE_KEYS, PipelineSettings
from hsdp_runner.distributed.world_mesh import LATER_DIMS, full_shape

RESOLVED_CONFIG_FILE = "config_resolved.yaml"
MEMORY_TARGET = 0.15  # the planner's memory target: |predicted / measured - 1| <= 15%


def _select(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _load_plan(path: Path, cache: dict) -> dict | None:
    if path not in cache:
        cache[path] = json.loads(path.read_text()) if path.is_file() else None
    return cache[path]


def predictions_for(job_dirs: list[Path], plan_file: Path | None = None) -> dict[Path, dict]:
    """Map each job dir that has a prediction to its plan.json layout entry.

    The plan is ``plan_file`` when given, else the job's ``plan.source``; jobs without a plan
    or without a matching layout are left out.
    """
    cache: dict = {}
    out = {}
    for job in job_dirs:
        job = Path(job)
        path = job / RESOLVED_CONFIG_FILE
        config = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
        source = plan_file or _select(config, "plan.source")
        plan = _load_plan(Path(source), cache) if source else None
        entry = (
            layout_of(plan, _job_values(config, (RunSummary.read(job) or RunSummary()).mesh_shape))
            if plan
            else None
        )
        if entry is not None:
            out[job] = entry
    return out


def layout_of(plan: dict, values) -> dict | None:
    """The plan.json layout entry whose every override equals ``values(key)``, or None."""
    for entry in plan.get("layouts", []):
        if all(values(k) == v for k, v in entry["overrides"].items()):
            return entry
    return None


def job_prediction(config: dict, summary: RunSummary) -> dict | None:
    """Predicted next to measured for one job whose config names a plan (``plan.source``):
    the plan, the layout's predicted rank and, per figure (steady-state step time,
    tokens/s/device, tensor memory per rank: ``measured_memory_gib``), the predicted and
    measured values and the error (predicted / measured - 1). An auto job's
    (``parallel.auto``) also names the runner-up. None without a plan or a matching layout."""
    source = _select(config, "plan.source")
    path = Path(source) if source else None
    plan = json.loads(path.read_text()) if path is not None and path.is_file() else None
    entry = layout_of(plan, _job_values(config, summary.mesh_shape)) if plan else None
    if entry is None or not entry.get("valid"):
        return None
    measured = {
        "step_time_s": summary.median_step_time_s,
        "tps_per_device": summary.median_tps_per_device,
        "mem_gib": measured_memory_gib(summary),
    }
    figures = {
        name: {
            "predicted": entry[name],
            "measured": value,
            "error": entry[name] / value - 1 if value else None,
        }
        for name, value in measured.items()
    }
    out = {
        "source": str(path),
        "cluster": plan["cluster"]["name"],
        "rank": entry["rank"],
        "layout": entry.get("layout"),
        "dominant": entry["dominant"],
        "figures": figures,
    }
    if _select(config, "parallel.auto"):
        fitting = [e for e in plan["layouts"] if e["valid"] and e["fits"] and e is not entry]
        out["runner_up"] = (
            {
                k: fitting[0][k]
                for k in ("overrides", "layout", "step_time_s", "tps_per_device", "mem_gib")
            }
            if fitting
            else None
        )
    return out


def _job_values(config: dict, shape: list | None):
    """Dotted key -> the job's value; a degree left at -1 (inferred) reads the degree the run
    used from summary.json's ``mesh_shape``, and the pipeline settings left unset
    (``parallel.pp_microbatches: null``) what they resolved to (``PipelineSettings``), as a
    plan row states them."""
    if shape:  # written before the pp or cp dims existed: 1 there
        shape = full_shape(shape)

    def value(key: str):
        found = _select(config, key)
        name = key.removeprefix("parallel.")
        if found == -1 and shape and name in DIM_NAMES:
            return shape[DIM_NAMES.index(name)]
        if found is None and name in LATER_DIMS:  # a job config from before the dim
            return 1
        if found is None and name in PIPELINE_KEYS and value("parallel.pp") > 1:
            unset = {k: _select(config, f"parallel.{k}") for k in PIPELINE_KEYS}
            return PipelineSettings.from_config(unset, value("parallel.pp")).describe()[name]
        return found

    return value


def _plain(value):
    """A resolved setting as a plan row writes it: a choice (an Enum) as its string."""
    return getattr(value, "value", value)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(xs, ys) -> float | None:
    """Spearman's rank correlation of two equal-length sequences; None below 2 points or
    when either side has no spread."""
    xs, ys = list(xs), list(ys)
    if len(xs) != len(ys) or len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return None if not sxx or not syy else sxy / (sxx * syy) ** 0.5


def evaluate(pairs: list[tuple[str, dict, float]]) -> dict:
    """Figures of merit of (label, layout entry, measured step s) pairs of completed jobs."""
    predicted = [p["step_time_s"] for _, p, _ in pairs]
    measured = [m for _, _, m in pairs]
    errors = [(p - m) / m for p, m in zip(predicted, measured)]
    best = min(range(len(pairs)), key=lambda i: measured[i]) if pairs else None
    top2 = sorted(range(len(pairs)), key=lambda i: predicted[i])[:2]
    return {
        "jobs": len(pairs),
        "spearman": spearman(predicted, measured),
        "median_abs_error": statistics.median(abs(e) for e in errors) if errors else None,
        "best_in_predicted_top2": best in top2 if pairs else None,
        "errors": errors,
    }


def measured_memory_gib(summary: RunSummary) -> float | None:
    """The memory a job's training added, in GiB, the largest over ranks: the peak of tensor
    memory since just before the model was built (``mem_tensor_peak_gib_per_rank``,
    ``tensor_memory.TensorMemoryMeter``); for a job that recorded none, the peak
    (``mem_peak_gib_per_rank``) minus the baseline (``mem_baseline_gib_per_rank``); None for a
    job that recorded neither."""
    tensor_peaks = [p for p in summary.mem_tensor_peak_gib_per_rank or [] if p is not None]
    if tensor_peaks:
        return max(tensor_peaks)
    peaks, bases = summary.mem_peak_gib_per_rank, summary.mem_baseline_gib_per_rank
    if not peaks or not bases or len(peaks) != len(bases):
        return None
    return max(p - b for p, b in zip(peaks, bases))


def memory_figures(pairs: list[tuple[str, float, float | None]]) -> dict:
    """Figures of (label, predicted GiB, measured GiB or None) pairs: per-job errors (None
    where nothing was measured), the median and largest absolute error and how many jobs lie
    within ``MEMORY_TARGET``."""
    errors = [None if not m else p / m - 1 for _, p, m in pairs]
    known = [abs(e) for e in errors if e is not None]
    return {
        "errors": errors,
        "jobs": len(known),
        "median_abs_error": statistics.median(known) if known else None,
        "max_abs_error": max(known) if known else None,
        "within_target": sum(e <= MEMORY_TARGET for e in known),
    }


def memory_summary(figures: dict) -> str:
    """One sentence on the memory figures against the target."""
    if not figures["jobs"]:
        return (
            "Memory: no job recorded its tensor peak (mem_tensor_peak_gib_per_rank) or its "
            "baseline before the model was built; rerun the jobs to compare memory."
        )
    return (
        f"Memory per rank (predicted vs measured tensor peak since the model was built): "
        f"median |error| "
        f"{figures['median_abs_error']:.0%}, largest {figures['max_abs_error']:.0%}; "
        f"{figures['within_target']} of {figures['jobs']} jobs within "
        f"{MEMORY_TARGET:.0%} (target: all)."
    )


def comparison_section(jobs, plan_file: Path | None = None) -> str:
    """Markdown for compare.md: predicted vs measured per job and the sweep's figures.

    ``jobs``: compare.Job objects (``path``, ``label``, ``status``, ``summary``). Empty string
    when no job has a prediction.
    """
    found = predictions_for([j.path for j in jobs], plan_file)
    pairs = [
        (j.label, found[j.path], j.summary.median_step_time_s)
        for j in jobs
        if j.path in found and j.status is RunStatus.completed and j.summary.median_step_time_s
    ]
    if not found:
        return ""
    figures = evaluate(pairs)
    summaries = {j.label: j.summary for j in jobs}
    mem_pairs = [
        (label, entry["mem_gib"], measured_memory_gib(summaries[label]))
        for label, entry, _ in pairs
    ]
    memory = memory_figures(mem_pairs)
    measured_rank = {
        label: i + 1 for i, (label, _, _) in enumerate(sorted(pairs, key=lambda p: p[2]))
    }
    rows = [
        "| job | predicted rank | measured rank | predicted step s | measured step s "
        "| error | predicted mem GiB | measured mem GiB (tensor peak) | mem error "
        "| dominant (predicted) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (label, entry, measured), error, (_, _, mem), mem_error in zip(
        pairs, figures["errors"], mem_pairs, memory["errors"]
    ):
        rows.append(
            f"| {label} | {entry['rank']} | {measured_rank[label]} | "
            f"{entry['step_time_s']:.4g} | {measured:.4g} | {error:+.0%} | "
            f"{entry['mem_gib']:.3g} | {'n/a' if mem is None else f'{mem:.3g}'} | "
            f"{'n/a' if mem_error is None else f'{mem_error:+.0%}'} | "
            f"{entry['dominant']} |"
        )
    rho, med = figures["spearman"], figures["median_abs_error"]
    summary = (
        f"Spearman's rank correlation (predicted vs measured step time): "
        f"{'n/a' if rho is None else f'{rho:.2f}'}; measured best in the predicted top 2: "
        f"{figures['best_in_predicted_top2']}; median absolute step-time error: "
        f"{'n/a' if med is None else f'{med:.0%}'} ({figures['jobs']} completed jobs with "
        "a prediction)."
    )
    return (
        "## Predicted vs measured\n\n"
        + "\n".join(rows)
        + "\n\n"
        + summary
        + "\n\n"
        + memory_summary(memory)
        + "\n"
    )
