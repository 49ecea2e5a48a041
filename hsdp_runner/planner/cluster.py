"""The machine a plan predicts for: compute peak, memory, and the links each collective uses.

A ``Cluster`` is resolved from the ``cluster`` config node (``conf/cluster/*.yaml``): presets
state datasheet figures (NVLink per GPU and direction; NICs per node and their line rate) and
the fraction of them NCCL's bus bandwidth reaches; ``cluster=this_machine`` (``measure: true``)
measures this machine instead (``linkbench``), and ``cluster.calibration`` lays the figures
that ``python -m hsdp_runner.plan --calibrate`` fitted to a sweep over either.

A collective over a group of ``n`` ranks costs ``latency + ring_factor x bytes / bus
bandwidth`` where ``bytes`` is the full tensor (as ``comm_model`` counts it) and the ring factor
is (n-1)/n for all-gather, reduce-scatter and all-to-all, 2(n-1)/n for all-reduce (NCCL's
ring; each byte leaves a rank once, or twice: reduce-scatter then all-gather; an all-to-all's
rank keeps 1/n of its input). The bus bandwidth depends on how
the group sits on nodes (``topology.Placement``):

- inside one node: NVLink, ``nvlink_gbps x nvlink_efficiency`` per GPU;
- across nodes, with k ranks of the group on each node: NCCL runs one ring channel per NIC
  next to those k GPUs, so a node sends the group's traffic through k GPUs' share of the
  node's NICs, ``k x nics_per_node x nic_gbit / 8 x nic_efficiency / gpus_per_node``; a ring
  with k > 1 also crosses NVLink inside each node, so the bus bandwidth is the smaller of the
  two. The node's other groups of the same dim (``groups_per_node`` of them, run at the same
  moment) use the other GPUs' shares: together the g groups of k ranks use the node's NICs
  exactly once (g x k = GPUs per node). An all-to-all (expert parallel's token exchange) is no
  ring: each rank sends every peer its part directly, so across nodes a rank's off-node bytes,
  (n - k)/n of them, go through its own NIC share, not k GPUs' (``_all_to_all_across_nodes``).

The time a collective spends on each link is kept apart (``Price.link_s``) so that
``planner.step_time`` can let collectives that run at the same time share a link they both use and
run side by side on links they do not share. NCCL's tree all-reduce (which it may pick on two
nodes, where it can beat the ring's network bound, or at small sizes) is not modelled: every
all-reduce is priced as a ring, an upper bound of its time.

The end of a step (gradient clipping, then fused AdamW) streams every trainable element of a
rank's shard through device memory a fixed number of times (``STEP_END_ACCESSES``), so it is
priced at the device's memory bandwidth (``memory_gbps``: the datasheet figure for GPUs,
measured on this machine with those same two calls, every rank at once; the count is the
trainer's ``STEP_END_ACCESSES``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from hsdp_runner.config.schema import ClusterConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.hardware import cache_dir
from hsdp_runner.distributed.topology import Placement
from hsdp_runner.train.metrics import lookup_peak_tflops
from hsdp_runner.train.step_end import STEP_END_ACCESSES

CALIBRATED_KEYS = (
    "compute_efficiency",
    "nvlink_efficiency",
    "nic_efficiency",
    "intra_node_latency_us",
    "inter_node_latency_us",
    "link_scale",
    "latency_scale",
)
# Keys earlier presets had, and what replaced them.
REPLACED_KEYS = {
    "intra_node_gbps": "cluster.nvlink_gbps and cluster.nvlink_efficiency",
    "inter_node_gbps": "cluster.nics_per_node, cluster.nic_gbit and cluster.nic_efficiency",
}
INTRA, INTER = "nvlink", "nic"  # the link names of Price.link_s


def ring_factor(kind: str, n: int) -> float:
    """Bytes each rank sends per byte of the full tensor, for a ring over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


