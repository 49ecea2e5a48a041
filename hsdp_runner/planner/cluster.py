"""The machine a plan predicts for: compute peak, memory, and the links each mesh dim uses.

A ``Cluster`` is resolved from the ``cluster`` config node (``conf/cluster/*.yaml``): presets
state datasheet-style figures per GPU; ``cluster=this_machine`` (``measure: true``) measures
this machine instead (``linkbench``), and ``cluster.calibration`` lays the figures that
``python -m hsdp_runner.plan --calibrate`` fitted to a sweep over either.

A collective over a group of ``n`` ranks costs ``latency + ring_factor x bytes / bandwidth``
where ``bytes`` is the full tensor (as ``comm_model`` counts it) and the ring factor is
(n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce (each byte leaves a rank
once, or twice: reduce-scatter then all-gather). A group inside one node uses the intra-node
bandwidth; a group that spans nodes is limited by the inter-node link of each GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.train.metrics import lookup_peak_tflops

CALIBRATED_KEYS = ("compute_efficiency", "intra_node_gbps", "inter_node_gbps",
                   "intra_node_latency_us", "inter_node_latency_us", "link_scale",
                   "latency_scale")


def ring_factor(kind: str, n: int) -> float:
    """Bytes each rank sends per byte of the full tensor, for a ring over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


@dataclass
class Cluster:
    """Resolved figures of a cluster; ``link`` gives (latency s, bytes/s) per collective."""

    name: str
    device: str
    gpus_per_node: int
    nodes: int
    device_memory_gib: float
    peak_tflops: float
    peak_source: str
    compute_efficiency: float
    intra_node_gbps: float
    inter_node_gbps: float
    intra_node_latency_us: float
    inter_node_latency_us: float
    overlap: float
    memory_reserve_gib: float
    # this_machine: {kind: {group size: [latency s, bytes/s]}} from the micro-benchmark.
    measured_links: dict = field(default_factory=dict)
    link_scale: float = 1.0       # calibrated multiplier of every bandwidth
    latency_scale: float = 1.0    # calibrated multiplier of every latency
    calibrated_from: str | None = None

    @property
    def world_size(self) -> int:
        """Ranks in the cluster: nodes x GPUs (ranks) per node."""
        return self.nodes * self.gpus_per_node

    def link(self, kind: str, n: int, across_nodes: bool) -> tuple[float, float]:
        """(latency in s, bandwidth in bytes/s) of collective ``kind`` over ``n`` ranks."""
        table = self.measured_links.get(kind)
        if table and not across_nodes:
            # Measured per group size (JSON keys are strings); the nearest size stands in.
            near = min(table, key=lambda k: abs(int(k) - n))
            latency, bandwidth = table[near]
        elif across_nodes:
            latency, bandwidth = self.inter_node_latency_us * 1e-6, self.inter_node_gbps * 1e9
        else:
            latency, bandwidth = self.intra_node_latency_us * 1e-6, self.intra_node_gbps * 1e9
        return latency * self.latency_scale, bandwidth * self.link_scale

    def collective_time(self, kind: str, n: int, across_nodes: bool, calls: int,
                        nbytes: float) -> tuple[float, float]:
        """(latency part, bandwidth part) in seconds of ``calls`` collectives moving ``nbytes``."""
        if n <= 1 or not calls:
            return 0.0, 0.0
        latency, bandwidth = self.link(kind, n, across_nodes)
        return calls * latency, ring_factor(kind, n) * nbytes / bandwidth

    def describe(self) -> dict:
        """Plain dict for plan.json (the measured table included)."""
        return {**asdict(self), "world_size": self.world_size}


def resolve(node, compute_dtype: str) -> Cluster:
    """Build the Cluster of the ``cluster`` config node for ``compute_dtype`` matmuls.

    Raises ConfigError for figures that make no sense or a calibration file that is missing.
    """
    c = dict(node)
    for key in ("gpus_per_node", "nodes"):
        if c[key] < 1:
            raise ConfigError(f"cluster.{key}={c[key]} must be >= 1")
    if c["overlap"] is not None and not 0.0 <= c["overlap"] <= 1.0:
        raise ConfigError(f"cluster.overlap={c['overlap']} must lie in [0, 1]")
    measured = {}
    if c["measure"]:
        from hsdp_runner.planner import linkbench

        bench = linkbench.cached_or_measure(c["gpus_per_node"])
        measured = bench["links"]
        c["peak_tflops"] = c["peak_tflops"] or bench["peak_tflops"][compute_dtype]
        source = f"measured: {compute_dtype} matmul, {c['gpus_per_node']} ranks at once"
        if c["device_memory_gib"] is None:
            c["device_memory_gib"] = bench["memory_gib"] / c["gpus_per_node"]
        if c["overlap"] is None:
            c["overlap"] = bench["overlap"]
    elif c["peak_tflops"] is None:
        c["peak_tflops"] = lookup_peak_tflops(c["device"], compute_dtype)
        if c["peak_tflops"] is None:
            raise ConfigError(f"cluster.device={c['device']!r} has no {compute_dtype} peak in "
                              "metrics.PEAK_TFLOPS; set cluster.peak_tflops=<TFLOP/s>")
        source = f"table: {c['device']} {compute_dtype}"
    else:
        source = "config cluster.peak_tflops"
    if c["device_memory_gib"] is None:
        raise ConfigError("cluster.device_memory_gib is null; set the memory of one device")
    if c["overlap"] is None:
        raise ConfigError("cluster.overlap is null, which only a measured cluster (cluster.measure"
                          "=true) fills in; set the fraction of compute collectives hide behind, "
                          "e.g. cluster.overlap=1.0")
    cluster = Cluster(name=c["name"], device=c["device"], gpus_per_node=c["gpus_per_node"],
                      nodes=c["nodes"], device_memory_gib=c["device_memory_gib"],
                      peak_tflops=c["peak_tflops"], peak_source=source,
                      compute_efficiency=c["compute_efficiency"],
                      intra_node_gbps=c["intra_node_gbps"], inter_node_gbps=c["inter_node_gbps"],
                      intra_node_latency_us=c["intra_node_latency_us"],
                      inter_node_latency_us=c["inter_node_latency_us"], overlap=c["overlap"],
                      memory_reserve_gib=c["memory_reserve_gib"], measured_links=measured)
    if c.get("calibration"):
        apply_calibration(cluster, Path(c["calibration"]))
    return cluster


def apply_calibration(cluster: Cluster, path: Path) -> None:
    """Lay the fitted figures of a calibration file (``--calibrate``) over ``cluster``."""
    if not path.is_file():
        raise ConfigError(f"cluster.calibration={path} does not exist; write one with "
                          "python -m hsdp_runner.plan --calibrate <sweep dir>")
    fitted = yaml.safe_load(path.read_text()) or {}
    for key in CALIBRATED_KEYS:
        if key in fitted:
            setattr(cluster, key, float(fitted[key]))
    cluster.calibrated_from = str(path)
