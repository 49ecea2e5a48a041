"""``parallel=auto``: a job plans its own layout before any worker starts.

One process plans for the whole job (``runtime.auto_job`` says which: the launching process,
torchrun's rank 0, or the process that submits a SLURM job) and calls ``plan_job`` with the
job's composed config and its world (ranks, ranks per node); the others run its choice
(``apply_choice``, ``adopt_plan``). The planner's rows come from ``planner.layouts`` for the
job's own model, precision, batch and ``parallel.*`` options on the cluster it runs on:
- ``cluster=<preset>`` given on the command line, else
- the preset (``conf/cluster/*.yaml``) whose ``device`` is the name torch reports for the GPU,
  else, on CPU, ``this_machine`` (measured once per host and rank count, then cached);
with ``cluster.nodes`` and ``cluster.gpus_per_node`` always the job's own (the launcher's).

Degrees left at -1 (the preset's) are the planner's to choose; a degree given explicitly
(``parallel=auto parallel.tp=2``) is a constraint: only layouts with that degree are planned.
With several micro-batches a step, ``trainer.accum_reduce`` is planned too (``planned_axes``)
unless the command line sets it.
The fastest layout that fits wins (the planner's rank 1); its degrees and planned choices,
``plan.source`` (the plan.json written into the job's ``plan/`` folder) and the cluster are
written into the config the workers receive, so nothing downstream plans again, and
``compare`` / summary.json find the prediction the way they find a planned sweep's. A model
that fits on no layout raises ConfigError listing what would fit: activation checkpointing, a
smaller global batch, more nodes (each planned, in one batch of measurements).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import yaml
from omegaconf import DictConfig, OmegaConf

from hsdp_runner.config.compose import CONF_DIR, to_run_config
from hsdp_runner.config.schema import ClusterConfig, ParallelConfig, PrecisionConfig, RunConfig
from hsdp_runner.core.choices import AC, AccumReduce
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.pipeline_settings import checkpoint_refusal
from hsdp_runner.models.base import ModelConfig, routed_experts
from hsdp_runner.planner import matmul_shapes
from hsdp_runner.planner import memory as plan_memory
from hsdp_runner.planner import report as plan_report
from hsdp_runner.planner.axes import check_plan_options
from hsdp_runner.planner.cluster import Cluster, resolve
from hsdp_runner.planner.degrees import PLANNED_DIMS, pp_degrees
from hsdp_runner.planner.layouts import (
    Scenario,
    enumerate_layouts,
    plan_layouts,
    plan_scenarios,
    with_degrees,
)
from hsdp_runner.planner.pipeline import pipeline_entries
from hsdp_runner.planner.state_bound import check_state_fits

CPU_PRESET = "this_machine"
PLAN_DIR = "plan"  # the job's plan.md and plan.json, inside its output dir


@dataclasses.dataclass
class AutoChoice:
    """What ``plan_job`` decided: the chosen row, the runner-up (None when only one layout
    fits), the cluster planned for (``Cluster.describe``), plan.json's path, and how long
    planning took."""

    chosen: dict
    runner_up: dict | None
    cluster: dict
    plan_json: Path
    seconds: float


def fixed_degrees(parallel: ParallelConfig) -> dict[str, int]:
    """The degrees an auto job set itself (dim name -> degree); -1 means 'the planner picks'."""
    degrees = {name: getattr(parallel, name) for name in PLANNED_DIMS}
    return {name: degree for name, degree in degrees.items() if degree != -1}


def preset_for_device(device_name: str) -> str | None:
    """The ``conf/cluster`` preset whose ``device`` is ``device_name`` (as
    ``torch.cuda.get_device_name`` reports it; case and spacing ignored), or None."""
    wanted = " ".join(device_name.split()).lower()
    for path in sorted((CONF_DIR / "cluster").glob("*.yaml")):
        device = (yaml.safe_load(path.read_text()) or {}).get("device") or ""
        if " ".join(str(device).split()).lower() == wanted:
            return path.stem
    return None


def cluster_node(
    given: Optional[ClusterConfig], world_size: int, ranks_per_node: int, device_name: str | None
) -> ClusterConfig:
    """The cluster to plan for (see the module docstring): ``given`` (the job's ``cluster``,
    None unless the command line chose one) or a preset, with the job's node count and ranks
    per node. ConfigError for a GPU without a preset."""
    if given is None:
        name = CPU_PRESET
        if device_name is not None:
            name = preset_for_device(device_name)
            if name is None:
                presets = ", ".join(p.stem for p in sorted((CONF_DIR / "cluster").glob("*.yaml")))
                raise ConfigError(
                    f"parallel=auto: no cluster preset has device {device_name!r} (torch's name "
                    f"for this GPU); pass the nearest with cluster=<preset> ({presets}), or add "
                    "conf/cluster/<name>.yaml with that device and its link figures"
                )
        given = OmegaConf.to_object(
            OmegaConf.merge(
                OmegaConf.structured(ClusterConfig),
                OmegaConf.load(CONF_DIR / "cluster" / f"{name}.yaml"),
            )
        )
    return dataclasses.replace(
        given, nodes=world_size // ranks_per_node, gpus_per_node=ranks_per_node
    )


def choose(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """(best, runner-up) among the rows that are valid and fit, in the planner's order
    (predicted step time); None where there is none."""
    fitting = [r for r in rows if r["valid"] and r["fits"]]
    return (fitting[0] if fitting else None), (fitting[1] if len(fitting) > 1 else None)


def plan_job(
    cfg: DictConfig,
    world_size: int,
    ranks_per_node: int,
    device_name: str | None,
    out_dir: Path,
    overrides: list[str],
) -> AutoChoice:
    """Plan the auto job ``cfg`` on its cluster, write plan.md / plan.json into ``out_dir``
    (an earlier attempt's are replaced), write the choice into ``cfg`` (degrees,
    ``plan.source``, ``cluster``) and return it. ConfigError when nothing fits (with what
    would) or the explicit degrees allow no valid layout.

    ``cfg`` is the composed config, not the typed one: the choice is written into it, and the
    launcher makes the workers' config from it. What is planned reads it typed (converted here).
    """
    start = time.perf_counter()
    run = to_run_config(cfg)
    check_plan_options(run.plan, run.model)
    fixed = fixed_degrees(run.parallel)
    try:  # a degree no layout has fails here, before anything is measured
        with_degrees(enumerate_layouts(run, world_size, ranks_per_node), fixed, world_size)
    except ConfigError as err:
        raise ConfigError(f"parallel=auto: {err}") from None
    node = cluster_node(run.cluster, world_size, ranks_per_node, device_name)
    cluster = resolve(node, run.precision.param_dtype)
    try:  # a model whose training state alone fits nowhere: said before anything is measured
        check_state_fits(
            run, cluster.world_size, cluster.device_memory_gib, cluster.memory_reserve_gib
        )
        # What a job would refuse, or the planner cannot price, the plan does not offer.
        matmul_shapes.check_plannable(run, gpus=0 if cluster.measured_links else 1)
    except ConfigError as err:
        raise ConfigError(f"parallel=auto: {err}") from None
    axes = planned_axes(run, overrides)
    try:
        try:
            rows = plan_with_pipelines(cfg, cluster, axes, fixed)
        except ConfigError as err:
            raise ConfigError(f"parallel=auto: {err}") from None
        plan_json = _write_plan(out_dir, run, cluster, rows, overrides, axes)
        best, runner_up = choose(rows)
        if best is None:
            cfg.cluster = node
            raise ConfigError(fits_nowhere(cfg, cluster, fixed, plan_json))
    finally:
        plan_memory.release_children()  # not left beside the job's workers
    apply_choice(cfg, best["overrides"], plan_json, node)
    return AutoChoice(best, runner_up, cluster.describe(), plan_json, time.perf_counter() - start)


def planned_pp(run: RunConfig, cluster: Cluster) -> list[int]:
    """The pipeline degrees an auto job plans: ``parallel.pp`` when the job sets it (a
    constraint; it must divide the nodes, as the planner prices stages of whole nodes), else
    ``plan.pp_degrees`` (null: ``degrees.default_pp_degrees``) less those the job's checkpoint
    settings refuse (``pipeline_settings.checkpoint_refusal``: such a job plans pp = 1 only)."""
    pp = run.parallel.pp
    if pp != -1:
        if cluster.nodes % pp:
            raise ConfigError(
                f"parallel.pp={pp} with parallel=auto on {cluster.nodes} node(s): the planner "
                "prices pipeline stages of whole nodes; use a divisor of the node count, "
                "or parallel.pp=-1 to let it choose"
            )
        return [pp]
    degrees = pp_degrees(run.plan.pp_degrees, cluster.nodes, run.model.n_layers)
    return [d for d in degrees if d == 1 or checkpoint_refusal(run.checkpoint, d) is None]


def plan_with_pipelines(cfg: DictConfig, cluster: Cluster, axes: dict, fixed: dict) -> list[dict]:
    """Rows of every layout an auto job may run, ranked: the pp = 1 layouts (``plan_layouts``)
    and, for each degree of ``planned_pp`` above 1, the pipeline rows priced from one stage
    (``pipeline.pipeline_entries``: each schedule, its micro-batches and stages per rank), the
    ``fixed`` degrees holding inside the stage. A degree whose stages have no valid layout adds
    no row; ConfigError when no degree has one."""
    run = to_run_config(cfg)
    degrees = planned_pp(run, cluster)
    flat = cfg.copy()
    flat.parallel.pp = 1  # a stage, and a pp = 1 layout, is planned as a job without pp
    rows: list[dict] = []
    errors: list[str] = []
    for pp in degrees:
        try:
            if pp == 1:
                rows += plan_layouts(flat, cluster, axes, fixed)
                continue
            rows += pipeline_entries(
                flat, cluster, pp, lambda c, cl, **kw: plan_layouts(c, cl, axes, fixed, **kw)
            )
        except ConfigError as err:
            errors.append(str(err))
    if not rows:
        raise ConfigError("; ".join(errors) or "no pipeline layout is valid for this job")
    plan_report.rank(rows)
    return rows


def apply_choice(
    cfg: DictConfig, overrides: dict, plan_json: Path | str, node: ClusterConfig | dict
) -> None:
    """Write a planned choice into ``cfg``: the chosen layout's ``overrides`` (its degrees;
    ``parallel.pp`` = 1 unless it is a pipeline row, ``parallel.ep`` = 1 unless the model has
    experts), ``plan.source`` = ``plan_json`` and the
    ``cluster`` node it was planned for (a config node, or its plain dict as another rank
    published it)."""
    cfg.cluster = OmegaConf.merge(OmegaConf.structured(ClusterConfig), node)
    for key, value in {"parallel.pp": 1, "parallel.ep": 1, **overrides}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    cfg.plan.source = str(plan_json)


def adopt_plan(cfg: DictConfig, plan_json: Path, world_size: int, ranks_per_node: int) -> dict:
    """Run the plan another process made for this job (a SLURM job's, planned before
    submission): write the plan.json's choice (its fastest fitting layout, as ``plan_job``
    chose it) into ``cfg`` and return that layout's row. ConfigError when the plan is missing
    or was made for another world size."""
    if not plan_json.is_file():
        raise ConfigError(
            f"parallel=auto: this job's plan {plan_json} is missing (the submitting process "
            "writes it into the job's dir); resubmit the job"
        )
    plan = json.loads(plan_json.read_text())
    if plan["world_size"] != world_size:
        raise ConfigError(
            f"parallel=auto: the plan {plan_json} is for {plan['world_size']} ranks, this job "
            f"has {world_size}; resubmit the job so that it is planned for its own ranks"
        )
    best, _ = choose(plan["layouts"])
    if best is None:
        raise ConfigError(f"parallel=auto: no layout of the plan {plan_json} fits; replan the job")
    node = cluster_node(to_run_config(cfg).cluster, world_size, ranks_per_node, None)
    apply_choice(cfg, best["overrides"], plan_json.resolve(), node)
    return best


def describe_adopted(row: dict, plan_json: Path) -> str:
    """One console line for a job that runs a plan made before it started (``adopt_plan``)."""
    return (
        f"parallel=auto runs {_degrees(row)} ({row['layout']}), planned before submission: "
        f"step {row['step_time_s']:.4g} s, {row['mem_gib']:.3g} GiB per rank; "
        f"plan: {plan_json.parent}"
    )


def planned_axes(run: RunConfig, overrides: list[str]) -> dict[str, list]:
    """The choices an auto job plans beside its degrees ({dotted key: values}, as
    ``plan.axes``): ``trainer.accum_reduce`` (every and last) when a step has several
    micro-batches and the command line (``overrides``) does not choose it. The fastest layout
    that fits then decides between the memory of unsharded gradients and the reduce-scatter of
    every micro-batch."""
    chosen = any(o.lstrip("+~").partition("=")[0] == "trainer.accum_reduce" for o in overrides)
    if run.trainer.grad_accum_steps > 1 and not chosen:
        return {"trainer.accum_reduce": [choice.value for choice in AccumReduce]}
    return {}


def _write_plan(
    out_dir: Path,
    cfg: RunConfig,
    cluster: Cluster,
    rows: list[dict],
    overrides: list[str],
    axes: dict,
) -> Path:
    """plan.md and plan.json of the job in ``out_dir``; return plan.json's absolute path."""
    for name in (plan_report.PLAN_JSON, plan_report.PLAN_MD):
        (out_dir / name).unlink(missing_ok=True)  # a rerun of this job plans afresh
    # A job's plan is a record, not a sweep.
    planned = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, write_sweep=None))
    plan_report.write(out_dir, planned, cluster.describe(), rows, overrides, axes)
    return (out_dir / plan_report.PLAN_JSON).resolve()


