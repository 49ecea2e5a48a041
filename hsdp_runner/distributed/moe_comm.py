"""What a mixture of experts adds to the analytic communication of a step (``comm_model``).

The runtime's collectives of a model with experts (``expert_parallel.py``,
``expert_balance.py``), counted as ``comm_counting`` counts them (an all-to-all by the rank's
input, an all-reduce by its tensor):

- **Token exchange** (``parallel.ep`` > 1, ``expert_parallel.TokenExchange`` over ``ep``):
  per MoE layer and micro-batch, forward all-to-alls the counts (``n_experts`` int64), the
  rank's routed token copies (N rows: its tokens x ``top_k``) and their router weights (N
  fp32) and, in combine, the outputs of the rows its experts received (M rows); backward
  all-to-alls their gradients (M rows, then M weights and N rows). In C chunks (``expert_parallel.exchange_chunks``, ``exchange_overlap``) the counts of
  all chunks go in one call (C x ``n_experts``) and every other call is made once a chunk:
  the same rows in C times the calls. Rows are ``dim`` wide in the compute dtype. ``parallel.ac=full`` (or ``moe``) runs the forward's three
  again in backward (the MoE is recomputed whole: the experts' inputs and outputs are saved
  activations); ``selective`` saves their outputs. N and M are the counted step's routing
  (``expert_parallel.recording_routing``: the rows each forward dispatch sent and received on
  this rank); without it a rank is taken to receive what it sends (balanced experts).
- **Token exchange by node** (an ep group spanning ``ParallelDims.ep_nodes`` > 1 nodes of k
  ranks, ``node_exchange.NodeExchange``): over ``ep_inter`` per MoE layer and micro-batch,
  forward the counts ((n_experts + nodes) int64), the D rows of the rank's distinct (node,
  token) pairs, the N copies' slots (int64) and weights (fp32) and, in combine, the D' rows
  of summed outputs for the pairs it received; backward the D' rows' gradients, the
  weights' (C' fp32: the copies it received) and the D rows'. Over ``ep_intra`` (k > 1):
  forward the counts (n_experts int64), the C' copies it forwards and their weights (fp32)
  and the M outputs of its experts; backward M, then M weights and C' rows. Full AC repeats every forward call; selective saves them.
  The routing a dispatch records is (D, D', N, C', M). In C chunks, as the flat exchange:
  each stage's counts in one call for all chunks (C times the bytes), every other call once
  a chunk.
- **Auxiliary loss** (``model.aux_loss_coef`` > 0 with ``cp x tp`` > 1): per MoE layer and
  micro-batch, ``MoE.sequence_sum`` all-reduces the (rows, ``n_experts``) fp32 counts of the
  rank's sequences over ``cp_tp`` (again under full AC; selective saves it).
- **Balance step** (``expert_balance.ExpertBalance``): after the optimizer step one all-reduce
  over all ranks of every MoE layer's counts and loss value, (``n_experts`` + 1) fp32 each.

The experts' weights' data-parallel collectives (their own FSDP units over ``efsdp`` and
``dp_shard_cp_tp``) are ``param_sizes``' units (their gradient norm rides in the step's
stats, ``train/grad_clip``); the TP collectives of an MoE block (attention's, and without
sequence parallel the MoE's output all-gather and its input gradient's) ``comm_model``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

from hsdp_runner.config.schema import ParallelConfig, PrecisionConfig, TrainerConfig
from hsdp_runner.core.choices import AC
from hsdp_runner.distributed.expert_parallel import exchange_chunks
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.distributed.param_sizes import moe_blocks
from hsdp_runner.models.base import ModelConfig, routed_experts
from hsdp_runner.models.params import torch_dtype

COUNT_BYTES = 8  # the exchange's counts (and the by-node exchange's copies' slots): int64
WEIGHT_BYTES = 4  # the router weight of a copy, travelling with it to its expert: fp32
STAT_BYTES = 4  # the auxiliary loss's counts and the balance step's vector: fp32


def stage_moe_comm(
    tally,
    model_cfg: ModelConfig,
    dims: ParallelDims,
    parallel: ParallelConfig,
    trainer: TrainerConfig,
    stage: int,
    micro_batches: int,
) -> None:
    """Add to ``tally`` the token exchange's calls and the bytes of its counts, and the
    auxiliary loss's all-reduces, of the MoE blocks of pipeline ``stage`` over
    ``micro_batches`` (module docstring); the routed rows' bytes are ``routed_rows``'."""
    layers = len(moe_blocks(model_cfg, dims, stage))
    if not layers:
        return
    again = 2 if AC(parallel.ac).reruns_moe_forward else 1  # full or moe AC: forward again
    passes = layers * micro_batches
    experts = routed_experts(model_cfg)
    chunks = exchange_chunks(parallel, dims)
    if dims.ep_nodes > 1:
        nodes, header = dims.ep_nodes, experts + dims.ep_nodes
        calls = again * (1 + 4 * chunks) + 3 * chunks
        count_bytes = passes * again * chunks * header * COUNT_BYTES
        tally.add("all_to_all/ep_inter", passes * calls, count_bytes)
        if dims.ep > nodes:  # more than one rank a node: the second stage
            calls = again * (1 + 3 * chunks) + 3 * chunks
            count_bytes = passes * again * chunks * experts * COUNT_BYTES
            tally.add("all_to_all/ep_intra", passes * calls, count_bytes)
    elif dims.ep > 1:
        key = f"all_to_all/{dims.same_group('ep')}"
        calls = again * (1 + 3 * chunks) + 3 * chunks
        tally.add(key, passes * calls, passes * again * chunks * experts * COUNT_BYTES)
    if dims.cp * dims.tp > 1 and getattr(model_cfg, "aux_loss_coef", 0) > 0:
        rows = trainer.global_batch_size // dims.dp // micro_batches
        counts = rows * routed_experts(model_cfg) * STAT_BYTES
        tally.add(f"all_reduce/{dims.same_group('cp_tp')}", passes * again, passes * again * counts)


def routed_rows(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    trainer: TrainerConfig,
    stages: Sequence[int],
    routing: Sequence[tuple[int, int]] | None,
) -> dict[str, int]:
    """{'all_to_all/<ep>': bytes} of the token exchange's rows and their router weights in a
    step of a rank holding pipeline ``stages`` (empty without expert parallel): each forward
    dispatch's N rows sent and M received (``routing``: the counted step's (N, M) per
    dispatch; None: balanced, ``planned_routing``), each row moved by forward's dispatch and
    combine and backward's two mirrors, and once more each under full AC; the N weights by
    each forward's dispatch, the M weights' gradients once."""
    if dims.ep == 1 or not dims.moe:
        return {}
    if routing is None:
        routing = planned_routing(model_cfg, dims, trainer, stages)
    again = 2 if AC(parallel.ac).reruns_moe_forward else 1
    row_bytes = model_cfg.dim * torch_dtype(precision.param_dtype).itemsize
    if dims.ep_nodes > 1:
        return _by_node_rows(routing, again, row_bytes, dims.ep > dims.ep_nodes)
    rows = sum(sent + received for sent, received in routing)
    weights = sum(again * sent + received for sent, received in routing) * WEIGHT_BYTES
    return {f"all_to_all/{dims.same_group('ep')}": (again + 1) * rows * row_bytes + weights}


def _by_node_rows(routing, again: int, row_bytes: int, intra: bool) -> dict[str, int]:
    """The by-node exchange's routed bytes (module docstring) of ``routing``'s (D, D', N, C',
    M) per dispatch: ``again`` forwards (2 under full AC) and one backward; ``intra``: k > 1
    (a second stage)."""
    inter = sum(
        (again + 1) * (pairs + pairs_in) * row_bytes
        + again * copies * (COUNT_BYTES + WEIGHT_BYTES)
        + copies_in * WEIGHT_BYTES
        for pairs, pairs_in, copies, copies_in, _ in routing
    )
    out = {"all_to_all/ep_inter": inter}
    if intra:
        rows = sum(copies_in + mine for _, _, _, copies_in, mine in routing)
        weights = sum(again * copies_in + mine for _, _, _, copies_in, mine in routing)
        out["all_to_all/ep_intra"] = (again + 1) * rows * row_bytes + weights * WEIGHT_BYTES
    return out


def planned_routing(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    trainer: TrainerConfig,
    stages: Sequence[int],
    imbalance: float = 1.0,
) -> list[tuple[int, int]]:
    """(rows sent, rows received) per MoE layer of pipeline ``stages`` over a step, as
    ``routed_rows`` reads a recorded routing: the rank's tokens of the step x ``top_k`` sent,
    ``imbalance`` x as many received (1.0: balanced experts; the planner prices the busiest
    ep rank with ``plan.expert_imbalance``). By node (``ParallelDims.ep_nodes`` > 1): (D, D',
    N, C', M) with D = tokens x ``expected_nodes`` (uniform routing), N = tokens x
    ``top_k``, and the received D', C', M ``imbalance`` x D, N, N."""
    layers = sum(len(moe_blocks(model_cfg, dims, stage)) for stage in stages)
    tokens = trainer.global_batch_size // dims.dp * model_cfg.seq_len // (dims.cp * dims.tp)
    sent = tokens * model_cfg.top_k
    if dims.ep_nodes > 1:
        nodes = expected_nodes(routed_experts(model_cfg), model_cfg.top_k, dims.ep_nodes)
        pairs = round(tokens * nodes)
        received = round(sent * imbalance)
        return [(pairs, round(pairs * imbalance), sent, received, received)] * layers
    return [(sent, round(sent * imbalance))] * layers


def expected_nodes(experts: int, top_k: int, nodes: int) -> float:
    """The expected number of distinct nodes a token's ``top_k`` experts sit on, its experts
    drawn uniformly without replacement from ``experts`` spread evenly over ``nodes``: by
    linearity of expectation, ``nodes`` x P(a node is hit), and a node's ``experts / nodes``
    are all missed with probability C(experts - experts / nodes, top_k) / C(experts, top_k).
    A node other than the token's own is hit with the same probability, so ``(nodes - 1) /
    nodes`` of it is what crosses nodes."""
    missed = comb(experts - experts // nodes, top_k) / comb(experts, top_k)
    return nodes * (1 - missed)


def balance_bytes(model_cfg: ModelConfig) -> int:
    """Bytes of the balance step's all-reduce (module docstring); 0 for a dense model."""
    experts = routed_experts(model_cfg)
    return len(moe_blocks(model_cfg)) * (experts + 1) * STAT_BYTES if experts else 0
