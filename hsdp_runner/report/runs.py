"""The finished runs of a sweep (or one job), read back: ``Job``, ``load_jobs`` and the job table.

Reads what every job dir holds (``summary.json``, ``metrics.jsonl``, ``config_resolved.yaml``
and Hydra's ``.hydra/overrides.yaml``), never W&B and never the trainer. ``compare`` (markdown
and plots) and the ``compare.html`` dashboard both build on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.records import RunSummary, precision_label
from hsdp_runner.distributed.parallel_dims import DIM_NAMES
from hsdp_runner.distributed.world_mesh import LATER_DIMS, full_shape
from hsdp_runner.train import sinks


@dataclass
class Job:
    """One job dir of a sweep, as its files describe it."""

    path: Path
    num: int
    overrides: list[str]
    config: dict
    summary: RunSummary  # empty (status None) while the job has no summary.json
    records: list[dict]
    label: str = field(default="")

    @property
    def status(self) -> RunStatus:
        """completed / interrupted / failed / skipped, or unfinished without a summary."""
        return self.summary.status or RunStatus.unfinished

    @property
    def tps_global(self) -> float | None:
        return self.summary.median_tps_global


# libyaml's parser where PyYAML was built with it: the live dashboard reads every job's
# files again after each job of a sweep, and the pure-Python parser made that the sweep's
# largest cost after Hydra's composition (~10 ms a resolved config).
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_yaml(path: Path):
    """The YAML document at ``path`` as plain Python data, None where there is no file."""
    return yaml.load(path.read_text(), Loader=_SAFE_LOADER) if path.exists() else None


def load_jobs(sweep_dir: Path) -> list[Job]:
    """Return the sweep's jobs, sorted by throughput: completed fastest first, then
    interrupted, failed, skipped, unfinished. A job dir is one Hydra wrote ``.hydra/`` into,
    at any depth (an override value with a ``/`` nests the dir Hydra names after the
    overrides)."""
    jobs = []
    for path in sorted({p.parent for p in sweep_dir.rglob(".hydra")}):
        parts = path.relative_to(sweep_dir).parts  # () when sweep_dir is one job's dir
        prefix = parts[0].split("_", 1)[0] if parts else ""
        jobs.append(
            Job(
                path=path,
                num=int(prefix) if prefix.isdigit() else len(jobs),
                overrides=_read_yaml(path / ".hydra" / "overrides.yaml") or [],
                config=_read_yaml(path / sinks.RESOLVED_CONFIG_FILE) or {},
                summary=RunSummary.read(path) or RunSummary(),
                records=sinks.read_metrics(path),
            )
        )
    _label(jobs)
    jobs.sort(key=lambda j: (j.status.rank, -(j.tps_global or 0.0), j.num))
    return jobs


def _label(jobs: list[Job]) -> None:
    """Name each job by the overrides that differ between the sweep's jobs."""
    common = set.intersection(*(set(j.overrides) for j in jobs)) if len(jobs) > 1 else set()
    for job in jobs:
        own = [o.removeprefix("parallel.") for o in job.overrides if o not in common]
        job.label = f"#{job.num} " + (" ".join(own) or "(base config)")


