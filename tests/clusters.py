"""A small made-up cluster for planner tests (round figures, so prices can be checked by hand),
and this machine's link table for 2 ranks written in advance for CLI jobs that plan."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from hsdp_runner.planner.cluster import Cluster


def quiet_load() -> dict:
    """A linkbench cache's ``peak_load`` record: measured now, nothing else running."""
    return {"measured_at": time.time(), "loadavg": 0.0, "own_load": 0.0, "cpus": 2}


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


def this_machine_cache(cache: Path, threads_per_rank: int | None = None) -> dict:
    """Write ``cluster=this_machine``'s link table for 2 ranks per node into the cache dir
    ``cache`` (figures of the 2-core machine, so no job pays for the micro-benchmark; fake
    memory measurements are made afresh) and return the environment that points jobs at it.
    ``threads_per_rank``: the intra-op threads the planning process's ranks get (default:
    what a job launched from this process gets)."""
    from hsdp_runner.planner import linkbench

    links = {
        "all_gather": {"2": [1.3e-3, 8.3e7]},
        "reduce_scatter": {"2": [1.6e-3, 1.1e8]},
        "all_reduce": {"2": [7.8e-4, 4.6e8]},
        "all_to_all": {"2": [2.5e-4, 6.7e8]},  # measured later than the others (linkbench)
    }
    (cache / f"linkbench_{socket.gethostname()}_2.json").write_text(
        json.dumps(
            {
                "peak_tflops": {"float32": 0.0085, "bfloat16": 0.0002},
                "links": links,
                "overlap": 0.4,
                "memory_gbps": 5.0,
                "memory_gib": 16.0,
                "threads_per_rank": threads_per_rank or linkbench._threads_per_rank(2),
                "host": socket.gethostname(),
                "ranks": 2,
                # measured now on a quiet machine: a busy one would be measured again
                "peak_load": quiet_load(),
            }
        )
    )
    return {"HSDP_RUNNER_CACHE_DIR": str(cache)}