def describe(choice: AutoChoice) -> str:
    """Two lines for the console: the chosen layout and the runner-up, with their predicted
    step time and memory, the cluster and where the plan is."""
    c = choice.cluster

    def row(entry: dict) -> str:
        return (
            f"{_degrees(entry)} ({entry['layout']}): step {entry['step_time_s']:.4g} s, "
            f"{entry['tps_per_device']:,.0f} tokens/s/device, {entry['mem_gib']:.3g} GiB "
            f"per rank (dominant: {entry['dominant']})"
        )

    second = (
        f"runner-up {row(choice.runner_up)}"
        if choice.runner_up
        else "no runner-up: no other planned layout fits"
    )
    return (
        f"parallel=auto chose {row(choice.chosen)} on cluster {c['name']} ({c['nodes']} x "
        f"{c['gpus_per_node']} ranks, {c['device_memory_gib']:.3g} GiB each; planned in "
        f"{choice.seconds:.1f} s)\n  {second}; plan: {choice.plan_json.parent}"
    )


def _degrees(entry: dict) -> str:
    """A layout row's degrees as ``dp_replicate=2 dp_shard=1 ...``, then any planned choice
    (``planned_axes``) as its override."""
    degrees = [
        f"{k.removeprefix('parallel.')}={v}"
        for k, v in entry["overrides"].items()
        if k.removeprefix("parallel.") in PLANNED_DIMS
    ]
    others = [
        f"{k}={v}"
        for k, v in entry["overrides"].items()
        if k.removeprefix("parallel.") not in PLANNED_DIMS
    ]
    return " ".join(degrees + others)


