"""Step time per rank of a layout: compute plus the communication that compute cannot hide.

- **Compute** (``precision_cost.compute_seconds``): matmul FLOPs at the compute dtype's peak,
  the float8 linears' at the float8 peak (both x the architecture's measured GEMM efficiency
  x ``cluster.compute_efficiency``), attention at its measured share of peak by tokens, and
  the work between matmuls (norms, activations, float8 casts) at memory bandwidth or its
  launches, eager or compiled.
  FLOPs are the
  runner's own count (the model's ``flops_per_token`` x tokens / world size: TP splits the
  matmuls, data parallelism the batch), plus what activation checkpointing recomputes in
  backward: with ``full`` the forward of every block once more, with ``selective`` the
  forward of the matmuls its policy does not save (``sharding._selective_contexts``: every
  other one; the model's ``selective_recompute_flops_per_token``). Forward is 1/3 of it,
  backward 2/3.
- **Communication** = ``comm_model.analytic_comm`` (calls and bytes per collective kind and mesh
  dim, proven equal to what a job measures), each priced by ``Cluster.price`` over the links
  its groups use: ``topology.placement`` says, from the node-aware mesh layout, how many ranks
  of one group share a node (k) and how many groups of the dim share it; NVLink inside a node,
  k GPUs' share of the node's NICs (capped by NVLink) across nodes; ring factors, per-call
  latency. An ep group spanning nodes exchanges tokens by node (``node_exchange``): its
  ``ep_inter`` stage (one rank a node) crosses the NICs, its ``ep_intra`` stage stays on
  NVLink.
- **Overlap**, as torch 2.13's FSDP2 schedules it: all-gathers run ahead of the unit that needs
  them, so only the first unit's all-gather of each pass is exposed (the root in forward, the
  last block in backward); each unit's reduce-scatter (and HSDP/DDP all-reduce over
  ``dp_replicate``, issued right after it in the same post-backward) overlaps the backward of
  the units before it, so only the last unit's (the root's) is exposed. The rest hides behind
  up to ``cluster.overlap`` x the compute of its pass. With ``trainer.grad_accum_steps`` = N
  every micro-batch is a forward and a backward pass of its own (all-gathers and exposures N
  times, ``comm_model`` counts them so). Under FSDP/HSDP with ``trainer.accum_reduce=every``
  each micro-batch also reduce-scatters its gradients (N reduce-scatters of the whole
  gradients a step), each hidden behind its own micro-batch's backward; with ``last``, and
  for DDP, they are reduced once, in the last micro-batch's backward, behind 1/N of the
  backward compute. HSDP's replicate all-reduce runs once either way, in the last
  micro-batch (``sharding.set_gradient_sync``). In backward these collectives run at the
  same time (FSDP2 issues them on separate streams): on a link they both use their times add,
  on different links (HSDP: the shard group's reduce-scatter on NVLink, the replicate
  all-reduce on the NICs) they run side by side, so the backward's communication takes its
  latencies plus its busiest link's time. TP collectives and the loss all-reduce sit on the
  critical path: exposed, but for each block's attention input gathered again in backward
  under ``parallel.sp_save_shard`` (``comm_model.attention_regather_comm``), which starts at
  the output projection's backward and runs beside the attention backward (``sp_saves``):
  exposed where it outlasts ``cluster.overlap`` x that backward's seconds (2/3 of the
  attention part); the dense feed-forward's, started at w2's backward, is exposed. Context
  parallel's key/value exchange is exposed too; expert
  parallel's token exchange too, but for what the experts' compute hides when it runs in
  chunks (``exchange_time``, ``parallel.ep_chunks``)
  (``comm_model.context_parallel_comm``): each block's attention waits for its all-gather, and
  the key/value projections' backward for the reduce-scatter of their gradients. It is priced
  apart from FSDP's collectives, which run over the same ``cp`` group when dp_shard = 1; FSDP's
  group is ``dp_shard_cp``, named as the comm model names it (``ParallelDims.same_group``).

- **Step end** = gradient clipping and the fused AdamW step over each rank's shard of the
  trainable parameters, memory-bandwidth bound (``Cluster.step_end_seconds``): whole replicas
  (DDP) pay it for every parameter of their TP part, FSDP/HSDP for 1/(dp_shard x cp) of it.
  On a GPU it is milliseconds; on a CPU with many ranks it separates layouts whose compute and
  communication are alike.

The dominant term is the largest of compute, the step end and each mesh dim's exposed
communication.
"""

