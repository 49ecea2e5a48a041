"""Expert parallel and the rest of what a mixture of experts needs from the runtime.

A model with experts (``models/base.routed_experts`` > 0) reaches the runtime through hooks
on each MoE block (``moe``; the model file holds no collective, as ``attend`` for context
parallel): ``exchange`` (where the routed tokens go), ``sequence_sum`` (the auxiliary loss's
counts of one sequence, whose parts several ranks hold) and ``aux_grad_scale``. This module
sets them and shards the experts (``apply_expert_parallel``, from ``parallelize.parallelize``
after TP, activation checkpointing and compile, before the blocks' data-parallel wrapping).

- **Token exchange** (``parallel.ep`` > 1): expert parallel borrows ``ep`` of the
  ``dp_shard x cp x tp`` ranks of a replica (ep innermost: ``world_mesh.EXPERT_SPLIT``); ep
  rank r holds experts ``[r E/ep, (r+1) E/ep)``. ``TokenExchange.dispatch`` sends each rank's
  routed token copies (sorted by expert) to the ranks holding their experts with one
  all-to-all of the counts (host read: the split sizes), one of the tokens and one of their
  router weights (fp32: the experts weigh their outputs) at uneven splits (torch's
  differentiable functional ``all_to_all_single``), then reorders what arrived from (source
  rank, local expert) to (local expert, source rank) for the grouped matmul; ``combine``
  sends the weighted outputs back and sums each token's copies.
- **Sharding**: the experts' weights become DTensors ``Shard(0)`` over ``ep`` and
  ``fully_shard`` shards each share over ``efsdp`` (+ ``dp_replicate``: HSDP) on the dim
  ``param_sizes.expert_shard_dim`` picks (dim 1 where a rank holds fewer experts than efsdp
  has ranks, which dim 0 would pad); the router's
  gate and the shared experts (all of ``moe`` but the experts) over ``dp_shard_cp_tp`` (+
  ``dp_replicate``). Both divide the summed gradients by ``dp_replicate x dp_shard x cp``: the
  MoE runs on each tp rank's part of the sequence, so tp ranks' gradients are pieces of one
  sum, not copies to average. All these meshes derive from the world mesh's root, which
  FSDP2 requires to shard a parameter that is a DTensor over another mesh (docs/moe.md). Under
  TP alone, or ep = 1 with TP, the same wrapping sums the tp ranks' pieces.
- **Auxiliary loss**: ``sequence_sum`` all-reduces the per-sequence expert counts over the
  ``cp_tp`` ranks; ``aux_grad_scale`` (``set_aux_grad_scale``, from ``pipeline.build_stages``)
  is ``cp / micro-batches`` without a pipeline and ``cp`` under one (torch's schedules divide
  the gradients by the micro-batches themselves).

The balance step after each optimizer step (counts all-reduced, the loss-free bias updated,
per-step figures) is ``expert_balance.py``'s.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hsdp_runner.config.schema import ParallelConfig, PrecisionConfig
from hsdp_runner.core.choices import Dtype, ExchangeOrder
from hsdp_runner.distributed.exchange_overlap import flat_overlap
from hsdp_runner.distributed.node_exchange import NodeExchange, permute_blocks
from hsdp_runner.distributed.parallel_dims import ParallelDims, WorldMesh
from hsdp_runner.distributed.param_sizes import expert_shard_dim
from hsdp_runner.distributed.world_mesh import EP_STAGES
from hsdp_runner.models.base import ModelConfig, moe_layers, routed_experts


class TokenExchange:
    """The ``MoE.exchange`` of expert parallel over the 1-D ``ep_mesh`` (``models/moe.py``'s
    ``TokenExchange`` protocol): this rank holds local experts ``[r L, (r+1) L)`` of ep rank
    r, L = n_experts / ep."""

    # Set under compiled blocks (``keep_out_of_compiled_code``): the rows that arrived are
    # marked a dynamic dim for the compiled code they enter.
    rows_dynamic = False
    # The methods a compiled block runs eagerly (``keep_out_of_compiled_code``): the
    # all-to-alls and their host reads; the copies' gather and their sum compile.
    EAGER = ("send", "send_back")

    def __init__(self, ep_mesh, chunks: int = 1):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        # > 1: the MoE layer exchanges its tokens in this many chunks (``overlap``).
        self.chunks = chunks
        # While a list (``recording_routing``): (rows sent, rows received) of each dispatch of
        # a forward, recomputations left out; what the comm model's token-exchange bytes read.
        self.routing: list[tuple[int, int]] | None = None

    def dispatch(
        self, tokens: torch.Tensor, token: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor
    ):
        """Send the routed copies ``tokens[token]`` (N, dim: this rank's, sorted by global
        expert) and their router weights ``weight`` (N,) to the ranks holding their experts
        (``counts``: (n_experts,) int64 copies per expert). Returns (local tokens (M, dim)
        sorted by local expert, local counts (L,) int64, their weights (M,), the state
        ``combine`` needs)."""
        local, local_counts, local_weight, state = self.send(tokens[token], counts, weight)
        return local, local_counts, local_weight, (state, token, tokens.shape[0], tokens.dtype)

    def combine(self, outputs: torch.Tensor, state, sum_copies):
        """Send the local experts' weighted ``outputs`` (M, dim, dispatch's order) back to the
        ranks the tokens came from, where each token's copies are summed (``sum_copies``: the
        layer's); returns (T, dim) in the tokens' dtype."""
        sent, token, n_tokens, dtype = state
        return sum_copies(self.send_back(outputs, sent), token, n_tokens, dtype)

    def send(self, tokens: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor):
        """The all-to-alls of ``dispatch`` (its copies ``tokens``, N rows, and their
        ``weight``): (local tokens, local counts, local weights, the state ``send_back``
        needs)."""
        from torch.distributed._functional_collectives import all_to_all_single

        sent, received = self.exchange_counts(counts)
        splits = self.split_sizes(sent, received)
        # Inside a backward (activation checkpointing recomputing the forward): not recorded.
        if self.routing is not None and torch._C._current_graph_task_id() == -1:
            self.routing.append((sum(splits[0]), sum(splits[1])))
        arrived = all_to_all_single(tokens, splits[1], splits[0], self.group)
        arrived_weight = all_to_all_single(weight, splits[1], splits[0], self.group)
        order, inverse = self.by_local_expert(received, arrived.shape[0])
        local, local_weight = arrived.index_select(0, order), arrived_weight.index_select(0, order)
        if self.rows_dynamic:
            for rows in (local, local_weight, inverse):
                torch._dynamo.maybe_mark_dynamic(rows, 0)
        return local, received.sum(0), local_weight, (inverse, splits)

    def by_local_expert(self, received: torch.Tensor, total: int):
        """(The order that takes ``total`` arrived rows, come as blocks of ``received[source,
        local expert]`` rows, local-expert-major for the grouped matmul; the index that puts
        them back)."""
        order = _by_local_expert(received, total)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return order, inverse

    def chunk_counts(self, copies: list[torch.Tensor], counts: list[torch.Tensor]):
        """``exchange_counts`` of C chunks at once (``exchange_overlap``): one all-to-all of
        their (n_experts,) ``counts`` (of their ``copies``' rows). Returns (sent, received): C
        tensors (ep, L) each."""
        chunks = len(counts)
        stacked = torch.stack(counts).view(chunks, self.ep, -1).transpose(0, 1).reshape(-1)
        sent, received = self.exchange_counts(stacked)
        sent, received = (t.reshape(self.ep, chunks, -1).transpose(0, 1) for t in (sent, received))
        return list(sent), list(received)

    def local_counts(self, received: torch.Tensor) -> torch.Tensor:
        """(L,) rows per local expert of one chunk, from its ``received`` (ep, L)."""
        return received.sum(0)

    def chunk_split_sizes(self, sent: list[torch.Tensor], received: list[torch.Tensor]):
        """Per chunk (rows sent to each ep rank, rows received from each): host values,
        one device-to-host read for all the chunks."""
        both = torch.stack([torch.stack([s.sum(1), r.sum(1)]) for s, r in zip(sent, received)])
        return [tuple(pair) for pair in both.tolist()]

    def overlap(self, tokens, routing, compute, weights, sum_copies) -> list[torch.Tensor]:
        """The chunks' exchange with ``compute`` (the experts) between its all-to-alls
        (``exchange_overlap.flat_overlap``, which says the arguments): each chunk's (T_i,
        dim)."""
        return flat_overlap(self, tokens, routing, compute, weights, sum_copies)

    def exchange_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sent, received): (ep, L) int64 rows this rank sends to [destination rank, its local
        expert] (``counts`` viewed so) and receives from [source rank, local expert] (the
        counts all-to-alled). The planner's memory run replaces it with planned routing."""
        from torch.distributed._functional_collectives import all_to_all_single

        received = all_to_all_single(counts, None, None, self.group)
        return counts.view(self.ep, -1), received.view(self.ep, -1)

    def split_sizes(self, sent: torch.Tensor, received: torch.Tensor) -> list[list[int]]:
        """[rows sent to each ep rank, rows received from each]: host values, one
        device-to-host read per layer and pass."""
        return torch.stack([sent.sum(1), received.sum(1)]).tolist()

    def send_back(self, outputs: torch.Tensor, state) -> torch.Tensor:
        """Send the local experts' ``outputs`` (M, dim, dispatch's order) back to the ranks
        the tokens came from; returns (N, dim) in the order of the copies ``send`` took."""
        from torch.distributed._functional_collectives import all_to_all_single

        inverse, (sent, received) = state
        return all_to_all_single(outputs.index_select(0, inverse), sent, received, self.group)