def _num(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _spread(summary: RunSummary, key: str) -> str:
    median = summary.get(f"median_{key}")
    if median is None:
        return "—"
    low, high = summary.get(f"min_{key}"), summary.get(f"max_{key}")
    spread = f" ({low:,.0f}–{high:,.0f})" if low is not None and high is not None else ""
    return f"{median:,.0f}{spread}"


def _first_line(text: str, limit: int = 240) -> str:
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _mfu(job: Job) -> str:
    if job.status is not RunStatus.completed:
        return "—"
    mfu = job.summary.median_mfu
    return "n/a" if mfu is None else f"{100 * mfu:.2f}%"


def _comm(summary: RunSummary) -> str:
    """Measured collective bytes of the counted step and their ratio to the analytic model."""
    measured, ratio = summary.comm_bytes_measured, summary.comm_ratio
    if measured is None:
        return "—"
    return f"{measured / 2**20:,.2f}" + ("" if ratio is None else f" (×{ratio:.3f})")


def _status(job: Job) -> str:
    s = job.summary
    if job.status is RunStatus.completed:
        return "ok"
    if job.status is RunStatus.skipped:
        return "skipped: " + _first_line(s.reason or "")
    if job.status is RunStatus.failed:
        return f"failed (rank {s.failed_rank}): " + _first_line(s.error or "")
    if job.status is RunStatus.interrupted:
        return f"interrupted at step {s.interrupted_at_step} ({s.signal})"
    return "unfinished (no summary.json)"


def degrees(job: Job) -> tuple[str, str, str]:
    """(layout, 'r x s x c x t', world size) from the run's mesh, or the asked-for degrees;
    a pipeline's stages lead as 'pp2 r x s x c x t', expert parallel follows as
    'r x s x c x t ep2' (it borrows ranks of s x c x t: not a mesh dim of its own).

    A run from before the pipeline or context-parallel dims (a mesh without them, no
    ``parallel.pp`` / ``parallel.cp``) had 1 there, and one from before ``parallel.ep`` ep 1.
    """
    s = job.summary
    if s.mesh_shape is not None:
        shape = _shape_text(full_shape(s.mesh_shape)) + _ep_text(s.ep)
        return s.layout, shape, str(s.world_size)
    parallel = job.config.get("parallel") or {}
    asked = s.requested_degrees or parallel
    shape = [asked.get(k, 1 if k in LATER_DIMS else "?") for k in DIM_NAMES]
    return "—", _shape_text(shape) + _ep_text(asked.get("ep", parallel.get("ep"))), "—"


def _ep_text(ep) -> str:
    """' ep<n>' for an expert-parallel degree other than 1 (None: a run without the key)."""
    return "" if ep in (None, 1) else f" ep{ep}"


def _shape_text(shape: list) -> str:
    """'r x s x c x t' of a ``DIM_NAMES``-ordered shape, led by 'pp<n> ' when pp is not 1."""
    pp, rest = shape[0], "×".join(map(str, shape[1:]))
    return rest if pp == 1 else f"pp{pp} {rest}"


def _precision(job: Job) -> str:
    parallel = job.config.get("parallel") or {}
    return precision_label(
        job.config.get("precision") or {},
        bool(parallel.get("compile")),
        parallel.get("compile_backend") or "inductor",  # runs from before the key: inductor
    )


# The job table's columns: heading, the cell's text, the value it sorts by (the job's own
# figures, so a reader of the table never parses its text back). compare.md and compare.html
# both render these.
Column = tuple[str, Callable[[Job], str], Callable[[Job], float | str | None]]
COLUMNS: tuple[Column, ...] = (
    ("job", lambda j: _first_line(j.label), lambda j: j.num),
    ("layout", lambda j: degrees(j)[0], lambda j: degrees(j)[0]),
    ("degrees (rep×shard×cp×tp)", lambda j: degrees(j)[1], lambda j: degrees(j)[1]),
    ("world", lambda j: degrees(j)[2], lambda j: j.summary.world_size),
    ("precision", _precision, _precision),
    (
        "comm MiB/step/rank (measured ÷ model)",
        lambda j: _comm(j.summary),
        lambda j: j.summary.comm_bytes_measured,
    ),
    (
        "tok/s/device (min–max)",
        lambda j: _spread(j.summary, "tps_per_device"),
        lambda j: j.summary.median_tps_per_device,
    ),
    (
        "tok/s global (min–max)",
        lambda j: _spread(j.summary, "tps_global"),
        lambda j: j.summary.median_tps_global,
    ),
    ("MFU", _mfu, lambda j: j.summary.median_mfu if j.status is RunStatus.completed else None),
    (
        "peak mem GiB",
        lambda j: _num(j.summary.mem_peak_gib, ".2f"),
        lambda j: j.summary.mem_peak_gib,
    ),
    (
        "step s",
        lambda j: _num(j.summary.median_step_time_s, ".3g"),
        lambda j: j.summary.median_step_time_s,
    ),
    # The last validation (trainer.val_every): equal across layouts of one model and data.
    ("val loss", lambda j: _num(j.summary.val_loss, ".4f"), lambda j: j.summary.val_loss),
    ("status", _status, lambda j: j.status.rank),
)


# The balance figures the runtime logs each step for a model with experts (expert_balance).
LOAD_KEY, AUX_KEY = "moe/load_max_over_mean", "moe/aux_loss"


def balance(job: Job) -> tuple[float, float | None] | None:
    """(busiest expert's load over the mean, auxiliary loss) at the job's last step that
    logged them (the largest over its MoE layers), or None for a model without experts."""
    last = next((r for r in reversed(job.records) if LOAD_KEY in r), None)
    return None if last is None else (last[LOAD_KEY], last.get(AUX_KEY))


def _balance_text(job: Job) -> str:
    figures = balance(job)
    if figures is None:
        return "—"
    load, aux = figures
    return f"{load:.2f}" + ("" if aux is None else f" (aux {aux:.3g})")


# Shown only for a sweep with a model with experts (``columns``).
BALANCE_COLUMN: Column = (
    "expert load max/mean (aux loss), last step",
    _balance_text,
    lambda j: (balance(j) or (None,))[0],
)


def columns(jobs: list[Job]) -> tuple[Column, ...]:
    """The table's columns for ``jobs``: ``COLUMNS``, and the experts' balance before the
    status when a job logged it."""
    if not any(balance(j) for j in jobs):
        return COLUMNS
    return (*COLUMNS[:-1], BALANCE_COLUMN, COLUMNS[-1])


def best(jobs: list[Job]) -> Job | None:
    """The job marked best: the first of ``jobs`` (``load_jobs``' order) when it completed."""
    return jobs[0] if jobs and jobs[0].status is RunStatus.completed else None


def cells(job: Job, cols: tuple[Column, ...] = COLUMNS) -> list[tuple[str, float | str | None]]:
    """One job's row: (text, sort value) per column of ``cols`` (``columns(jobs)``)."""
    return [(text(job), key(job)) for _, text, key in cols]


def table(jobs: list[Job]) -> str:
    """Return the markdown table: one row per job, in ``jobs`` order, the best job in bold."""
    cols = columns(jobs)
    head = "| " + " | ".join(name for name, _, _ in cols) + " |"
    rows = [head, "|" + "---|" * len(cols)]
    for job in jobs:
        texts = [text.replace("|", "\\|") for text, _ in cells(job, cols)]
        if job is best(jobs):
            texts[0] = f"**{texts[0]} (best)**"
        rows.append("| " + " | ".join(texts) + " |")
    return "\n".join(rows)
