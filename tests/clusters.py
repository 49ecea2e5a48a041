"""A small made-up cluster for planner tests: round figures, so prices can be checked by hand."""

from __future__ import annotations

from hsdp_runner.planner.cluster import Cluster


def fake_cluster(**overrides) -> Cluster:
    """4 GPUs per node on 2 nodes, NVLink 100 GB/s, 4 NICs of 80 Gb/s (10 GB/s per GPU), full
    overlap and no reserve; ``overrides`` replace any field."""
    base = dict(
        name="t",
        device="H100",
        gpus_per_node=4,
        nodes=2,
        device_memory_gib=80.0,
        peak_tflops=100.0,
        peak_source="test",
        compute_efficiency=0.5,
        nvlink_gbps=100.0,
        nvlink_efficiency=1.0,
        nics_per_node=4,
        nic_gbit=80.0,
        nic_efficiency=1.0,
        intra_node_latency_us=10.0,
        inter_node_latency_us=20.0,
        overlap=1.0,
        memory_reserve_gib=0.0,
        memory_gbps=1000.0,
    )
    return Cluster(**{**base, **overrides})
