"""What one rank holds of the model's parameters, from the model shape and the layout alone.

The sizes the communication model (``comm_model``) and the planner count with, read off a meta
model without building a mesh: per FSDP unit, the elements of one rank's TP part of each
parameter (dim 0 padded as FSDP pads it), trainable or frozen (``unit_sizes``), and the group
each unit is sharded over (``unit_views``); the weights a float8 all-gather sends at one byte
per element (``float8_weight_sizes``); the parameters a rank holds as it holds them
(``local_params``) and those whose
gradients TP leaves partial (``tp_partial_grads``). Each takes an optional pipeline stage and
then counts only the parameters ``models/base.keep_stage`` leaves there.

A model with experts (``models/base.moe_layers``) whose MoE layers get their own FSDP wraps
(``expert_wraps``: expert parallel or TP, ``expert_parallel.apply_expert_parallel``) has two
more units per MoE block: '<block>.moe.experts' (this rank's ``n_experts / ep`` experts,
sharded over ``efsdp`` on the dim ``expert_shard_dim`` picks) and '<block>.moe' (router gate
and shared experts, sharded over ``dp_shard_cp_tp``), neither split by TP; the block's unit
keeps the rest.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple, Optional

from torch import nn

from hsdp_runner.distributed import float8
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.models.base import (
    ModelConfig,
    block_prefix,
    build_meta_model,
    model_spec,
    moe_layers,
)
from hsdp_runner.models.params import frozen_names


class LocalParam(NamedTuple):
    """One parameter as a rank holds it before FSDP shards it (``local_params``)."""

    unit: str  # its FSDP unit: '<blocks>.<i>', an MoE block's '<...>.moe(.experts)', 'root'
    name: str
    numel: int  # elements of the rank's part (TP, expert parallel), padded as FSDP pads it
    split: Optional[int]  # the dim TP splits it on, or None
    view: str  # the group FSDP shards its unit over: 'dp_shard_cp', 'efsdp', 'dp_shard_cp_tp'
    experts: bool  # a routed expert weight (sharded over ``ep`` too)


def expert_shard_dim(shape, shard: int) -> int:
    """The dim FSDP shards a rank's routed expert weight on: ``shape`` is what the rank holds
    (its ``n_experts / ep`` experts first, then the weight's rows and columns), ``shard`` the
    ``efsdp`` ranks. FSDP pads the dim it shards to a multiple of ``shard``, and every rank
    stores and gathers the padding: the experts' dim 0 unless padding dim 1 wastes less, as
    where a rank holds fewer experts than ``efsdp`` has ranks (Mixtral's 8 experts at ep 8 over
    efsdp 2: one expert padded to two, each weight stored, gathered and reduced twice over).
    torchtitan shards on dim 1 in that case too. The runtime (``expert_parallel``) and the
    sizes here both ask this function."""

    def padded(length: int) -> float:
        return math.ceil(length / shard) * shard / length

    return 1 if len(shape) > 1 and padded(shape[1]) < padded(shape[0]) else 0


def expert_wraps(dims: ParallelDims) -> bool:
    """Whether a model with experts gets the MoE layers' own FSDP wraps (experts over
    ``efsdp``, router and shared experts over ``dp_shard_cp_tp``): under expert parallel or TP
    (``expert_parallel.apply_expert_parallel``); otherwise they stay in their block's unit."""
    return dims.moe and (dims.ep > 1 or dims.tp > 1)


def _moe_names(model) -> list[str]:
    """The module names of ``model``'s MoE layers (``models/base.moe_layers``)."""
    layers = {id(moe) for moe in moe_layers(model)}
    return [name for name, module in model.named_modules() if id(module) in layers]


def moe_blocks(
    model_cfg: ModelConfig, dims: ParallelDims | None = None, stage: int | None = None
) -> list[int]:
    """The indices of the blocks with an MoE layer (``models/base.moe_layers``) of the model,
    or with ``stage`` of pipeline stage ``stage`` of ``dims``; empty for a dense model."""
    model = build_meta_model(model_cfg)
    blocks = block_prefix(model) + "."
    found = [int(name[len(blocks) :].split(".")[0]) for name in _moe_names(model)]
    if stage is None:
        return found
    mine = dims.stage_blocks(model_cfg.n_layers)[stage]
    return [block for block in found if block in mine]


