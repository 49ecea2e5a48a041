"""Figures that do not change during a run, computed once before its first step.

Peak FLOP/s of a device in the dtypes a step's matmuls run in (``matmul_flop_shares``; from a
table, the config, or CPU matmuls measured on this machine), model FLOPs per token, the analytic communication of one step and the per-rank memory
estimate of the sharded state. The worker computes them and hands them to the trainer, so the
step loop only reads them. This module imports neither the trainer nor the sharding applier.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from hsdp_runner.config.schema import PrecisionConfig, RunConfig
from hsdp_runner.distributed import float8
from hsdp_runner.distributed.comm_model import analytic_comm
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.models.base import ModelConfig, build_meta_model, model_spec
from hsdp_runner.train import metrics


@dataclass(frozen=True)
class RunFigures:
    """The run's fixed figures; ``analytic_comm`` is None when no step's comm is counted.
    ``peak`` is the one figure that can change: measured again when a step beats it
    (``metrics.Peak.beaten``), so ``peak_tflops`` and ``peak_source`` read it each time."""

    peak: metrics.Peak
    flops_per_token: float
    # The analytic comm of one step of this rank: ``comm_model.analytic_comm`` with the job's
    # config bound, called with ``routing=``: under expert parallel the token exchange's rows
    # of the counted step (``expert_parallel.recording_routing``; None: balanced).
    analytic_comm: Optional[Callable[..., dict]]
    memory_estimate: dict  # GiB: params, grads, optimizer, total (metrics.memory_breakdown)

    @property
    def peak_tflops(self) -> Optional[float]:
        """Peak TFLOP/s per device that MFU divides by (None: MFU null)."""
        return self.peak.tflops

    @property
    def peak_source(self) -> str:
        """Where ``peak_tflops`` came from (and why MFU is null, when it is)."""
        return self.peak.source


# torchao's emulated float8 matmul (``emulate=True``, what ``float8.convert`` sets on the CPU)
# upcasts both operands: ``torch.mm(a._data.float() / a._scale, b._data.float() / b._scale)``
# (torchao/float8/float8_ops.py, ``float8_mm`` / ``float8_addmm``), so it runs in float32.
EMULATED_FLOAT8_DTYPE = "float32"


def float8_gemms(precision: PrecisionConfig) -> int:
    """How many of a converted linear's three matmuls (output, grad input, grad weight) run in
    float8 under ``precision.float8``'s torchao recipe: 3, or 2 for ``rowwise_with_gw_hp``
    (its grad weight in high precision). 0 without float8."""
    if not float8.enabled(precision):
        return 0
    ao = float8.torchao_float8()
    config = float8.linear_config(precision, emulate=True, fsdp_all_gather=False)
    operands = (
        config.cast_config_input,
        config.cast_config_grad_output,
        config.cast_config_input_for_grad_weight,
    )
    return sum(cast.scaling_type is not ao.ScalingType.DISABLED for cast in operands)


def float8_flops_per_token(
    model_cfg: ModelConfig, precision: PrecisionConfig, tp: int, sp: bool
) -> float:
    """Training FLOPs per token of the matmuls that run in float8: 2 FLOPs per weight of each
    linear ``float8.convert`` converts at TP degree ``tp`` (the output layer and unaligned
    layers stay), per float8 matmul (``float8_gemms``)."""
    gemms = float8_gemms(precision)
    if not gemms:
        return 0.0
    kept = float8.high_precision_linears(model_cfg, tp, sp)
    weights = sum(
        module.weight.numel()
        for fqn, module in build_meta_model(model_cfg).named_modules()
        if isinstance(module, torch.nn.Linear) and fqn not in kept
    )
    return 2.0 * gemms * weights


def matmul_flop_shares(cfg: RunConfig, tp: int, device: torch.device) -> dict:
    """{dtype a step's matmuls run in: its share of the model FLOPs}. Without float8 every
    FLOP counts in ``precision.param_dtype``; with it the float8 matmuls' share runs in float8
    on a GPU and in float32 on the CPU (``EMULATED_FLOAT8_DTYPE``), the rest (output layer,
    attention, high-precision linears and matmuls) in ``param_dtype``."""
    compute = str(cfg.precision.param_dtype)
    total = model_spec(cfg.model).flops_per_token()
    low = float8_flops_per_token(cfg.model, cfg.precision, tp, cfg.parallel.sequence_parallel)
    low_dtype = EMULATED_FLOAT8_DTYPE if device.type != "cuda" else "float8"
    shares = {compute: 1.0 - low / total}
    shares[low_dtype] = shares.get(low_dtype, 0.0) + low / total
    return {dtype: share for dtype, share in shares.items() if share > 0}


def run_peak(cfg: RunConfig, dims: ParallelDims, device: torch.device) -> metrics.Peak:
    """The peak this rank's MFU divides by (``metrics.resolve_peak`` for the dtypes the job's
    matmuls run in). On a CPU it may measure matmuls: a job resolves it before its tensor-memory
    meter starts, so those matrices are not counted as the job's."""
    return metrics.resolve_peak(
        device, matmul_flop_shares(cfg, dims.tp, device), cfg.metrics.peak_tflops
    )


def compute_run_figures(
    cfg: RunConfig,
    dims: ParallelDims,
    model: torch.nn.Module | list[torch.nn.Module],
    device: torch.device,
    peak: metrics.Peak | None = None,
) -> RunFigures:
    """Compute the fixed figures of a run from its resolved config, ParallelDims, the sharded
    model or this rank's pipeline stage chunks (for the memory estimate) and the rank's
    device, with ``peak`` when resolved already (``run_peak``); every rank calls it."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    peak = peak or run_peak(cfg, dims, device)
    comm = (
        None
        if cfg.metrics.comm_step is None
        else functools.partial(
            analytic_comm,
            cfg.model,
            dims,
            cfg.parallel,
            cfg.precision,
            cfg.trainer,
            pp_rank=dims.pp_rank_of(rank),
        )
    )
    if comm is not None:
        comm()  # built now, not in the step loop: the meta model and its sizes are cached
    return RunFigures(
        peak=peak,
        flops_per_token=model_spec(cfg.model).flops_per_token(),
        analytic_comm=comm,
        memory_estimate=metrics.memory_breakdown(
            torch.nn.ModuleList(model) if isinstance(model, list) else model,
            cfg.precision.master_dtype,
        ),
    )
