"""ParallelDims: the single owner of the parallel degrees and of the world DeviceMesh.

DDP, FSDP and HSDP are all special cases of two degrees, ``dp_replicate x dp_shard``; TP is a
third, innermost dim. The world mesh is built once, up front, with every dim named (size-1
dims included, so code can always ask for ``mesh["tp"]``) and with the flattened ``dp`` view
(replicate x shard) that data loading and loss averaging use.

Node awareness: ranks are placed on nodes contiguously (torchrun numbers ranks node by node;
SLURM's default block distribution does too) and the mesh is row-major with ``tp`` innermost
and ``dp_replicate`` outermost, so with ``dp_shard x tp <= ranks per node`` the shard and TP
groups stay inside a node and only the replicate all-reduce crosses the slow inter-node link.
``ParallelDims`` works out which dims cross nodes, refuses TP across nodes unless allowed, and
warns when the shard group spans nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from math import prod
from typing import Optional

from hsdp_runner.core.errors import ConfigError

DIM_NAMES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Validated degrees for one job. Construct with ``ParallelDims.from_config``."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ranks_per_node: Optional[int] = None  # None: the whole job is on one node

    @classmethod
    def from_config(cls, parallel, model, world_size: int,
                    ranks_per_node: Optional[int] = None) -> ParallelDims:
        """Infer -1 degrees from ``world_size`` and validate against the model shape and nodes.

        Takes the ``parallel`` and ``model`` config nodes (DictConfig, dict or dataclass), the
        job's world size and the ranks per node (local world size; None = one node). Returns
        ParallelDims or raises ConfigError naming keys and a fix.
        """
        get = (lambda node, k: node[k]) if isinstance(parallel, dict) else getattr
        degrees = {name: get(parallel, name) for name in DIM_NAMES}
        if world_size < 1:
            raise ConfigError(f"world size {world_size} must be >= 1; check launcher.nnodes and "
                              "launcher.nproc_per_node")
        check_degree_values(degrees)
        unknown = [n for n, v in degrees.items() if v == -1]
        if len(unknown) > 1:
            raise ConfigError(f"{' and '.join('parallel.' + n for n in unknown)} are all -1; "
                              "at most one degree can be inferred, set the others explicitly")
        known = 1
        for value in degrees.values():
            known *= value if value != -1 else 1
        if unknown:
            if world_size % known:
                raise ConfigError(
                    f"parallel.{unknown[0]}=-1 cannot be inferred: world size {world_size} is not "
                    f"divisible by the other degrees' product {known}; change the other degrees "
                    "or the world size")
            degrees[unknown[0]] = world_size // known
        dims = cls(world_size=world_size, ranks_per_node=ranks_per_node, **degrees)
        dims._check_product()
        dims._check_model(parallel, model, get)
        dims._check_nodes(parallel)
        return dims

    def _check_product(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel.dp_replicate={self.dp_replicate} x parallel.dp_shard={self.dp_shard} x "
                f"parallel.tp={self.tp} = {product}, but the world size is {self.world_size}; make "
                "the product match (set one degree to -1 to infer it) or change "
                "launcher.nproc_per_node / launcher.nnodes")

    def _check_model(self, parallel, model, get) -> None:
        if model is None:
            return
        n_heads = get(model, "n_heads")
        # Only grouped-query families (Llama) have n_kv_heads.
        kv = model.get("n_kv_heads") if hasattr(model, "get") else getattr(model, "n_kv_heads", None)
        n_kv_heads = kv or n_heads
        for key, value in (("model.n_heads", n_heads), ("model.n_kv_heads", n_kv_heads)):
            if value % self.tp:
                raise ConfigError(f"parallel.tp={self.tp} does not divide {key}={value}; choose a "
                                  f"tp degree that divides {value}")
        seq_len = get(model, "seq_len")
        if self.tp > 1 and get(parallel, "sequence_parallel") and seq_len % self.tp:
            raise ConfigError(f"model.seq_len={seq_len} is not divisible by parallel.tp={self.tp} "
                              "with parallel.sequence_parallel=true; change the sequence length "
                              "or set parallel.sequence_parallel=false")

    def _check_nodes(self, parallel) -> None:
        node = self.node_size
        if node < 1 or self.world_size % node:
            raise ConfigError(f"world size {self.world_size} is not a multiple of the {node} ranks "
                              "per node; give every node the same launcher.nproc_per_node "
                              "(torchrun --nproc-per-node)")
        allowed = (parallel.get("allow_tp_across_nodes", False) if isinstance(parallel, dict)
                   else getattr(parallel, "allow_tp_across_nodes", False))
        if "tp" in self.dims_across_nodes() and not allowed:
            raise ConfigError(
                f"parallel.tp={self.tp} spans nodes ({self._nodes_phrase()}): every TP layer's "
                "all-reduce/all-gather would cross the slow inter-node link; use a parallel.tp "
                f"that divides {node}, or set parallel.allow_tp_across_nodes=true to run it anyway")

    def _nodes_phrase(self) -> str:
        return f"{self.nodes} nodes x {self.node_size} ranks per node"

    @property
    def node_size(self) -> int:
        """Ranks per node (the local world size); the world size for a one-node job."""
        return self.ranks_per_node or self.world_size

    @property
    def nodes(self) -> int:
        """Number of nodes the job runs on."""
        return self.world_size // self.node_size

    def dims_across_nodes(self) -> list[str]:
        """Names of the mesh dims (``DIM_NAMES`` order) whose groups hold ranks of several nodes.

        Assumes contiguous placement: global rank r lives on node r // ranks_per_node.
        """
        return [name for i, name in enumerate(DIM_NAMES)
                if _group_spans_nodes(self.shape, i, self.node_size)]

    def node_warnings(self) -> list[str]:
        """Messages for shard or TP groups that span nodes (their collectives run every layer)."""
        crossing, node = self.dims_across_nodes(), self.node_size
        warnings = []
        if "dp_shard" in crossing:
            warnings.append(
                f"parallel.dp_shard={self.dp_shard} spans nodes ({self._nodes_phrase()}): FSDP's "
                "per-layer all-gather and reduce-scatter cross the slow inter-node link; for "
                f"HSDP make parallel.dp_shard x parallel.tp divide {node} and put the rest in "
                "parallel.dp_replicate")
        if "tp" in crossing:
            warnings.append(
                f"parallel.tp={self.tp} spans nodes ({self._nodes_phrase()}; allowed by "
                "parallel.allow_tp_across_nodes): TP's per-layer collectives cross the slow "
                "inter-node link")
        return warnings

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of distinct batch slices per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_mode(self) -> str:
        """'none', 'ddp', 'fsdp' or 'hsdp': which data-parallel wrapper the degrees call for."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return "hsdp"
        if self.dp_shard > 1:
            return "fsdp"
        if self.dp_replicate > 1:
            return "ddp"
        return "none"

    @property
    def shape(self) -> tuple[int, int, int]:
        """The world mesh shape in ``DIM_NAMES`` order."""
        return (self.dp_replicate, self.dp_shard, self.tp)

    @property
    def layout(self) -> str:
        """A short human name such as 'hsdp_tp' or 'fsdp'."""
        parts = [] if self.dp_mode == "none" else [self.dp_mode]
        if self.tp > 1:
            parts.append("tp")
        return "_".join(parts) or "single"

    def describe(self) -> dict:
        """Return the derived facts as a plain dict for logs, W&B and summary.json."""
        return {"world_size": self.world_size, "mesh_shape": list(self.shape),
                "mesh_dim_names": list(DIM_NAMES), "dp": self.dp, "dp_mode": self.dp_mode,
                "layout": self.layout, "dp_replicate": self.dp_replicate,
                "dp_shard": self.dp_shard, "tp": self.tp, "nodes": self.nodes,
                "ranks_per_node": self.node_size, "dims_across_nodes": self.dims_across_nodes()}

    def build_mesh(self, device_type: str, timeout_s: float | None = None) -> WorldMesh:
        """Build the world mesh once (all ranks must call this together); return a WorldMesh.

        ``timeout_s`` bounds every collective on the mesh's groups: DeviceMesh creates its
        groups with torch's 30-minute default unless their backend options carry a timeout,
        whatever the default process group was given. None: the default group's timeout.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if timeout_s is None:
            timeout_s = default_group_timeout_s(device_type)
        # One options object per group, as torch builds them: NCCL's communicator split
        # writes into the options it is given, so groups must not share one.
        per_dim = {name: _backend_with_timeout(device_type, timeout_s) for name in DIM_NAMES} \
            if timeout_s is not None else None
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES,
                                backend_override=per_dim)
        # Flattening is a private DeviceMesh API; it is used here and nowhere else. Slicing a
        # flattened dim back out of the root mesh is deprecated, so the view is kept here.
        dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten(
            "dp", backend_override=_backend_with_timeout(device_type, timeout_s))
        return WorldMesh(mesh, {"dp": dp_mesh})


def default_group_timeout_s(device_type: str) -> float | None:
    """The collective timeout the default process group was created with (None without one)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    backend = dist.group.WORLD._get_backend(torch.device(device_type))
    options = getattr(backend, "options", None)  # None for backends without options (fake)
    return options._timeout.total_seconds() if options is not None else None


