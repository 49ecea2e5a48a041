"""The pipeline's settings and their checks: what ``parallel.pp_*`` resolve to for a layout, and
which combinations a pipeline cannot run (each a ConfigError naming the key and the fix,
raised before any worker starts).

``ParallelDims.from_config`` resolves them (``pipeline_settings``) and checks the layout they
make (``ParallelDims._check_pipeline``, which asks ``zero_bubble_refusal``); the planner skips
what ``zero_bubble_refusal`` refuses.
"""

from __future__ import annotations

from hsdp_runner.core.choices import INTERLEAVED_SCHEDULES, PPSchedule
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


def zero_bubble_refusal(schedule, dp_shard_cp: int, reshard_after_forward: bool) -> str | None:
    """Why the pipeline ``schedule`` cannot run with FSDP over ``dp_shard_cp`` ranks inside the
    stages (a message naming the keys and the fix), or None.

    torch 2.13's zero-bubble schedule splits each backward into the input gradients, then the
    weights'; with FSDP resharding after forward the weight gradients come out wrong (the loss
    of the second step differs from one process's by 0.5% on tiny Llama, pp 2 x FSDP 2,
    measured 2026-11-26), while FSDP without resharding, DDP and TP inside the stages match
    one process. So that one combination is refused.
    """
    if PPSchedule(schedule) is PPSchedule["interleaved_zb"] and dp_shard_cp > 1:
        if reshard_after_forward:
            return (
                f"parallel.pp_schedule=interleaved_zb with FSDP inside the stages (parallel."
                f"dp_shard x parallel.cp = {dp_shard_cp}) and parallel.reshard_after_forward="
                "true computes wrong weight gradients in torch 2.13; set "
                "parallel.reshard_after_forward=false, or parallel.pp_schedule=interleaved_1f1b"
            )
    return None
