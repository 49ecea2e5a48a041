"""``python -m hsdp_runner.plan [overrides]``: predict memory and step time of every layout.

Composes the same config as a job (``conf/plan.yaml`` = ``conf/config.yaml`` + a ``cluster``),
checks every ``plan.axes.<dotted key>=v1,v2`` value as the same override on the command line
would be checked, and hands the rest to ``planner.layouts``: every ``(dp_replicate, dp_shard, cp,
tp)`` whose product is the cluster's world size (``cluster.nodes x cluster.gpus_per_node``; cp
over ``plan.cp_degrees``) times every axis combination, checked by ``ParallelDims`` and the
batch split (invalid ones are kept, with the reason), memory per rank from the runner's model
and sharding under a fake process group (``planner.memory``) and step time
(``planner.step_time``). Writes a ranked table to stdout, ``plan.md`` and ``plan.json``
(format: docs/planner.md).
``plan.write_sweep=<file>`` writes a sweep of the ``plan.top_k`` best layouts that fit;
``--calibrate <sweep dir>`` fits the cluster's figures to such a sweep's measurements
(``planner.calibrate``). Exit 2 on bad input: unknown cluster, key or axis value, no valid
layout, a model that fits nowhere (at once, before anything is measured, where its training
state alone exceeds every layout's memory: ``planner.state_bound``). Never imports the trainer.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hsdp_runner.config.checks import bad_choice_override, validate_config
from hsdp_runner.config.compose import compose as compose_config
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.core.exit_codes import EXIT_CONFIG, EXIT_OK
from hsdp_runner.core.frozen_imports import freeze_imports
from hsdp_runner.planner import matmul_shapes
from hsdp_runner.planner import report as plan_report
from hsdp_runner.planner.axes import check_axis_keys, check_plan_options
from hsdp_runner.planner.cluster import resolve
from hsdp_runner.planner.degrees import pp_degrees
from hsdp_runner.planner.layouts import plan_layouts
from hsdp_runner.planner.pipeline import pipeline_entries
from hsdp_runner.planner.state_bound import check_state_fits
from hsdp_runner.runtime import forkserver

AXES_PREFIX = "plan.axes."


def compose(overrides: list[str]) -> DictConfig:
    """Compose ``conf/plan.yaml`` with ``overrides``; raise ConfigError on a Hydra error."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose_config(overrides, config_name="plan")
    except (HydraException, OmegaConfBaseException) as err:
        # Hydra's first line names the override; the schema's error (the cause) says why.
        message = str(err).split("\nConfig search path")[0].strip()
        if err.__cause__ is not None and str(err.__cause__).strip():
            message += ": " + str(err.__cause__).strip().splitlines()[0]
        raise ConfigError(message) from None