@contextlib.contextmanager
def recording_routing(parts: list[nn.Module], record: bool):
    """Within the block, with ``record``, every token exchange of ``parts`` (a rank's stage
    chunks) appends (rows sent, rows received) of each forward dispatch to one list, which the
    block gets (the rows a rank's first forwards send and receive: host values the exchange
    reads anyway, so nothing is added to the step); without ``record``, or for a model
    without expert parallel, the block gets None."""
    exchanges = {
        id(moe.exchange): moe.exchange
        for part in parts
        for moe in moe_modules(part).values()
        if isinstance(moe.exchange, (TokenExchange, NodeExchange))
    }
    if not record or not exchanges:
        yield None
        return
    routing: list[tuple[int, int]] = []
    for exchange in exchanges.values():
        exchange.routing = routing
    try:
        yield routing
    finally:
        for exchange in exchanges.values():
            exchange.routing = None


def _by_local_expert(received: torch.Tensor, total: int) -> torch.Tensor:
    """The gather index that reorders ``total`` rows arrived as blocks of
    ``received[source, local expert]`` rows (source-major, each source's rows sorted by
    expert) into local-expert-major order (each expert's rows by source)."""
    return permute_blocks(received, (1, 0), total)


class SequenceSum:
    """The ``MoE.sequence_sum`` of a model whose sequences are split over ranks (context
    parallel, and tp under which the MoE runs on each rank's part): sums a (sequences,
    n_experts) count tensor over the ``cp_tp`` mesh's group (torch's functional all-reduce)."""

    def __init__(self, mesh):
        self.group = mesh.get_group()

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_reduce

        return all_reduce(counts, "sum", self.group)


