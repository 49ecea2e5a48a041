"""Where rank 0's figures go: the console, the job's metrics files, and Weights & Biases.

W&B is optional and never fatal: it runs offline by default (no account, no network), an
online run without credentials falls back to offline, and any W&B failure becomes a warning
while training and the local metrics files go on.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
RESOLVED_CONFIG_FILE = "config_resolved.yaml"


def write_summary(output_dir: str | Path, summary: dict) -> Path:
    """Write ``summary.json`` atomically (temp file + rename); return its path."""
    path = Path(output_dir) / SUMMARY_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_summary(output_dir: str | Path) -> dict | None:
    """Return the job's summary.json as a dict, or None if it has none."""
    path = Path(output_dir) / SUMMARY_FILE
    return json.loads(path.read_text()) if path.exists() else None


def read_metrics(output_dir: str | Path) -> list[dict]:
    """Return the job's per-step records from metrics.jsonl (empty if absent)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(output_dir: str | Path, last_step: int) -> int:
    """Drop metrics.jsonl records after ``last_step`` (a resumed job trains them again).

    Rewrites the file atomically; returns how many records were dropped.
    """
    records = read_metrics(output_dir)
    keep = [r for r in records if r["step"] <= last_step]
    if len(keep) < len(records):
        path = Path(output_dir) / METRICS_FILE
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, path)
    return len(records) - len(keep)


class MetricsFile:
    """Appends one JSON line per step to ``metrics.jsonl`` in the job's output dir."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / METRICS_FILE
        self._file = open(self.path, "a", buffering=1)

    def log(self, record: dict) -> None:
        """Append ``record`` as one line and flush it."""
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class WandbRun:
    """A W&B run for rank 0, or a no-op when disabled or when W&B cannot start."""

    def __init__(self, logger_cfg, run_info: dict, config: dict, output_dir: str | Path):
        self.run = None
        if logger_cfg.name != "wandb" or logger_cfg.mode == "disabled":
            return
        try:
            self.run = self._start(logger_cfg, run_info, config, Path(output_dir))
        except Exception as err:  # any W&B failure must not stop training
            log.warning("W&B could not start (%s: %s); training goes on, metrics are in %s",
                        type(err).__name__, err, output_dir)

    @staticmethod
    def _start(logger_cfg, run_info: dict, config: dict, output_dir: Path):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        mode = logger_cfg.mode
        if mode == "online" and not wandb_credentials_present():
            log.warning("logger.mode=online but no W&B credentials (WANDB_API_KEY or `wandb "
                        "login`); logging offline instead. Sync later with `wandb sync %s`",
                        output_dir / "wandb")
            mode = "offline"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = wandb.init(
                project=logger_cfg.project, entity=logger_cfg.entity, mode=mode,
                dir=str(output_dir), group=run_info["group"], name=run_info["run_name"],
                tags=run_info["tags"], config=config, job_type="train",
                settings=wandb.Settings(console="off", init_timeout=60, silent=True),
                reinit="finish_previous")
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def log(self, record: dict) -> None:
        """Log one step's record (``step`` is the x-axis)."""
        self._guard(lambda: self.run.log(record))

    def summary(self, values: dict) -> None:
        """Write steady-state figures into the run summary."""
        self._guard(lambda: self.run.summary.update(values))

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
            log.warning("W&B failed (%s: %s); it is turned off for the rest of this run",
                        type(err).__name__, err)
            self.run = None


def wandb_credentials_present() -> bool:
    """True when W&B has an API key: ``WANDB_API_KEY`` or a ``wandb login`` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")
