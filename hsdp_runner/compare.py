"""``python -m hsdp_runner.compare <sweep dir>``: one table and two plots from a finished sweep.

Reads what every job dir of a multirun holds (``summary.json``, ``metrics.jsonl``,
``config_resolved.yaml`` and Hydra's ``.hydra/overrides.yaml``), never W&B and never the
trainer, so it works offline and on a laptop. Writes into the sweep dir:
- ``compare.md``: one row per job, sorted by global throughput, the best marked;
- ``throughput_memory.png``: throughput and peak memory per job (bars);
- ``loss.png``: the loss curves of every job that trained;
- ``compare.html``: all of it and more, interactive, in one file (``hsdp_runner/dashboard.py``).
Steady-state figures are the medians the run wrote into ``summary.json`` (steps after
``metrics.warmup_steps``); the spread shown is their min-max over the same steps.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hsdp_runner import prediction, tracking

TABLE_FILE, BARS_FILE, LOSS_FILE = "compare.md", "throughput_memory.png", "loss.png"
ORDER = {"completed": 0, "interrupted": 1, "failed": 2, "skipped": 3, "unfinished": 4}


@dataclass
class Job:
    """One job dir of a sweep, as its files describe it."""

    path: Path
    num: int
    overrides: list[str]
    config: dict
    summary: dict
    records: list[dict]
    label: str = field(default="")

    @property
    def status(self) -> str:
        """completed / interrupted / failed / skipped, or unfinished without a summary."""
        return self.summary.get("status", "unfinished")

    @property
    def tps_global(self) -> float | None:
        return self.summary.get("median_tps_global")


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
                        summary=tracking.read_summary(path) or {},
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


def _spread(summary: dict, key: str) -> str:
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
    mfu = job.summary.get("median_mfu")
    return "n/a" if mfu is None else f"{100 * mfu:.2f}%"


def _comm(summary: dict) -> str:
    """Measured collective bytes of the counted step and their ratio to the analytic model."""
    measured, ratio = summary.get("comm_bytes_measured"), summary.get("comm_ratio")
    if measured is None:
        return "—"
    return f"{measured / 2**20:,.2f}" + ("" if ratio is None else f" (×{ratio:.3f})")


def _status(job: Job) -> str:
    s = job.summary
    if job.status == "completed":
        return "ok"
    if job.status == "skipped":
        return "skipped: " + _cell(s.get("reason", ""))
    if job.status == "failed":
        return f"failed (rank {s.get('failed_rank')}): " + _cell(s.get("error", ""))
    if job.status == "interrupted":
        return f"interrupted at step {s.get('interrupted_at_step')} ({s.get('signal')})"
    return "unfinished (no summary.json)"


def _degrees(job: Job) -> tuple[str, str, str]:
    """(layout, 'r x s x t', world size) from the run's mesh, or the asked-for degrees."""
    s = job.summary
    if "mesh_shape" in s:
        return s["layout"], "×".join(map(str, s["mesh_shape"])), str(s["world_size"])
    asked = s.get("requested_degrees") or job.config.get("parallel") or {}
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
        layout, shape, world = _degrees(job)
        name = _cell(job.label)
        if i == 0 and job.status == "completed":
            name = f"**{name} (best)**"
        rows.append(" | ".join([
            f"| {name}", layout, shape, world,
            (job.config.get("precision") or {}).get("name", "?"), _comm(s),
            _spread(s, "tps_per_device"), _spread(s, "tps_global"),
            _mfu(job),
            _num(s.get("mem_peak_gib"), ".2f"), _num(s.get("median_step_time_s"), ".3g"),
            _status(job)]) + " |")
    return "\n".join(rows)


