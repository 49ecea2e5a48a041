"""Seconds of a list of matmuls on one device, from their shapes (this module's one job).

A GEMM (M, N, K) multiplies an (M, K) operand by a (K, N) one into an (M, N) output; a grouped
GEMM runs G such groups of (M_g, N, K) in one launch (``F.grouped_mm``: the experts of a
mixture-of-experts layer, each on the rows routed to it). On a GPU:

- **Tiles.** The output is cut into tiles, one per thread block, each stepping through K; a
  tile that hangs over an edge still does a whole tile's work (tile quantization), in whole K
  steps. cuBLAS picks, per shape, among output tiles of 256 x 128, 128 x 256, 128 x 128 and
  smaller for bf16/fp16 (NVIDIA, "Matrix Multiplication Background User's Guide", Deep
  Learning Performance documentation, sections "Tile quantization" and "Wave quantization";
  CUTLASS's sm80 and sm90 tensor-core kernels come in the same shapes, stepping through K by
  32 and 64). Priced here with 128 x 128 on Ampere (sm80) and Hopper (sm90) (``TILES``): with
  one efficiency for every tile, 128 x 128 never pads or quantizes more than the larger ones,
  so charging a larger tile's padding would charge what the library avoids by picking another
  tile. Smaller tiles are not offered: they reach a lower rate per SM than the measured
  efficiency describes.
- **Waves.** The tiles run in waves over the device's streaming multiprocessors
  (``metrics.SM_COUNT``): 133 tiles on an H100's 132 SMs take two waves, the second with one
  SM busy (wave quantization). A wave takes one tile's FLOPs (2 x 128 x 128 x K) at 1/SMs of
  the device's rate.
- **Split-K.** When a GEMM has too few output tiles to fill its waves (the weight gradient of
  a small weight, whose K is every token; a GEMM of a few rows), cuBLAS cuts K into s slices
  (split-K; Hopper's stream-K kernels do the same job): s x the tiles, each over 1/s of K, then
  a reduction that writes and reads s fp32 partial outputs. The model takes the s (1 up to the
  SMs, while a slice keeps one K step) that prices the launch fastest, which is what the
  library's heuristics aim at; grouped GEMMs are not split.
- **Roofline.** A launch takes the larger of its compute time and the bytes it moves through
  device memory at ``cluster.memory_gbps``: its operands read once and its output written
  once, at the compute dtype's width (float8 operands one byte, their output in the compute
  dtype); a split's reduction comes on top. A GEMM of one row is memory bound: it reads a whole
  N x K weight for 2 x N x K FLOPs.

A tile runs at the fraction of peak its architecture's large, well-shaped GEMMs were measured
to reach (``kernel_rates.GEMM_EFFICIENCY``: a device fact, measured on an H200, inherited by
the H100 and assumed for the A100) x ``cluster.compute_efficiency``, the one constant per GPU
(sm90's fitted to this runner's one H200 job, benchmarks/planner_gpu_heldout.py; the A100's to
the single-node figures marked ``role: fitted`` in benchmarks/published_figures.yaml): the
kernels' rate in a job against their measured one (the launches' idle is priced apart,
``precision_cost``). float8 GEMMs run at the float8 peak x the same product (assumed, as
before). Not modelled: operands re-read from L2 rather than memory (bytes are one read each), and a tile's
rate falling as its K gets short (pipeline fill: the measured GEMMs with K = 512 ran at 0.32 of
peak per tile against 0.76; the expert GEMMs' weight gradients over few rows per expert).

A device without an SM figure gets the roofline alone: FLOPs at peak x efficiency against
bytes at the memory bandwidth. That is ``cluster=this_machine`` (a CPU: no SMs, no tiles; its
peak and bandwidth are measured, ``planner/linkbench.py``) and any GPU ``metrics.SM_COUNT``
does not list.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from hsdp_runner.planner import kernel_rates
from hsdp_runner.planner.cluster import Cluster
from hsdp_runner.train.metrics import lookup_sm_count

# The tile (output rows, output cols, K step) each architecture's GEMMs are priced with
# (module docstring): CUTLASS's 128 x 128 bf16 tensor-core tiles step through K by 32 on sm80
# and by 64 on sm90.
TILES = {"sm80": (128, 128, 32), "sm90": (128, 128, 64)}
PARTIAL_BYTES = 4  # a split-K partial output element: fp32 accumulators


@dataclass(frozen=True)
class Gemm:
    """``groups`` GEMMs of (m, n, k) in one launch (1: a plain GEMM), launched ``runs`` times a
    step (once per micro-batch; a fraction stands for a share of the launches), priced into the
    compute part ``part``; ``float8``: at the float8 peak, its operands one byte wide. ``m`` and
    ``k`` may be means (rows per expert) and need not be whole."""

    m: float
    n: float
    k: float
    groups: int = 1
    runs: float = 1.0
    part: str = "matmul"
    float8: bool = False

    @property
    def flops(self) -> float:
        """FLOPs of all its launches: 2 x m x n x k per group."""
        return 2.0 * self.groups * self.m * self.n * self.k * self.runs


@dataclass(frozen=True)
class MatmulDevice:
    """What prices a GEMM on one device: dense FLOP/s of the compute dtype and of float8 (None:
    no float8 GEMM may be priced), the fraction of them a large well-shaped GEMM reaches,
    memory bytes/s, the compute dtype's width in bytes, and its SMs and output tile (None: the
    roofline alone)."""

    peak_flops: float
    float8_peak_flops: float | None
    efficiency: float
    memory_bytes_per_s: float
    dtype_bytes: int
    sms: int | None = None
    tile: tuple[int, int, int] | None = None


def device_of(
    cluster: Cluster, dtype_bytes: int, float8_peak_tflops: float | None = None
) -> MatmulDevice:
    """The ``MatmulDevice`` of one device of ``cluster`` with ``dtype_bytes``-wide compute
    (its SMs and tile from ``metrics.SM_COUNT`` by ``cluster.device``; none for a CPU): a
    GPU's tiles at its architecture's measured GEMM efficiency (``kernel_rates``) x
    ``cluster.compute_efficiency``, a CPU's FLOPs at its measured peak x the latter."""
    found = lookup_sm_count(cluster.device)
    measured = kernel_rates.gemm_efficiency(found[1]) if found else 1.0
    return MatmulDevice(
        peak_flops=cluster.peak_tflops * 1e12,
        float8_peak_flops=float8_peak_tflops * 1e12 if float8_peak_tflops else None,
        efficiency=measured * cluster.compute_efficiency,
        memory_bytes_per_s=cluster.memory_gbps * 1e9,
        dtype_bytes=dtype_bytes,
        sms=found[0] if found else None,
        tile=TILES[found[1]] if found else None,
    )


