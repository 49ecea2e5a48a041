"""Where rank 0's figures go: the job's metrics files and Weights & Biases, behind one interface.

Every sink is a ``Tracker`` (log a step, log the run's summary, finish); ``open_trackers``
returns rank 0's list of them for the ``logger`` config: always ``MetricsFile`` (metrics.jsonl
and summary.json), plus ``WandbRun`` with ``logger=wandb``. W&B is optional and never fatal:
it runs offline by default (no account, no network), an online run without credentials falls
back to offline, and any W&B failure becomes a warning while training and the local metrics
files go on.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Protocol

from hsdp_runner.config.schema import LoggerConfig
from hsdp_runner.core.choices import Logger, WandbMode
from hsdp_runner.core.records import SUMMARY_FILE, RunInfo, RunSummary

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RESOLVED_CONFIG_FILE = "config_resolved.yaml"
EARLIER_RUNS_DIR = "earlier_runs"


def read_metrics(output_dir: str | Path) -> list[dict]:
    """Return the job's per-step records from metrics.jsonl (empty if absent)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(output_dir: str | Path, last_step: int) -> int:
    """Keep in metrics.jsonl each step up to ``last_step`` once (a resumed job trains the later
    ones again; of a step logged twice the later record stays), in step order.

    Rewrites the file atomically; returns how many records were dropped.
    """
    records = read_metrics(output_dir)
    by_step = {r["step"]: r for r in records if r["step"] <= last_step}
    keep = [by_step[step] for step in sorted(by_step)]
    if keep != records:
        path = Path(output_dir) / METRICS_FILE
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, path)
    return len(records) - len(keep)


def set_aside_earlier_run(output_dir: str | Path) -> Path | None:
    """Before a fresh start in a dir that holds an earlier run's ``metrics.jsonl`` or
    ``summary.json``, move them into ``earlier_runs/<n>/`` (n = 1, 2, ...), so the new run's
    files hold only its own steps and nothing is lost. Returns that folder, or None."""
    output_dir = Path(output_dir)
    files = [
        output_dir / name for name in (METRICS_FILE, SUMMARY_FILE) if (output_dir / name).exists()
    ]
    if not files:
        return None
    earlier = output_dir / EARLIER_RUNS_DIR
    earlier.mkdir(exist_ok=True)
    n = 1 + max((int(p.name) for p in earlier.iterdir() if p.name.isdigit()), default=0)
    (earlier / str(n)).mkdir()
    for path in files:
        os.replace(path, earlier / str(n) / path.name)
    return earlier / str(n)


def last_step(output_dir: str | Path) -> int:
    """The last step recorded in metrics.jsonl (0 when none)."""
    return max((r["step"] for r in read_metrics(output_dir)), default=0)


class Tracker(Protocol):
    """A sink of rank 0's figures; the trainer and worker talk to every sink through this."""

    def log_step(self, record: dict) -> None:
        """Take one step's record (metrics.step_record plus the step's extras)."""

    def log_summary(self, summary: RunSummary) -> None:
        """Take the finished run's summary."""

    def finish(self, exit_code: int = 0) -> None:
        """Flush and close (``exit_code`` 1: the run failed)."""


class MetricsFile:
    """The job's own files: one JSON line per step in ``metrics.jsonl``, and ``summary.json``."""

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / METRICS_FILE
        self._file = open(self.path, "a", buffering=1)

    def log_step(self, record: dict) -> None:
        """Append ``record`` as one line and flush it."""
        self._file.write(json.dumps(record) + "\n")

    def log_summary(self, summary: RunSummary) -> None:
        """Write ``summary.json``."""
        summary.write(self.output_dir)

    def finish(self, exit_code: int = 0) -> None:
        """Close metrics.jsonl."""
        self._file.close()