def _ac_ladder(model: ModelConfig, precision: PrecisionConfig) -> list[AC]:
    """The activation-checkpointing settings of ``model`` in ``precision``, from the one that
    keeps most to the one that keeps least. With MoE blocks: the experts' activation alone
    (``moe_act``, no matmul again; not beside float8 experts, which it is refused with), then
    selective, then the MoE feed-forward alone (``moe``: in an MoE model it keeps less than
    selective, docs/moe.md), then full; without: none, selective, full."""
    moe_blocks = model.n_layers - (getattr(model, "n_dense_layers", 0) or 0)
    if routed_experts(model) == 0 or moe_blocks < 1:
        return [AC.none, AC.selective, AC.full]
    act = [] if precision.float8_experts else [AC.moe_act]
    return [AC.none, *act, AC.selective, AC.moe, AC.full]


def remedies(cfg: DictConfig, cluster: Cluster, fixed: dict) -> list[tuple[str, dict | None]]:
    """What could make the job fit, each planned: (the change as an override, its best
    fitting row or None). Tried, one step each (each costs fake measurements): each stronger
    activation checkpointing (``_ac_ladder``), half the global batch, twice the micro-batches at the same
    global batch (gradients reduced every micro-batch, so FSDP's stay sharded), twice the
    nodes."""
    tried: list[tuple[str, Scenario]] = []
    order = _ac_ladder(
        cfg.model, cfg.precision
    )  # the job's own setting is on it: the config checks refuse others
    for ac in order[order.index(AC(cfg.parallel.ac)) + 1 :]:
        variant = cfg.copy()
        variant.parallel.ac = ac
        tried.append((f"parallel.ac={ac.value}", Scenario(variant, cluster, {}, fixed)))
    if cfg.trainer.global_batch_size % 2 == 0:
        variant = cfg.copy()
        variant.trainer.global_batch_size = cfg.trainer.global_batch_size // 2
        tried.append(
            (
                f"trainer.global_batch_size={variant.trainer.global_batch_size}",
                Scenario(variant, cluster, {}, fixed),
            )
        )
    accum = cfg.trainer.grad_accum_steps * 2
    if cfg.trainer.global_batch_size % accum == 0:
        variant = cfg.copy()
        variant.trainer.grad_accum_steps = accum
        variant.trainer.accum_reduce = AccumReduce.every.value
        tried.append(
            (
                f"trainer.grad_accum_steps={accum} trainer.accum_reduce=every",
                Scenario(variant, cluster, {}, fixed),
            )
        )
    more = dataclasses.replace(cluster, nodes=cluster.nodes * 2)
    tried.append(
        (f"launcher.nnodes={more.nodes} ({more.world_size} ranks)", Scenario(cfg, more, {}, fixed))
    )
    results = plan_scenarios([s for _, s in tried], on_error=lambda scenario, err: None)
    return [(label, choose(rows or [])[0]) for (label, _), rows in zip(tried, results)]


def fits_nowhere(cfg: DictConfig, cluster: Cluster, fixed: dict, plan_json: Path) -> str:
    """The error for a job that fits on no layout: the smallest need, and what would fit."""
    found = remedies(cfg, cluster, fixed)
    fits = [
        f"{label} ({_degrees(row)}: {row['mem_gib']:.3g} GiB per rank, step "
        f"{row['step_time_s']:.3g} s)"
        for label, row in found
        if row is not None
    ]
    tried = ", ".join(label for label, _ in found)
    advice = (
        ("would fit: " + "; ".join(fits))
        if fits
        else (
            f"none of {tried} fits either; use devices with more memory (cluster=<preset>) or a "
            "smaller model"
        )
    )
    return (
        f"parallel=auto: model {cfg.model.name} fits on no layout of {cluster.world_size} "
        f"ranks x {cluster.device_memory_gib:.3g} GiB (cluster {cluster.name}; every layout "
        f"is in {plan_json.parent / plan_report.PLAN_MD}); {advice}"
    )