def _blocks(length: float, tile: int) -> int:
    """Tiles of ``tile`` covering ``length`` (a mean length rounded to 1e-9 first)."""
    return math.ceil(round(length / tile, 9))


def tile_count(gemm: Gemm, tile: tuple[int, int, int]) -> int:
    """Output tiles of one launch of ``gemm``: per group ceil(m / rows) x ceil(n / cols)."""
    return gemm.groups * _blocks(gemm.m, tile[0]) * _blocks(gemm.n, tile[1])


def waves(gemm: Gemm, device: MatmulDevice, split: int = 1) -> int:
    """Waves one launch of ``gemm`` runs on ``device``'s SMs, its K cut into ``split``
    slices: ceil(tiles x split / SMs)."""
    return math.ceil(tile_count(gemm, device.tile) * split / device.sms)


def _rate(gemm: Gemm, device: MatmulDevice) -> float:
    """FLOP/s a large well-shaped GEMM of ``gemm``'s dtype reaches on ``device``."""
    peak = device.float8_peak_flops if gemm.float8 else device.peak_flops
    if peak is None:
        raise ValueError("a float8 GEMM on a device priced without a float8 peak")
    return peak * device.efficiency


def compute_seconds(gemm: Gemm, device: MatmulDevice, split: int = 1) -> float:
    """Seconds one launch of ``gemm`` takes at the tensor cores' rate, its K cut into
    ``split`` slices: its waves of tiles, each a tile's FLOPs over its slice of K rounded up to
    whole K steps (padded tiles and the last wave's idle SMs included); its FLOPs without SMs."""
    if device.sms is None:
        return gemm.flops / gemm.runs / _rate(gemm, device)
    rows, cols, depth = device.tile
    k_padded = _blocks(gemm.k / split, depth) * depth
    tile_seconds = 2.0 * rows * cols * k_padded / (_rate(gemm, device) / device.sms)
    return waves(gemm, device, split) * tile_seconds


def memory_seconds(gemm: Gemm, device: MatmulDevice) -> float:
    """Seconds one launch of ``gemm`` takes to read its operands and write its output once."""
    operand = 1 if gemm.float8 else device.dtype_bytes
    g = gemm
    nbytes = g.groups * ((g.m * g.k + g.k * g.n) * operand + g.m * g.n * device.dtype_bytes)
    return nbytes / device.memory_bytes_per_s


def launch_seconds(gemm: Gemm, device: MatmulDevice, split: int = 1) -> float:
    """Seconds of one launch of ``gemm`` with K cut into ``split`` slices: the larger of its
    compute and memory time, then (split > 1) the reduction that writes and reads ``split``
    fp32 partial outputs."""
    partials = 2 * split * gemm.groups * gemm.m * gemm.n * PARTIAL_BYTES if split > 1 else 0
    return max(compute_seconds(gemm, device, split), memory_seconds(gemm, device)) + (
        partials / device.memory_bytes_per_s
    )


def best_split(gemm: Gemm, device: MatmulDevice) -> int:
    """The K slices (split-K) that price one launch of ``gemm`` fastest: 1 to the SMs while a
    slice keeps one K step; 1 for a grouped GEMM or a device without SMs."""
    if device.sms is None or gemm.groups > 1:
        return 1
    most = max(1, min(device.sms, int(gemm.k // device.tile[2])))
    return min(range(1, most + 1), key=lambda s: launch_seconds(gemm, device, s))


@functools.lru_cache(maxsize=4096)
def _one_launch(gemm: Gemm, device: MatmulDevice) -> float:
    return launch_seconds(gemm, device, best_split(gemm, device))


def seconds(gemm: Gemm, device: MatmulDevice) -> float:
    """Seconds of all launches of ``gemm``: each at its best split of K (``best_split``), the
    larger of compute and memory time plus the split's reduction."""
    one = dataclasses.replace(gemm, runs=1.0, part="")
    return gemm.runs * _one_launch(one, device)


def efficiency(gemm: Gemm, device: MatmulDevice) -> float:
    """The fraction of the device's peak ``gemm`` reaches (its FLOPs over seconds x peak):
    ``device.efficiency`` for a large well-shaped GEMM, less when tiles, waves or memory
    bound it."""
    peak = device.float8_peak_flops if gemm.float8 else device.peak_flops
    return gemm.flops / seconds(gemm, device) / peak


def seconds_by_part(gemms: Iterable[Gemm], device: MatmulDevice) -> dict[str, float]:
    """{part: seconds} of ``gemms`` on ``device`` (``Gemm.part`` names the part)."""
    parts: dict[str, float] = {}
    for gemm in gemms:
        parts[gemm.part] = parts.get(gemm.part, 0.0) + seconds(gemm, device)
    return parts