@dataclass(frozen=True)
class Price:
    """What ``calls`` collectives of one kind over one group cost, and on which links."""

    latency_s: float
    link_s: dict  # {link name: seconds the traffic occupies that link}
    bus_gbps: float  # the bus bandwidth assumed (GB/s)
    link: str  # the bottleneck: 'nvlink', 'nic' or 'measured'
    algorithm: str  # 'ring', or 'all_to_all' (pairwise: every rank to every peer)

    @property
    def bandwidth_s(self) -> float:
        """Seconds of the traffic alone: the slowest link it crosses."""
        return max(self.link_s.values(), default=0.0)

    @property
    def seconds(self) -> float:
        """Latency plus bandwidth time."""
        return self.latency_s + self.bandwidth_s


FREE = Price(0.0, {}, 0.0, "none", "none")


@dataclass
class Cluster:
    """Resolved figures of a cluster; ``price`` gives what one collective costs on it."""

    name: str
    device: str
    gpus_per_node: int
    nodes: int
    device_memory_gib: float
    peak_tflops: float
    peak_source: str
    compute_efficiency: float
    nvlink_gbps: float | None  # per GPU and direction, datasheet (None: measured)
    nvlink_efficiency: float | None
    nics_per_node: int | None  # None: no inter-node link of its own (this_machine)
    nic_gbit: float | None  # line rate of one NIC, Gb/s
    nic_efficiency: float | None
    intra_node_latency_us: float
    inter_node_latency_us: float
    overlap: float
    memory_reserve_gib: float
    memory_gbps: float  # device memory bandwidth (GB/s): datasheet, or measured (this_machine)
    # this_machine: {kind: {group size: [latency s, bytes/s]}} from the micro-benchmark.
    measured_links: dict = field(default_factory=dict)
    # this_machine's measured peak: when and under what load (cpu_peak.MachineLoad's fields,
    # recorded by linkbench); None for a peak from a table or the config.
    peak_load: dict | None = None
    # Dense FP8 TFLOP/s (precision=float8's matmuls): cluster.float8_peak_tflops or the peak
    # table; None where the device has none (planning float8 there is an error).
    float8_peak_tflops: float | None = None
    link_scale: float = 1.0  # calibrated multiplier of every bandwidth
    latency_scale: float = 1.0  # calibrated multiplier of every latency
    calibrated_from: str | None = None

    @property
    def device_type(self) -> str:
        """The torch device type this cluster's jobs run on: 'cpu' for a CPU cluster
        (``device`` 'cpu': ``this_machine``), else 'cuda'."""
        return "cpu" if self.device.lower() == "cpu" else "cuda"

    @property
    def world_size(self) -> int:
        """Ranks in the cluster: nodes x GPUs (ranks) per node."""
        return self.nodes * self.gpus_per_node

    @property
    def intra_node_bus_gbps(self) -> float:
        """Bus bandwidth of a ring inside one node (GB/s per GPU)."""
        return self.nvlink_gbps * self.nvlink_efficiency * self.link_scale

    @property
    def nic_share_gbps(self) -> float:
        """One GPU's share of its node's NICs, as NCCL reaches it (GB/s)."""
        return (
            self.nics_per_node
            * self.nic_gbit
            / 8
            * self.nic_efficiency
            / self.gpus_per_node
            * self.link_scale
        )

    def step_end_seconds(self, elements: int, element_bytes: int) -> float:
        """Seconds the end of a step (clipping and the fused AdamW step) takes over a shard of
        ``elements`` trainable elements of ``element_bytes`` each, memory-bandwidth bound."""
        return elements * element_bytes * STEP_END_ACCESSES / (self.memory_gbps * 1e9)

    def price(self, kind: str, where: Placement, calls: int, nbytes: float) -> Price:
        """What ``calls`` collectives ``kind`` moving ``nbytes`` (full tensors, summed) cost
        over groups placed as ``where``; free for groups of one rank or no calls."""
        if where.size <= 1 or not calls:
            return FREE
        traffic = ring_factor(kind, where.size) * nbytes
        table = self.measured_links.get(kind)
        if not table and self.nvlink_gbps is None:
            raise ConfigError(
                f"cluster {self.name!r} is measured but its link table has no "
                f"{kind}; delete its cache in {cache_dir()} to measure it "
                "again"
            )
        if table:
            # Measured per group size on this machine (JSON keys are strings); the nearest
            # size stands in. "Nodes" on one machine share its memory: the same table.
            latency, bandwidth = table[min(table, key=lambda k: abs(int(k) - where.size))]
            bandwidth *= self.link_scale
            return Price(
                calls * latency * self.latency_scale,
                {INTRA: traffic / bandwidth},
                bandwidth / 1e9,
                "measured",
                "ring",
            )
        if not where.spans_nodes:
            bus = self.intra_node_bus_gbps
            return Price(
                calls * self.intra_node_latency_us * 1e-6 * self.latency_scale,
                {INTRA: traffic / (bus * 1e9)},
                bus,
                INTRA,
                "ring",
            )
        if kind == "all_to_all":
            return self._all_to_all_across_nodes(where, calls, nbytes)
        nic = where.ranks_per_node * self.nic_share_gbps
        link_s = {INTER: traffic / (nic * 1e9)}
        if where.ranks_per_node > 1:
            link_s[INTRA] = traffic / (self.intra_node_bus_gbps * 1e9)
        bus = min(nic, self.intra_node_bus_gbps) if where.ranks_per_node > 1 else nic
        return Price(
            calls * self.inter_node_latency_us * 1e-6 * self.latency_scale,
            link_s,
            bus,
            INTER if bus == nic else INTRA,
            "ring",
        )

    def _all_to_all_across_nodes(self, where: Placement, calls: int, nbytes: float) -> Price:
        """An all-to-all over a group spanning nodes, k ranks on each: every rank sends each
        peer its part directly, the (n - k)/n of its bytes bound for other nodes through its
        own share of the node's NICs (no ring spreads them over k GPUs' NICs), the (k - 1)/n
        for its node's peers over NVLink at the same time."""
        n, k = where.size, where.ranks_per_node
        nic = self.nic_share_gbps
        link_s = {INTER: nbytes * (n - k) / n / (nic * 1e9)}
        if k > 1:
            link_s[INTRA] = nbytes * (k - 1) / n / (self.intra_node_bus_gbps * 1e9)
        return Price(
            calls * self.inter_node_latency_us * 1e-6 * self.latency_scale,
            link_s,
            nic,
            INTER,
            "all_to_all",
        )

    def describe(self) -> dict:
        """Plain dict for plan.json (the measured table included)."""
        return {**asdict(self), "world_size": self.world_size}


