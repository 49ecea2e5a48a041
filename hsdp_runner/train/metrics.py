"""Throughput, MFU and memory figures, and the steady-state summary of a run.

Peak FLOP/s come from a table of known accelerators (dense, no sparsity), from
``metrics.peak_tflops`` when the user states one, or on CPU from a short matmul measured once
per machine and cached (``cached_cpu_tflops``). An unknown GPU reports MFU as null with a
warning; nothing is guessed.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from hsdp_runner.distributed.hardware import cache_dir
from hsdp_runner.models.params import torch_dtype

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per device (no sparsity), from the vendors' datasheets; NVIDIA's list
# "with sparsity" figures, halved here. Each name pattern must match the whole string
# torch.cuda.get_device_name() returns (case-insensitive), so "H200 NVL" never takes the H200
# SXM figure and "GB200" never matches "B200"; a name that matches nothing gets MFU null and a
# warning rather than a guess. "float32" is the plain FP32 (non-tensor-core) figure, which
# an fp32 matmul gets with TF32 off (torch's default); left out where the datasheet gives none.
# "float8": the dense FP8 tensor-core figure (precision=float8's matmuls; the planner's
# planner/precision_cost.py), half of the datasheet's sparse one; absent where the device has
# no float8 tensor cores (A100, MI250X).
_H100_SXM = {
    "bfloat16": 989.5,
    "float16": 989.5,
    "float32": 67.0,
    "float8": 1979.0,
}  # FP8 3,958 sparse
_H100_PCIE = {
    "bfloat16": 756.5,
    "float16": 756.5,
    "float32": 51.0,
    "float8": 1513.0,
}  # FP8 3,026 sparse
_H100_NVL = {
    "bfloat16": 835.5,
    "float16": 835.5,
    "float32": 60.0,
    "float8": 1670.5,
}  # FP8 3,341 sparse
_MI300 = {"bfloat16": 1307.4, "float16": 1307.4, "float32": 163.4}
PEAK_TFLOPS = (
    (r"NVIDIA H100( 80GB HBM3)?", _H100_SXM),
    (r"NVIDIA H100 PCIe", _H100_PCIE),
    (r"NVIDIA H100 NVL", _H100_NVL),
    # H800: the H100 SXM / PCIe compute with less NVLink bandwidth (H800 datasheet).
    (r"NVIDIA H800( 80GB HBM3)?", _H100_SXM),
    (r"NVIDIA H800 PCIe", _H100_PCIE),
    (r"NVIDIA H200( 141GB HBM3e)?", _H100_SXM),  # H200 SXM datasheet: 1,979 sparse, FP32 67
    (r"NVIDIA H200 NVL", _H100_NVL),  # H200 NVL datasheet: 1,671 sparse, FP32 60
    (r"NVIDIA GH200( \d+GB( HBM3e?)?)?", _H100_SXM),  # GH200 datasheet: 1,979 sparse, FP32 67
    # HGX B200: 36 PFLOPS FP16/BF16 sparse for 8 GPUs; GB200 NVL72: 360 PFLOPS for 72 GPUs.
    # FP8: HGX B200 72 PFLOPS sparse for 8 GPUs; GB200 NVL72 720 PFLOPS sparse for 72.
    (r"NVIDIA B200", {"bfloat16": 2250.0, "float16": 2250.0, "float8": 4500.0}),
    (r"NVIDIA GB200", {"bfloat16": 2500.0, "float16": 2500.0, "float8": 5000.0}),
    # A100 SXM4 and PCIe, 40 and 80 GB: 624 sparse, FP32 19.5.
    (
        r"NVIDIA A100([- ](SXM4|PCIE)?-?\d+GB( PCIe)?)?",
        {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    ),
    # L40S: 733 sparse, FP8 1,466 sparse; L4: 242 sparse, FP8 485 sparse.
    (r"NVIDIA L40S", {"bfloat16": 362.05, "float16": 362.05, "float32": 91.6, "float8": 733.0}),
    (r"NVIDIA L40", {"bfloat16": 181.05, "float16": 181.05, "float32": 90.5}),  # 362.1 sparse
    (r"NVIDIA L4", {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3, "float8": 242.5}),
    # AMD Instinct datasheets (dense matrix figures; FP32 matrix; MI300X/MI325X FP8 2,614.9).
    (r"AMD Instinct MI300X( VF)?", {**_MI300, "float8": 2614.9}),
    (r"AMD Instinct MI325X( VF)?", {**_MI300, "float8": 2614.9}),
    (r"AMD Instinct MI250X( ?/ ?MI250)?", {"bfloat16": 383.0, "float16": 383.0, "float32": 95.7}),
)


def lookup_peak_tflops(device_name: str, dtype: str) -> float | None:
    """Return the table's dense peak TFLOP/s for ``device_name`` in ``dtype``, or None.

    ``device_name`` is what ``torch.cuda.get_device_name()`` returns; a pattern must match the
    whole (stripped) name, so an unknown or merely similar name returns None.
    """
    name = " ".join(device_name.split())
    for pattern, peaks in PEAK_TFLOPS:
        if re.fullmatch(pattern, name, flags=re.IGNORECASE):
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


def cpu_peak_cache_file() -> Path:
    """Where measured CPU peaks are kept: ``cpu_peak.json`` in ``hardware.cache_dir()``."""
    return cache_dir() / "cpu_peak.json"


def _cpu_key(dtype: str) -> str:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            model = next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return (
        f"{platform.node()}|{model}|{os.cpu_count()} cpus|{torch.get_num_threads()} threads"
        f"|{ranks} ranks|{dtype}|torch {torch.__version__}"
    )


def cached_cpu_tflops(dtype: str) -> tuple[float, str]:
    """This rank's CPU peak TFLOP/s in ``dtype``, measured once per machine and cached.

    The key is the host, CPU model, core count, this process's thread count, the ranks
    sharing the node (``LOCAL_WORLD_SIZE``), the dtype and the torch version: what the
    measured share depends on. Returns (TFLOP/s, 'cached' or 'measured now'). A cache that
    cannot be read or written is measured around, never an error. Delete the file to measure
    again (e.g. after moving to another machine class under the same host name).
    """
    path, key = cpu_peak_cache_file(), _cpu_key(dtype)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached, dict) and isinstance(cached.get(key), (int, float)):
        return float(cached[key]), f"cached in {path}"
    peak = measure_cpu_tflops(torch_dtype(dtype))
    try:  # ranks of one job write at once: each writes a whole file and renames it into place
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps(
                {**(cached if isinstance(cached, dict) else {}), key: peak},
                indent=1,
                sort_keys=True,
            )
        )
        os.replace(tmp, path)
    except OSError as err:
        log.warning("could not cache the CPU peak in %s: %s", path, err)
    return peak, "measured now"


def resolve_peak_tflops(
    device: torch.device, compute_dtype: str, override: float | None
) -> tuple[float | None, str]:
    """Return (peak TFLOP/s per device or None, where the figure came from)."""
    if override is not None:
        return override, "config metrics.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = lookup_peak_tflops(name, compute_dtype)
        if peak is None:
            log.warning(
                "no peak FLOP/s known for %s in %s; MFU is reported as null. Set "
                "metrics.peak_tflops=<TFLOP/s> to enable it",
                name,
                compute_dtype,
            )
            return None, f"unknown device {name}"
        return peak, f"table: {name} {compute_dtype}"
    peak, when = cached_cpu_tflops(compute_dtype)
    return peak, f"measured: {compute_dtype} matmul on this rank's CPU share, {when}"


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated CUDA memory, or this process's peak RSS on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def current_memory_gib(device: torch.device) -> float:
    """Memory this process holds now, in GiB: allocated CUDA memory, or on CPU the resident
    set (``/proc/self/statm``; the peak RSS so far where there is no /proc). Read before the
    model is built, it is the baseline that ``peak_memory_gib`` is compared against."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return peak_memory_gib(device)
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30


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
    size = torch_dtype(master_dtype).itemsize
    local = trainable = 0
    for param in model.parameters():
        n = (param.to_local() if hasattr(param, "to_local") else param).numel()
        local += n
        trainable += n if param.requires_grad else 0
    gib = {
        "params": local * size / 2**30,
        "grads": trainable * size / 2**30,
        "optimizer": 2 * trainable * size / 2**30,
    }
    return {**gib, "total": sum(gib.values())}


def step_record(
    step: int,
    loss: float,
    grad_norm: float,
    lr: float,
    step_time_s: float,
    tokens_global: int,
    world_size: int,
    flops_per_token: float,
    peak_tflops: float | None,
    mem_peak_gib: float,
) -> dict:
    """Build one metrics.jsonl record from a step's measurements."""
    tps_global = tokens_global / step_time_s
    tps_per_device = tps_global / world_size
    tflops = flops_per_token * tps_per_device / 1e12
    return {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "step_time_s": step_time_s,
        "tps_per_device": tps_per_device,
        "tps_global": tps_global,
        "tflops": tflops,
        "mfu": None if peak_tflops is None else tflops / peak_tflops,
        "mem_peak_gib": mem_peak_gib,
    }


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
