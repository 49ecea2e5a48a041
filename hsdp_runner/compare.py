"""``python -m hsdp_runner.compare <sweep dir>``: one table and two plots from a finished sweep.

Reads what every job dir of a multirun holds (``summary.json``, ``metrics.jsonl``,
``config_resolved.yaml`` and Hydra's ``.hydra/overrides.yaml``), never W&B and never the
trainer, so it works offline and on a laptop. Writes into the sweep dir:
- ``compare.md``: one row per job, sorted by global throughput, the best marked;
- ``throughput_memory.png``: throughput and peak memory per job (bars);
- ``loss.png``: the loss curves of every job that trained;
- ``compare.html``: all of it and more, interactive, in one file (``hsdp_runner/report/dashboard/page.py``).
Steady-state figures are the medians the run wrote into ``summary.json`` (steps after
``metrics.warmup_steps``); the spread shown is their min-max over the same steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.exit_codes import EXIT_CONFIG, EXIT_OK
from hsdp_runner.core.frozen_imports import freeze_imports
from hsdp_runner.report import prediction
from hsdp_runner.report.dashboard import page as dashboard_page
from hsdp_runner.report.runs import Job, degrees, load_jobs, table

TABLE_FILE, BARS_FILE, LOSS_FILE = "compare.md", "throughput_memory.png", "loss.png"


def plot_bars(jobs: list[Job], path: Path) -> Path:
    """Horizontal bars of global tokens/s (median, min-max whiskers) and peak memory per job."""
    plt = _pyplot()
    done = [j for j in jobs if j.status is RunStatus.completed]
    fig, (ax_tps, ax_mem) = plt.subplots(
        1, 2, figsize=(12, 1.5 + 0.55 * max(1, len(done))), sharey=True, layout="constrained"
    )
    names = [f"{j.label}\n{degrees(j)[0]} {degrees(j)[1]}" for j in done]
    colors = ["tab:orange" if i == 0 else "tab:blue" for i in range(len(done))]
    tps = [j.tps_global for j in done]
    whiskers = [
        [t - j.summary.get("min_tps_global", t) for t, j in zip(tps, done)],
        [j.summary.get("max_tps_global", t) - t for t, j in zip(tps, done)],
    ]
    bars = ax_tps.barh(names, tps, xerr=whiskers, color=colors, capsize=3)
    ax_tps.bar_label(bars, fmt="{:,.0f}", label_type="center", color="white")
    ax_tps.set_title("tokens/s, global (median after warm-up, min–max)")
    bars = ax_mem.barh(names, [j.summary.mem_peak_gib or 0 for j in done], color=colors)
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
    """Loss against step for every job with metrics (failed jobs dashed, up to where they died),
    and its validation losses (``trainer.val_every``) as dotted markers in the same colour."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    for job in sorted(jobs, key=lambda j: j.num):
        if job.records:
            failed = job.status is not RunStatus.completed
            (line,) = ax.plot(
                [r["step"] for r in job.records],
                [r["loss"] for r in job.records],
                linestyle="--" if failed else "-",
                marker="." if failed else None,
                label=job.label + (f" ({job.status})" if failed else ""),
            )
            val = [(r["step"], r["val_loss"]) for r in job.records if r.get("val_loss") is not None]
            if val:
                ax.plot(*zip(*val), linestyle=":", marker="o", color=line.get_color())
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("loss")
    ax.set_title(f"{path.parent.name}: training loss (dotted: validation)")
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
    counts = ", ".join(
        f"{sum(j.status == s for j in jobs)} {s}"
        for s in RunStatus
        if any(j.status == s for j in jobs)
    )
    text = table(jobs)
    md = (
        f"# Sweep {sweep_dir.name}\n\n{len(jobs)} jobs: {counts}. Medians over the steps "
        "after `metrics.warmup_steps`; (min–max) over the same steps. Sorted by global "
        f"throughput.\n\n{text}\n\n![throughput and memory]({BARS_FILE})\n\n"
        f"![loss]({LOSS_FILE})\n"
    )
    (sweep_dir / TABLE_FILE).write_text(md)
    paths = [
        sweep_dir / TABLE_FILE,
        plot_bars(jobs, sweep_dir / BARS_FILE),
        plot_loss(jobs, sweep_dir / LOSS_FILE),
    ]
    return text, paths


def _wandb_facts(sweep_dir: Path, jobs: list[Job]) -> tuple[str, str | None, str, bool]:
    """(project, entity, group, logged offline) of the sweep's W&B runs, from a job's config.

    The group rule is ``app.run_info_from_hydra``'s: ``logger.group``, else the sweep dir name.
    """
    logger = next((j.config["logger"] for j in jobs if "logger" in j.config), {})
    return (
        logger.get("project", "hsdp_runner"),
        logger.get("entity"),
        logger.get("group") or sweep_dir.name,
        logger.get("mode", "offline") != "online",
    )


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns 0, or 2 for a missing sweep dir or an unmet --wandb-report."""
    parser = argparse.ArgumentParser(
        prog="python -m hsdp_runner.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "sweep_dir", type=Path, help="a multirun dir, e.g. multirun/2025-01-01_12-00-00_degrees_8"
    )
    parser.add_argument(
        "--wandb-report",
        action="store_true",
        help="also save a W&B report for the sweep's group (needs W&B online "
        "and the wandb-workspaces package)",
    )
    parser.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="a plan.json whose predictions to compare with (default: the "
        "plan.source of each job's config)",
    )
    args = parser.parse_args(argv)
    jobs = load_jobs(args.sweep_dir) if args.sweep_dir.is_dir() else []
    if not jobs:
        print(
            f"compare: {args.sweep_dir} holds no job dirs; pass the sweep dir a multirun "
            "printed (hydra.sweep.dir)",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    text, paths = write_comparison(args.sweep_dir, jobs)

    paths.append(dashboard_page.write_dashboard(args.sweep_dir, jobs, plan_file=args.plan))
    print(text)
    predicted = prediction.comparison_section(jobs, args.plan)
    if predicted:
        with open(args.sweep_dir / TABLE_FILE, "a") as md:
            md.write("\n" + predicted)
        print("\n" + predicted)
    print("compare: wrote " + ", ".join(str(p) for p in paths))
    if args.wandb_report:
        from hsdp_runner.report import wandb_report

        return wandb_report.publish(*_wandb_facts(args.sweep_dir, jobs))
    return EXIT_OK


if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