def moe_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{block index: its MoE layer} of ``model``'s (a stage's) blocks that have one (the
    family's ``moe_layers``, through the seam ``models.base.moe_layers``); empty for a dense
    model. The indices are the whole model's (a stage keeps its blocks' keys)."""
    layers = {id(moe) for moe in moe_layers(model)}
    found = {}
    for key, block in model.blocks().items() if layers else ():
        for module in block.modules():
            if id(module) in layers:
                found[int(key)] = module
    return found


def apply_expert_parallel(
    model: nn.Module,
    dims: ParallelDims,
    world: WorldMesh,
    mp_policy,
    experts_policy,
    reshard_after_forward: bool,
    compiled: bool = False,
    chunks: int = 1,
    order: ExchangeOrder = ExchangeOrder.breadth_first,
) -> None:
    """Set the MoE hooks of ``model`` (a stage, on the meta device) and shard its experts over
    the ``ep``, ``efsdp`` and ``dp_shard_cp_tp`` meshes of ``world`` (see the module
    docstring), with ``mp_policy`` (the dense blocks' ``MixedPrecisionPolicy``; the routed
    experts' unit ``experts_policy``: ``mixed_precision.mixed_precision_policy``) and
    ``reshard_after_forward``; with ``compiled`` (``parallel.compile``: the blocks were
    compiled), ``keep_out_of_compiled_code``; ``chunks`` and ``order``: the exchange's
    (``exchange_chunks``, ``exchange_order``). Nothing to do for a dense model. The MoE's own
    ``fully_shard`` wraps come only where a rank's MoE gradients are pieces that the dense
    blocks' wrapping would not sum (tp > 1) or its experts differ from its peers' (ep > 1);
    otherwise they stay in their block's unit."""
    moes = moe_modules(model)
    if not moes:
        return
    exchange = make_exchange(dims, world, chunks, order)
    sequence_sum = SequenceSum(world["cp_tp"]) if dims.cp * dims.tp > 1 else None
    for moe in moes.values():
        if exchange is not None:
            moe.exchange = exchange
        if sequence_sum is not None:
            moe.sequence_sum = sequence_sum
    if dims.ep > 1 or dims.tp > 1:
        for moe in moes.values():
            if dims.ep > 1:
                _distribute_experts(moe.experts, world["ep"])
            _shard(
                moe.experts,
                world,
                dims,
                "efsdp",
                experts_policy,
                reshard_after_forward,
                _expert_placement(dims.group_size("efsdp")),
            )
            _shard(moe, world, dims, "dp_shard_cp_tp", mp_policy, reshard_after_forward)
    if compiled:
        keep_out_of_compiled_code(list(moes.values()), exchange)


def make_exchange(
    dims: ParallelDims,
    world: WorldMesh,
    chunks: int = 1,
    order: ExchangeOrder = ExchangeOrder.breadth_first,
) -> TokenExchange | NodeExchange | None:
    """The token exchange of ``dims``: by node (``NodeExchange``: each token crosses to a node
    once) where an ep group spans nodes (``ParallelDims.ep_nodes``: the ranks per node the
    launcher gave, ranks placed on nodes contiguously, as the planner and the node checks
    take them), one all-to-all over ``ep`` inside a node, in ``chunks`` chunks (by node in
    ``order``); None without expert parallel."""
    if dims.ep_nodes > 1:
        return NodeExchange(world["ep"], *(world[name] for name in EP_STAGES), chunks, order)
    return TokenExchange(world["ep"], chunks) if dims.ep > 1 else None


# parallel.ep_chunks=null: two chunks, the fewest that overlap (each chunk's grouped matmuls
# stay as large as they can), as Megatron's all-to-all overlap pairs two micro-batches.
DEFAULT_CHUNKS = 2


def exchange_chunks(parallel: ParallelConfig, dims: ParallelDims) -> int:
    """The chunks each rank's tokens are exchanged in (``exchange_overlap``): 1 without
    expert parallel or with compiled blocks, else ``parallel.ep_chunks`` (None:
    ``DEFAULT_CHUNKS``), for the flat exchange and the exchange by node alike. What the
    runtime builds, the comm model counts and the planner prices."""
    if dims.ep == 1 or parallel.compile:
        return 1
    return parallel.ep_chunks if parallel.ep_chunks is not None else DEFAULT_CHUNKS


def exchange_order(parallel: ParallelConfig) -> ExchangeOrder:
    """The order a job's exchange by node runs its chunks in: ``parallel.ep_order``, breadth
    first where null (the planner chooses for null instead: ``planner.step_time``, which names
    its choice in the plan row's overrides)."""
    return ExchangeOrder(parallel.ep_order or ExchangeOrder.breadth_first)


def chunks_refusal(parallel: ParallelConfig, dims: ParallelDims) -> str | None:
    """Why ``parallel.ep_chunks`` cannot run with these degrees and settings (a message
    naming the keys and the fix), or None."""
    chunks = parallel.ep_chunks
    if chunks is None or chunks == 1:
        return None
    if chunks < 1:
        return f"parallel.ep_chunks={chunks} must be >= 1 (or null: chosen for the layout)"
    if parallel.compile:
        return (
            f"parallel.ep_chunks={chunks} with parallel.compile=true: the chunked exchange runs "
            "eagerly only; set parallel.ep_chunks=1 (or null) or parallel.compile=false"
        )
    return None


def keep_out_of_compiled_code(
    moes: list[nn.Module], exchange: TokenExchange | NodeExchange | None
) -> None:
    """Compiled blocks with experts: what depends on the step's routing as host values runs
    eagerly between the compiled parts, and the row counts it hands them are dynamic dims, so
    a block compiles once however the tokens are routed (docs/moe.md, "Compile").

    - ``exchange`` (ep > 1): its all-to-alls never compiled (``EAGER``: their split sizes
      are read on the host each step; a compiled all-to-all would guard on them; the flat
      exchange's gather of the copies and its sum compile, the by-node exchange runs whole),
      the arrived rows and weights (M, a new count every step) and their order marked
      dynamic on dim 0;
    - the experts' inputs (rows and weights) and outputs (ep > 1) marked again by a forward
      pre-hook and hook registered after FSDP's: FSDP's pre-forward hook hands the experts
      new tensors (its post-backward autograd function), which lose the exchange's marking;
    - the per-expert loop (``model.grouped_mm=false``, the reference) never compiled: it
      splits the rows by counts read on the host, and Dynamo specialises a count of 0 or 1,
      so a compiled loop recompiles whenever an expert gets 0 or 1 rows.

    Called after the MoE's ``fully_shard`` wraps (the hooks' order); ``torch._dynamo`` is
    imported only here, by a compiled job."""
    mark_rows = torch.compiler.disable(_rows_dynamic)
    for moe in moes:
        moe.experts._loop = torch.compiler.disable(moe.experts._loop)
        if exchange is not None:
            moe.experts.register_forward_pre_hook(mark_rows)
            moe.experts.register_forward_hook(mark_rows)
    if exchange is not None:
        exchange.rows_dynamic = True
        for name in exchange.EAGER:
            setattr(exchange, name, torch.compiler.disable(getattr(exchange, name)))


def _rows_dynamic(experts: nn.Module, args: tuple, output: torch.Tensor | None = None) -> None:
    """Forward pre-hook (``args``: the rows the experts receive, their counts, their router
    weights) and hook (``output``: the rows they return) of the experts: mark dim 0 dynamic
    for the compiled code around them."""
    for rows in (args[0], args[2]) if output is None else (output,):
        torch._dynamo.maybe_mark_dynamic(rows, 0)


def _distribute_experts(experts: nn.Module, ep_mesh) -> None:
    """Replace each weight of ``experts`` (n_experts first) by a DTensor ``Shard(0)`` over
    ``ep_mesh``: this rank keeps its own experts' rows (no communication; meta or not)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, param in list(experts.named_parameters(recurse=False)):
        shard = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        setattr(experts, name, nn.Parameter(shard, requires_grad=param.requires_grad))


def _expert_placement(shard: int):
    """FSDP's ``shard_placement_fn`` for the routed experts' weights over ``shard`` (efsdp)
    ranks: ``Shard`` on the dim ``param_sizes.expert_shard_dim`` picks for what this rank holds
    (its experts' rows of an ep DTensor)."""
    from torch.distributed.tensor import DTensor, Shard

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(expert_shard_dim(local.shape, shard))

    return placement


def _shard(
    module, world, dims, over: str, mp_policy, reshard_after_forward: bool, placement=None
) -> None:
    """``fully_shard`` ``module`` over the view ``over`` (with ``dp_replicate``: HSDP), its
    gradients divided by ``dp_replicate x dp_shard x cp`` (the ranks whose losses the job
    objective averages); ``placement``: FSDP's ``shard_placement_fn`` (None: dim 0).

    gloo has no pre-multiplied sum, which FSDP2 reduce-scatters with when the factor is not
    the shard group's size: there the reduction sums, then divides. Not on a one-rank shard
    group: torch 2.13 then divides twice (its copy instead of a reduce-scatter divides, and so
    does the sum's division after it), and needs no pre-multiplied sum anyway."""
    from torch.distributed.fsdp import fully_shard

    mesh = world.fsdp_mesh(replicate=dims.dp_replicate > 1, shard=over)
    fully_shard(
        module,
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=placement,
    )
    module.set_gradient_divide_factor(float(dims.dp_replicate * dims.dp_shard * dims.cp))
    if mesh.device_type == "cpu" and dims.group_size(over) > 1:
        module.set_force_sum_reduction_for_comms(True)


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """Set ``aux_grad_scale`` of every MoE block of ``model`` (a stage): ``cp / micro-batches``
    without a pipeline (each micro-batch's loss is divided by their count), ``cp`` under a
    pipeline schedule (which divides the gradients itself). See the module docstring."""
    for moe in moe_modules(model).values():
        moe.aux_grad_scale = scale


@torch.no_grad()
def reset_statistics(model: nn.Module) -> None:
    """Zero the balance statistics of every MoE block of ``model`` (a stage): the routers'
    ``tokens_per_expert`` and the blocks' ``aux_loss_sum``. For a forward that must not count
    (torch's pipeline shape inference); the balance step resets them after each step."""
    for moe in moe_modules(model).values():
        moe.router.tokens_per_expert.zero_()
        moe.aux_loss_sum.zero_()


def compile_refusal(
    parallel: ParallelConfig, precision: PrecisionConfig, model_cfg: ModelConfig
) -> str | None:
    """Why a model with experts cannot run compiled with these settings (a message naming the
    keys and the fix), or None: torch 2.13 compiles ``torch._grouped_mm`` (``model.grouped_mm``)
    for bfloat16 inputs only (its meta function copies the CUDA kernel's check, so the first
    step fails while tracing, on any device; expert parallel itself compiles)."""
    if not parallel.compile or not routed_experts(model_cfg):
        return None
    if getattr(model_cfg, "grouped_mm", False) and Dtype(precision.param_dtype) != Dtype.bfloat16:
        return (
            f"parallel.compile=true with model.grouped_mm=true and precision.param_dtype="
            f"{Dtype(precision.param_dtype)}: torch 2.13 compiles the experts' grouped matmul "
            "for bfloat16 only; use precision=bf16, model.grouped_mm=false (the per-expert "
            "loop) or parallel.compile=false"
        )
    return None
