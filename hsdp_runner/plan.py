"""``python -m hsdp_runner.plan [overrides]``: predict memory and step time of every layout.

Composes the same config as a job (``conf/plan.yaml`` = ``conf/config.yaml`` + a ``cluster``),
enumerates every ``(dp_replicate, dp_shard, cp, tp)`` whose product is the cluster's world
size (``cluster.nodes x cluster.gpus_per_node``; cp over ``plan.cp_degrees``, by default every
context-parallel degree the sequence length and the node allow) times every value of the axes
given as ``plan.axes.<dotted key>=v1,v2``, checks each with ``ParallelDims`` and the batch
split (invalid ones are kept, with the reason), predicts memory per rank (``plan_memory``: the
runner's model and sharding under a fake process group) and step time (``plan_time``), and
writes a ranked table to stdout, ``plan.md`` and ``plan.json`` (format:
docs/planner.md). ``plan.write_sweep=<file>`` writes a sweep of the ``plan.top_k`` best layouts that
fit; ``--calibrate <sweep dir>`` fits the cluster's figures to such a sweep's measurements
(``plan_calibrate``). Exit 2 on bad input: unknown cluster or key, no valid layout, a model
that fits nowhere. Never imports the trainer.

The planner varies keys of the composed config (axes, degrees), so it works on Hydra's
DictConfig; built from the ``RunConfig`` schema, that node reads like the dataclass, which is
what the annotations name. Each variant is checked as a real ``RunConfig``
(``compose.to_run_config``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from enum import Enum
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hsdp_runner.config.checks import validate_batch, validate_config
from hsdp_runner.config.compose import compose as compose_config
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.core.exit_codes import EXIT_CONFIG, EXIT_OK
from hsdp_runner.distributed.comm_model import unit_sizes
from hsdp_runner.distributed.parallel_dims import DIM_NAMES, ParallelDims
from hsdp_runner.models.base import model_spec
from hsdp_runner.planner import memory as plan_memory
from hsdp_runner.planner import report as plan_report
from hsdp_runner.planner.cluster import Cluster, resolve
from hsdp_runner.planner.degrees import cp_degrees, degree_shapes

AXES_PREFIX = "plan.axes."


def compose(overrides: list[str]) -> DictConfig:
    """Compose ``conf/plan.yaml`` with ``overrides``; raise ConfigError on a Hydra error."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose_config(overrides, config_name="plan")
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(str(err).split("\nConfig search path")[0]) from None


