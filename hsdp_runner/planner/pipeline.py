"""Pipeline layouts priced from one stage: the bubble of each schedule, the stage-to-stage sends
and the activations the ranks hold through the warm-up.

A pp layout runs ``pp`` stages of ``world / pp`` ranks each (whole nodes: stages are the
outermost mesh dim). Each stage is planned as a job of its own (``layouts.plan_layouts``) on
``nodes / pp`` nodes, with the busiest stage's blocks (``busiest_stage_blocks``: ceil(n_layers /
pp) on an even split; embedding and output layer counted in full) and ``trainer.grad_accum_steps`` = the pipeline's micro-batches ``m``:
that is what a stage does in a step: m forward and backward passes of one micro-batch each,
priced as a stage runs them (``pipeline_stage``: the schedule keeps the parameters gathered
after each backward, so a block resharded after forward is gathered 1 + m times a step and the
root once, ``step_passes.fsdp_gathers``), gradients reduced once after the last. On top of the
stage:

- **Bubble**: with pp stages and m micro-batches, GPipe and 1F1B idle a fraction
  (pp - 1) / (m + pp - 1) of the step (pp - 1 slots of the m + pp - 1 a stage passes through);
  interleaving v stages per rank makes each slot 1/v as long: (pp - 1) / (v m + pp - 1)
  of the step, (pp - 1) / (v m) of the busy time (Narayanan et al. 2021). v is the job's
  ``parallel.pp_stages_per_rank`` where it sets one, else ``DEFAULT_STAGES_PER_RANK``
  (``stages_per_rank``); the busiest rank's blocks are its v stages' (``busiest_stage_blocks``). The zero-bubble schedule splits each backward into its input- and
  weight-gradient halves and fills the bubble with the weight halves: with forward, input
  backward and weight backward equally long (each a third of a micro-batch's forward and
  backward) a third of the interleaved bubble is left (Qi et al. 2024, ZB-H1).
  The compute and communication of the stage's step are stretched by 1 / (1 - bubble).
- **Stage-to-stage sends**: per micro-batch each stage boundary sends the hidden state
  (micro-batch rows x tokens of the rank x dim, compute dtype: ``comm_model.stage_send_bytes``)
  forward and its gradient back; the m + pp - 1 slots of the critical path each wait for one
  send each way, priced as a 2-rank exchange over the link between neighbouring stages
  (across nodes when a stage fills whole nodes); interleaving sends v times as often.
- **Memory**: the stage's measured peak holds one micro-batch's activations, plus its blocks
  gathered between micro-batches (``gathered_blocks_gib``); before their first backward ranks
  hold the saved activations of more micro-batches, counted per rank from the schedule's
  order (``pipeline_schedule.held_blocks``: each of the rank's stages' blocks times that
  stage's micro-batches in flight at the rank's peak): GPipe all m, 1F1B min(m, pp - rank)
  of the rank's stage, interleaved schedules per virtual stage (Megatron's warm-up, 2 (pp - 1)
  + (v - 1) pp + 1 chunks on rank 0 of an even split). The most any rank holds, in micro-
  batches of the busiest rank's blocks, is priced; that rank is priced without the output
  layer and loss, whose transients make the measured peak of the stage planned (which
  carries both ends). So it is priced at the peak of its other phases plus the micro-batches
  it holds beyond one, the last stage at the measured peak (plus m - 1 under GPipe), and the
  larger taken (``stage_peak_gib``).

Fitted nothing: every term is arithmetic on the stage's prediction, which ``planner.md``
checks against measurements.
"""

from __future__ import annotations

import dataclasses
from enum import Enum

from omegaconf import DictConfig