from __future__ import annotations

from hsdp_runner.config.schema import RunConfig, TrainerConfig
from hsdp_runner.core.choices import AC, ExchangeOrder
from hsdp_runner.distributed.comm_model import (
    analytic_comm,
    attention_regather_comm,
    context_parallel_comm,
)
from hsdp_runner.distributed.expert_parallel import exchange_chunks
from hsdp_runner.distributed.moe_comm import planned_routing
from hsdp_runner.distributed.parallel_dims import DIM_NAMES, ParallelDims
from hsdp_runner.distributed.param_sizes import expert_wraps, moe_blocks, unit_sizes, view_sizes
from hsdp_runner.distributed.step_passes import stage_passes
from hsdp_runner.distributed.topology import Placement, placement
from hsdp_runner.distributed.world_mesh import EP_STAGES, EXPERT_SPLIT
from hsdp_runner.models.base import ModelConfig, model_spec
from hsdp_runner.models.params import torch_dtype
from hsdp_runner.planner import matmul_shapes, precision_cost
from hsdp_runner.planner.cluster import Cluster, Price
from hsdp_runner.planner.exchange_time import exposed_exchange


def step_flops(
    model_cfg: ModelConfig, trainer: TrainerConfig, ac: AC, world_size: int
) -> tuple[float, float]:
    """(model FLOPs per rank per step, FLOPs the hardware executes incl. recompute)."""
    spec = model_spec(model_cfg)
    tokens = trainer.global_batch_size * model_cfg.seq_len
    model = spec.flops_per_token() * tokens / world_size
    hardware = model
    if ac == AC.full:
        hardware += spec.block_forward_flops_per_token() * tokens / world_size
    elif ac == AC.selective:
        hardware += spec.selective_recompute_flops_per_token() * tokens / world_size
    elif ac == AC.moe:
        hardware += spec.moe_recompute_flops_per_token() * tokens / world_size
    return model, hardware


