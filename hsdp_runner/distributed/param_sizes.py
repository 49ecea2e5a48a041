"""What one rank holds of the model's parameters, from the model shape and the layout alone.

The sizes the communication model (``comm_model``) and the planner count with, read off a meta
model without building a mesh: per FSDP unit, the elements of one rank's TP part of each
parameter (dim 0 padded as FSDP pads it), trainable or frozen (``unit_sizes``); the weights a
float8 all-gather sends at one byte per element (``float8_weight_sizes``); the gradients
the rank clips (``clipped_gradients``) and those TP leaves partial (``tp_partial_grads``). Each takes an optional pipeline stage (or the rank's
stages) and then counts only the parameters ``models/base.keep_stage`` leaves there.
"""

from __future__ import annotations

import math
from collections import defaultdict

from torch import nn

from hsdp_runner.distributed import float8
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.models.base import ModelConfig, block_prefix, build_meta_model, model_spec
from hsdp_runner.models.params import frozen_names


def _local_params(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    sequence_parallel: bool,
    stage: int | None = None,
):
    """(FSDP unit, parameter name, elements on one rank before FSDP sharding, the dim TP
    splits it on or None) of every parameter: its TP part (``ModelSpec.tp_split_dim``), dim 0
    padded to a multiple of ``dp_shard x cp`` as FSDP pads it. Units: '<blocks>.<i>' (e.g.
    'layers.0') or 'root'. With ``stage`` (a pipeline stage index of ``dims.pp_stages``), only
    that stage's parameters (``_on_stage``)."""
    spec, model = model_spec(model_cfg), build_meta_model(model_cfg)
    blocks = block_prefix(model) + "."
    for name, param in model.named_parameters():
        if stage is not None and not _on_stage(model, name, blocks, stage, dims):
            continue
        shape = list(param.shape)
        split = spec.tp_split_dim(name, sequence_parallel) if dims.tp > 1 else None
        if split is not None:
            shape[split] //= dims.tp
        shape[0] = math.ceil(shape[0] / dims.dp_shard_cp) * dims.dp_shard_cp
        unit = ".".join(name.split(".")[:2]) if name.startswith(blocks) else "root"
        yield unit, name, math.prod(shape), split


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
    for unit, name, numel, _ in _local_params(model_cfg, dims, sequence_parallel, stage):
        units[unit][0] += numel
        units[unit][1] += 0 if name in frozen else numel
    return {unit: (sizes[0], sizes[1]) for unit, sizes in units.items()}


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
    for unit, name, numel, _ in _local_params(model_cfg, dims, sequence_parallel, stage):
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


def clipped_gradients(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    freeze=(),
    sequence_parallel: bool = True,
    stages=(0,),
) -> tuple[int, bool]:
    """The gradients a rank holding pipeline ``stages`` clips (its trainable parameters, the
    ones ``freeze``, ``trainer.freeze``'s patterns, leaves out): (how many, whether any is of
    a parameter TP splits, ``ModelSpec.tp_split_dim``)."""
    frozen = set(frozen_names(dict(build_meta_model(model_cfg).named_parameters()), freeze))
    count, tp_split = 0, False
    for stage in stages:
        for _, name, _, split in _local_params(model_cfg, dims, sequence_parallel, stage):
            if name not in frozen:
                count += 1
                tp_split = tp_split or split is not None
    return count, tp_split


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
    parameters split, ``ModelSpec.tp_split_dim``: the norms), whose input is sequence-sharded.
    Empty without TP or sequence parallel. ``ModelSpec.tp_partial_grad_numels`` lists the
    whole model's (``tests/test_comm.py`` checks that they agree)."""
    if dims.tp == 1 or not sequence_parallel:
        return []
    spec, model = model_spec(model_cfg), build_meta_model(model_cfg)
    params = dict(model.named_parameters())
    split = {n.rpartition(".")[0] for n in params if spec.tp_split_dim(n, True) is not None}
    frozen = set(frozen_names(params, freeze))
    blocks = block_prefix(model) + "."
    return [
        param.numel()
        for name, param in params.items()
        if name.rpartition(".")[0] not in split
        and name not in frozen
        and (stage is None or _on_stage(model, name, blocks, stage, dims))
    ]