def _backend_with_timeout(device_type: str, timeout_s: float | None):
    """Return (backend, a new options object with the timeout) for DeviceMesh's
    backend_override, or None without a timeout. Each call builds its own options."""
    if timeout_s is None:
        return None
    import torch.distributed as dist

    if device_type == "cuda":
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    return backend, options


def _group_spans_nodes(shape: tuple[int, ...], dim: int, node_size: int) -> bool:
    """True if some process group along ``dim`` of a row-major mesh holds ranks of two nodes."""
    size, stride = shape[dim], prod(shape[dim + 1:])
    if size == 1:
        return False
    for first in range(prod(shape)):
        if (first // stride) % size:
            continue  # not the first member of its group
        if first // node_size != (first + (size - 1) * stride) // node_size:
            return True
    return False


class WorldMesh:
    """The world DeviceMesh plus its flattened views; hands out submeshes by name."""

    def __init__(self, root, flattened: dict):
        self.root = root
        self._flattened = flattened

    def __getitem__(self, names):
        """Return the submesh for a dim name, a flattened view name, or a tuple of dim names."""
        if isinstance(names, str) and names in self._flattened:
            return self._flattened[names]
        return self.root[names]

    def local_rank_in(self, name: str) -> int:
        """This rank's coordinate along the named (possibly flattened) dim."""
        return self[name].get_local_rank()


def check_degree_values(degrees: dict) -> None:
    """Raise ConfigError for a degree that is neither positive nor -1 ({name: value})."""
    for name, value in degrees.items():
        if value == 0 or value < -1:
            raise ConfigError(f"parallel.{name}={value} is invalid; use a positive degree, "
                              "or -1 to fill the rest of the world size")


def infer_world_size(launcher, parallel, device_count: Optional[int]) -> int:
    """Return the world size a launch will have, before any process starts.

    ``launcher.nnodes x launcher.nproc_per_node``; ``nproc_per_node`` defaults to the number of
    GPUs (``device_count``) or, on CPU, to the product of the explicit degrees in ``parallel``
    (a single run passes its own degrees; a sweep its ``parallel`` preset's, so that every
    combination runs on the same ranks and misfits are skipped).
    """
    check_degree_values({name: getattr(parallel, name) for name in DIM_NAMES})
    nproc = launcher.nproc_per_node
    if nproc is None:
        if device_count:
            nproc = device_count
        else:
            degrees = [parallel.dp_replicate, parallel.dp_shard, parallel.tp]
            if -1 in degrees:
                raise ConfigError(
                    "a parallel degree is -1 but on CPU the world size comes from the degrees; "
                    "set launcher.nproc_per_node (e.g. launcher.nproc_per_node=4) or give every "
                    "degree explicitly")
            nproc = degrees[0] * degrees[1] * degrees[2] // launcher.nnodes
            if nproc < 1:
                raise ConfigError(f"launcher.nnodes={launcher.nnodes} exceeds the product of the "
                                  "parallel degrees; set launcher.nproc_per_node explicitly")
    return launcher.nnodes * nproc
