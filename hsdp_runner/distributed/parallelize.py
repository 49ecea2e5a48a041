"""The sharding applier: TP/SP -> context parallel -> activation checkpointing -> compile ->
expert parallel -> data parallel.

Each step is its own function and ``parallelize`` applies them in that fixed order, the order
FSDP2 expects (it shards what TP already made into DTensors, yielding strided sharding). What is
model-specific (the TP plan, the blocks that are wrapped) comes from the model through the
seam in ``models/base.py``; nothing here knows a model family.
Mixed precision in every data-parallel mode comes from ``MixedPrecisionPolicy``, never autocast.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn

from hsdp_runner.config.schema import ParallelConfig, PrecisionConfig
from hsdp_runner.core.choices import AC, AccumReduce, DDPImpl, DPMode
from hsdp_runner.distributed import float8, float8_experts
from hsdp_runner.distributed.context_parallel import SequenceShard
from hsdp_runner.distributed.expert_parallel import (
    apply_expert_parallel,
    exchange_chunks,
    exchange_order,
)
from hsdp_runner.distributed.mixed_precision import mixed_precision_policy
from hsdp_runner.distributed.parallel_dims import ParallelDims, WorldMesh
from hsdp_runner.distributed.sp_saves import (
    PrepareInputSavingShard,
    saves_shard,
    saves_unpacked,
)
from hsdp_runner.models.base import ModelConfig, ParallelModule, keep_stage, model_spec
from hsdp_runner.models.params import freeze_parameters, torch_dtype

log = logging.getLogger(__name__)


def _new_replicate():
    """Return torch's FSDP-based ``replicate`` if this torch has it, else None."""
    try:
        return importlib.import_module(
            "torch.distributed._composable.replicate_with_fsdp"
        ).replicate
    except (ImportError, AttributeError):
        return None


def apply_tp(
    model: ParallelModule,
    world: WorldMesh,
    sequence_parallel: bool,
    loss_parallel: bool,
    save_shard: bool = False,
) -> None:
    """Shard the model's linear layers over the ``tp`` mesh with the plan beside the model
    (torchao's float8 styles for float8 linears on GPUs, ``float8.tp_styles``); with
    ``loss_parallel`` the logits stay sharded over the vocabulary for the loss; with
    ``save_shard`` (``parallel.sp_save_shard``) the blocks' gathered inputs are saved as the
    rank's shard (``sp_saves``)."""
    tp_mesh = world["tp"]
    styles = float8.tp_styles(model, tp_mesh.device_type)
    if save_shard:
        styles = dataclasses.replace(styles, prepare_input=PrepareInputSavingShard)
    model.tp_plan(tp_mesh, sequence_parallel, styles, loss_parallel)


def apply_cp(
    model: ParallelModule, world: WorldMesh, seq_len: int, parallel: ParallelConfig
) -> None:
    """Run the model on this rank's part of each ``seq_len``-token sequence: positions and
    attention come from a ``context_parallel.SequenceShard`` over the ``cp`` mesh (K/V
    all-gathered per layer), its two query chunks' outputs saved once where no checkpoint of
    the block (``parallel.ac`` none, moe or moe_act) and no compile packs its saved tensors."""
    share = saves_unpacked(parallel)
    model.shard_sequence(SequenceShard(world["cp"], seq_len, share_output=share))


# Every fused attention kernel scaled_dot_product_attention can dispatch to in torch 2.13
# (read in its native_functions.yaml): CUDA's flash, memory-efficient and cuDNN (torch may
# prefer cuDNN on sm90; not seen here, no GPU), CPU's flash, and the overrideable one of other
# accelerators (XPU, out-of-tree backends).
# One missing here is recomputed in backward, and the planner's recompute figure is wrong.
SDPA_FORWARD_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)


