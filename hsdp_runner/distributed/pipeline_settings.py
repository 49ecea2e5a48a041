"""The pipeline's settings and their checks: what ``parallel.pp_*`` resolve to for a layout, and
which combinations a pipeline cannot run (each a ConfigError naming the key and the fix,
raised before any worker starts).

``ParallelDims.from_config`` resolves them (``pipeline_settings``) and checks the layout they
make (``ParallelDims._check_pipeline``, which asks ``zero_bubble_refusal``); the pre-launch
checks add ``zero_bubble_precision_refusal``, which needs the precision. The planner prices no
pipeline row these refuse: it passes each row through the same checks
(``planner.pipeline.runner_refusal``).
"""

from __future__ import annotations

from hsdp_runner.core.choices import AC, INTERLEAVED_SCHEDULES, DDPImpl, DPMode, Dtype, PPSchedule
from hsdp_runner.core.errors import ConfigError

# The ``parallel.*`` keys ``pipeline_settings`` reads.
PIPELINE_KEYS = (
    "pp_schedule",
    "pp_microbatches",
    "pp_stages_per_rank",
    "pp_first_stage_less_blocks",
    "pp_last_stage_less_blocks",
)


def pipeline_settings(values: dict, pp: int) -> dict:
    """The pipeline fields of ParallelDims for ``pp`` stages' ranks from ``values`` (the
    ``parallel.*`` value of each of ``PIPELINE_KEYS``; None where unset): the schedule, the
    micro-batches (``parallel.pp_microbatches``; None: 2 x pp), the stages per rank and the
    end stages' weights (``models.base.stage_blocks``). Raises ConfigError for a schedule and
    stage count that do not go together, or a negative count.

    The default, 2 x pp micro-batches: 1F1B needs at least pp to fill the pipeline, and at
    2 x pp its bubble (pp - 1) / (m + pp - 1) stays under a third while the micro-batches stay
    as large as that allows (more of them shrink the bubble but also each matmul). Users who
    can afford a larger batch set more.
    """
    schedule = PPSchedule(values.get("pp_schedule") or "1f1b")
    per_rank = 1 if values.get("pp_stages_per_rank") is None else values["pp_stages_per_rank"]
    micro = values.get("pp_microbatches")
    less = {
        key: 0 if values.get(key) is None else values[key]
        for key in ("pp_first_stage_less_blocks", "pp_last_stage_less_blocks")
    }
    if pp == 1:
        return {"pp_schedule": schedule, "pp_microbatches": 1, "pp_stages_per_rank": 1}
    for key, value in less.items():
        if value < 0:
            raise ConfigError(
                f"parallel.{key}={value} must be >= 0: blocks the end stage gets fewer than an "
                "even split (0 = an even split)"
            )
    if per_rank < 1:
        raise ConfigError(
            f"parallel.pp_stages_per_rank={per_rank} must be >= 1; use 1, or 2 or more with an "
            "interleaved parallel.pp_schedule"
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
    return {
        "pp_schedule": schedule,
        "pp_microbatches": micro,
        "pp_stages_per_rank": per_rank,
        **less,
    }


def zero_bubble_refusal(dims, parallel) -> str | None:
    """Why the layout ``dims`` (a ParallelDims: its schedule and data-parallel degrees) cannot
    run its pipeline schedule with the ``parallel.*`` settings ``parallel`` (a message naming
    the keys and the fix), or None. ``zero_bubble_precision_refusal`` adds what the precision
    decides. ``ParallelDims._check_pipeline`` raises it; the planner never plans it.

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
    if PPSchedule(dims.pp_schedule) is not PPSchedule["interleaved_zb"]:
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


def zero_bubble_precision_refusal(dims, precision) -> str | None:
    """Why the layout ``dims`` cannot run its pipeline schedule with ``precision`` (a
    PrecisionConfig), or None: the zero-bubble schedule without data parallelism inside the
    stages and a compute dtype other than the stored one. The runner then wraps each block in a
    one-rank ``fully_shard`` for the cast alone (``parallelize.apply_data_parallel``), which
    reshards after forward: the weight gradients come out wrong as under FSDP
    (``zero_bubble_refusal``; bf16 and float8 on tiny Llama, 2026-11-26; float8 computing in
    fp32 and bf16_pure match). Checked before the workers start (``runtime/prelaunch.py``: the
    precision is not ParallelDims'); the planner never plans it."""
    if PPSchedule(dims.pp_schedule) is not PPSchedule["interleaved_zb"]:
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
