"""The Hydra application: composition, the job's output dir, and W&B naming facts.

Hydra's runtime config exists only in this process, so everything workers need from it
(output dir, group, run name, tags) is read here into a ``core.records.RunInfo``.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hsdp_runner.config.checks import bad_choice_override
from hsdp_runner.config.compose import CONF_DIR, bootstrap, default_run_dir
from hsdp_runner.config.schema import ParallelConfig
from hsdp_runner.core.choices import LauncherName
from hsdp_runner.core.exit_codes import EXIT_CONFIG, EXIT_OK
from hsdp_runner.core.records import RunInfo
from hsdp_runner.distributed.parallel_dims import DIM_NAMES
from hsdp_runner.runtime import sweep
from hsdp_runner.runtime.launch import run_job


def torchrun_problem(multirun: bool, run_dir: str) -> str | None:
    """Return an error for a torchrun launch the runner cannot serve, else None.

    Refused: a Hydra sweep inside torchrun (the ranks would run every job in the same
    processes; with torch 2.13 the second job's process group hung until the collective
    timeout), and several nodes whose output dir name is only per node (no ``--rdzv-id``, no
    ``hydra.run.dir``).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    if multirun:
        return (
            "a Hydra sweep (-m) cannot run inside torchrun: start one torchrun per job "
            "(docs/many_nodes.md) or use launcher=slurm"
        )
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if (
        nodes == 1
        or os.environ["TORCHELASTIC_RUN_ID"] not in ("", "none")
        or run_dir != default_run_dir()
    ):
        return None
    return (
        f"torchrun runs {nodes} nodes without --rdzv-id, so each node would name its own "
        "output dir; pass the same --rdzv-id on every node (e.g. --rdzv-id exp17, or "
        "$SLURM_JOB_ID in an allocation) or hydra.run.dir=<a folder every node sees>"
    )


def run_info_from_hydra(cfg: DictConfig) -> RunInfo:
    """Read output dir, W&B group, run name and tags from Hydra's runtime config."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    overrides = hc.job.override_dirname
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    group = cfg.logger.group or (Path(hc.sweep.dir).name if multirun else hc.job.name)
    return RunInfo(
        output_dir=hc.runtime.output_dir,
        group=group,
        run_name=overrides
        or "+".join(
            f"{k}={v}"
            for k, v in sorted(choices.items())
            if k in ("parallel", "model", "precision")
        ),
        tags=[f"{k}={v}" for k, v in sorted(choices.items())],
        multirun=multirun,
        overrides=list(hc.overrides.task),
        sweep_dir=hc.sweep.dir if multirun else None,
        size_degrees=preset_degrees(choices.get("parallel")) if multirun else None,
    )


def preset_degrees(choice: str | None) -> dict | None:
    """Return the degrees of the ``parallel`` preset ``choice`` as its YAML states them.

    A sweep overrides degrees per job, but its world size must stay fixed: on CPU without
    ``launcher.nproc_per_node`` it is the product of the preset's degrees, not the job's
    (``parallel_dims.infer_world_size``). Missing keys take the schema's defaults; None without a choice.
    """
    if choice is None:
        return None
    return dict(_preset_degrees(choice))


@functools.cache
def _preset_degrees(choice: str) -> dict:
    """The degrees of preset ``choice``, composed once per process (a sweep asks per job, and
    composing costs a quarter of a second)."""
    preset = OmegaConf.merge(
        OmegaConf.structured(ParallelConfig),
        hydra.compose(config_name=f"parallel/{choice}").parallel,
    )
    return {name: preset[name] for name in DIM_NAMES}


_state = {"task_started": False}


def mark_jobs_submitted() -> None:
    """Record that a launcher plugin (SLURM) took the jobs: from here on, Hydra's exit code 1
    means a job failed, not that the config did not compose."""
    _state["task_started"] = True


def unwritable_output_dir(argv: list[str]) -> str | None:
    """Return an error message if the output dir the command line asks for cannot be created.

    Hydra creates the job's dir before our task runs and reports a failure there with a bare
    traceback, so the explicit ``hydra.run.dir`` / ``hydra.sweep.dir`` (or the working
    directory that holds the default ``outputs/``) is checked first.
    """
    wanted = {}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and value and "${" not in value:
            wanted[key] = Path(value).expanduser()
    for key, path in (wanted or {"": Path.cwd()}).items():
        try:
            path.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
        except OSError as err:
            where = (
                f"{key}={path}" if key else f"the working directory {path} (outputs/ goes there)"
            )
            return (
                f"{where} is not writable ({err.strerror}); "
                "set hydra.run.dir (or hydra.sweep.dir for -m) to a writable folder"
            )
    return None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_task(cfg: DictConfig) -> int:
    _state["task_started"] = True
    info = run_info_from_hydra(cfg)
    problem = torchrun_problem(info.multirun, HydraConfig.get().run.dir)
    if problem:
        print(f"hsdp_runner: config error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
    code = run_job(cfg, info)
    if LauncherName(cfg.launcher.name).submitit:
        return code  # submitit pickles it for the submitting process, which tallies the sweep
    if info.multirun:
        sweep.note_job(info.sweep_dir, code)
    if code > 128 or (code != EXIT_OK and not info.multirun):
        raise SystemExit(code)  # an interrupt (128 + signal) also ends a sweep
    return code


def main() -> int:
    """Entry point: register schemas and resolvers, run Hydra; return the process exit code."""
    bootstrap()
    # Per call, not per process: a second main() in one process (tests run many) must not
    # take an earlier call's started task for its own when Hydra rejects its overrides.
    _state["task_started"] = False
    # Hydra reports a bad choice over several lines (the schema's Enum error and its context);
    # a choice override on the command line is checked first, for one line.
    problem = bad_choice_override(sys.argv[1:]) or unwritable_output_dir(sys.argv[1:])
    if problem:
        print(f"hsdp_runner: config error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        hydra_task()
    except SystemExit as stop:
        # Hydra exits 1 on a composition error (unknown key, wrong type, missing group option)
        # before our task starts; that is a config error too.
        if not _state["task_started"] and stop.code == 1:
            return EXIT_CONFIG
        return stop.code if isinstance(stop.code, int) else 1
    return sweep.finish() if sweep.ran() else EXIT_OK