def selective_policy():
    """The ``parallel.ac=selective`` policy of one block call: torchtitan's op-level policy.
    The block's 1st, 3rd, 5th, ... matmul outputs are saved and the others recomputed (in our
    block: wq, wv, w1, w2 saved; wk, wo, w3 recomputed), so a block keeps about 60% of the
    matmul outputs for about a third more matmul work in backward; attention
    (``SDPA_FORWARD_OPS``) and TP collective outputs are saved; the cheap element-wise ops
    (norms, activations, RoPE) are recomputed. A fresh count per call, kept apart for forward
    and recomputation, so both passes pick the same matmuls. Returns
    ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten, funcol = torch.ops.aten, torch.ops._c10d_functional
    # _scaled_mm: the float8 matmul (precision.float8 on a GPU; emulated on CPU it is aten.mm).
    # _grouped_mm: the MoE experts' matmuls (models/moe_routing.py), one call per weight.
    matmuls = {aten.mm.default, aten.addmm.default, aten._scaled_mm.default}
    matmuls.add(aten._grouped_mm.default)
    save = {getattr(aten, name).default for name in SDPA_FORWARD_OPS if hasattr(aten, name)}
    # Under float8 training the amax of each cast (torchao's torch.max of |x|): saved, so a
    # recomputed cast uses the scale of the forward one (torchtitan's policy does the same).
    save.add(aten.max.default)
    # TP's collectives, context parallel's K/V all-gather and expert parallel's token
    # exchange: recomputing them would repeat the block's forward communication in backward;
    # their outputs are activations of the rank's tokens (of the whole sequence's keys and
    # values under cp, of the tokens routed to its experts under ep).
    save |= {
        funcol.all_gather_into_tensor.default,
        funcol.reduce_scatter_tensor.default,
        funcol.all_reduce.default,
        funcol.all_to_all_single.default,
    }
    counts = {True: 0, False: 0}  # matmuls seen, keyed by ctx.is_recompute
    # The experts' three grouped matmuls (w1, w3, w2) run once per chunk of a chunked token
    # exchange: every chunk keeps the first chunk's choice for each, so the saved set is the
    # unchunked layer's (the FLOPs ``ModelSpec.selective_recompute_flops_per_token`` counts).
    grouped = {True: [], False: []}

    def policy(ctx, op, *args, **kwargs):
        if op is aten._grouped_mm.default:
            seen = grouped[ctx.is_recompute]
            if len(seen) < 3:
                counts[ctx.is_recompute] += 1
                seen.append(counts[ctx.is_recompute] % 2 == 1)
                keep = seen[-1]
            else:
                keep = seen[len(seen) % 3]
                seen.append(keep)
        elif op in matmuls:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in save
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_contexts():
    """Checkpoint contexts of one block call for ``parallel.ac=selective``
    (``selective_policy``)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy())


# parallel.ac -> the checkpoint_wrapper arguments of each block (None: no wrapping; ``moe``
# checkpoints inside the block, see apply_ac).
_AC_WRAPPER_KWARGS = {
    AC.none: None,
    AC.full: dict,
    AC.selective: lambda: {"context_fn": _selective_contexts},
    AC.moe: None,
    AC.moe_act: None,
}


def apply_ac(model: ParallelModule, mode: AC) -> None:
    """Wrap each block for activation checkpointing.

    'full' recomputes the whole block in backward (TP's forward collectives included);
    'selective' (torchtitan's op-level policy, ``_selective_contexts``) saves every other
    matmul output, attention and TP collective outputs and recomputes the rest, so it repeats
    no communication. 'moe' wraps no block: each block that holds an MoE layer checkpoints its
    feed-forward itself (``recompute_moe``), so parameter names stay the block's own and the
    attention's activations are kept. 'moe_act' wraps nothing either: each routed experts'
    module recomputes its activation's output in backward (``GroupedExperts.recompute_act``).
    """
    if AC(mode) is AC.moe:
        for block in model.blocks().values():
            if hasattr(block, "recompute_moe"):
                block.recompute_moe = True
        return
    if AC(mode) is AC.moe_act:
        for module in model.modules():
            if hasattr(module, "recompute_act"):
                module.recompute_act = True
        return
    make_kwargs = _AC_WRAPPER_KWARGS[AC(mode)]
    if make_kwargs is None:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = make_kwargs()
    blocks = model.blocks()
    for name, block in list(blocks.items()):
        blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


def apply_compile(model: ParallelModule, tp: int, backend: str = "inductor") -> None:
    """Compile each block in place through ``backend`` (``parallel.compile_backend``); names
    and state-dict keys stay unchanged."""
    if tp > 1:
        # torch 2.13 computes an all-zero embedding gradient (TP+FSDP) or crashes in backward
        # (TP alone) when compiled blocks take the TP embedding's output directly; a clone
        # between them avoids it (see tests/test_compile.py).
        model.clone_embedding_output = True
    for block in model.blocks().values():
        block.compile(backend=str(backend))