class WandbRun:
    """A W&B run for rank 0, or a no-op when disabled or when W&B cannot start."""

    def __init__(
        self, logger_cfg: LoggerConfig, run_info: RunInfo, config: dict, output_dir: str | Path
    ):
        self.run = None
        if logger_cfg.mode == WandbMode.disabled:
            return
        try:
            self.run = self._start(logger_cfg, run_info, config, Path(output_dir))
        except Exception as err:  # any W&B failure must not stop training
            log.warning(
                "W&B could not start (%s: %s); training goes on, metrics are in %s",
                type(err).__name__,
                err,
                output_dir,
            )

    @staticmethod
    def _start(logger_cfg: LoggerConfig, run_info: RunInfo, config: dict, output_dir: Path):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        mode = WandbMode(logger_cfg.mode)
        if mode is WandbMode.online and not wandb_credentials_present():
            log.warning(
                "logger.mode=online but no W&B credentials (WANDB_API_KEY or `wandb "
                "login`); logging offline instead. Sync later with `wandb sync %s`",
                output_dir / "wandb",
            )
            mode = WandbMode.offline
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = wandb.init(
                project=logger_cfg.project,
                entity=logger_cfg.entity,
                mode=mode.value,
                dir=str(output_dir),
                group=run_info.group,
                name=run_info.run_name,
                tags=list(run_info.tags),
                config=config,
                job_type="train",
                settings=wandb.Settings(console="off", init_timeout=60, silent=True),
                reinit="finish_previous",
            )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def log_step(self, record: dict) -> None:
        """Log one step's scalars (``step`` is the x-axis).

        The counted step's communication breakdowns (``comm_measured``, ``comm_analytic``:
        dicts) are left out: W&B would copy them into the summary as nested keys beside the
        flat ``comm_<source>/<kind>/<dim>/bytes`` that ``log_summary`` writes."""
        scalars = {k: v for k, v in record.items() if not isinstance(v, dict)}
        self._guard(lambda: self.run.log(scalars))

    def log_summary(self, summary: RunSummary) -> None:
        """Write the run's scalars (``wandb_summary``) into the W&B run summary."""
        self._guard(lambda: self.run.summary.update(wandb_summary(summary)))

    def finish(self, exit_code: int = 0) -> None:
        """Close the run; offline runs can be uploaded later with ``wandb sync``."""
        self._guard(lambda: self.run.finish(exit_code=exit_code))
        self.run = None

    def _guard(self, action) -> None:
        if self.run is None:
            return
        try:
            action()
        except Exception as err:
            log.warning(
                "W&B failed (%s: %s); it is turned off for the rest of this run",
                type(err).__name__,
                err,
            )
            self.run = None


def wandb_summary(summary: RunSummary) -> dict:
    """Scalars for the W&B run summary: status, final loss, skipped steps, the steady-state
    figures, the memory estimate and peak of the fullest rank, comm totals and ratio, the
    measured and analytic bytes per collective kind and mesh dim (``comm_<source>/<kind>/<dim>/
    bytes``, ...) and, for a planned job, predicted vs measured
    (``prediction/<figure>/<predicted|measured|error>``, ``prediction/rank``)."""
    out = {
        "status": summary.status and summary.status.value,
        "final_loss": summary.final_loss,
        "skipped_steps": summary.skipped_steps,
    }
    if summary.val_loss is not None:
        out["val_loss"] = summary.val_loss
    out |= {f"mem_estimate_gib/{k}": v for k, v in (summary.mem_estimate_gib or {}).items()}
    if summary.mem_peak_gib_per_rank:
        out["mem_peak_gib_max_rank"] = max(summary.mem_peak_gib_per_rank)
    for source in ("measured", "analytic"):
        for name, entry in (summary.get(f"comm_{source}") or {}).items():
            for key, value in entry.items():
                out[f"comm_{source}/{name}/{key}"] = value
    prediction = summary.prediction or {}
    for name, figure in (prediction.get("figures") or {}).items():
        out |= {f"prediction/{name}/{side}": value for side, value in figure.items()}
    if prediction:
        out["prediction/rank"] = prediction["rank"]
    scalars = (
        "steady_steps",
        "warmup_steps_excluded",
        "mem_peak_gib",
        "comm_bytes_measured",
        "comm_bytes_analytic",
        "comm_ratio",
        "comm_step",
    )
    for key, value in summary.to_dict().items():
        if key in scalars or key.startswith(("median_", "min_", "max_")):
            out[key] = value
    return out


def open_trackers(
    logger_cfg: LoggerConfig, run_info: RunInfo, config: dict, output_dir: str | Path
) -> list[Tracker]:
    """Rank 0's sinks for ``logger.name``: the job's files always, W&B with ``logger=wandb``.

    ``config``: the resolved config as a plain dict (W&B's run config)."""
    extra = {
        Logger.none: lambda: [],
        Logger.wandb: lambda: [WandbRun(logger_cfg, run_info, config, output_dir)],
    }
    return [MetricsFile(output_dir), *extra[Logger(logger_cfg.name)]()]


def wandb_credentials_present() -> bool:
    """True when W&B has an API key: ``WANDB_API_KEY`` or a ``wandb login`` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")
