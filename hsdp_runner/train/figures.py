"""Figures that do not change during a run, computed once before its first step.

Peak FLOP/s of a device (a table, the config, or a CPU matmul measured once per machine),
model FLOPs per token, the analytic communication of one step and the per-rank memory
estimate of the sharded state. The worker computes them and hands them to the trainer, so the
step loop only reads them. This module imports neither the trainer nor the sharding applier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hsdp_runner.config.schema import RunConfig
from hsdp_runner.distributed.comm_model import analytic_comm
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.models.base import model_spec
from hsdp_runner.train import metrics


@dataclass(frozen=True)
class RunFigures:
    """The run's fixed figures; ``analytic_comm`` is None when no step's comm is counted."""

    peak_tflops: Optional[float]
    peak_source: str
    flops_per_token: float
    analytic_comm: Optional[dict]
    memory_estimate: dict  # GiB: params, grads, optimizer, total (metrics.memory_breakdown)


def compute_run_figures(
    cfg: RunConfig,
    dims: ParallelDims,
    model: torch.nn.Module | list[torch.nn.Module],
    device: torch.device,
) -> RunFigures:
    """Compute the fixed figures of a run from its resolved config, ParallelDims, the sharded
    model or this rank's pipeline stage chunks (for the memory estimate) and the rank's
    device; every rank calls it."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    peak, source = metrics.resolve_peak_tflops(
        device, cfg.precision.param_dtype, cfg.metrics.peak_tflops
    )
    comm = (
        None
        if cfg.metrics.comm_step is None
        else analytic_comm(
            cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer, dims.pp_rank_of(rank)
        )
    )
    return RunFigures(
        peak_tflops=peak,
        peak_source=source,
        flops_per_token=model_spec(cfg.model).flops_per_token(),
        analytic_comm=comm,
        memory_estimate=metrics.memory_breakdown(
            torch.nn.ModuleList(model) if isinstance(model, list) else model,
            cfg.precision.master_dtype,
        ),
    )
