"""Throughput, MFU and memory figures, and the steady-state summary of a run.

Peak FLOP/s (``resolve_peak``) are those of the dtypes a step's matmuls really run in, each
for its share of the model FLOPs (``figures.matmul_flop_shares``: float8 linears in float8 on
a GPU, in float32 where torchao emulates them on the CPU, the rest in the compute dtype),
combined by ``combined_peak``. They come from a table of known accelerators (dense, no
sparsity), from ``metrics.peak_tflops`` when the user states one, or on CPU from matmuls
measured on this machine and cached (``distributed/cpu_peak.py``). An unknown GPU reports MFU
as null with a warning; nothing is guessed. MFU is never above 1: a step that beats a measured
CPU peak has it measured again (``Peak.beaten``), and a step that beats the figure still gets
MFU null, its reason in the peak's source.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from hsdp_runner.distributed import cpu_peak
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


# Streaming multiprocessors (SMs) per device and the architecture of its tensor cores: the
# planner's matmul time (planner/matmul_time.py) runs a matmul's output tiles in waves over the
# SMs. From NVIDIA's architecture whitepapers: "NVIDIA A100 Tensor Core GPU Architecture"
# (A100, every memory size and form factor: 108 SMs) and "NVIDIA H100 Tensor Core GPU
# Architecture" (H100 SXM5: 132, H100 PCIe: 114). H800 SXM: the H100 SXM with less NVLink
# bandwidth (H800 datasheet), 132. H200 and GH200: the same GH100 part as H100 SXM5, 132 SMs
# (NVIDIA H200 datasheet; "NVIDIA Grace Hopper Superchip Architecture" whitepaper). Same name
# patterns as PEAK_TFLOPS; a device not listed (the CPU, an AMD part) has no SM figure and the
# planner prices its matmuls by the roofline alone.
SM_COUNT = (
    (r"NVIDIA H100( 80GB HBM3)?", 132, "sm90"),
    (r"NVIDIA H100 PCIe", 114, "sm90"),
    (r"NVIDIA H800( 80GB HBM3)?", 132, "sm90"),
    (r"NVIDIA H200( 141GB HBM3e)?", 132, "sm90"),
    (r"NVIDIA GH200( \d+GB( HBM3e?)?)?", 132, "sm90"),
    (r"NVIDIA A100([- ](SXM4|PCIE)?-?\d+GB( PCIe)?)?", 108, "sm80"),
)


def lookup_sm_count(device_name: str) -> tuple[int, str] | None:
    """(SMs, architecture such as 'sm90') of ``device_name`` (as ``torch.cuda.
    get_device_name()`` says it) from ``SM_COUNT``, or None for a device it does not list."""
    name = " ".join(device_name.split())
    for pattern, sms, arch in SM_COUNT:
        if re.fullmatch(pattern, name, flags=re.IGNORECASE):
            return sms, arch
    return None


class Peak:
    """What one rank's MFU divides by: ``tflops`` (None: no honest figure, MFU null), where it
    came from (``source``), and for a figure measured on this CPU ``remeasure``, which measures
    it again and returns the new (tflops, source)."""

    def __init__(self, tflops: float | None, source: str, remeasure: Callable | None = None):
        self.tflops, self.source, self.remeasure = tflops, source, remeasure
        self.remeasured = False

    def beaten(self, achieved: float, step: int) -> float | None:
        """The peak after step ``step`` reached ``achieved`` TFLOP/s per device, above
        ``tflops``: a CPU figure is measured again, once per run (and the cache rewritten,
        ``cpu_peak.cached_cpu_peak``); None when the step still beats it (MFU null), which
        ``source`` then says."""
        if self.remeasure is not None and not self.remeasured:
            log.info(
                "step %d reached %.4g TFLOP/s per device, above the peak %.4g (%s): measuring "
                "the peak again",
                step,
                achieved,
                self.tflops,
                self.source,
            )
            self.remeasured = True
            self.tflops, self.source = self.remeasure()
            if self.tflops is not None and achieved <= self.tflops:
                return self.tflops
        if "MFU null" not in self.source:
            log.warning(
                "step %d reached %.4g TFLOP/s per device, above the peak %.4g (%s); MFU is "
                "reported as null on such steps. Set metrics.peak_tflops=<TFLOP/s> to the "
                "device's real peak",
                step,
                achieved,
                self.tflops,
                self.source,
            )
            self.source += f"; step {step} reached {achieved:.4g} TFLOP/s above it: MFU null"
        return None


def combined_peak(shares: dict, peaks: dict) -> float | None:
    """The peak of a step whose model FLOPs run ``shares[dtype]`` in each dtype at
    ``peaks[dtype]`` TFLOP/s: the rate at which those FLOPs would run were each share at its
    own peak (1 / sum of share / peak); None when a dtype with a share has no peak."""
    used = [dtype for dtype, share in shares.items() if share]
    if any(not peaks.get(dtype) for dtype in used):
        return None
    if len(used) == 1:  # the figure itself, not 1 / (1 / figure)
        return peaks[used[0]]
    return 1.0 / sum(shares[dtype] / peaks[dtype] for dtype in used)


def _shares_text(shares: dict) -> str:
    return " + ".join(f"{dtype} {share:.0%}" for dtype, share in shares.items() if share)


def measured_cpu_peak(shares: dict, remeasure: bool = False) -> Peak:
    """The CPU peak for a step whose model FLOPs run ``shares[dtype]`` in each dtype: each
    dtype's matmul measured on this rank's share of the CPUs (``cpu_peak.cached_cpu_peak``),
    combined (``combined_peak``); measured again on ``remeasure``."""
    parts, found = [], {}
    for dtype in (d for d, share in shares.items() if share):
        peak, from_cache = cpu_peak.cached_cpu_peak(dtype, remeasure)
        found[dtype] = peak.tflops
        when = f"cached, measured {peak.load.age()}" if from_cache else "measured now"
        kept = ": measured again on a quiet machine" if peak.load.busy else ""
        parts.append(f"{dtype} {peak.tflops:.4g} ({when}; {peak.load.describe()}{kept})")
    source = (
        f"measured on this rank's CPU share, for {_shares_text(shares)} of the model FLOPs: "
        f"{', '.join(parts)} TFLOP/s"
    )
    return Peak(
        combined_peak(shares, found), source, lambda: _figures(measured_cpu_peak(shares, True))
    )


def _figures(peak: Peak) -> tuple[float | None, str]:
    return peak.tflops, peak.source


def resolve_peak(device: torch.device, shares: dict, override: float | None) -> Peak:
    """The peak for a step whose model FLOPs run ``shares[dtype]`` in each dtype (the dtypes
    its matmuls really run in: ``figures.matmul_flop_shares``): ``override`` (the config's
    ``metrics.peak_tflops``) if set, the device table on a GPU (None with a warning when a
    dtype has no figure there), else measured on this CPU."""
    if override is not None:
        return Peak(override, "config metrics.peak_tflops")
    if device.type != "cuda":
        return measured_cpu_peak(shares)
    name = torch.cuda.get_device_name(device)
    peaks = {dtype: lookup_peak_tflops(name, dtype) for dtype in shares}
    tflops = combined_peak(shares, peaks)
    if tflops is None:
        missing = [dtype for dtype, share in shares.items() if share and not peaks[dtype]]
        log.warning(
            "no peak FLOP/s known for %s in %s; MFU is reported as null. Set "
            "metrics.peak_tflops=<TFLOP/s> to enable it",
            name,
            ", ".join(missing),
        )
        return Peak(None, f"unknown device {name} in {', '.join(missing)}: MFU null")
    return Peak(tflops, f"table: {name} {_shares_text(shares)}")


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
    peak: Peak,
    mem_peak_gib: float,
) -> dict:
    """Build one metrics.jsonl record from a step's measurements and the rank's ``peak``.
    MFU is never above 1: a step that beats the peak has it measured again when it was
    measured on this CPU (``Peak.beaten``, which updates ``peak``), else gets MFU null."""
    tps_global = tokens_global / step_time_s
    tps_per_device = tps_global / world_size
    tflops = flops_per_token * tps_per_device / 1e12
    peak_tflops = peak.tflops
    if peak_tflops is not None and tflops > peak_tflops:
        peak_tflops = peak.beaten(tflops, step)
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
    for key in ("step_time_s", "tps_per_device", "tps_global", "tflops", "mfu", "data_wait_s"):
        values = [r[key] for r in steady if r.get(key) is not None]
        out[f"median_{key}"] = statistics.median(values) if values else None
        if key in ("tps_per_device", "tps_global", "step_time_s") and values:
            out[f"min_{key}"], out[f"max_{key}"] = min(values), max(values)
    # The longest wait for a batch, warm-up included: a loader that cannot keep up shows here.
    waits = [r["data_wait_s"] for r in records if r.get("data_wait_s") is not None]
    out["max_data_wait_s"] = max(waits, default=None)
    out["mem_peak_gib"] = max((r["mem_peak_gib"] for r in records), default=None)
    return out
