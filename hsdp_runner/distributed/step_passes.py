"""How a stage's step passes: its micro-batches, FSDP's all-gathers and gradient reductions.

The passes the communication model (``comm_model``) and the planner count a step's collectives
with, from the layout and the trainer settings: the accumulation loop's over
``trainer.grad_accum_steps`` micro-batches (``parallelize.set_gradient_sync`` switching the
gradient sync per micro-batch), or a pipeline schedule's (``PipelineStage``: every backward
without sync, one reduction after the last); how often FSDP gathers each unit and reduces the
gradients (``fsdp_gathers``, ``grad_reductions``), and how a step all-reduces TP's partial
gradients (``partial_grad_reductions``), which depends on whether the runner wraps the model
for data parallelism at all (``has_dp_wrapper``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hsdp_runner.config.schema import ParallelConfig, PrecisionConfig, TrainerConfig
from hsdp_runner.core.choices import AccumReduce, DPMode
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.models.params import torch_dtype


@dataclass(frozen=True)
class StagePasses:
    """How a stage runs its step: ``micro_batches`` forward and backward passes, FSDP's
    all-gathers ``gathers`` (``fsdp_gathers``: of each unit in forward, of each block in
    backward) and its gradient reductions ``reductions`` a step (``grad_reductions``);
    ``scheduled``: run by a pipeline schedule, whose backwards all leave the gradients
    unreduced until one reduction after the last."""

    micro_batches: int
    gathers: tuple[int, int]
    reductions: int
    scheduled: bool = False


def stage_passes(
    dims: ParallelDims,
    parallel: ParallelConfig,
    trainer: TrainerConfig,
    pipeline_stage: bool = False,
) -> StagePasses:
    """The passes of every stage of layout ``dims`` (``parallel``, ``trainer`` config nodes).
    Under a pipeline schedule (pp > 1: ``pp_microbatches`` micro-batches; or
    ``pipeline_stage``: a pp = 1 job priced as one stage of a pipeline, its micro-batches
    ``trainer.grad_accum_steps``) FSDP gathers as a stage does and reduces once; without
    one, as the accumulation loop over ``trainer.grad_accum_steps`` micro-batches does."""
    scheduled = dims.pp > 1 or pipeline_stage
    m = dims.pipeline.microbatches if dims.pp > 1 else trainer.grad_accum_steps
    gathers = fsdp_gathers(m, parallel.reshard_after_forward, scheduled)
    reductions = 1 if scheduled else grad_reductions(dims, trainer)
    return StagePasses(m, gathers, reductions, scheduled)


def grad_reductions(dims: ParallelDims, trainer: TrainerConfig) -> int:
    """How many times a step reduce-scatters the gradients over FSDP's group
    (``parallelize.set_gradient_sync``): every micro-batch with ``trainer.accum_reduce=every``
    when they are sharded (``dp_shard x cp`` > 1), else once, on the last micro-batch. Whole
    replicas (DDP) and HSDP's replicate dim all-reduce once a step either way."""
    if dims.dp_shard_cp > 1 and AccumReduce(trainer.accum_reduce) is AccumReduce.every:
        return trainer.grad_accum_steps
    return 1


def has_dp_wrapper(dims: ParallelDims, precision: PrecisionConfig) -> bool:
    """Whether the runner wraps the model for data parallelism
    (``parallelize.apply_data_parallel``): FSDP, HSDP or DDP (torch's FSDP-based ``replicate``
    or a shard-size-1 ``fully_shard``), or without data parallelism a size-1 ``fully_shard``
    that applies the mixed-precision policy when ``precision.param_dtype`` differs from
    ``precision.master_dtype``."""
    return dims.dp_mode is not DPMode.none or precision.param_dtype != precision.master_dtype


def partial_grad_reductions(
    dims: ParallelDims, precision: PrecisionConfig, passes: StagePasses
) -> tuple[int, int]:
    """How a step all-reduces each TP partial gradient (the norms' under sequence parallel,
    ``param_sizes.tp_partial_grads``) over ``tp``: (times, bytes per element).

    With a data-parallel wrapper (``has_dp_wrapper``) FSDP2 all-reduces it over ``tp`` at
    each of its gradient reductions (``passes.reductions``; ``FSDPParam._get_grad_inner_tensor``),
    in the dtype the gradient has then: the compute dtype when every micro-batch reduces its
    own, else (earlier micro-batches accumulated unreduced: ``trainer.accum_reduce=last``,
    DDP, a pipeline schedule) the reduce dtype FSDP2 accumulates them in
    (``to_accumulated_grad_if_needed``). Without one the gradient stays ``Partial`` and
    DTensor all-reduces it for each op that reads it: the clip's per-gradient norm and the
    fused AdamW step, twice a step in the master dtype.
    """
    if not has_dp_wrapper(dims, precision):
        return 2, torch_dtype(precision.master_dtype).itemsize
    accumulated = passes.scheduled or passes.reductions < passes.micro_batches
    dtype = precision.reduce_dtype if accumulated else precision.param_dtype
    return passes.reductions, torch_dtype(dtype).itemsize


def fsdp_gathers(micro_batches: int, reshard: bool, pipeline_stage: bool) -> tuple[int, int]:
    """How often a step all-gathers FSDP's parameters: (each unit in forward, each block in
    backward), over ``micro_batches`` micro-batches.

    With accumulation every micro-batch's forward gathers every unit (FSDP reshards after each
    backward), and its backward the blocks again when they are resharded after forward
    (``reshard``). A pipeline stage's schedule keeps the parameters gathered after each
    micro-batch's backward and reduces its gradients once, after the last one
    (``PipelineStage.backward_maybe_with_nosync`` and ``perform_reduce_grad``): a block
    resharded after forward is gathered again only by the action after a forward, so with
    every stage's actions ending in a backward, once per micro-batch in backward, plus the
    first forward's gather (1 + m a step, whatever the schedule's order); without resharding,
    and for the root (never resharded after forward), once a step.
    """
    backward = micro_batches if reshard else 0
    return (1 if pipeline_stage else micro_batches), backward
