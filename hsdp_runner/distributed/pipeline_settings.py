"""The pipeline's settings and every check of a pipeline job, in one place: what
``parallel.pp_*`` resolve to (``PipelineSettings``, a frozen object ``ParallelDims`` holds beside
the degrees) and which jobs a pipeline cannot run, each a message naming the keys and the fix,
raised as a ConfigError before any worker starts.

- ``PipelineSettings.from_config``: the settings' own values (a schedule and a stage count that
  go together, counts >= 0), when ``ParallelDims.from_config`` resolves them;
- ``layout_refusal``: what the degrees, the model and ``parallel.*`` decide (stages vs blocks,
  micro-batches vs stages, the zero-bubble schedule's limits), raised by
  ``ParallelDims.from_config``;
- ``job_refusal``: what the rest of the job's config decides (the precision under zero-bubble,
  gradient accumulation, the batch split into micro-batches, the checkpoint settings), raised
  by the pre-launch checks (``runtime/prelaunch.py``).

The planner prices no pipeline row these refuse: it passes each row through the same two
(``planner.pipeline.runner_refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hsdp_runner.config.schema import (
    CheckpointConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
)
from hsdp_runner.core.choices import AC, INTERLEAVED_SCHEDULES, DDPImpl, DPMode, Dtype, PPSchedule
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import ModelConfig, stage_blocks

# The ``parallel.*`` keys the settings are read from.
PIPELINE_KEYS = (
    "pp_schedule",
    "pp_microbatches",
    "pp_stages_per_rank",
    "pp_first_stage_less_blocks",
    "pp_last_stage_less_blocks",
)


@dataclass(frozen=True)
class PipelineSettings:
    """What ``parallel.pp_*`` resolve to for one layout (the defaults without pp): the schedule,
    the micro-batches each data-parallel rank's batch is cut into per step, the stages each
    rank holds, and the blocks the first and the last stage get fewer than an even split
    (``models.base.stage_blocks``)."""

    schedule: PPSchedule = PPSchedule["1f1b"]
    microbatches: int = 1
    stages_per_rank: int = 1
    first_stage_less_blocks: int = 0
    last_stage_less_blocks: int = 0

    @classmethod
    def from_config(cls, values: dict, pp: int) -> PipelineSettings:
        """The settings of ``pp`` stages' ranks from ``values`` (the ``parallel.*`` value of
        each of ``PIPELINE_KEYS``; None where unset): micro-batches default to 2 x pp, stages
        per rank to 1. Raises ConfigError for a schedule and stage count that do not go
        together, or a negative count.

        The default, 2 x pp micro-batches: 1F1B needs at least pp to fill the pipeline, and at
        2 x pp its bubble (pp - 1) / (m + pp - 1) stays under a third while the micro-batches
        stay as large as that allows (more of them shrink the bubble but also each matmul).
        Users who can afford a larger batch set more.
        """
        schedule = PPSchedule(values.get("pp_schedule") or "1f1b")
        if pp == 1:
            return cls(schedule=schedule)
        per_rank = 1 if values.get("pp_stages_per_rank") is None else values["pp_stages_per_rank"]
        micro = values.get("pp_microbatches")
        less = {
            key: 0 if values.get(key) is None else values[key]
            for key in ("pp_first_stage_less_blocks", "pp_last_stage_less_blocks")
        }
        for key, value in less.items():
            if value < 0:
                raise ConfigError(
                    f"parallel.{key}={value} must be >= 0: blocks the end stage gets fewer than "
                    "an even split (0 = an even split)"
                )
        if per_rank < 1:
            raise ConfigError(
                f"parallel.pp_stages_per_rank={per_rank} must be >= 1; use 1, or 2 or more with "
                "an interleaved parallel.pp_schedule"
            )
        if schedule in INTERLEAVED_SCHEDULES and per_rank == 1:
            raise ConfigError(
                f"parallel.pp_schedule={schedule} needs several stages per rank, but "
                "parallel.pp_stages_per_rank=1; set parallel.pp_stages_per_rank=2 (or more), or "
                "parallel.pp_schedule=1f1b"
            )
        if schedule not in INTERLEAVED_SCHEDULES and per_rank > 1:
            raise ConfigError(
                f"parallel.pp_stages_per_rank={per_rank} needs an interleaved schedule, but "
                f"parallel.pp_schedule={schedule} runs one stage per rank; set "
                "parallel.pp_schedule=interleaved_1f1b or parallel.pp_stages_per_rank=1"
            )
        if micro is None:
            micro = 2 * pp
        elif micro < 1:
            raise ConfigError(
                f"parallel.pp_microbatches={micro} must be >= 1; use null (2 x parallel.pp) or a "
                "positive count"
            )
        return cls(
            schedule=schedule,
            microbatches=micro,
            stages_per_rank=per_rank,
            first_stage_less_blocks=less["pp_first_stage_less_blocks"],
            last_stage_less_blocks=less["pp_last_stage_less_blocks"],
        )

    def stage_blocks(self, n_layers: int, pp: int) -> list[range]:
        """The block indices of each stage of a model of ``n_layers`` blocks on ``pp`` ranks
        (``models.base.stage_blocks`` with these stages per rank and end-stage weights)."""
        return stage_blocks(
            n_layers,
            pp * self.stages_per_rank,
            self.first_stage_less_blocks,
            self.last_stage_less_blocks,
        )

    def describe(self) -> dict:
        """The settings under their ``parallel.*`` key names, choices as strings (records)."""
        return {
            "pp_schedule": self.schedule.value,
            "pp_microbatches": self.microbatches,
            "pp_stages_per_rank": self.stages_per_rank,
            "pp_first_stage_less_blocks": self.first_stage_less_blocks,
            "pp_last_stage_less_blocks": self.last_stage_less_blocks,
        }


class Layout(Protocol):
    """What the checks read of a layout's degrees (``ParallelDims``, which imports this
    module and holds the settings as ``pipeline``)."""

    pp: int
    dp: int
    dp_shard_cp: int
    dp_mode: DPMode
    pp_stages: int
    pipeline: PipelineSettings


def layout_refusal(dims: Layout, model: ModelConfig | None, parallel: ParallelConfig) -> str | None:
    """Why the pipeline of ``dims`` cannot run (a message naming the keys and the fix), or None
    (always without pp): a ``model`` (None: not checked) whose blocks cannot split over the
    stages (``models.base.stage_blocks``: a middle stage without a block, an end stage weighed
    more than its share), fewer micro-batches than stages under
    1F1B, a schedule the ``parallel`` settings inside the stages cannot follow
    (``zero_bubble_refusal``), micro-batches an interleaved schedule cannot run in rounds of
    pp."""
    if dims.pp == 1:
        return None
    pipeline, stages = dims.pipeline, dims.pp_stages
    m = pipeline.microbatches
    if model is not None:
        try:
            pipeline.stage_blocks(model.n_layers, dims.pp)
        except ConfigError as err:  # a stage left without a block, or an end stage's weight
            return (
                f"{err} (parallel.pp={dims.pp} x parallel.pp_stages_per_rank="
                f"{pipeline.stages_per_rank} = {stages} stages)"
            )
    if pipeline.schedule is PPSchedule["1f1b"] and m < dims.pp:
        return (
            f"parallel.pp_microbatches={m} is fewer than the parallel.pp={dims.pp} stages: "
            f"1F1B keeps every stage busy only with at least one micro-batch per stage; set "
            f"parallel.pp_microbatches>={dims.pp} or parallel.pp_schedule=gpipe"
        )
    refusal = zero_bubble_refusal(dims, parallel)
    if refusal:
        return refusal
    rounds = max(1, m // dims.pp)
    if pipeline.schedule in INTERLEAVED_SCHEDULES and m % rounds:
        return (
            f"parallel.pp_microbatches={m} does not suit parallel.pp_schedule="
            f"{pipeline.schedule} with parallel.pp={dims.pp}: interleaved schedules run "
            f"micro-batches in rounds of pp; use a multiple of {dims.pp}"
        )
    return None


def job_refusal(dims: Layout, job: RunConfig) -> str | None:
    """Why the pipeline of ``dims`` cannot run the job ``job`` (its whole typed config) for
    what the degrees alone do not decide (a message naming the keys and the fix), or None
    (always without pp): the precision under the zero-bubble schedule
    (``zero_bubble_precision_refusal``), gradient accumulation (the pipeline's micro-batches
    are the accumulation), a global batch that does not split into ``dp x micro-batches``,
    and the checkpoint settings (``checkpoint_refusal``)."""
    if dims.pp == 1:
        return None
    m, accum = dims.pipeline.microbatches, job.trainer.grad_accum_steps
    if accum > 1:
        return (
            f"trainer.grad_accum_steps={accum} with pipeline parallel: the pipeline's "
            "micro-batches are the accumulation; set trainer.grad_accum_steps=1 and "
            f"parallel.pp_microbatches={m * accum}"
        )
    gbs = job.trainer.global_batch_size
    if gbs % (dims.dp * m):
        return (
            f"trainer.global_batch_size={gbs} does not split into parallel.pp_microbatches="
            f"{m} micro-batches on each of the {dims.dp} data-parallel ranks "
            f"({gbs / dims.dp:g} sequences per rank); use a global batch that is a multiple of "
            f"{dims.dp * m}, or a parallel.pp_microbatches dividing it"
        )
    return zero_bubble_precision_refusal(dims, job.precision) or checkpoint_refusal(
        job.checkpoint, dims.pp
    )


def checkpoint_refusal(checkpoint: CheckpointConfig, pp: int) -> str | None:
    """Why the ``checkpoint`` settings cannot run with ``pp`` pipeline stages (a message
    naming key, value and fix), or None (-1: not chosen yet). The HF export at the end reads
    the last step's checkpoint back whole (rank 0 holds one stage), so it needs checkpointing
    on."""
    if pp in (1, -1):
        return None
    if checkpoint.export_at_end and not checkpoint.enable:
        return (
            f"checkpoint.export_at_end=true with parallel.pp={pp} needs checkpoint.enable=true: "
            "rank 0 holds one stage, so the export reads the last step's checkpoint back "
            "whole; set checkpoint.enable=true, or export a checkpoint later with python -m "
            "hsdp_runner.export <checkpoint> <out_dir>"
        )
    return None


def zero_bubble_refusal(dims: Layout, parallel: ParallelConfig) -> str | None:
    """Why the layout ``dims`` (a ParallelDims: its schedule and data-parallel degrees) cannot
    run its pipeline schedule with the ``parallel.*`` settings ``parallel`` (a message naming
    the keys and the fix), or None. ``zero_bubble_precision_refusal`` adds what the precision
    decides. ``layout_refusal`` includes it; the planner never plans it.

    torch 2.13's zero-bubble schedule splits each backward into the input gradients, then the
    weights' (``pipelining/_backward.py``), which these cannot follow (each measured on tiny
    GPT-2 and Llama, 2026-11-26; every other layout inside the stages matches one process):
    - a ``fully_shard`` wrap that reshards after forward (FSDP, HSDP or cp with
      ``parallel.reshard_after_forward=true``; DDP through ``parallel.ddp_impl=fully_shard``):
      the stage collects its parameters' gradient nodes while the sharded ones are registered,
      not those the forward used, so the weight half computes no gradient for them (the first
      step's grad norm 12-29% low);
    - ``parallel.ac=selective``: torch's selective checkpointing allows one backward per
      block ("Trying to backward an extra time");
    - ``parallel.compile=true``: a compiled block's backward frees its saved buffers (donated
      buffers) and cannot run twice.
    """
    if dims.pipeline.schedule is not PPSchedule["interleaved_zb"]:
        return None
    zb = "parallel.pp_schedule=interleaved_zb"
    if dims.dp_shard_cp > 1 and parallel.reshard_after_forward:
        return (
            f"{zb} with FSDP inside the stages (parallel.dp_shard x parallel.cp = "
            f"{dims.dp_shard_cp}) and parallel.reshard_after_forward=true computes wrong weight "
            "gradients in torch 2.13; set parallel.reshard_after_forward=false, or "
            "parallel.pp_schedule=interleaved_1f1b"
        )
    if dims.dp_mode is DPMode.ddp and DDPImpl(parallel.ddp_impl) is DDPImpl.fully_shard:
        return (
            f"{zb} with parallel.ddp_impl=fully_shard (which reshards after forward) computes "
            "wrong weight gradients in torch 2.13; set parallel.ddp_impl=replicate, or "
            "parallel.pp_schedule=interleaved_1f1b"
        )
    if AC(parallel.ac) is AC.selective:
        return (
            f"{zb} with parallel.ac=selective fails in torch 2.13: the schedule runs each "
            "backward in two halves (input gradients, then the weights') and selective "
            "checkpointing allows one backward per block; set parallel.ac=full or none, or "
            "parallel.pp_schedule=interleaved_1f1b"
        )
    if parallel.compile:
        return (
            f"{zb} with parallel.compile=true fails in torch 2.13: the schedule runs each "
            "backward in two halves and a compiled block's backward frees its saved buffers "
            "after the first; set parallel.compile=false, or parallel.pp_schedule="
            "interleaved_1f1b"
        )
    return None


def zero_bubble_precision_refusal(dims: Layout, precision: PrecisionConfig) -> str | None:
    """Why the layout ``dims`` cannot run its pipeline schedule with ``precision`` (a
    PrecisionConfig), or None: the zero-bubble schedule without data parallelism inside the
    stages and a compute dtype other than the stored one. The runner then wraps each block in a
    one-rank ``fully_shard`` for the cast alone (``parallelize.apply_data_parallel``), which
    reshards after forward: the weight gradients come out wrong as under FSDP
    (``zero_bubble_refusal``; bf16 and float8 on tiny Llama, 2026-11-26; float8 computing in
    fp32 and bf16_pure match). Part of ``job_refusal`` (the precision is not ParallelDims')."""
    if dims.pipeline.schedule is not PPSchedule["interleaved_zb"]:
        return None
    if dims.dp_mode is DPMode.none and precision.param_dtype != precision.master_dtype:
        return (
            "parallel.pp_schedule=interleaved_zb with no data parallelism inside the stages and "
            f"precision.param_dtype={Dtype(precision.param_dtype)} != precision.master_dtype="
            f"{Dtype(precision.master_dtype)} computes wrong weight gradients in torch 2.13; use "
            "parallel.pp_schedule=interleaved_1f1b, precision=fp32 or bf16_pure, or data "
            "parallelism inside the stages (parallel.dp_replicate, or parallel.dp_shard with "
            "parallel.reshard_after_forward=false)"
        )
    return None