def split_axes(args: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Separate ``plan.axes.<key>=a,b`` arguments from ordinary overrides."""
    overrides, axes = [], {}
    for arg in args:
        if arg.startswith(AXES_PREFIX):
            key, _, values = arg[len(AXES_PREFIX):].partition("=")
            axes[key] = [v.strip() for v in values.split(",") if v.strip()]
        else:
            overrides.append(arg)
    return overrides, axes


def axis_configs(cfg: DictConfig, axes: dict[str, list[str]]) -> list[tuple[dict, DictConfig]]:
    """One (axis values, config) per combination of the axes; each config validated."""
    for key in axes:
        if key.split(".")[0] in ("cluster", "plan") or OmegaConf.select(cfg, key,
                                                                      default="<absent>") == "<absent>":
            raise ConfigError(f"plan.axes.{key}: {key} is not a key of the job config; "
                              "axes take dotted keys such as plan.axes.parallel.ac=none,selective")
        if key.split(".")[-1] in DIM_NAMES:
            raise ConfigError(f"plan.axes.{key}: the degrees are always enumerated; drop it")
    out = []
    for values in itertools.product(*axes.values()) if axes else [()]:
        variant = cfg.copy()
        chosen = dict(zip(axes, values))
        for key, value in chosen.items():
            node = OmegaConf.create({"v": value})  # YAML typing: true -> bool, 2 -> int
            OmegaConf.update(variant, key, node.v, merge=False)
        validate_config(to_run_config(variant))
        out.append((chosen, variant))
    return out


def enumerate_layouts(cfg: DictConfig, world: int, ranks_per_node: int) -> list[dict]:
    """Every (dp_replicate, dp_shard, cp, tp) with product ``world`` (cp over
    ``planner.degrees.cp_degrees``): dims or the reason it is invalid."""
    cps = cp_degrees(cfg.plan.cp_degrees, cfg.model.seq_len, world, ranks_per_node,
                     cfg.parallel.allow_cp_across_nodes)
    out = []
    for shape in degree_shapes(world, cps):
        parallel = OmegaConf.merge(cfg.parallel, dict(zip(DIM_NAMES, shape)))
        entry = {"shape": shape, "dims": None, "reason": None}
        try:
            dims = ParallelDims.from_config(parallel, cfg.model, world, ranks_per_node)
            model_spec(cfg.model).check_parallel(dims.cp, dims.tp, parallel.sequence_parallel)
            validate_batch(cfg.trainer, dims.dp)
            entry["dims"] = dims
        except ConfigError as err:
            entry["reason"] = str(err)
        out.append(entry)
    return out


def _memory_requests(variants, cluster: Cluster, layers: list[int]) -> tuple[list, list]:
    """Group valid layouts by what their measurement depends on; return (requests, groups)."""
    groups: dict[tuple, dict] = {}
    for v, (_chosen, cfg, layouts) in enumerate(variants):
        depths = sorted({min(n, cfg.model.n_layers) for n in layers})
        for entry in layouts:
            dims = entry["dims"]
            if dims is None:
                continue
            micro = validate_batch(cfg.trainer, dims.dp)
            # HSDP's replicate all-reduce works in place on the reduce-scattered shard, so an
            # HSDP layout shares the measurement of the FSDP ones (DDP keeps whole parameters);
            # cp changes the tokens each rank holds, so it is measured per degree.
            key = (v, dims.tp, dims.cp, dims.dp_shard_cp > 1, micro)
            if key not in groups:
                groups[key] = {"shape": dims.shape, "depths": depths, "cfg": cfg}
            entry["mem_key"] = key
    requests = []
    for key, group in groups.items():
        cfg = group["cfg"]
        plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        for depth in group["depths"]:
            group.setdefault("index", {})[depth] = len(requests)
            requests.append(plan_memory.request(
                plain["model"], plain["parallel"], plain["precision"], plain["trainer"]["freeze"],
                group["shape"], key[-1], cfg.trainer.grad_accum_steps, cluster.world_size,
                cluster.gpus_per_node, depth))
    return requests, groups


def _state(cfg: RunConfig, dims: ParallelDims) -> dict:
    from hsdp_runner.models.params import torch_dtype

    master = torch_dtype(cfg.precision.master_dtype).itemsize
    return plan_memory.state_bytes(unit_sizes(cfg.model, dims, cfg.trainer.freeze,
                                                 cfg.parallel.sequence_parallel),
                                   dims.dp_shard_cp, master)


def predict(cfg: DictConfig, axes: dict[str, list[str]]) -> tuple[dict, list[dict]]:
    """Return (cluster description, one entry per layout and axis combination, ranked)."""
    from hsdp_runner.planner.step_time import step_time

    layers = list(cfg.plan.layers_measured)
    if len(set(layers)) < 2 or min(layers) < 1:
        raise ConfigError(f"plan.layers_measured={layers} needs two different block counts >= 1 "
                          "to extrapolate per block, e.g. plan.layers_measured=[1,2]")
    if cfg.plan.top_k < 1:
        raise ConfigError(f"plan.top_k={cfg.plan.top_k} must be >= 1")
    cluster = resolve(cfg.cluster, cfg.precision.param_dtype)
    variants = [(chosen, variant, enumerate_layouts(variant, cluster.world_size,
                                                    cluster.gpus_per_node))
                for chosen, variant in axis_configs(cfg, axes)]
    if not any(e["dims"] for _, _, layouts in variants for e in layouts):
        reasons = sorted({e["reason"] for _, _, layouts in variants for e in layouts})
        raise ConfigError(f"no layout of {cluster.world_size} ranks (cluster.nodes="
                          f"{cluster.nodes} x cluster.gpus_per_node={cluster.gpus_per_node}) is "
                          f"valid for this config: {'; '.join(reasons[:3])}; change the world "
                          "size or the batch/model")
    requests, groups = _memory_requests(variants, cluster, layers)
    measured = plan_memory.measure(requests)
    entries = []
    for chosen, variant, layouts in variants:
        for entry in layouts:
            entries.append(_entry(chosen, variant, entry, groups, measured, cluster, step_time))
    plan_report.rank(entries)
    return cluster.describe(), entries


def _plain(value):
    """A config value as YAML and JSON write it: a choice (an Enum) as its string."""
    return value.value if isinstance(value, Enum) else value


def _entry(chosen, cfg: RunConfig, layout, groups, measured, cluster: Cluster, step_time) -> dict:
    overrides = {f"parallel.{name}": degree for name, degree in zip(DIM_NAMES, layout["shape"])}
    overrides.update({k: _plain(OmegaConf.select(cfg, k)) for k in chosen})
    dims = layout["dims"]
    if dims is None:
        return {"overrides": overrides, "valid": False, "reason": layout["reason"], "fits": None,
                "mem_gib": None, "step_time_s": None, "tps_per_device": None, "mfu": None,
                "dominant": None, "rank": None}
    group = groups[layout["mem_key"]]
    cats = plan_memory.extrapolate({d: measured[i] for d, i in group["index"].items()},
                                   cfg.model.n_layers)
    ref = ParallelDims(**dict(zip(DIM_NAMES, group["shape"])), world_size=dims.world_size,
                       ranks_per_node=dims.ranks_per_node)
    memory = plan_memory.layout_memory(cats, _state(cfg, ref), _state(cfg, dims),
                                       cluster.memory_reserve_gib)
    time = step_time(cfg, dims, cluster)
    return {"overrides": overrides, "valid": True, "reason": None,
            "fits": memory["peak_gib"] <= cluster.device_memory_gib,
            "mem_gib": memory["peak_gib"], "step_time_s": time["step_time_s"],
            "tps_per_device": time["tps_per_device"], "mfu": time["mfu"],
            "dominant": time["dominant"], "rank": None, "layout": dims.layout,
            "memory": memory, "compute_s": time["compute_s"],
            "exposed_comm_s": time["exposed_comm_s"], "comm_total_s": time["comm_total_s"],
            "comm_latency_s": time["comm_latency_s"], "comm_links": time["comm_links"],
            "dims_across_nodes": dims.dims_across_nodes()}


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns 0, or 2 for bad input (the message says which key and the fix)."""
    parser = argparse.ArgumentParser(prog="python -m hsdp_runner.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", type=Path, metavar="SWEEP_DIR",
                        help="fit the cluster's efficiency and link figures to a planned sweep")
    parser.add_argument("--plan", type=Path, default=None, dest="plan_file",
                        help="with --calibrate: the plan.json a sweep not written by the planner "
                             "is compared with")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama3_8b")
    args = parser.parse_args(argv)
    try:
        if args.calibrate is not None:
            from hsdp_runner.planner import calibrate as plan_calibrate

            print(plan_calibrate.calibrate(args.calibrate, args.plan_file))
            return EXIT_OK
        overrides, axes = split_axes(args.overrides)
        cfg = compose(overrides)
        validate_config(to_run_config(cfg))
        cluster, entries = predict(cfg, axes)
    except ConfigError as err:
        print(f"plan: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    out_dir = Path(cfg.plan.out_dir or datetime.datetime.now().strftime(
        f"plans/%Y-%m-%d_%H-%M-%S_{cfg.model.name}"))
    paths = plan_report.write(out_dir, cfg, cluster, entries, overrides, axes)
    print(plan_report.table(entries, cluster))
    print("plan: wrote " + ", ".join(str(p) for p in paths))
    if not any(e["fits"] for e in entries):
        print(f"plan: error: model {cfg.model.name} fits on no layout of {cluster['world_size']}"
              f" x {cluster['device_memory_gib']:.1f} GiB devices (every layout is listed above);"
              " add nodes (cluster.nodes), use activation checkpointing (parallel.ac=full or "
              "plan.axes.parallel.ac=none,full), or lower trainer.global_batch_size",
              file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
