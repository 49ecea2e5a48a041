"""The typed records that cross process and file boundaries: ``RunInfo`` and ``RunSummary``.

``RunInfo`` is what the launching process knows about a job before it runs (output dir, W&B
naming, sweep facts); ``app`` (or ``parity``) builds it, the workers receive it. ``RunSummary``
is the job's ``summary.json``: every writer builds one (``completed``, ``interrupted_at_once``,
``failed`` or ``skipped``) and ``write`` is the only code that writes the file; every reader
goes through ``RunSummary.read``, which tolerates files written before a field existed. The
JSON keys on disk are the field names, so old runs and the dashboard keep reading.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hsdp_runner.core.choices import RunStatus

SUMMARY_FILE = "summary.json"


def precision_label(section: dict, compiled: bool, backend: str = "inductor") -> str:
    """How reports name a run's numerics: the precision preset's name, its float8 recipe when
    it has one, and whether the blocks were compiled (``section``: the config's ``precision``
    section as a plain dict, old runs' too; ``compiled``: ``parallel.compile``; ``backend``:
    ``parallel.compile_backend``, named when it is not inductor). E.g. ``bf16``, ``float8
    (tensorwise) +compile``, ``bf16 +compile(aot_eager)``. compare, the dashboard and W&B (a
    derived fact) show it."""
    label = str(section.get("name", "?"))
    recipe = str(section.get("float8") or "none")
    if recipe != "none":
        label += f" ({recipe})"
    if not compiled:
        return label
    return label + (" +compile" if str(backend) == "inductor" else f" +compile({backend})")


@dataclass(frozen=True)
class RunInfo:
    """Facts about one job that only the launching process has (Hydra's runtime config)."""

    output_dir: str
    group: str
    run_name: str
    tags: list[str]
    multirun: bool
    overrides: list[str]
    sweep_dir: Optional[str] = None
    # A sweep's ``parallel`` preset degrees (``app.preset_degrees``), which size its world.
    size_degrees: Optional[dict] = None
    # True when this node's launcher of ours started the workers (it records a failed rank
    # itself); False under torchrun / SLURM, where rank 0's sidecar records one.
    local_launch: bool = False


def _trained(default: Any = None):
    """A field every trained run's summary holds, written even when null."""
    return field(default=default, metadata={"trained": True})


@dataclass
class RunSummary:
    """One job's summary.json. Fields a run did not reach are None and not written, except
    ``error`` (always written) and the fields of a trained run (``steps`` set)."""

    status: Optional[RunStatus] = None
    error: Optional[str] = None
    # The layout (ParallelDims.describe) and the machine (rank_training.run_facts).
    world_size: Optional[int] = None
    mesh_shape: Optional[list] = None
    mesh_dim_names: Optional[list] = None
    dp: Optional[int] = None
    dp_mode: Optional[str] = None
    layout: Optional[str] = None
    pp: Optional[int] = None
    dp_replicate: Optional[int] = None
    dp_shard: Optional[int] = None
    cp: Optional[int] = None
    tp: Optional[int] = None
    ep: Optional[int] = None  # expert parallel (borrows ranks: not a mesh dim of its own)
    nodes: Optional[int] = None
    ranks_per_node: Optional[int] = None
    dims_across_nodes: Optional[list] = None
    # Pipeline runs only (pp > 1): the schedule, micro-batches per step and stages per rank.
    pp_schedule: Optional[str] = None
    pp_microbatches: Optional[int] = None
    pp_stages_per_rank: Optional[int] = None
    pp_first_stage_less_blocks: Optional[int] = None
    pp_last_stage_less_blocks: Optional[int] = None
    # Per mesh dim and flattened view, read from the real process groups and the launcher's
    # node ranks: {name: {size, ranks_per_node, groups_per_node, nodes}} (topology.Placement).
    mesh_placement: Optional[dict] = None
    device: Optional[str] = None
    device_name: Optional[str] = None
    cpu_threads: Optional[int] = None  # each rank's intra-op threads (torch.get_num_threads)
    torch_version: Optional[str] = None
    hostname: Optional[str] = None
    # Training.
    steps: Optional[int] = None
    skipped_steps: Optional[int] = _trained()
    final_loss: Optional[float] = _trained()
    eval_loss: Optional[float] = _trained()
    # The last validation during training (trainer.val_every; each is in metrics.jsonl).
    val_loss: Optional[float] = None
    peak_tflops: Optional[float] = _trained()
    peak_tflops_source: Optional[str] = _trained()
    flops_per_token: Optional[float] = _trained()
    # Steady state (metrics.steady_state): medians after warm-up, min/max of some.
    steady_steps: Optional[int] = _trained()
    warmup_steps_excluded: Optional[int] = _trained()
    median_step_time_s: Optional[float] = _trained()
    min_step_time_s: Optional[float] = None
    max_step_time_s: Optional[float] = None
    median_tps_per_device: Optional[float] = _trained()
    min_tps_per_device: Optional[float] = None
    max_tps_per_device: Optional[float] = None
    median_tps_global: Optional[float] = _trained()
    min_tps_global: Optional[float] = None
    max_tps_global: Optional[float] = None
    median_tflops: Optional[float] = _trained()
    median_mfu: Optional[float] = _trained()
    # Seconds a step waited for its batch: median after warm-up, longest of all steps.
    median_data_wait_s: Optional[float] = None
    max_data_wait_s: Optional[float] = None
    mem_peak_gib: Optional[float] = _trained()
    # Checkpointing (Checkpointer.facts).
    start_step: Optional[int] = _trained()
    loaded_from: Optional[str] = _trained()
    last_checkpoint: Optional[str] = _trained()
    export: Optional[str] = _trained()
    # Memory of every rank and the estimate (run_figures.MemoryEstimate as a dict).
    mem_peak_gib_per_rank: Optional[list] = None
    mem_peak_gib_max: Optional[float] = None
    mem_reserved_gib_per_rank: Optional[list] = None
    # Each rank's memory before its model was built: the planner predicts peak minus this.
    mem_baseline_gib_per_rank: Optional[list] = None
    mem_tensor_peak_gib_per_rank: Optional[list] = None
    mem_estimate_gib: Optional[dict] = None
    # Communication of the counted step (comm_model.comm_report).
    comm_step: Optional[int] = None
    comm_bytes_measured: Optional[int] = None
    comm_bytes_analytic: Optional[int] = None
    comm_ratio: Optional[float] = None
    comm_measured: Optional[dict] = None
    comm_analytic: Optional[dict] = None
    # A job with a plan (parallel=auto, a planned sweep's job): predicted next to measured
    # (prediction.job_prediction: step time, tokens/s/device, tensor memory per rank).
    prediction: Optional[dict] = None
    # An interrupted run: the signal, the last step done, and whether it stopped mid-step.
    signal: Optional[str] = None
    interrupted_at_step: Optional[int] = None
    stopped_at_once: Optional[bool] = None
    # A failed run: the first rank that failed. A skipped sweep job: why, and what it asked.
    failed_rank: Optional[int] = None
    reason: Optional[str] = None
    overrides: Optional[list] = None
    requested_degrees: Optional[dict] = None

    @classmethod
    def from_dict(cls, data: dict) -> RunSummary:
        """Build from a summary.json dict; missing keys stay None, unknown keys are dropped
        (a file from an older or newer runner still reads)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("status") is not None:
            values["status"] = RunStatus(values["status"])
        return cls(**values)

    @classmethod
    def read(cls, output_dir: str | Path) -> Optional[RunSummary]:
        """The job's summary.json, or None if it has none."""
        path = Path(output_dir) / SUMMARY_FILE
        return cls.from_dict(json.loads(path.read_text())) if path.exists() else None

    def to_dict(self) -> dict:
        """The JSON form: see the class docstring for which None fields are written."""
        trained = self.steps is not None
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
            or f.name == "error"
            or (trained and f.metadata.get("trained"))
        }

    def write(self, output_dir: str | Path) -> Path:
        """Write ``summary.json`` atomically (temp file + rename); return its path."""
        path = Path(output_dir) / SUMMARY_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        os.replace(tmp, path)
        return path

    def get(self, name: str, default: Any = None) -> Any:
        """The field ``name`` (by its JSON key), or ``default`` when it is None or unknown."""
        value = getattr(self, name, None) if name in _FIELD_NAMES else None
        return default if value is None else value

    # Constructors, one per way a job ends.
    @classmethod
    def failed(cls, layout: dict, rank: int, error: str, **facts) -> RunSummary:
        """A failed run: its layout, the first rank that failed and its error."""
        return cls(status=RunStatus.failed, failed_rank=rank, error=error, **layout, **facts)

    @classmethod
    def interrupted_at_once(
        cls, layout: dict, signal: str, step: int, last_checkpoint: Optional[str]
    ) -> RunSummary:
        """A run a repeated stop signal ended mid-step (no figures: the step was cut off)."""
        return cls(
            status=RunStatus.interrupted,
            signal=signal,
            interrupted_at_step=step,
            stopped_at_once=True,
            last_checkpoint=last_checkpoint,
            **layout,
        )

    @classmethod
    def skipped(cls, reason: str, overrides: list[str], requested_degrees: dict) -> RunSummary:
        """A sweep's job that cannot run (a config error): why, and what it asked for."""
        return cls(
            status=RunStatus.skipped,
            reason=reason,
            overrides=list(overrides),
            requested_degrees=dict(requested_degrees),
        )


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(RunSummary))