def plot_bars(jobs: list[Job], path: Path) -> Path:
    """Horizontal bars of global tokens/s (median, min-max whiskers) and peak memory per job."""
    plt = _pyplot()
    done = [j for j in jobs if j.status == "completed"]
    fig, (ax_tps, ax_mem) = plt.subplots(1, 2, figsize=(12, 1.5 + 0.55 * max(1, len(done))),
                                         sharey=True, layout="constrained")
    names = [f"{j.label}\n{_degrees(j)[0]} {_degrees(j)[1]}" for j in done]
    colors = ["tab:orange" if i == 0 else "tab:blue" for i in range(len(done))]
    tps = [j.tps_global for j in done]
    whiskers = [[t - j.summary.get("min_tps_global", t) for t, j in zip(tps, done)],
                [j.summary.get("max_tps_global", t) - t for t, j in zip(tps, done)]]
    bars = ax_tps.barh(names, tps, xerr=whiskers, color=colors, capsize=3)
    ax_tps.bar_label(bars, fmt="{:,.0f}", label_type="center", color="white")
    ax_tps.set_title("tokens/s, global (median after warm-up, min–max)")
    bars = ax_mem.barh(names, [j.summary.get("mem_peak_gib") or 0 for j in done], color=colors)
    ax_mem.bar_label(bars, fmt="{:.2f}", label_type="center", color="white")
    ax_mem.set_title("peak memory, rank 0 (GiB)")
    ax_tps.invert_yaxis()
    if not done:
        ax_tps.text(0.5, 0.5, "no job completed", ha="center", transform=ax_tps.transAxes)
    fig.suptitle(f"{path.parent.name}: best = orange")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(jobs: list[Job], path: Path) -> Path:
    """Loss against step for every job with metrics (failed jobs dashed, up to where they died)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    for job in sorted(jobs, key=lambda j: j.num):
        if job.records:
            failed = job.status != "completed"
            ax.plot([r["step"] for r in job.records], [r["loss"] for r in job.records],
                    linestyle="--" if failed else "-", marker="." if failed else None,
                    label=job.label + (f" ({job.status})" if failed else ""))
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("loss")
    ax.set_title(f"{path.parent.name}: training loss")
    if ax.lines:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no job logged a step", ha="center", transform=ax.transAxes)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def write_comparison(sweep_dir: Path, jobs: list[Job]) -> tuple[str, list[Path]]:
    """Write compare.md and both plots of ``jobs`` into ``sweep_dir``; return (table, paths)."""
    counts = ", ".join(f"{sum(j.status == s for j in jobs)} {s}" for s in ORDER
                       if any(j.status == s for j in jobs))
    text = table(jobs)
    md = (f"# Sweep {sweep_dir.name}\n\n{len(jobs)} jobs: {counts}. Medians over the steps "
          "after `metrics.warmup_steps`; (min–max) over the same steps. Sorted by global "
          f"throughput.\n\n{text}\n\n![throughput and memory]({BARS_FILE})\n\n"
          f"![loss]({LOSS_FILE})\n")
    (sweep_dir / TABLE_FILE).write_text(md)
    paths = [sweep_dir / TABLE_FILE, plot_bars(jobs, sweep_dir / BARS_FILE),
             plot_loss(jobs, sweep_dir / LOSS_FILE)]
    return text, paths


def _wandb_facts(sweep_dir: Path, jobs: list[Job]) -> tuple[str, str | None, str, bool]:
    """(project, entity, group, logged offline) of the sweep's W&B runs, from a job's config.

    The group rule is ``app.run_info_from_hydra``'s: ``logger.group``, else the sweep dir name.
    """
    logger = next((j.config["logger"] for j in jobs if "logger" in j.config), {})
    return (logger.get("project", "hsdp_runner"), logger.get("entity"),
            logger.get("group") or sweep_dir.name, logger.get("mode", "offline") != "online")


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns 0, or 2 for a missing sweep dir or an unmet --wandb-report."""
    parser = argparse.ArgumentParser(prog="python -m hsdp_runner.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", type=Path,
                        help="a multirun dir, e.g. multirun/2025-01-01_12-00-00_degrees_8")
    parser.add_argument("--wandb-report", action="store_true",
                        help="also save a W&B report for the sweep's group (needs W&B online "
                             "and the wandb-workspaces package)")
    parser.add_argument("--plan", type=Path, default=None,
                        help="a plan.json whose predictions to compare with (default: the "
                             "plan.source of each job's config)")
    args = parser.parse_args(argv)
    jobs = load_jobs(args.sweep_dir) if args.sweep_dir.is_dir() else []
    if not jobs:
        print(f"compare: {args.sweep_dir} holds no job dirs; pass the sweep dir a multirun "
              "printed (hydra.sweep.dir)", file=sys.stderr)
        return 2
    text, paths = write_comparison(args.sweep_dir, jobs)
    from hsdp_runner import dashboard  # it imports this module

    paths.append(dashboard.write_dashboard(args.sweep_dir, jobs, plan_file=args.plan))
    print(text)
    predicted = prediction.comparison_section(jobs, args.plan)
    if predicted:
        with open(args.sweep_dir / TABLE_FILE, "a") as md:
            md.write("\n" + predicted)
        print("\n" + predicted)
    print("compare: wrote " + ", ".join(str(p) for p in paths))
    if args.wandb_report:
        from hsdp_runner import wandb_report

        return wandb_report.publish(*_wandb_facts(args.sweep_dir, jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