def local_params(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    sequence_parallel: bool,
    stage: int | None = None,
):
    """``LocalParam`` of every parameter: its TP part (``ModelSpec.tp_split_dim``), or with
    the MoE layers' own wraps (``expert_wraps``) an expert weight's ``n_experts / ep`` experts
    or a router/shared weight whole; dim 0 padded to a multiple of its unit's shard group as
    FSDP pads it. Units: '<blocks>.<i>' (e.g. 'layers.0'), 'root', and an MoE layer's (module
    docstring). With ``stage`` (a pipeline stage index of ``dims.pp_stages``), only that
    stage's parameters (``_on_stage``)."""
    spec, model = model_spec(model_cfg), build_meta_model(model_cfg)
    blocks = block_prefix(model) + "."
    moes = _moe_names(model) if expert_wraps(dims) else []
    for name, param in model.named_parameters():
        if stage is not None and not _on_stage(model, name, blocks, stage, dims):
            continue
        shape, split, padded = list(param.shape), None, 0
        moe = next((m for m in moes if name.startswith(m + ".")), None)
        experts = moe is not None and name.startswith(f"{moe}.experts.")
        if moe is None:
            unit = ".".join(name.split(".")[:2]) if name.startswith(blocks) else "root"
            view = "dp_shard_cp"
            split = spec.tp_split_dim(name, sequence_parallel) if dims.tp > 1 else None
            if split is not None:
                shape[split] //= dims.tp
        elif experts:
            unit, view = f"{moe}.experts", "efsdp"
            shape[0] //= dims.ep
        else:
            unit, view = moe, "dp_shard_cp_tp"
        shard = dims.group_size(view)
        if experts:
            padded = expert_shard_dim(shape, shard)
        shape[padded] = math.ceil(shape[padded] / shard) * shard
        yield LocalParam(unit, name, math.prod(shape), split, view, experts)


def _on_stage(model, name: str, blocks: str, stage: int, dims: ParallelDims) -> bool:
    """Whether parameter ``name`` of the unsplit ``model`` lives on pipeline ``stage``, as
    ``models/base.keep_stage`` cuts it: a block on its stage, the first modules on stage 0,
    the last on the last stage, anything else on every stage (so the one stage of a job
    without pipeline parallel holds every parameter)."""
    if name.startswith(blocks):
        block = int(name[len(blocks) :].split(".")[0])
        return block in dims.stage_blocks(len(model.blocks()))[stage]
    first, last = model.pipeline_ends()
    top = name.split(".")[0]
    if top in first:
        return stage == 0
    return stage == dims.pp_stages - 1 if top in last else True


def unit_sizes(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    freeze=(),
    sequence_parallel: bool = True,
    stage: int | None = None,
) -> dict[str, tuple[int, int]]:
    """Elements per FSDP unit ('<blocks>.<i>', e.g. 'layers.0', or 'root'): (all parameters,
    trainable ones).

    Sizes are one TP rank's part of each parameter (``ModelSpec.tp_split_dim``), dim 0 padded
    to a multiple of ``dp_shard x cp`` (the FSDP shard degree) as FSDP pads it. ``freeze``:
    ``trainer.freeze``'s patterns. With ``stage`` (a pipeline stage index of
    ``dims.pp_stages``), only that stage's parameters (``models/base.keep_stage``); a stage
    without embeddings or output layer has no root unit.
    """
    params = dict(build_meta_model(model_cfg).named_parameters())
    frozen = set(frozen_names(params, freeze))
    units: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for param in local_params(model_cfg, dims, sequence_parallel, stage):
        units[param.unit][0] += param.numel
        units[param.unit][1] += 0 if param.name in frozen else param.numel
    return {unit: (sizes[0], sizes[1]) for unit, sizes in units.items()}