def resolve(cluster_cfg: ClusterConfig, compute_dtype: str) -> Cluster:
    """Build the Cluster of the ``cluster`` config ``cluster_cfg`` for ``compute_dtype`` matmuls.

    Raises ConfigError for figures that make no sense, replaced keys, or a calibration file
    that is missing.
    """
    c = asdict(cluster_cfg)
    for old, new in REPLACED_KEYS.items():
        if c.pop(old, None) is not None:
            raise ConfigError(
                f"cluster.{old} was replaced by the datasheet figures {new} "
                "(see conf/cluster/h100_sxm.yaml); set those instead"
            )
    for key in ("gpus_per_node", "nodes"):
        if c[key] < 1:
            raise ConfigError(f"cluster.{key}={c[key]} must be >= 1")
    if c["overlap"] is not None and not 0.0 <= c["overlap"] <= 1.0:
        raise ConfigError(f"cluster.overlap={c['overlap']} must lie in [0, 1]")
    measured, peak_load = {}, None
    if c["measure"]:
        from hsdp_runner.planner import linkbench

        bench = linkbench.cached_or_measure(c["gpus_per_node"])
        measured = bench["links"]
        if c["peak_tflops"] is None:
            c["peak_tflops"] = bench["peak_tflops"][compute_dtype]
            source = f"measured: {compute_dtype} matmul, {c['gpus_per_node']} ranks at once"
            peak_load = bench.get("peak_load")
        else:
            source = "config cluster.peak_tflops"
        if c["device_memory_gib"] is None:
            c["device_memory_gib"] = bench["memory_gib"] / c["gpus_per_node"]
        if c["overlap"] is None:
            c["overlap"] = bench["overlap"]
        if c["memory_gbps"] is None:
            c["memory_gbps"] = bench["memory_gbps"]
    elif c["peak_tflops"] is None:
        c["peak_tflops"] = lookup_peak_tflops(c["device"], compute_dtype)
        if c["peak_tflops"] is None:
            raise ConfigError(
                f"cluster.device={c['device']!r} has no {compute_dtype} peak in "
                "metrics.PEAK_TFLOPS; set cluster.peak_tflops=<TFLOP/s>"
            )
        source = f"table: {c['device']} {compute_dtype}"
    else:
        source = "config cluster.peak_tflops"
    _check_links(c)
    if c["device_memory_gib"] is None:
        raise ConfigError("cluster.device_memory_gib is null; set the memory of one device")
    if c["overlap"] is None:
        raise ConfigError(
            "cluster.overlap is null, which only a measured cluster (cluster.measure"
            "=true) fills in; set the fraction of compute collectives hide behind, "
            "e.g. cluster.overlap=1.0"
        )
    if not c["memory_gbps"] or c["memory_gbps"] <= 0:
        raise ConfigError(
            f"cluster.memory_gbps={c['memory_gbps']} must be > 0: the memory bandwidth of one "
            "device in GB/s (datasheet, e.g. 3350 for H100 SXM), or null with "
            "cluster.measure=true"
        )
    cluster = Cluster(
        name=c["name"],
        device=c["device"],
        gpus_per_node=c["gpus_per_node"],
        nodes=c["nodes"],
        device_memory_gib=c["device_memory_gib"],
        peak_tflops=c["peak_tflops"],
        peak_source=source,
        compute_efficiency=c["compute_efficiency"],
        nvlink_gbps=c["nvlink_gbps"],
        nvlink_efficiency=c["nvlink_efficiency"],
        nics_per_node=c["nics_per_node"],
        nic_gbit=c["nic_gbit"],
        nic_efficiency=c["nic_efficiency"],
        intra_node_latency_us=c["intra_node_latency_us"],
        inter_node_latency_us=c["inter_node_latency_us"],
        overlap=c["overlap"],
        memory_reserve_gib=c["memory_reserve_gib"],
        memory_gbps=c["memory_gbps"],
        measured_links=measured,
        peak_load=peak_load,
        float8_peak_tflops=c["float8_peak_tflops"] or lookup_peak_tflops(c["device"], "float8"),
    )
    if c.get("calibration"):
        apply_calibration(cluster, Path(c["calibration"]))
    return cluster


