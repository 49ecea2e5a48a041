"""What a GPU architecture's kernels reach, measured: device facts, not fitted constants.

The planner prices a step from physics (tiles, waves, bytes against bandwidth); the rate a
kernel reaches on the tensor cores is a property of the device, measured like its peak. Every
figure here comes from one measurement on one NVIDIA H200 (sm90, torch 2.11.0+cu130):
``benchmarks/gpu_kernels.py``, stored in ``benchmarks/results/h200_2026-11-27/kernels.json``
(``KERNELS_FILE``); ``tests/test_kernel_rates.py`` derives each figure from that file again, so
the numbers below cannot drift from it. The H100 (SXM, PCIe, H800, GH200) is the same sm90
architecture and inherits them. sm80 (A100) has no measurement: it inherits the sm90 fractions
too, an assumption (its bf16 GEMMs and flash attention reach similar fractions of their own
peak in NVIDIA's and FlashAttention-2's published kernel figures, not checked here); its
preset's ``compute_efficiency`` is chosen on its own fitted figures over them.

- **GEMM** (``GEMM_EFFICIENCY``): the fraction of peak one tile's tensor-core work runs at in
  ``matmul_time``'s tile and wave model: per measured GEMM, the model's time at full peak over
  the measured time, the median over the 20 GEMMs whose output dims are both >= 2,048 (large,
  well shaped: the tile model, not this figure, prices the ill-shaped ones).
- **Attention** (``ATTENTION_SHARE``): ``scaled_dot_product_attention`` forward + backward
  (bf16, 32 query and 8 key/value heads of 128), as a share of peak at the FLOPs the runner
  counts (every query against every key, backward twice forward), by tokens of one sequence:
  causal (a whole sequence, or a context-parallel ring's diagonal chunk) and full (a ring's
  off-diagonal chunk, which the causal mask keeps or skips whole).
- **Launch** (``LAUNCH_SECONDS``): the device's idle time per eager kernel launch, from the
  runner's profiled eager step of Llama-3 1B shape
  (16 blocks, 4 x 2,048 tokens, selective AC) on the same H200 (``PROFILE_FILE``): the step
  unprofiled (its tokens over its tokens/s) less the kernels' busy time, over its launches
  (24.6 us). The planner adds it to the step's kernels per launch its trace counts
  (``precision_cost``: why added, not a floor).
"""

from __future__ import annotations

import math

KERNELS_FILE = "benchmarks/results/h200_2026-11-27/kernels.json"
PROFILE_FILE = "benchmarks/results/h200_2026-11-27/titan_eager_profiled.json"

# Architectures without a measurement of their own, and the one whose figures they take.
INHERITS = {"sm80": "sm90"}

GEMM_EFFICIENCY = {"sm90": 0.763}

# (tokens of one sequence, share of dense peak at the counted FLOPs), tokens ascending.
_SM90_ATTENTION = {
    "causal": (
        (1024, 0.142),
        (2048, 0.408),
        (4096, 0.738),
        (8192, 0.916),
        (16384, 0.970),
        (32768, 0.960),
        (65536, 0.969),
    ),
    "full": (
        (1024, 0.091),
        (2048, 0.369),
        (4096, 0.472),
        (8192, 0.512),
        (16384, 0.484),
        (32768, 0.493),
    ),
}
ATTENTION_SHARE = {"sm90": _SM90_ATTENTION}

LAUNCH_SECONDS = {"sm90": 24.6e-6}


def measured_arch(arch: str) -> str:
    """The architecture whose measurement ``arch`` uses (itself, or the one it inherits);
    KeyError naming the architectures known when there is none."""
    found = INHERITS.get(arch, arch)
    if found not in GEMM_EFFICIENCY:
        known = sorted({*GEMM_EFFICIENCY, *INHERITS})
        raise KeyError(f"no measured kernel rates for architecture {arch!r}; known: {known}")
    return found


def gemm_efficiency(arch: str) -> float:
    """The fraction of peak a large well-shaped GEMM's tiles reach on ``arch`` ('sm90')."""
    return GEMM_EFFICIENCY[measured_arch(arch)]


def attention_share(arch: str, causal: bool, tokens: float) -> float:
    """The share of peak attention reaches at the runner's FLOP count on ``arch``, for one
    sequence (or context-parallel chunk) of ``tokens`` tokens, ``causal`` or full: linear in
    log2(tokens) between the measured points, the end points' shares outside them."""
    points = ATTENTION_SHARE[measured_arch(arch)]["causal" if causal else "full"]
    if tokens <= points[0][0]:
        return points[0][1]
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if tokens <= t1:
            f = (math.log2(tokens) - math.log2(t0)) / (math.log2(t1) - math.log2(t0))
            return s0 + f * (s1 - s0)
    return points[-1][1]


def launch_seconds(arch: str) -> float:
    """Seconds the device idles per eager kernel launch on ``arch`` (module docstring)."""
    return LAUNCH_SECONDS[measured_arch(arch)]