def split_axes(args: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Separate ``plan.axes.<key>=a,b`` arguments from ordinary overrides."""
    overrides, axes = [], {}
    for arg in args:
        if arg.startswith(AXES_PREFIX):
            key, _, values = arg[len(AXES_PREFIX) :].partition("=")
            axes[key] = [v.strip() for v in values.split(",") if v.strip()]
        else:
            overrides.append(arg)
    return overrides, axes


def check_axes(
    cfg: DictConfig, overrides: list[str], axes: dict[str, list[str]]
) -> dict[str, list]:
    """Check every ``plan.axes.<key>`` value as the same override on the command line would be
    checked, and return the values typed as composition types them.

    A choice field's value goes through ``config.checks.bad_choice_override`` (one line with
    the allowed values), then each value is composed as ``<key>=<value>`` on top of
    ``overrides`` (Hydra's own parsing and the typed schema) and validated
    (``validate_config``); ConfigError names ``plan.axes.<key>``, the value and the fix.
    ``cfg``: the config composed from ``overrides`` (the keys are checked against it).
    """
    check_axis_keys(cfg, axes)
    typed: dict[str, list] = {}
    for key, values in axes.items():
        if not values:
            raise ConfigError(
                f"plan.axes.{key} has no value; give one or more, e.g. plan.axes.{key}=a,b"
            )
        base = [o for o in overrides if o.lstrip("+~").partition("=")[0] != key]
        problem = bad_choice_override([f"{key}={v}" for v in values])
        if problem:
            raise ConfigError(f"plan.axes.{key}: {problem}")
        typed[key] = []
        for value in values:
            try:
                cfg = compose(base + [f"{key}={value}"])
                validate_config(to_run_config(cfg))
            except ConfigError as err:
                raise ConfigError(f"plan.axes.{key}={value}: {err}") from None
            typed[key].append(OmegaConf.select(cfg, key))
    return typed


def predict(cfg: DictConfig, axes: dict[str, list]) -> tuple[dict, list[dict]]:
    """Return (cluster description, one entry per layout and axis combination, ranked).

    ``cfg`` is the composed config: the planner applies each axis combination to it as an
    override before converting the candidate to the typed ``RunConfig``."""
    run = to_run_config(cfg)
    check_plan_options(run.plan, run.model)
    cluster = resolve(run.cluster, run.precision.param_dtype)
    check_state_fits(run, cluster.world_size, cluster.device_memory_gib, cluster.memory_reserve_gib)
    # What a job would refuse, or the planner cannot price, the plan does not offer.
    matmul_shapes.check_plannable(run, gpus=0 if cluster.measured_links else 1)
    degrees = pp_degrees(
        run.plan.pp_degrees, cluster.nodes, run.model.n_layers, cluster.gpus_per_node
    )
    entries = plan_layouts(cfg, cluster, axes)
    for pp in [d for d in degrees if d > 1]:
        entries += pipeline_entries(
            cfg, cluster, pp, lambda c, cl, **kw: plan_layouts(c, cl, axes, **kw)
        )
    plan_report.rank(entries)
    return cluster.describe(), entries


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns 0, or 2 for bad input (the message says which key and the fix)."""
    parser = argparse.ArgumentParser(
        prog="python -m hsdp_runner.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--calibrate",
        type=Path,
        metavar="SWEEP_DIR",
        help="fit the cluster's efficiency and link figures to a planned sweep",
    )
    parser.add_argument(
        "--plan",
        type=Path,
        default=None,
        dest="plan_file",
        help="with --calibrate: the plan.json a sweep not written by the planner is compared with",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama3_8b")
    args = parser.parse_args(argv)
    try:
        if args.calibrate is not None:
            from hsdp_runner.planner import calibrate as plan_calibrate

            print(plan_calibrate.calibrate(args.calibrate, args.plan_file))
            return EXIT_OK
        overrides, axes = split_axes(args.overrides)
        problem = bad_choice_override(overrides)
        if problem:
            raise ConfigError(problem)
        cfg = compose(overrides)
        run = to_run_config(cfg)
        validate_config(run)
        out_dir = Path(
            run.plan.out_dir
            or datetime.datetime.now().strftime(f"plans/%Y-%m-%d_%H-%M-%S_{run.model.name}")
        )
        plan_report.check_targets(run, out_dir)
        forkserver.plan_children(from_here=True)
        cluster, entries = predict(cfg, check_axes(cfg, overrides, axes))
        paths = plan_report.write(out_dir, run, cluster, entries, overrides, axes)
    except ConfigError as err:
        print(f"plan: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    print(plan_report.table(entries, cluster))
    print("plan: wrote " + ", ".join(str(p) for p in paths))
    if not any(e["fits"] for e in entries):
        print(
            f"plan: error: model {run.model.name} fits on no layout of {cluster['world_size']}"
            f" x {cluster['device_memory_gib']:.1f} GiB devices (every layout is listed above);"
            " add nodes (cluster.nodes), use activation checkpointing (parallel.ac=full or "
            "plan.axes.parallel.ac=none,full), or lower trainer.global_batch_size",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    return EXIT_OK


if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