def placement_of(dims: ParallelDims, dim: str) -> Placement:
    """How the groups of ``dim`` (a mesh dim, a flattened view such as 'dp', 'world': the
    trainer's step-statistics all-reduce when no one dim spans every rank, or a group of the
    experts' split 'efsdp' / 'ep') sit on the nodes of ``dims``. The split cuts ``dp_shard x
    cp x tp``, the innermost ranks, row-major into ``efsdp x ep``: the same placement as a
    mesh whose innermost dims are those two. The by-node exchange's stages (``EP_STAGES``,
    an ep group spanning nodes) split ep once more into (nodes, ranks per node): ``ep_inter``
    one rank a node, ``ep_intra`` a node's ranks."""
    if dim in EXPERT_SPLIT:
        shape = (dims.pp, dims.dp_replicate, dims.efsdp, dims.ep)
        return placement(shape, (*DIM_NAMES[:2], *EXPERT_SPLIT), dim, dims.node_size)
    if dim in EP_STAGES:
        stages = (dims.ep_nodes, dims.ep // dims.ep_nodes)
        shape = (dims.pp, dims.dp_replicate, dims.efsdp, *stages)
        return placement(shape, (*DIM_NAMES[:2], "efsdp", *EP_STAGES), dim, dims.node_size)
    return placement(dims.shape, DIM_NAMES, dim, dims.node_size)


def comm_prices(comm: dict, dims: ParallelDims, cluster: Cluster) -> dict[str, Price]:
    """{'<kind>/<dim>': Price} of every collective of one step (``comm_model.analytic_comm``)."""
    out = {}
    for key, entry in comm.items():
        kind, dim = key.split("/")
        out[key] = cluster.price(kind, placement_of(dims, dim), entry["calls"], entry["bytes"])
    return out


def comm_times(comm: dict, dims: ParallelDims, cluster: Cluster, split: bool = False) -> dict:
    """{'<kind>/<dim>': seconds} of every collective of one step, none hidden; with ``split``
    the values are (latency part, bandwidth part)."""
    return {
        key: (p.latency_s, p.bandwidth_s) if split else p.seconds
        for key, p in comm_prices(comm, dims, cluster).items()
    }


def concurrent_time(prices: list[Price], shares: list[float]) -> float:
    """Seconds that collectives running at the same time take together: every latency, plus the
    busiest link's summed traffic (``shares``: the fraction of each price that runs)."""
    latency = sum(p.latency_s * f for p, f in zip(prices, shares))
    per_link: dict[str, float] = {}
    for price, share in zip(prices, shares):
        for link, seconds in price.link_s.items():
            per_link[link] = per_link.get(link, 0.0) + seconds * share
    return latency + max(per_link.values(), default=0.0)


def link_facts(prices: dict[str, Price], dims: ParallelDims) -> dict[str, dict]:
    """Per term, what was assumed: group size, k, groups per node, nodes, link, algorithm, bus
    bandwidth and seconds (for plan.json and plan.md)."""
    out = {}
    for key, price in prices.items():
        where = placement_of(dims, key.split("/")[1])
        out[key] = {
            **where.describe(),
            "link": price.link,
            "algorithm": price.algorithm,
            "bus_gbps": price.bus_gbps,
            "seconds": price.seconds,
        }
    return out


def _without(comm: dict, part: dict) -> dict:
    """``comm`` less the calls and bytes of ``part`` (both keyed '<kind>/<dim>')."""
    out = {}
    for key, entry in comm.items():
        left = {k: v - part.get(key, {}).get(k, 0) for k, v in entry.items()}
        if left["calls"] and left["bytes"]:
            out[key] = left
    return out


def fsdp_groups(dims: ParallelDims) -> list[str]:
    """The groups FSDP gathers and reduces over, by the names ``comm_model`` gives them
    (``ParallelDims.same_group``): the blocks' and root's (``dp_shard_cp``) first, then, with
    the MoE layers' own wraps (``param_sizes.expert_wraps``), the experts' (``efsdp``) and the
    router's and shared experts' (``dp_shard_cp_tp``) where those are other groups."""
    groups = [dims.same_group("dp_shard_cp")]
    if expert_wraps(dims):
        for view in ("efsdp", "dp_shard_cp_tp"):
            if dims.same_group(view) not in groups:
                groups.append(dims.same_group(view))
    return groups


def _spill(running: list[tuple[str, Price, float]], budget: float) -> dict[str, float]:
    """Seconds of one backward pass's hidden collectives that its compute cannot hide, per
    mesh dim: ``running`` holds (dim, price, share of the price that runs in this pass), all
    at once (``concurrent_time``); what exceeds ``budget`` (overlap x the pass's compute) is
    exposed, split over the dims in proportion to their seconds."""
    seconds: dict[str, float] = {}
    for dim, price, share in running:
        seconds[dim] = seconds.get(dim, 0.0) + price.seconds * share
    total = sum(seconds.values())
    spill = max(
        0.0, concurrent_time([p for _, p, _ in running], [f for _, _, f in running]) - budget
    )
    return {dim: spill * s / total for dim, s in seconds.items()} if total else {}


def step_time(
    cfg: RunConfig, dims: ParallelDims, cluster: Cluster, pipeline_stage: bool = False
) -> dict:
    """Predict one optimizer step of layout ``dims`` for config ``cfg`` on ``cluster``;
    ``pipeline_stage``: the job is one stage of a pipeline whose micro-batches are
    ``trainer.grad_accum_steps`` (``planner.pipeline``), so FSDP gathers and reduces as a
    stage does (``step_passes.stage_passes``).

    Returns compute, exposed communication per mesh dim, the step time, tokens/s/device, MFU
    and the dominant term.
    """
    model_flops, hw_flops = step_flops(cfg.model, cfg.trainer, cfg.parallel.ac, dims.world_size)
    compute_parts = precision_cost.compute_seconds(cfg, dims, cluster, hw_flops)
    compute = sum(compute_parts.values())
    fwd, bwd = compute / 3, 2 * compute / 3
    # The busiest ep rank's exchange: its rows received are plan.expert_imbalance x the mean.
    routing = (
        planned_routing(
            cfg.model, dims, cfg.trainer, dims.local_stages(0), cfg.plan.expert_imbalance
        )
        if dims.moe
        else None
    )
    comm = analytic_comm(
        cfg.model,
        dims,
        cfg.parallel,
        cfg.precision,
        cfg.trainer,
        pipeline_stage=pipeline_stage,
        routing=routing,
    )
    kv = context_parallel_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    regather = attention_regather_comm(
        cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer, pipeline_stage=pipeline_stage
    )
    prices = comm_prices(_without(_without(comm, kv), regather), dims, cluster)
    times = {key: p.seconds for key, p in prices.items()}
    kv_prices = comm_prices(kv, dims, cluster)
    groups = fsdp_groups(dims)
    fsdp = groups[0]
    units = unit_sizes(cfg.model, dims, cfg.trainer.freeze, cfg.parallel.sequence_parallel)
    total = sum(u[0] for u in units.values()) or 1
    # The root unit (embedding, final norm, output) is the dense group's alone.
    root = {g: units.get("root", (0, 0))[0] / total if g == fsdp else 0.0 for g in groups}
    # Units per group: the blocks, or the MoE layers' own (their experts, their router).
    blocks = {
        g: max(1, cfg.model.n_layers if g == fsdp else len(moe_blocks(cfg.model))) for g in groups
    }
    ag = {g: times.get(f"all_gather/{g}", 0.0) for g in groups}
    # all-gathers: forward gathers every unit, backward (with reshard) the blocks again; a
    # pipeline stage gathers in its first forward alone. The passes the comm model counted.
    passes = stage_passes(dims, cfg.parallel, cfg.trainer, pipeline_stage)
    accum = passes.micro_batches
    forward_gathers, backward_gathers = passes.gathers
    fwd_share = {
        g: forward_gathers / (forward_gathers + backward_gathers * (1 - root[g])) for g in groups
    }
    exposed: dict[str, float] = {}

    def expose(dim: str, seconds: float) -> None:
        if seconds > 0:
            exposed[dim] = exposed.get(dim, 0.0) + seconds

    hidden_fwd = {}
    for g in groups:
        expose(g, ag[g] * fwd_share[g] * root[g])
        hidden_fwd[g] = ag[g] * fwd_share[g] * (1 - root[g])
    spill = max(0.0, sum(hidden_fwd.values()) - cluster.overlap * fwd)
    for g, seconds in hidden_fwd.items():
        expose(g, spill * seconds / (sum(hidden_fwd.values()) or 1))
    # Backward, per micro-batch: each gathers its blocks again and hides what it runs behind
    # its own backward compute. The gradients are reduce-scattered in every micro-batch
    # (``trainer.accum_reduce=every`` under FSDP/HSDP, ``step_passes.grad_reductions``) or in
    # the last alone; HSDP's and DDP's all-reduce over dp_replicate runs in the last alone.
    reductions = passes.reductions
    bwd_pass = bwd / accum
    ar_key = "all_reduce/dp_replicate"
    ag_running, rs_running = [], []
    for g in groups:
        expose(g, ag[g] * (1 - fwd_share[g]) / blocks[g])
        # Of the step's all-gather price, what one micro-batch's backward hides.
        share = (1 - fwd_share[g]) * (1 - 1 / blocks[g]) / accum
        if ag[g]:
            ag_running.append((g, prices[f"all_gather/{g}"], share))
        if f"reduce_scatter/{g}" in prices:
            rs_running.append((g, prices[f"reduce_scatter/{g}"], (1 - root[g]) / reductions))
    # The root's reductions are the last of each backward: exposed (each reduction's share).
    for key in (f"reduce_scatter/{fsdp}", ar_key):
        if key in times:
            expose(key.split("/")[1], times[key] * root[fsdp])
    earlier = ag_running + (rs_running if reductions > 1 else [])
    last = ag_running + rs_running
    if ar_key in prices:
        last.append(("dp_replicate", prices[ar_key], 1 - root[fsdp]))
    for dim, seconds in _spill(earlier, cluster.overlap * bwd_pass).items():
        expose(dim, (accum - 1) * seconds)
    for dim, seconds in _spill(last, cluster.overlap * bwd_pass).items():
        expose(dim, seconds)
    overlapped = {ar_key} | {
        f"{kind}/{g}" for g in groups for kind in ("all_gather", "reduce_scatter")
    }
    # The token exchange in chunks: what the experts' compute does not hide (the exchange by
    # node's two stages on their own links), shared out over its keys.
    chunks, exposed_part, exchange = exchange_chunks(cfg.parallel, dims), 1.0, []
    if chunks > 1:
        names = EP_STAGES if dims.ep_nodes > 1 else (dims.same_group("ep"),)
        exchange = [f"all_to_all/{name}" for name in names]
    exchanged = sum(times.get(key, 0.0) for key in exchange)
    # The exchange by node's order: the job's, or (null) the faster of the two, which the
    # plan row then names (``layouts``) so that the job runs what was timed. The flat
    # exchange's two orders are one: timed once, named not.
    by_node = dims.ep_nodes > 1
    if not by_node:
        orders = [ExchangeOrder.breadth_first]
    else:
        orders = (
            [ExchangeOrder(cfg.parallel.ep_order)] if cfg.parallel.ep_order else list(ExchangeOrder)
        )
    chosen_order = None
    if exchanged > 0:
        not_hidden, chosen_order = min(
            (
                exposed_exchange(
                    [times.get(key, 0.0) for key in exchange],
                    compute_parts.get(matmul_shapes.EXPERTS, 0.0),
                    chunks,
                    matmul_shapes.recompute_share(cfg, in_moe=True),
                    AC(cfg.parallel.ac).reruns_moe_forward,
                    cluster.overlap,
                    by_node=by_node,
                    order=order,
                ),
                order,
            )
            for order in orders
        )
        exposed_part = not_hidden / exchanged
    for key, seconds in times.items():
        if key not in overlapped:
            expose(key.split("/")[1], seconds * (exposed_part if key in exchange else 1.0))
    for price in kv_prices.values():
        expose("cp", price.seconds)
    # The attention input gathered again (sp_save_shard) runs beside the attention backward.
    regather_prices = comm_prices(regather, dims, cluster)
    attention_backward = 2 / 3 * compute_parts.get("attention", 0.0)
    regathered = sum(p.seconds for p in regather_prices.values())
    expose("tp", max(0.0, regathered - cluster.overlap * attention_backward))
    views = view_sizes(cfg.model, dims, cfg.trainer.freeze, cfg.parallel.sequence_parallel)
    trainable = sum(sizes[1] // dims.group_size(view) for view, sizes in views.items())
    step_end = cluster.step_end_seconds(trainable, torch_dtype(cfg.precision.master_dtype).itemsize)
    step = compute + step_end + sum(exposed.values())
    terms = {
        "compute": compute,
        "step_end": step_end,
        **{f"comm:{d}": s for d, s in exposed.items()},
    }
    tokens = cfg.trainer.global_batch_size * cfg.model.seq_len
    tps = tokens / step / dims.world_size
    return {
        "step_time_s": step,
        "compute_s": compute,
        "compute_parts_s": compute_parts,
        "step_end_s": step_end,
        "exposed_comm_s": {d: s for d, s in sorted(exposed.items())},
        "comm_total_s": sum(times.values())
        + sum(p.seconds for p in (*kv_prices.values(), *regather_prices.values())),
        "tps_per_device": tps,
        "comm_latency_s": sum(
            p.latency_s for p in (*prices.values(), *kv_prices.values(), *regather_prices.values())
        ),
        "comm_links": {
            **link_facts(prices, dims),
            **{f"{k} (K/V)": v for k, v in link_facts(kv_prices, dims).items()},
            **{f"{k} (again)": v for k, v in link_facts(regather_prices, dims).items()},
        },
        "mfu": model_flops / step / (cluster.peak_tflops * 1e12),
        "dominant": max(terms, key=terms.get),
        "comm": comm,
        # The exchange by node's order timed (None: no such exchange in chunks).
        "ep_order": chosen_order.value if by_node and chosen_order else None,
    }
