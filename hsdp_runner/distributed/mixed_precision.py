"""FSDP2's mixed-precision policy for a precision config: the one place a unit's compute,
reduce and stored dtypes meet (every data-parallel mode takes it, never autocast)."""

from __future__ import annotations

from hsdp_runner.config.schema import PrecisionConfig
from hsdp_runner.models.params import torch_dtype


def mixed_precision_policy(
    precision: PrecisionConfig, cast_forward_inputs: bool = True, reduced: bool = True
):
    """Build the MixedPrecisionPolicy for the ``precision`` config node; ``cast_forward_inputs``
    False for a module whose float inputs must keep their dtype (the blocks' RoPE tables).

    ``reduced`` False for a unit whose gradients no other rank holds (its FSDP group, replicas
    included, is one rank: routed experts that ep alone shards). Its reduce dtype then only
    sets what FSDP2 accumulates a step's unsharded gradients in until they are stored in the
    master dtype (``FSDPParam.to_accumulated_grad_if_needed``: every micro-batch of a pipeline
    schedule, or of ``trainer.accum_reduce=last``), so it is made no wider than the master
    dtype: with bf16 master weights an fp32 reduce dtype doubled the experts' largest transient
    (fp32 copies of every local expert's gradient) for a reduction that sums nothing, the
    gradients a parameter outside FSDP would accumulate in bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch_dtype(precision.reduce_dtype)
    master = torch_dtype(precision.master_dtype)
    if not reduced and master.itemsize < reduce.itemsize:
        reduce = master
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(precision.param_dtype),
        reduce_dtype=reduce,
        cast_forward_inputs=cast_forward_inputs,
    )
