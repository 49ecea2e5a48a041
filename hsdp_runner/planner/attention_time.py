"""Seconds of a rank's attention (flash: QK^T and AV, forward and backward) from its counted
FLOPs, at the share of peak its architecture's kernel measurably reaches (this module's job).

The runner counts attention as every query against every key (``step_time.step_flops``, as
torchtitan and MFU count it). A causal kernel computes about half of that and runs it at its
own rate, which grows with the tokens of the sequence (more tiles per head, the softmax's
bookkeeping amortised); ``kernel_rates.attention_share`` holds the share of peak measured at
the counted FLOPs, so no factor of two appears here. Without context parallelism (``cp`` = 1)
a rank's attention is one causal kernel over ``seq_len`` tokens. With a ring over ``cp`` ranks
each rank holds ``seq_len / cp`` tokens and its count is its queries against every key: 1/cp of
it the diagonal chunk (causal, at ``seq_len / cp`` tokens), the rest off-diagonal chunks, of
which the causal mask skips half whole and the kernel runs the other half full (the measured
full share, twice over at the count). That split is assumed, not traced from the ring.

A device the SM table does not list (a CPU: ``cluster=this_machine``) prices the count at its
peak x ``cluster.compute_efficiency``, as before. A GPU multiplies the measured share by
``cluster.compute_efficiency`` too (what a job loses beside the kernel itself).
"""

from __future__ import annotations

from hsdp_runner.planner import kernel_rates
from hsdp_runner.planner.cluster import Cluster
from hsdp_runner.train.metrics import lookup_sm_count


def counted_share(arch: str, seq_len: int, cp: int) -> float:
    """The share of peak, at the runner's count, of a rank's attention on ``arch`` for
    sequences of ``seq_len`` tokens over a context-parallel ring of ``cp`` ranks."""
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    chunk = seq_len / cp
    causal = kernel_rates.attention_share(arch, True, chunk)
    if cp == 1:
        return causal
    full = 2 * kernel_rates.attention_share(arch, False, chunk)
    diagonal = 1 / cp
    return 1 / (diagonal / causal + (1 - diagonal) / full)


def seconds(flops: float, cluster: Cluster, seq_len: int, cp: int) -> float:
    """Seconds of ``flops`` counted attention FLOPs of one rank on ``cluster`` (module
    docstring)."""
    rate = cluster.peak_tflops * 1e12 * cluster.compute_efficiency
    found = lookup_sm_count(cluster.device)
    if not found:
        return flops / rate
    return flops / (rate * counted_share(found[1], seq_len, cp))
