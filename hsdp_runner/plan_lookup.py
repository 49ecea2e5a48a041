"""Which planner prediction belongs to which job, and the rank correlation of two lists.

The dashboard's copy of the planner contract's two functions (same names, signatures and
rules as ``hsdp_runner/prediction.py``'s, which replaces this module when both exist):
- a job's plan is ``plan_file`` when given, else the ``plan.source`` of its resolved config;
- its prediction is the layout in that ``plan.json`` whose every ``overrides`` key equals the
  job's resolved config value at that dotted key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from hsdp_runner import tracking


_MISSING = object()


def _dotted(config: dict, key: str):
    """The value at ``a.b.c`` in a nested dict; a ``_MISSING`` sentinel when a level is absent."""
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _same(planned, actual) -> bool:
    # A config-group choice (``precision: bf16``) resolves to the group's dict, named by its
    # ``name`` key; the plan may name the choice by that string.
    if isinstance(actual, dict) and isinstance(planned, str):
        return actual.get("name") == planned
    return planned == actual


def _plan(path: Path, cache: dict) -> dict | None:
    if path not in cache:
        try:
            cache[path] = json.loads(path.read_text())
        except (OSError, ValueError):
            cache[path] = None
    return cache[path]


def predictions_for(job_dirs: list[Path], plan_file: Path | None = None) -> dict[Path, dict]:
    """Return {job dir: its layout entry of the plan} for the jobs a plan predicts.

    Takes the job dirs and an optional ``plan.json`` that overrides each job's
    ``plan.source``. Jobs without a plan, with an unreadable one or matching no layout are
    left out; a job matching several layouts gets the first.
    """
    cache: dict = {}
    found = {}
    for job_dir in job_dirs:
        path = Path(job_dir) / tracking.RESOLVED_CONFIG_FILE
        config = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
        source = plan_file or (config.get("plan") or {}).get("source")
        plan = _plan(Path(source), cache) if source else None
        for layout in (plan or {}).get("layouts", []):
            overrides = layout.get("overrides") or {}
            if overrides and all(_same(v, _dotted(config, k)) for k, v in overrides.items()):
                found[Path(job_dir)] = layout
                break
    return found


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs, ys) -> float | None:
    """Spearman's rank correlation of two equally long sequences of numbers (ties averaged).

    Returns None for fewer than two pairs or when either side is constant. Written here
    rather than taken from scipy, which the project does not otherwise need.
    """
    xs, ys = list(xs), list(ys)
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs equally long sequences, got {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return None if var == 0 else cov / var
