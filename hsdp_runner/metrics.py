"""Throughput, MFU and memory figures, and the steady-state summary of a run.

Peak FLOP/s come from a table of known accelerators (dense, no sparsity), from
``metrics.peak_tflops`` when the user states one, or on CPU from a short matmul measured at
start-up. An unknown GPU reports MFU as null with a warning; nothing is guessed.
"""

from __future__ import annotations

import logging
import resource
import statistics
import sys
import time

import torch

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per device, from the vendors' datasheets. Keys are matched as substrings of
# torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS = (
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("H100 NVL", {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),  # SXM
    ("B200", {"bfloat16": 2250.0, "float16": 2250.0, "float32": 80.0}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6}),
    ("L40", {"bfloat16": 181.0, "float16": 181.0, "float32": 90.5}),
    ("L4", {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3}),  # after L40S / L40
    ("A10G", {"bfloat16": 70.0, "float16": 70.0, "float32": 31.2}),
    ("MI325X", {"bfloat16": 1307.0, "float16": 1307.0, "float32": 163.4}),
    ("MI300X", {"bfloat16": 1307.0, "float16": 1307.0, "float32": 163.4}),
    ("MI250X", {"bfloat16": 383.0, "float16": 383.0, "float32": 47.9}),
)


def lookup_peak_tflops(device_name: str, dtype: str) -> float | None:
    """Return the table's dense peak TFLOP/s for ``device_name`` in ``dtype``, or None."""
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peaks.get(dtype)
    return None


def measure_cpu_tflops(dtype: torch.dtype, size: int = 512, seconds: float = 0.3) -> float:
    """Time square matmuls on this process's CPU threads; return achieved TFLOP/s.

    Run while the other ranks run it too, so it measures this rank's share of the machine.
    """
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2.0 * size**3 * count / (time.perf_counter() - start) / 1e12


def resolve_peak_tflops(device: torch.device, compute_dtype: str, override: float | None
                        ) -> tuple[float | None, str]:
    """Return (peak TFLOP/s per device or None, where the figure came from)."""
    if override is not None:
        return override, "config metrics.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = lookup_peak_tflops(name, compute_dtype)
        if peak is None:
            log.warning("no peak FLOP/s known for %s in %s; MFU is reported as null. Set "
                        "metrics.peak_tflops=<TFLOP/s> to enable it", name, compute_dtype)
            return None, f"unknown device {name}"
        return peak, f"table: {name} {compute_dtype}"
    peak = measure_cpu_tflops(getattr(torch, compute_dtype))
    return peak, f"measured: {compute_dtype} matmul on this rank's CPU share"


def reset_peak_memory(device: torch.device) -> None:
    """Start a fresh peak-memory window (CUDA only; RSS peaks cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated CUDA memory, or this process's peak RSS on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def peak_reserved_gib(device: torch.device) -> float | None:
    """Peak memory the CUDA caching allocator reserved, in GiB; None on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return None


def memory_breakdown(model: torch.nn.Module, master_dtype: str) -> dict:
    """Estimate this rank's resident training state in GiB from its (sharded) parameters.

    ``params``: the local shards in the stored (master) dtype; ``grads``: one such tensor per
    trainable parameter; ``optimizer``: AdamW's two moments per trainable parameter, in the
    master dtype. Activations, gathered (unsharded) parameters, communication buffers and the
    allocator's slack come on top: compare ``total`` with the measured peak.
    """
    size = getattr(torch, master_dtype).itemsize
    local = trainable = 0
    for param in model.parameters():
        n = (param.to_local() if hasattr(param, "to_local") else param).numel()
        local += n
        trainable += n if param.requires_grad else 0
    gib = {"params": local * size / 2**30, "grads": trainable * size / 2**30,
           "optimizer": 2 * trainable * size / 2**30}
    return {**gib, "total": sum(gib.values())}


def step_record(step: int, loss: float, grad_norm: float, lr: float, step_time_s: float,
                tokens_global: int, world_size: int, flops_per_token: float,
                peak_tflops: float | None, mem_peak_gib: float) -> dict:
    """Build one metrics.jsonl record from a step's measurements."""
    tps_global = tokens_global / step_time_s
    tps_per_device = tps_global / world_size
    tflops = flops_per_token * tps_per_device / 1e12
    return {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
            "step_time_s": step_time_s, "tps_per_device": tps_per_device,
            "tps_global": tps_global, "tflops": tflops,
            "mfu": None if peak_tflops is None else tflops / peak_tflops,
            "mem_peak_gib": mem_peak_gib}


def steady_state(records: list[dict], warmup_steps: int) -> dict:
    """Medians (and min/max) of the per-step figures after the first ``warmup_steps`` steps.

    With too few steps to leave warm-up out, all steps are used and ``steady_steps`` says so.
    """
    steady = records[warmup_steps:] or records
    out = {"steady_steps": len(steady), "warmup_steps_excluded": len(records) - len(steady)}
    for key in ("step_time_s", "tps_per_device", "tps_global", "tflops", "mfu"):
        values = [r[key] for r in steady if r.get(key) is not None]
        out[f"median_{key}"] = statistics.median(values) if values else None
        if key in ("tps_per_device", "tps_global", "step_time_s") and values:
            out[f"min_{key}"], out[f"max_{key}"] = min(values), max(values)
    out["mem_peak_gib"] = max((r["mem_peak_gib"] for r in records), default=None)
    return out


def flat_summary(memory: dict, comm_facts: dict) -> dict:
    """Scalars for the W&B summary: memory estimate, comm totals and ratio, and the measured
    and analytic bytes per collective kind and mesh dim (``comm/<kind>/<dim>/bytes``, ...)."""
    out = {f"mem_estimate_gib/{k}": v for k, v in memory.get("mem_estimate_gib", {}).items()}
    if memory.get("mem_peak_gib_per_rank"):
        out["mem_peak_gib_max_rank"] = max(memory["mem_peak_gib_per_rank"])
    for key in ("comm_bytes_measured", "comm_bytes_analytic", "comm_ratio", "comm_step"):
        if key in comm_facts:
            out[key] = comm_facts[key]
    for source in ("measured", "analytic"):
        for name, entry in comm_facts.get(f"comm_{source}", {}).items():
            for field, value in entry.items():
                out[f"comm_{source}/{name}/{field}"] = value
    return out