def view_sizes(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    freeze=(),
    sequence_parallel: bool = True,
) -> dict[str, tuple[int, int]]:
    """{group FSDP shards over (``LocalParam.view``): (all elements, trainable ones)} of the
    parameters a rank holds before sharding (as ``unit_sizes``, padded), so that each part
    divides by its own group: the blocks' and root's by ``dp_shard_cp``, the experts' by
    ``efsdp``, an MoE layer's router and shared experts by ``dp_shard_cp_tp``."""
    params = dict(build_meta_model(model_cfg).named_parameters())
    frozen = set(frozen_names(params, freeze))
    views: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for param in local_params(model_cfg, dims, sequence_parallel):
        views[param.view][0] += param.numel
        views[param.view][1] += 0 if param.name in frozen else param.numel
    return {view: (sizes[0], sizes[1]) for view, sizes in views.items()}


def unit_views(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    sequence_parallel: bool = True,
    stage: int | None = None,
) -> dict[str, str]:
    """{FSDP unit (as ``unit_sizes``): the group it is sharded over}: 'dp_shard_cp' for the
    blocks and the root, 'efsdp' for an MoE layer's experts and 'dp_shard_cp_tp' for its router
    and shared experts under their own wraps (``expert_wraps``); HSDP adds ``dp_replicate``."""
    return {
        param.unit: param.view for param in local_params(model_cfg, dims, sequence_parallel, stage)
    }


def float8_weight_sizes(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    sequence_parallel: bool = True,
    stage: int | None = None,
) -> dict[str, list[int]]:
    """Per FSDP unit (as ``unit_sizes``, ``stage`` too), the elements of each weight
    ``float8.convert`` turns into a float8 linear: what a float8 all-gather sends at one byte
    per element."""
    spec, model = model_spec(model_cfg), build_meta_model(model_cfg)
    modules = dict(model.named_modules())
    sizes: dict[str, list[int]] = defaultdict(list)
    for unit, name, numel, *_ in local_params(model_cfg, dims, sequence_parallel, stage):
        fqn, _, leaf = name.rpartition(".")
        module = modules.get(fqn)
        if leaf != "weight" or not isinstance(module, nn.Linear):
            continue
        if not float8.keeps_high_precision(
            fqn,
            tuple(module.weight.shape),
            model_cfg.vocab_size,
            dims.tp,
            lambda f: spec.tp_split_dim(f"{f}.weight", sequence_parallel),
        ):
            sizes[unit].append(numel)
    return dict(sizes)


def tp_partial_grads(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    freeze=(),
    sequence_parallel: bool = True,
    stage: int | None = None,
) -> list[int]:
    """Elements of each trainable parameter (``freeze``: ``trainer.freeze``'s patterns) of
    pipeline ``stage`` (None: the whole model) whose gradient is ``Partial`` over ``tp``: with
    sequence parallel, those of the modules TP keeps whole on every rank (none of their
    parameters split, ``ModelSpec.tp_split_dim``: the norms), whose input is sequence-sharded;
    with or without it, those the family names
    (``ModelConfig.tp_partial_without_sequence_parallel``: norms over each head's channels).
    A mixture of experts' MoE layers are no TP module (their weights are sharded over the
    ranks holding distinct tokens, which sum their gradients). Empty without TP.
    ``ModelSpec.tp_partial_grad_numels`` lists the whole model's under sequence parallel
    (``tests/test_comm.py`` checks that they agree)."""
    if dims.tp == 1:
        return []
    spec, model = model_spec(model_cfg), build_meta_model(model_cfg)
    params = dict(model.named_parameters())
    split = {n.rpartition(".")[0] for n in params if spec.tp_split_dim(n, True) is not None}
    moes = tuple(f"{name}." for name in _moe_names(model))
    frozen = set(frozen_names(params, freeze))
    blocks = block_prefix(model) + "."
    return [
        param.numel()
        for name, param in params.items()
        if name.rpartition(".")[0] not in split
        and not name.startswith(moes)
        and (sequence_parallel or spec.tp_partial_without_sequence_parallel(name))
        and name not in frozen
        and (stage is None or _on_stage(model, name, blocks, stage, dims))
    ]
