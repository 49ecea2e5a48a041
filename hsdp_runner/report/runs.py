"""The finished runs of a sweep (or one job), read back: ``Job``, ``load_jobs`` and the job table.

Reads what every job dir holds (``summary.json``, ``metrics.jsonl``, ``config_resolved.yaml``
and Hydra's ``.hydra/overrides.yaml``), never W&B and never the trainer. ``compare`` (markdown
and plots) and the ``compare.html`` dashboard both build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hsdp_runner.core.records import RunSummary
from hsdp_runner.train import sinks as tracking

ORDER = {"completed": 0, "interrupted": 1, "failed": 2, "skipped": 3, "unfinished": 4}


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
    def status(self) -> str:
        """completed / interrupted / failed / skipped, or unfinished without a summary."""
        return self.summary.status or "unfinished"

    @property
    def tps_global(self) -> float | None:
        return self.summary.median_tps_global


def _read_yaml(path: Path):
    return yaml.safe_load(path.read_text()) if path.exists() else None


def load_jobs(sweep_dir: Path) -> list[Job]:
    """Return the sweep's jobs, sorted by throughput: completed fastest first, then
    interrupted, failed, skipped, unfinished. A job dir is one Hydra wrote ``.hydra/`` into,
    at any depth (an override value with a ``/`` nests the dir Hydra names after the
    overrides)."""
    jobs = []
    for path in sorted({p.parent for p in sweep_dir.rglob(".hydra")}):
        parts = path.relative_to(sweep_dir).parts  # () when sweep_dir is one job's dir
        prefix = parts[0].split("_", 1)[0] if parts else ""
        jobs.append(Job(path=path, num=int(prefix) if prefix.isdigit() else len(jobs),
                        overrides=_read_yaml(path / ".hydra" / "overrides.yaml") or [],
                        config=_read_yaml(path / tracking.RESOLVED_CONFIG_FILE) or {},
                        summary=RunSummary.read(path) or RunSummary(),
                        records=tracking.read_metrics(path)))
    _label(jobs)
    jobs.sort(key=lambda j: (ORDER.get(j.status, len(ORDER)), -(j.tps_global or 0.0), j.num))
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


def _cell(text: str, limit: int = 240) -> str:
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    line = line if len(line) <= limit else line[:limit - 1] + "…"
    return line.replace("|", "\\|")


def _mfu(job: Job) -> str:
    if job.status != "completed":
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
    if job.status == "completed":
        return "ok"
    if job.status == "skipped":
        return "skipped: " + _cell(s.reason or "")
    if job.status == "failed":
        return f"failed (rank {s.failed_rank}): " + _cell(s.error or "")
    if job.status == "interrupted":
        return f"interrupted at step {s.interrupted_at_step} ({s.signal})"
    return "unfinished (no summary.json)"


def degrees(job: Job) -> tuple[str, str, str]:
    """(layout, 'r x s x t', world size) from the run's mesh, or the asked-for degrees."""
    s = job.summary
    if s.mesh_shape is not None:
        return s.layout, "×".join(map(str, s.mesh_shape)), str(s.world_size)
    asked = s.requested_degrees or job.config.get("parallel") or {}
    shape = "×".join(str(asked.get(k, "?")) for k in ("dp_replicate", "dp_shard", "tp"))
    return "—", shape, "—"


def table(jobs: list[Job]) -> str:
    """Return the markdown table: one row per job, in ``jobs`` order, the first ok job marked."""
    head = ("| job | layout | degrees (rep×shard×tp) | world | precision | comm MiB/step/rank "
            "(measured ÷ model) | tok/s/device "
            "(min–max) | tok/s global (min–max) | MFU | peak mem GiB | step s | status |")
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for i, job in enumerate(jobs):
        s = job.summary
        layout, shape, world = degrees(job)
        name = _cell(job.label)
        if i == 0 and job.status == "completed":
            name = f"**{name} (best)**"
        rows.append(" | ".join([
            f"| {name}", layout, shape, world,
            (job.config.get("precision") or {}).get("name", "?"), _comm(s),
            _spread(s, "tps_per_device"), _spread(s, "tps_global"),
            _mfu(job),
            _num(s.mem_peak_gib, ".2f"), _num(s.median_step_time_s, ".3g"),
            _status(job)]) + " |")
    return "\n".join(rows)