def apply_data_parallel(
    model: nn.Module,
    dims: ParallelDims,
    world: WorldMesh,
    precision: PrecisionConfig,
    reshard_after_forward: bool,
    ddp_impl: DDPImpl = DDPImpl.replicate,
) -> None:
    """Wrap each block then the root in the data-parallel mode the degrees call for.

    fsdp: ``fully_shard`` on the 1-D ``dp_shard_cp`` mesh (``dp_shard`` when cp = 1: context-
    parallel ranks hold the same parameters); hsdp: on the 2-D (dp_replicate, dp_shard_cp)
    mesh; ddp: torch's FSDP-based ``replicate`` on the 1-D ``dp_replicate`` mesh, so
    it shares FSDP's mixed-precision policy, or with ``ddp_impl='fully_shard'`` (and on torch
    without ``replicate``) ``fully_shard`` on the (dp_replicate, dp_shard=1) mesh: the same
    HSDP-with-shard-size-1 computation. Blocks are ``model.blocks()`` when the model has them.
    With no data parallelism, a size-1 ``fully_shard`` is applied only when the precision
    needs a policy (compute dtype differs from the stored dtype).
    """
    from torch.distributed.fsdp import fully_shard

    mp_policy = mixed_precision_policy(precision)
    mode = dims.dp_mode
    if mode is DPMode.none:
        if precision.param_dtype == precision.master_dtype:
            return
        wrap, mesh_kw = fully_shard, {"mesh": world["dp_shard"]}
    elif mode is DPMode.ddp:
        wanted = DDPImpl(ddp_impl) is DDPImpl.replicate
        replicate = _new_replicate() if wanted else None
        if wanted and replicate is None:
            log.warning(
                "this torch has no FSDP-based replicate; parallel.ddp_impl=fully_shard "
                "is used instead (same computation)"
            )
        if replicate is not None:
            wrap, mesh_kw = replicate, {"mesh": world["dp_replicate"]}
        else:
            wrap, mesh_kw = fully_shard, {"mesh": world["dp_replicate", "dp_shard"]}
    else:
        wrap, mesh_kw = (
            fully_shard,
            {
                "mesh": world.fsdp_mesh(replicate=mode is DPMode.hsdp),
                "reshard_after_forward": reshard_after_forward,
            },
        )
    blocks = model.blocks().values() if hasattr(model, "blocks") else ()
    # A block is called as block(h, cos, sin): h is already in the compute dtype (the root's
    # embedding ran in it), and casting its fp32 RoPE tables to it would round the rotation's
    # angles and cost two casts a block plus RoPE's casts back (torchtitan passes a complex
    # table, which FSDP does not cast).
    block_policy = mixed_precision_policy(precision, cast_forward_inputs=False)
    for block in blocks:
        wrap(block, mp_policy=block_policy, **mesh_kw)
    # The root's parameters (embedding, final norm, output) are used again right at the start
    # of backward, so resharding them after forward would only add an all-gather.
    if "reshard_after_forward" in mesh_kw:
        mesh_kw = {**mesh_kw, "reshard_after_forward": False}
    wrap(model, mp_policy=mp_policy, **mesh_kw)
    # torch 2.13 warns (once per rank) when the root's output is a view (under TP the logits are
    # the local view of a DTensor), because an in-place op on it would skip the pre-backward
    # hook. The trainer's loss reads the logits out of place only; a copy of the largest
    # activation to silence it would cost memory.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view")


def set_gradient_sync(
    model: nn.Module, dims: ParallelDims, accum_reduce: AccumReduce, last: bool
) -> None:
    """Set which gradient collectives the next backward of ``model`` runs: the backward of a
    step's last micro-batch when ``last``, of an earlier one otherwise.

    The last micro-batch always reduces everything. Before it, with ``trainer.accum_reduce=every``
    and gradients sharded (``dp_shard x cp`` > 1: FSDP, HSDP), each backward reduce-scatters its
    gradients, which then accumulate sharded, and HSDP's all-reduce over ``dp_replicate`` waits
    for the last micro-batch (FSDP2's ``set_requires_all_reduce``: the reduce-scattered shards
    are summed in the reduce dtype until then). With ``last``, and for whole replicas (DDP, where
    a reduce-scatter would save nothing) or no data parallelism, sync is off: every rank keeps
    the unsharded gradients until the last micro-batch. A model without a data-parallel wrapper
    is left as it is. The trainer calls it before each micro-batch; a fake step that is to hold
    the trainer's gradients calls it the same way.
    """
    if not hasattr(model, "set_requires_gradient_sync"):
        return
    if dims.dp_shard_cp > 1 and AccumReduce(accum_reduce) is AccumReduce.every:
        model.set_requires_gradient_sync(True)  # sets the all-reduce flag too: reset below
        if dims.dp_replicate > 1:
            model.set_requires_all_reduce(last)
    else:
        model.set_requires_gradient_sync(last)


def sync_buffers(model: nn.Module, world: WorldMesh | None = None) -> int:
    """Broadcast every non-DTensor buffer of ``model`` (a stage) from the first rank holding
    its stage, so all ranks of the stage agree: over ``world``'s ``dp_cp`` groups, then its
    ``tp`` groups (together every rank of the stage, no group of their own needed); without
    ``world``, over all ranks from global rank 0 (a model that is one stage).

    DTensors are kept consistent by their placements; plain buffers are not, and a buffer
    initialised from each rank's RNG would silently differ between replicas. Ranks of another
    pipeline stage hold other blocks' buffers (a mixture of experts' routers), so a broadcast
    over all ranks would pair unrelated buffers. Returns how many buffers were synchronised.
    """
    from torch.distributed.tensor import DTensor

    groups = [None] if world is None else [world["dp_cp"].get_group(), world["tp"].get_group()]
    count = 0
    for buf in model.buffers():
        if not isinstance(buf, DTensor):
            for group in groups:
                dist.broadcast(buf, group=group, group_src=0)
            count += 1
    return count


