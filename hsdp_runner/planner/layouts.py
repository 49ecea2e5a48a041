"""Plan the layouts of one config on one cluster: enumerate, measure memory, predict, rank.

The planner's core, shared by ``python -m hsdp_runner.plan`` (every layout, written as a table)
and ``parallel=auto`` (the job picks the best one before its workers start). A ``Scenario`` is
a config, a resolved ``Cluster``, the axes to vary (``plan.axes.<key>`` values, typed) and the
degrees held fixed; ``plan_scenarios`` enumerates every layout of each (``enumerate_layouts``:
every degree tuple whose product is the cluster's world size, checked by ``ParallelDims`` and
the batch split), measures memory for all of them in one batch (``planner.memory.measure``: the
fake measurements of every scenario share the same child processes and on-disk cache),
predicts step time (``planner.step_time``) and returns one ranked list of rows per
scenario (``planner.report.rank``; row format: plan.json's ``layouts``).

A scenario's config is the composed one (a DictConfig): each axis combination is applied to it
as a dotted-key override would be (``axes.axis_configs``), then converted once to the typed
``RunConfig`` (``config.compose.to_run_config``), which is all the rest of the planning reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from omegaconf import DictConfig

from hsdp_runner.config.checks import validate_batch
from hsdp_runner.config.compose import plain_config
from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.distributed.param_sizes import view_sizes
from hsdp_runner.models.base import model_spec, routed_experts
from hsdp_runner.models.params import torch_dtype
from hsdp_runner.planner import layout_memory, mem_phases, pipeline
from hsdp_runner.planner import memory as plan_memory
from hsdp_runner.planner import report as plan_report
from hsdp_runner.planner.axes import axis_configs, plain_value, typed_value
from hsdp_runner.planner.cluster import Cluster
from hsdp_runner.planner.degrees import PLANNED_DIMS, cp_degrees, degree_shapes


@dataclass
class Scenario:
    """What to plan: ``cfg`` on ``cluster``, times every combination of ``axes`` (dotted key ->
    values), keeping only the layouts whose degrees equal ``fixed`` (dim name -> degree).
    ``cfg`` is the composed config: the axes are dotted-key overrides applied to it.
    ``pipeline_stage``: each layout is one stage of a pipeline whose micro-batches are
    ``trainer.grad_accum_steps`` (``planner.pipeline``)."""

    cfg: DictConfig
    cluster: Cluster
    axes: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    pipeline_stage: bool = False


def enumerate_layouts(cfg: RunConfig, world: int, ranks_per_node: int) -> list[dict]:
    """Every (dp_replicate, dp_shard, cp, tp, ep) (``degrees.PLANNED_DIMS``) whose first four
    multiply to ``world`` (cp over ``planner.degrees.cp_degrees``, ep over
    ``degrees.ep_degrees``): dims or the reason it is invalid."""
    cps = cp_degrees(
        cfg.plan.cp_degrees,
        cfg.model.seq_len,
        world,
        ranks_per_node,
        cfg.parallel.allow_cp_across_nodes,
    )
    out = []
    for shape in degree_shapes(world, cps, cfg.plan.ep_degrees, routed_experts(cfg.model)):
        parallel = dataclasses.replace(cfg.parallel, **dict(zip(PLANNED_DIMS, shape)))
        entry = {"shape": shape, "dims": None, "reason": None}
        try:
            dims = ParallelDims.from_config(parallel, cfg.model, world, ranks_per_node)
            model_spec(cfg.model).check_parallel(dims.cp, dims.tp, parallel.sequence_parallel)
            validate_batch(cfg.trainer, dims.dp)
            entry["dims"] = dims
        except ConfigError as err:
            entry["reason"] = str(err)
        out.append(entry)
    return _one_row_per_refusal(out)


def _one_row_per_refusal(entries: list[dict]) -> list[dict]:
    """``entries`` less the ep variants of a degree tuple refused for the same reason as its
    first (a tp that does not divide the heads is refused at every ep: one row says it); the
    row kept lists the ep degrees it stands for under ``"same_refusal_eps"``."""
    first: dict[tuple, dict] = {}
    kept = []
    for entry in entries:
        base = entry["shape"][:-1]
        head = first.setdefault(base, entry)
        if head is not entry and entry["dims"] is None and entry["reason"] == head["reason"]:
            head.setdefault("same_refusal_eps", []).append(entry["shape"][-1])
            continue
        kept.append(entry)
    return kept


def with_degrees(layouts: list[dict], fixed: dict, world: int) -> list[dict]:
    """The layouts whose degrees equal ``fixed`` (a refused row matching at each ep degree it
    stands for: ``_one_row_per_refusal``), so a refused layout keeps its reason; ConfigError
    naming the keys if none does."""
    if not fixed:
        return layouts

    def matches(entry: dict) -> bool:
        degrees = dict(zip(PLANNED_DIMS, entry["shape"]))
        eps = {degrees["ep"], *entry.get("same_refusal_eps", ())}
        return all(
            degree in eps if name == "ep" else degrees[name] == degree
            for name, degree in fixed.items()
        )

    kept = [e for e in layouts if matches(e)]
    if not kept:
        asked = " ".join(f"parallel.{name}={degree}" for name, degree in fixed.items())
        raise ConfigError(
            f"{asked}: no layout of {world} ranks has that degree (each degree "
            f"must divide the world size {world}); change it or drop it"
        )
    return kept


def _prepare(scenario: Scenario) -> list[tuple[dict, RunConfig, list[dict]]]:
    """Validated (axis values, config, layouts) per axis combination of ``scenario``."""
    cluster = scenario.cluster
    variants = [
        (
            chosen,
            variant,
            with_degrees(
                enumerate_layouts(variant, cluster.world_size, cluster.gpus_per_node),
                scenario.fixed,
                cluster.world_size,
            ),
        )
        for chosen, variant in axis_configs(scenario.cfg, scenario.axes)
    ]
    if not any(e["dims"] for _, _, layouts in variants for e in layouts):
        reasons = [e["reason"] for _, _, layouts in variants for e in layouts]
        raise ConfigError(
            f"no layout of {cluster.world_size} ranks (cluster.nodes="
            f"{cluster.nodes} x cluster.gpus_per_node={cluster.gpus_per_node}) is "
            f"valid for this config: {'; '.join(main_reasons(reasons))}; change the world "
            "size or the batch/model"
        )
    return variants


def main_reasons(reasons: list[str], keep: int = 3) -> list[str]:
    """The ``keep`` keys that rule out the most layouts, each with one of its messages and the
    count: reasons are grouped by the config key they start with (``trainer.global_batch_size``
    for every data-parallel size the batch does not divide)."""
    by_key: dict[str, list[str]] = {}
    for reason in reasons:
        by_key.setdefault(reason.split("=", 1)[0].split(" ", 1)[0], []).append(reason)
    ranked = sorted(by_key.values(), key=len, reverse=True)[:keep]
    return [f"{group[0]} ({len(group)} of {len(reasons)} layouts)" for group in ranked]


def plan_scenarios(
    scenarios: list[Scenario], on_error: Callable[[Scenario, ConfigError], None] | None = None
) -> list[list[dict] | None]:
    """Plan every scenario; return, per scenario, its rows ranked (``plan_report.rank``).

    The fake memory measurements of all scenarios run in one batch. A scenario with no valid
    layout raises ConfigError, or with ``on_error`` is reported to it and gets None.
    """
    prepared, requests, groups_of = [], [], []
    for scenario in scenarios:
        try:
            variants = _prepare(scenario)
        except ConfigError as err:
            if on_error is None:
                raise
            on_error(scenario, err)
            variants = None
        prepared.append(variants)
        if variants is None:
            groups_of.append(None)
            continue
        reqs, groups = _memory_requests(variants, scenario.cluster)
        for group in groups.values():  # indices into the batch of every scenario's requests
            group["index"] = {d: i + len(requests) for d, i in group["index"].items()}
        requests += reqs
        groups_of.append(groups)
    measured = plan_memory.measure(requests) if requests else []
    from hsdp_runner.planner.step_time import step_time

    out = []
    for scenario, variants, groups in zip(scenarios, prepared, groups_of):
        if variants is None:
            out.append(None)
            continue
        entries = [
            _entry(chosen, variant, layout, groups, measured, scenario, step_time)
            for chosen, variant, layouts in variants
            for layout in layouts
        ]
        plan_report.rank(entries)
        out.append(entries)
    return out


def plan_layouts(
    cfg: DictConfig,
    cluster: Cluster,
    axes: dict | None = None,
    fixed: dict | None = None,
    pipeline_stage: bool = False,
) -> list[dict]:
    """Rows of every layout of ``cfg`` on ``cluster`` (times ``axes``, degrees ``fixed`` held;
    ``pipeline_stage``: see ``Scenario``), ranked; ConfigError when none is valid."""
    return plan_scenarios([Scenario(cfg, cluster, axes or {}, fixed or {}, pipeline_stage)])[0]


def _memory_requests(
    variants: list[tuple[dict, RunConfig, list[dict]]], cluster: Cluster
) -> tuple[list, dict]:
    """Group valid layouts by what their measurement depends on; return (requests, groups)."""
    groups: dict[tuple, dict] = {}
    for v, (_chosen, cfg, layouts) in enumerate(variants):
        depths = mem_phases.measured_depths(
            cfg.plan.layers_measured, cfg.model.n_layers, _dense_blocks(cfg)
        )
        for entry in layouts:
            dims = entry["dims"]
            if dims is None:
                continue
            micro = validate_batch(cfg.trainer, dims.dp)
            # HSDP's replicate all-reduce works in place on the reduce-scattered shard, so an
            # HSDP layout shares the measurement of the FSDP ones (DDP keeps whole parameters);
            # cp changes the tokens each rank holds, so it is measured per degree; ep the
            # experts a rank runs and the rows it receives.
            key = (v, dims.tp, dims.cp, dims.ep, dims.dp_shard_cp > 1, micro)
            if key not in groups:
                groups[key] = {"shape": entry["shape"], "depths": depths, "cfg": cfg}
            entry["mem_key"] = key
    requests = []
    for key, group in groups.items():
        cfg = group["cfg"]
        plain = plain_config(cfg)
        for depth in group["depths"]:
            group.setdefault("index", {})[depth] = len(requests)
            requests.append(
                plan_memory.request(
                    plain["model"],
                    plain["parallel"],
                    plain["precision"],
                    plain["trainer"]["freeze"],
                    group["shape"][:-1],
                    key[-1],
                    cfg.trainer.grad_accum_steps,
                    cluster.world_size,
                    cluster.gpus_per_node,
                    depth,
                    accum_reduce=plain_value(cfg.trainer.accum_reduce),
                    chunked_loss=cfg.trainer.chunked_loss,
                    loss_fp32=cfg.trainer.loss_fp32,
                    device_type=cluster.device_type,
                    experts=(
                        {"ep": group["shape"][-1], "imbalance": cfg.plan.expert_imbalance}
                        if routed_experts(cfg.model)
                        else None
                    ),
                )
            )
    return requests, groups


def _dense_blocks(cfg: RunConfig) -> int | None:
    """The dense blocks before the MoE blocks of a model with experts (``model.n_dense_layers``);
    None for a dense model (``mem_phases.depth_key``)."""
    return getattr(cfg.model, "n_dense_layers", 0) if routed_experts(cfg.model) else None


def _state(cfg: RunConfig, dims: ParallelDims, cache: dict | None = None) -> dict:
    """Exact per-rank state bytes of ``dims`` (``layout_memory.state_bytes``); ``cache`` keeps
    them per (config, degrees): counting a big model's parameters builds it on the meta
    device."""
    key = (id(cfg), dims.shape, dims.ep)
    if cache is not None and key in cache:
        return cache[key]
    master = torch_dtype(cfg.precision.master_dtype).itemsize
    state = layout_memory.state_bytes(
        view_sizes(cfg.model, dims, cfg.trainer.freeze, cfg.parallel.sequence_parallel),
        dims,
        master,
    )
    if cache is not None:
        cache[key] = state
    return state


def _entry(
    chosen: dict,
    cfg: RunConfig,
    layout: dict,
    groups: dict,
    measured: list[dict],
    scenario: Scenario,
    step_time: Callable[..., dict],
) -> dict:
    cluster = scenario.cluster
    # ep only for a model with experts: a dense model's plan names the degrees it always did.
    names = PLANNED_DIMS if routed_experts(cfg.model) else PLANNED_DIMS[:-1]
    overrides = {f"parallel.{name}": degree for name, degree in zip(names, layout["shape"])}
    overrides.update({k: plain_value(typed_value(cfg, k)) for k in chosen})
    dims = layout["dims"]
    if dims is None:
        return {
            "overrides": overrides,
            "valid": False,
            "reason": layout["reason"],
            "fits": None,
            "mem_gib": None,
            "step_time_s": None,
            "tps_per_device": None,
            "mfu": None,
            "dominant": None,
            "rank": None,
        }
    group = groups[layout["mem_key"]]
    phases = mem_phases.extrapolate(
        {d: measured[i] for d, i in group["index"].items()},
        mem_phases.depth_key(cfg.model.n_layers, _dense_blocks(cfg)),
    )
    ref = ParallelDims(
        **dict(zip(PLANNED_DIMS, group["shape"])),
        world_size=dims.world_size,
        ranks_per_node=dims.ranks_per_node,
        moe=dims.moe,
    )
    memory = layout_memory.layout_memory(
        phases,
        _state(cfg, ref, group.setdefault("states", {})),
        _state(cfg, dims, group["states"]),
        cluster.memory_reserve_gib,
        cfg.model.n_layers,
        cfg.trainer.grad_accum_steps,
    )
    if scenario.pipeline_stage:
        held = pipeline.gathered_blocks_gib(cfg, dims)
        memory.update(
            peak_gib=memory["peak_gib"] + held,
            peak_without_head_gib=memory["peak_without_head_gib"] + held,
            pipeline_gathered_blocks_gib=held,
        )
    time = step_time(cfg, dims, cluster, pipeline_stage=scenario.pipeline_stage)
    if time.get("ep_order"):  # the exchange by node's order timed: the job must run it
        overrides["parallel.ep_order"] = time["ep_order"]
    return {
        "overrides": overrides,
        "valid": True,
        "reason": None,
        "fits": memory["peak_gib"] <= cluster.device_memory_gib,
        "mem_gib": memory["peak_gib"],
        "step_time_s": time["step_time_s"],
        "tps_per_device": time["tps_per_device"],
        "mfu": time["mfu"],
        "dominant": time["dominant"],
        "rank": None,
        "layout": dims.layout,
        "memory": memory,
        "compute_s": time["compute_s"],
        "step_end_s": time["step_end_s"],
        "exposed_comm_s": time["exposed_comm_s"],
        "comm_total_s": time["comm_total_s"],
        "comm_latency_s": time["comm_latency_s"],
        "comm_links": time["comm_links"],
        "dims_across_nodes": dims.dims_across_nodes(),
    }
