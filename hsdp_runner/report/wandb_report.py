"""``compare --wandb-report``: a W&B report with the comparison's views for one sweep's group.

Built with W&B's own report API (``wandb-workspaces``, the ``report`` extra): a bar chart of
throughput and of peak memory per run, a parallel-coordinates plot of degrees against
throughput and MFU, and the loss curves, all over the runs of the sweep's W&B group. Saving a
report needs the W&B server; without it (offline, no credentials, package missing) the flag
only explains what is missing.
"""

from __future__ import annotations

import os

from hsdp_runner.core.exit_codes import EXIT_CONFIG, EXIT_OK
from hsdp_runner.distributed.parallel_dims import DIM_NAMES
from hsdp_runner.train import sinks

EXTRA = "pip install 'hsdp_runner[report]'  (or: pip install wandb-workspaces)"


def missing_requirements() -> list[str]:
    """Return what stops a report from being saved now (empty when nothing does)."""
    missing = []
    try:
        import wandb_workspaces  # noqa: F401
    except ImportError:
        missing.append(f"the wandb-workspaces package: {EXTRA}")
    if os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun"):
        missing.append(
            f"W&B online: WANDB_MODE is {os.environ['WANDB_MODE']!r}; unset it or "
            "set WANDB_MODE=online"
        )
    if not sinks.wandb_credentials_present():
        missing.append("W&B credentials: set WANDB_API_KEY or run `wandb login`")
    return missing


def build_report(project: str, entity: str | None, group: str, title: str):
    """Return an unsaved ``wandb_workspaces`` Report over the runs of W&B group ``group``.

    ``entity`` None means the logged-in user's default entity (looked up when saving).
    Building it needs no server; ``report.save()`` does.
    """
    import wandb_workspaces.reports.v2 as wr

    runset = wr.Runset(
        project=project,
        name=group,
        filters=f"Group = '{group}'",
        **({"entity": entity} if entity else {}),
    )
    degrees = [
        wr.ParallelCoordinatesPlotColumn(metric=wr.Config(f"derived.{name}"))
        for name in (*DIM_NAMES, "ep")  # ep borrows ranks: not a mesh dim, a degree all the same
    ]
    figures = [
        wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(name))
        for name in ("median_tps_global", "median_mfu", "mem_peak_gib")
    ]
    grid = wr.PanelGrid(
        runsets=[runset],
        panels=[
            wr.BarPlot(
                title="tokens/s, global (median after warm-up)",
                metrics=["median_tps_global"],
                orientation="h",
            ),
            wr.BarPlot(
                title="peak memory, rank 0 (GiB)", metrics=["mem_peak_gib"], orientation="h"
            ),
            wr.ParallelCoordinatesPlot(
                title="degrees vs throughput, MFU, memory", columns=degrees + figures
            ),
            wr.LinePlot(title="loss (and validation)", x="step", y=["loss", "val_loss"]),
        ],
    )
    return wr.Report(
        project=project,
        title=title,
        blocks=[
            wr.P(f"Runs of the W&B group {group}: one per job of the sweep (hsdp_runner)."),
            grid,
        ],
        **({"entity": entity} if entity else {}),
    )


def publish(project: str, entity: str | None, group: str, runs_were_offline: bool) -> int:
    """Save the report for ``group`` if W&B is reachable; else print what it needs.

    Returns 0 when saved, 2 when something is missing (nothing is sent then).
    """
    missing = missing_requirements()
    if missing:
        print(
            "compare: --wandb-report needs " + "; ".join(missing) + ".\n"
            "The sweep's runs must be on the server too: upload offline runs with "
            "`wandb sync <sweep dir>/*/wandb/offline-run-*`."
        )
        return EXIT_CONFIG
    if runs_were_offline:
        print(
            "compare: the sweep logged offline; the report shows its runs once they are "
            "uploaded with `wandb sync <sweep dir>/*/wandb/offline-run-*`"
        )
    report = build_report(project, entity, group, title=f"hsdp_runner sweep {group}")
    report.save()
    print(f"compare: W&B report: {report.url}")
    return EXIT_OK