from hsdp_runner.config.compose import to_run_config
from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.choices import INTERLEAVED_SCHEDULES, AccumReduce, PPSchedule
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.comm_model import stage_send_bytes
from hsdp_runner.distributed.expert_parallel import chunks_refusal
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.distributed.param_sizes import local_params
from hsdp_runner.distributed.pipeline_settings import job_refusal
from hsdp_runner.distributed.topology import Placement, placement
from hsdp_runner.distributed.world_mesh import DIM_NAMES
from hsdp_runner.models.base import stage_blocks
from hsdp_runner.models.params import torch_dtype
from hsdp_runner.planner.cluster import Cluster
from hsdp_runner.planner.pipeline_schedule import held_blocks

# The schedules the planner prices (every one, whatever ``parallel.pp_schedule`` says).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb")
# Stages per rank an interleaved schedule is offered at when the job leaves
# ``parallel.pp_stages_per_rank`` at 1 (``stages_per_rank``). Only 2: a larger v shrinks the
# bubble (1/v) and the warm-up's held activations (pp + (pp - 1) / v micro-batches), and of
# its costs the planner prices only the v-fold stage-to-stage sends; what each further chunk
# costs on a GPU (a send/receive pair waited for on the critical path, each chunk's FSDP
# gathers and kernels on fewer blocks, the schedule's per-chunk work on the host) is not
# modelled, so offered larger v the ranking would always take the most chunks the blocks
# allow, on grounds it does not price. A job that knows its v sets it and is priced at it.
DEFAULT_STAGES_PER_RANK = 2