def _check_links(c: dict) -> None:
    """Raise ConfigError for link figures a described (not measured) cluster lacks."""
    if c["measure"]:
        return  # the measured table prices every group
    for key in ("nvlink_efficiency", "nic_efficiency"):
        if c[key] is None or not 0.0 < c[key] <= 1.0:
            raise ConfigError(
                f"cluster.{key}={c[key]} must lie in (0, 1]: the fraction of the "
                "line rate NCCL's bus bandwidth reaches"
            )
    if not c["nvlink_gbps"] or c["nvlink_gbps"] <= 0:
        raise ConfigError(
            f"cluster.nvlink_gbps={c['nvlink_gbps']} must be > 0: the NVLink "
            "bandwidth of one GPU in one direction (GB/s, e.g. 450 for H100 SXM)"
        )
    if c["nodes"] > 1:
        for key, example in (("nics_per_node", "8"), ("nic_gbit", "400")):
            if not c[key] or c[key] <= 0:
                raise ConfigError(
                    f"cluster.{key}={c[key]} must be > 0 for cluster.nodes="
                    f"{c['nodes']}: the compute NICs of one node and the line rate "
                    f"of each (e.g. cluster.{key}={example})"
                )


def apply_calibration(cluster: Cluster, path: Path) -> None:
    """Lay the fitted figures of a calibration file (``--calibrate``) over ``cluster``."""
    if not path.is_file():
        raise ConfigError(
            f"cluster.calibration={path} does not exist; write one with "
            "python -m hsdp_runner.plan --calibrate <sweep dir>"
        )
    fitted = yaml.safe_load(path.read_text()) or {}
    for key in CALIBRATED_KEYS:
        if key in fitted:
            setattr(cluster, key, float(fitted[key]))
    cluster.calibrated_from = str(path)