def parallelize(
    model: ParallelModule,
    dims: ParallelDims,
    world: WorldMesh,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    seq_len: int,
    frozen: list[str] = (),
) -> None:
    """Apply TP/SP, context parallel (for ``seq_len``-token sequences), activation
    checkpointing, compile, expert parallel (a model with experts: its hooks, and the experts'
    own ``fully_shard`` wraps, which the blocks' wraps must come after) and data parallel, in
    that order. ``frozen``: the names of the parameters ``trainer.freeze`` froze, kept frozen
    through TP."""
    if dims.tp > 1:
        apply_tp(
            model,
            world,
            parallel.sequence_parallel,
            parallel.loss_parallel,
            saves_shard(parallel),
        )
        # torch 2.13's sequence-parallel style (and GPT-2's position table's) makes the
        # modules it replicates new parameters with requires_grad=True: freeze them again.
        params = dict(model.named_parameters())
        for name in frozen:
            if name in params:
                params[name].requires_grad_(False)
    if dims.cp > 1:
        apply_cp(model, world, seq_len, parallel)
    apply_ac(model, parallel.ac)
    if parallel.compile:
        apply_compile(model, dims.tp, parallel.compile_backend)
    apply_expert_parallel(
        model,
        dims,
        world,
        mixed_precision_policy(precision),
        # The experts take their rows' router weights as an argument, in fp32 (the product
        # with them is taken in fp32); their rows come in the compute dtype already (the
        # block's), so their unit casts nothing.
        mixed_precision_policy(
            precision,
            cast_forward_inputs=False,
            reduced=dims.group_size("efsdp") * dims.dp_replicate > 1,
        ),
        parallel.reshard_after_forward,
        compiled=parallel.compile,
        chunks=exchange_chunks(parallel, dims),
        order=exchange_order(parallel),
    )
    apply_data_parallel(
        model, dims, world, precision, parallel.reshard_after_forward, parallel.ddp_impl
    )


def parallelized_meta_model(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    world: WorldMesh,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    device: torch.device,
    freeze=(),
    stage: int | None = None,
) -> ParallelModule:
    """The model on the meta device, cut to pipeline ``stage`` (of ``dims.pp_stages``;
    None: whole), float8-converted for ``device`` and parallelized: everything a job does
    before the weights exist (``build_model`` materialises it; the planner's memory child
    measures it under a fake tensor mode). Parameters are named as in the whole model."""
    default_dtype = torch.get_default_dtype()
    # Parameters are created in the storage (master) dtype so FSDP shards and the optimizer
    # keep that dtype; bf16_pure stores bf16, the others fp32.
    torch.set_default_dtype(torch_dtype(precision.master_dtype))
    try:
        with torch.device("meta"):
            model = model_spec(model_cfg).build()
    finally:
        torch.set_default_dtype(default_dtype)
    # On the whole model: a pattern may name another stage's parameters.
    frozen = freeze_parameters(model, freeze)
    if stage is not None:
        keep_stage(
            model,
            stage,
            dims.pp_stages,
            dims.pipeline.first_stage_less_blocks,
            dims.pipeline.last_stage_less_blocks,
        )
    spec = model_spec(model_cfg)
    float8.convert(
        model,
        precision,
        torch.device(device),
        dims.dp_mode,
        model_cfg.vocab_size,
        dims.tp,
        lambda fqn: spec.tp_split_dim(f"{fqn}.weight", parallel.sequence_parallel),
    )
    float8_experts.convert(model, precision, torch.device(device))
    parallelize(model, dims, world, parallel, precision, model_cfg.seq_len, frozen)
    return model


def build_model(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    world: WorldMesh,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    device: torch.device,
    seed: int,
    freeze=(),
    stage: int | None = None,
) -> ParallelModule:
    """Create the model on the meta device, parallelize it, then materialise and initialise
    (``parallelized_meta_model``, then on ``device``).

    With ``stage`` (a pipeline stage index), only that stage of ``dims.pp_stages`` is built
    (``models/base.keep_stage``), parameters named as in the whole model. Returns the
    sharded model on ``device`` with identical weights in every layout and non-DTensor
    buffers equal on every rank of its stage.
    """
    model = parallelized_meta_model(
        model_cfg, dims, world, parallel, precision, device, freeze, stage
    )
    model.to_empty(device=device)
    model.init_weights(seed)
    sync_buffers(model, world)
    return model