def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step of ``schedule`` on ``pp`` stages per rank group, ``m`` micro-
    batches and ``v`` stages per rank (module docstring)."""
    if pp == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    bubble = (pp - 1) / (v * m + pp - 1)
    return bubble / 3 if schedule == "interleaved_zb" else bubble


def stage_peak_gib(
    memory: dict,
    schedule: str,
    pp: int,
    m: int,
    v: int = 1,
    stage_sizes: tuple[int, ...] | None = None,
) -> float:
    """The peak of the busiest rank of a pipeline from its stage's planned ``memory`` (one
    micro-batch in flight; ``saved_activations_gib``, ``forward_held_gib`` and
    ``peak_without_head_gib`` as ``planner.memory.layout_memory`` gives them): the rank holding
    the most (rank 0 without interleaving) holds what the blocks' forward leaves for as many
    micro-batches as ``held_microbatches`` says (``stage_sizes``: the blocks of each stage)
    but is priced without the output layer and loss; the last runs them and, but under GPipe
    (every stage holds all m, the last what its whole forward leaves, output layer and loss
    included), holds one micro-batch. The stage planned carries both ends, so each is priced
    from it and the larger taken."""
    saved = memory["saved_activations_gib"]
    held = memory.get("forward_held_gib", saved)
    held_mb = held_microbatches(schedule, pp, m, v, stage_sizes)
    first = memory["peak_without_head_gib"] + (held_mb - 1) * saved
    last = memory["peak_gib"] + ((m if schedule == "gpipe" else 1) - 1) * held
    return max(first, last)


def held_microbatches(
    schedule: str, pp: int, m: int, v: int = 1, stage_sizes: tuple[int, ...] | None = None
) -> float:
    """Micro-batches' activations, in units of the busiest rank's blocks, that the rank holding
    the most holds at its peak: the largest over ranks of ``pipeline_schedule.held_blocks``
    (each of its stages' blocks times that stage's micro-batches in flight, from the
    schedule's order) over the most blocks a rank holds. ``stage_sizes``: the blocks of each
    of the pp x v stages (``models.base.stage_blocks``); default an even split."""
    sizes = tuple(stage_sizes) if stage_sizes is not None else (1,) * (pp * v)
    busiest = max(sum(sizes[rank::pp]) for rank in range(pp))
    return max(held_blocks(schedule, pp, m, v, sizes)) / busiest


def stages_per_rank(run: RunConfig, schedule: str) -> int:
    """The stages per rank ``schedule`` is priced at for the job ``run``: 1 for GPipe and
    1F1B; for an interleaved schedule the job's ``parallel.pp_stages_per_rank`` where it sets
    more than 1 (a fixed layout, a published figure's VP, a plan or ``parallel=auto`` job that
    names it), else ``DEFAULT_STAGES_PER_RANK``."""
    if PPSchedule[schedule] not in INTERLEAVED_SCHEDULES:
        return 1
    given = run.parallel.pp_stages_per_rank
    return given if given > 1 else DEFAULT_STAGES_PER_RANK


def pipeline_entries(cfg: DictConfig, cluster: Cluster, pp: int, plan_stage) -> list[dict]:
    """Plan rows of every ``pp``-stage layout of ``cfg`` on ``cluster``, one per stage layout
    and priced schedule (``SCHEDULES``, each at ``stages_per_rank``). ``plan_stage(cfg,
    cluster, pipeline_stage=True) -> rows`` plans a stage (the planner's ``plan_layouts``),
    once per distinct busiest rank's blocks among the schedules (``busiest_stage_blocks``;
    nearly always one). Rows carry the pipeline's overrides, its terms (``bubble_s``, exposed
    ``pp`` sends) and the stage row they came from (``stage``). ConfigError when no schedule's
    stages can be cut from the model's blocks."""
    run = to_run_config(cfg)
    m = run.parallel.pp_microbatches or 2 * pp
    by_blocks: dict[int, list[tuple[str, int]]] = {}
    cuts = []
    for schedule in SCHEDULES:
        v = stages_per_rank(run, schedule)
        try:
            by_blocks.setdefault(busiest_stage_blocks(run, pp, v), []).append((schedule, v))
        except ConfigError as err:  # the runner refuses that cut too (``runner_refusal``)
            cuts.append(err)
    if not by_blocks:
        raise cuts[0]
    stage_cluster = (
        dataclasses.replace(cluster, nodes=cluster.nodes // pp)
        if cluster.nodes % pp == 0
        # On one node (``degrees.check_pp_degrees``) a stage is a share of its GPUs.
        else dataclasses.replace(cluster, gpus_per_node=cluster.gpus_per_node // pp)
    )
    out = []
    for blocks, schedules in by_blocks.items():
        stage_rows = plan_stage(_stage_config(cfg, blocks, m), stage_cluster, pipeline_stage=True)
        for row in (row for row in stage_rows if row["valid"]):
            o = row["overrides"]
            tp, cp = o.get("parallel.tp", 1), o.get("parallel.cp", 1)
            dp = o.get("parallel.dp_replicate", 1) * o.get("parallel.dp_shard", 1)
            rows = run.trainer.global_batch_size // dp // m  # a micro-batch's
            sp = run.parallel.sequence_parallel
            hidden = stage_send_bytes(run.model, run.precision, sp, rows, cp, tp)
            shape = (pp, *(o.get(f"parallel.{d}", 1) for d in DIM_NAMES[1:]))
            pair = placement(shape, DIM_NAMES, "pp", cluster.gpus_per_node)
            pair = dataclasses.replace(pair, size=2)
            for schedule, v in schedules:
                if runner_refusal(run, _overrides(row, pp, schedule, v, m), cluster):
                    continue  # a job the runner would refuse before its workers start
                out.append(_entry(row, run, cluster, pp, m, v, schedule, hidden, pair))
    return out


def _stage_config(cfg: DictConfig, blocks: int, m: int) -> DictConfig:
    """``cfg`` as the job one pipeline stage runs: ``blocks`` blocks (MoE blocks alone for a
    model with experts: its dense blocks lead the first stage, the busiest is one of MoE
    blocks, with more weights and the all-to-alls), ``m`` micro-batches accumulated, the
    gradients reduced after the last (torch's PipelineStage turns FSDP's gradient sync off
    until the last micro-batch's backward: the stage holds unsharded gradients and reduces
    once, as ``trainer.accum_reduce=last``)."""
    stage_cfg = cfg.copy()
    stage_cfg.model.n_layers = blocks
    if "n_dense_layers" in stage_cfg.model:
        stage_cfg.model.n_dense_layers = 0
    stage_cfg.trainer.grad_accum_steps = m
    stage_cfg.trainer.accum_reduce = AccumReduce.last.value
    return stage_cfg


def runner_refusal(run: RunConfig, overrides: dict, cluster: Cluster) -> str | None:
    """Why the job ``run`` with a pipeline row's ``overrides`` (dotted key -> value, as the
    row carries them) would be refused on ``cluster`` before its workers start, or None. Asks
    the runner's own checks of a layout, so the planner skips exactly what they refuse: the
    degrees and the pipeline's settings (``ParallelDims.from_config``, which raises
    ``pipeline_settings.layout_refusal``) and the rest of the job's pipeline checks
    (``pipeline_settings.job_refusal``: precision, batch split, checkpoint settings) and the
    token exchange's chunks (``expert_parallel.chunks_refusal``)."""
    # An auto job's ep left to the planner (-1) is 1 where the row does not set it (a dense
    # model: ``auto.apply_choice`` writes it so).
    job = with_overrides(
        run, {"parallel.ep": 1, **overrides} if run.parallel.ep == -1 else overrides
    )
    try:
        dims = ParallelDims.from_config(
            job.parallel, job.model, cluster.world_size, cluster.gpus_per_node
        )
    except ConfigError as err:
        return str(err)
    return job_refusal(dims, job) or chunks_refusal(job.parallel, dims)


def with_overrides(run: RunConfig, overrides: dict) -> RunConfig:
    """``run`` with each dotted key of ``overrides`` set to its value (a choice given by its
    name, as a row's overrides hold it, becomes the field's Enum); ``run`` is not changed."""
    for key, value in overrides.items():
        run = _replaced(run, key.split("."), value)
    return run


def _replaced(node, path: list[str], value):
    head, *rest = path
    old = getattr(node, head)
    if rest:
        value = _replaced(old, rest, value)
    elif isinstance(old, Enum):
        value = type(old)(value)
    return dataclasses.replace(node, **{head: value})


def _overrides(row: dict, pp: int, schedule: str, v: int, m: int) -> dict:
    """The overrides of stage row ``row`` run as ``pp`` stages under ``schedule`` (``v`` stages
    per rank, ``m`` micro-batches)."""
    return {
        "parallel.pp": pp,
        **row["overrides"],
        "parallel.pp_schedule": PPSchedule[schedule].value,
        "parallel.pp_stages_per_rank": v,
        "parallel.pp_microbatches": m,
    }


def _entry(
    row: dict,
    run: RunConfig,
    cluster: Cluster,
    pp: int,
    m: int,
    v: int,
    schedule: str,
    hidden: int,
    pair: Placement,
) -> dict:
    """The pipeline row of stage row ``row`` under ``schedule`` (``v`` stages per rank, ``m``
    micro-batches, ``hidden`` bytes per send, ``pair``: two neighbouring stages' placement)."""
    bubble = bubble_fraction(schedule, pp, m, v)
    # One send each way per slot of the critical path, priced as a 2-rank exchange.
    sends = cluster.price("all_reduce", pair, 2 * v * (m + pp - 1), 2 * v * (m + pp - 1) * hidden)
    busy = row["step_time_s"] - row["step_end_s"]
    bubble_s = busy * bubble / (1 - bubble)
    step = row["step_time_s"] + bubble_s + sends.seconds
    world = cluster.world_size
    tokens = run.trainer.global_batch_size * run.model.seq_len
    memory = dict(row["memory"])
    peak = stage_peak_gib(memory, schedule, pp, m, v, _stage_sizes(run, pp, v))
    memory.update(peak_gib=peak, pipeline_held_activations_gib=peak - memory["peak_gib"])
    exposed = {**row["exposed_comm_s"], "pp": sends.seconds}
    terms = {
        "compute": row["compute_s"],
        "step_end": row["step_end_s"],
        "bubble": bubble_s,
        **{f"comm:{d}": s for d, s in exposed.items()},
    }
    stage_flops = row["mfu"] * row["step_time_s"]  # model FLOPs / peak of the stage's step
    return {
        **row,
        "overrides": _overrides(row, pp, schedule, v, m),
        "fits": memory["peak_gib"] <= cluster.device_memory_gib,
        "mem_gib": memory["peak_gib"],
        "memory": memory,
        "step_time_s": step,
        "tps_per_device": tokens / step / world,
        # The stage's model FLOPs are its blocks' share; the whole model's over all stages.
        "mfu": stage_flops / step * _flops_ratio(run, pp, v),
        "bubble_s": bubble_s,
        "bubble_fraction": bubble,
        "stage_step_time_s": row["step_time_s"],
        "exposed_comm_s": exposed,
        "dominant": max(terms, key=terms.get),
        "layout": f"pp_{row['layout']}" if row["layout"] != "single" else "pp",
        "dims_across_nodes": ["pp"] * (pair.nodes > 1) + row["dims_across_nodes"],
        "rank": None,
    }


def gathered_blocks_gib(run: RunConfig, dims: ParallelDims) -> float:
    """GiB a stage's rank holds beyond its shards because the schedule keeps the stage's
    blocks gathered between micro-batches (``step_passes.fsdp_gathers``): after a micro-batch's
    backward every block stays unsharded until the next forward passes it, so the forward
    after a backward starts with all of them gathered (in ``precision.param_dtype``), next to
    the activations the stage holds. Each parameter is gathered over the group its FSDP unit
    shards over (``param_sizes.local_params``' view): a block's over ``dp_shard x cp``, a
    model with experts' routed experts over ``efsdp`` (nothing to gather where efsdp = 1: ep
    takes every rank of the replica), its router and shared experts over ``dp_shard_cp_tp``.
    Nothing when blocks are not resharded after forward (then one micro-batch's measured peak
    already holds them all gathered). ``run`` is the stage's config (its blocks), ``dims`` its
    layout. Counted on top of the measured peak, which holds up to two blocks gathered
    already: high by at most those."""
    if not run.parallel.reshard_after_forward:
        return 0.0
    held = sum(
        param.numel * (1 - 1 / dims.group_size(param.view))
        for param in local_params(run.model, dims, run.parallel.sequence_parallel)
        if param.unit != "root"
    )
    return held * torch_dtype(run.precision.param_dtype).itemsize / 2**30


def _stage_sizes(run: RunConfig, pp: int, v: int) -> tuple[int, ...]:
    """The blocks of each of the pp x v stages of ``run``'s model (``stage_blocks``, with the
    end stages' weights); ConfigError when a stage would get no block."""
    split = stage_blocks(
        run.model.n_layers,
        pp * v,
        run.parallel.pp_first_stage_less_blocks,
        run.parallel.pp_last_stage_less_blocks,
    )
    return tuple(len(blocks) for blocks in split)


def busiest_stage_blocks(run: RunConfig, pp: int, v: int = 1) -> int:
    """The most blocks one of ``pp`` ranks holds with ``v`` stages each: the model cut into
    pp x v stages (``_stage_sizes``), rank r holding stages r, r + pp, ...
    (``ParallelDims.local_stages``). The stage is planned with these and both ends' modules:
    the busiest rank, priced high rather than low. ConfigError when a stage would get no
    block."""
    sizes = _stage_sizes(run, pp, v)
    return max(sum(sizes[rank::pp]) for rank in range(pp))


def _flops_ratio(run: RunConfig, pp: int, v: int) -> float:
    """The whole model's FLOPs per token over pp x the busiest rank's (``v`` stages each; MFU
    counts the model's useful work once; the stage planned carries the embedding and output in
    full)."""
    from hsdp_runner.models.base import model_spec

    whole = model_spec(run.model).flops_per_token()
    stage_model = dataclasses.replace(run.model, n_layers=busiest_stage_blocks(run, pp, v))
    if hasattr(stage_model, "n_dense_layers"):  # as pipeline_entries plans the stage
        stage_model = dataclasses.replace(stage_model, n_dense_layers=0)
    return whole / (pp * model_spec(stage_model).flops_per_token())
