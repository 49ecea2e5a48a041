"""ParallelDims: the single owner of the parallel degrees, which builds the world DeviceMesh.

DDP, FSDP and HSDP are all special cases of two degrees, ``dp_replicate x dp_shard``; context
parallel (``cp``: each sequence split over ranks) is a third and TP a fourth, innermost dim.
Pipeline parallel (``pp``: the blocks split into stages) is the outermost dim; what its
``parallel.pp_*`` settings resolve to is held beside the degrees (``pipeline``, a
``pipeline_settings.PipelineSettings``, whose module holds every pipeline check).
``ParallelDims`` infers a -1 degree, checks the degrees against the world size, the model and
the nodes, and builds the world mesh once, up front (``build_mesh``): every dim named and the
flattened views ``dp``, ``dp_shard_cp`` and ``dp_cp`` (``world_mesh.py`` owns the names, the
views and the process groups).

Expert parallel (``ep``, a model with experts) is a sixth degree that multiplies nothing: it
borrows its ranks from the ``dp_shard x cp x tp`` ranks of one replica (those holding distinct
tokens), which it splits row-major into ``efsdp x ep`` with ep innermost; its checks are
``expert_layout.py``'s, and the expert meshes are built with the world mesh
(``world_mesh.EXPERT_VIEWS``, ``EXPERT_SPLIT``).

Node awareness: ranks are placed on nodes contiguously (torchrun numbers ranks node by node;
SLURM's default block distribution does too) and the mesh is row-major with ``tp`` innermost
and ``dp_replicate`` outermost, so with ``dp_shard x cp x tp <= ranks per node`` the shard, cp
and TP groups stay inside a node and only the replicate all-reduce crosses the slow inter-node
link. ``ParallelDims`` works out which dims cross nodes, refuses TP or cp across nodes unless
allowed, and warns when the shard group spans nodes. ``pp`` crossing nodes is fine: a stage
sends one micro-batch's activations (and receives their gradients) per micro-batch, point to
point, far less than any per-layer collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Optional

from hsdp_runner.config.schema import LauncherConfig, ParallelConfig
from hsdp_runner.core.choices import DPMode
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed import expert_layout
from hsdp_runner.distributed.pipeline_settings import (
    PIPELINE_KEYS,
    PipelineSettings,
    layout_refusal,
)

# The mesh's dim names and views are world_mesh.py's; the runner imports them (and WorldMesh)
# from here, beside the degrees they name.
from hsdp_runner.distributed.world_mesh import (
    DIM_NAMES,
    EP_STAGES,
    EXPERT_SPLIT,
    EXPERT_VIEWS,
    GROUP_ORDER,
    LATER_DIMS,
    STAGE_DIMS,
    VIEWS,
    WorldMesh,
    build_world_mesh,
)
from hsdp_runner.models.base import ModelConfig, routed_experts


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Validated degrees for one job. Construct with ``ParallelDims.from_config`` (or with
    keywords, for a layout already validated)."""

    pp: int = 1
    dp_replicate: int
    dp_shard: int
    cp: int = 1
    tp: int
    world_size: int
    ranks_per_node: Optional[int] = None  # None: the whole job is on one node
    # What ``parallel.pp_*`` resolve to (the defaults without pp): schedule, micro-batches,
    # stages per rank, the end stages' weights.
    pipeline: PipelineSettings = PipelineSettings()
    # Expert parallel: the ranks of dp_shard x cp x tp that share out each MoE block's experts.
    ep: int = 1
    # The model routes tokens to experts: the expert meshes are built with the world mesh.
    moe: bool = False

    @classmethod
    def from_config(
        cls,
        parallel: ParallelConfig,
        model: Optional[ModelConfig],
        world_size: int,
        ranks_per_node: Optional[int] = None,
    ) -> ParallelDims:
        """Infer -1 degrees from ``world_size`` and validate against the model shape and nodes.

        Takes the typed ``parallel`` and ``model`` configs (model None: no shape checks), the
        job's world size and the ranks per node (local world size; None = one node). Returns
        ParallelDims or raises ConfigError naming keys and a fix.
        """
        # pp and cp may be absent from configs written before they existed (they default to 1).
        degrees = {
            name: _get(parallel, name, 1) if name in LATER_DIMS else getattr(parallel, name)
            for name in DIM_NAMES
        }
        if world_size < 1:
            raise ConfigError(
                f"world size {world_size} must be >= 1; check launcher.nnodes and "
                "launcher.nproc_per_node"
            )
        check_degree_values(degrees)
        ep = _get(parallel, "ep", 1)
        expert_layout.check_ep_value(ep)
        unknown = [n for n, v in degrees.items() if v == -1]
        if len(unknown) > 1:
            raise ConfigError(
                f"{' and '.join('parallel.' + n for n in unknown)} are all -1; "
                "at most one degree can be inferred, set the others explicitly"
            )
        known = 1
        for value in degrees.values():
            known *= value if value != -1 else 1
        if unknown:
            if world_size % known:
                raise ConfigError(
                    f"parallel.{unknown[0]}=-1 cannot be inferred: world size {world_size} is not "
                    f"divisible by the other degrees' product {known}; change the other degrees "
                    "or the world size"
                )
            degrees[unknown[0]] = world_size // known
        dims = cls(
            world_size=world_size,
            ranks_per_node=ranks_per_node,
            **degrees,
            pipeline=PipelineSettings.from_config(
                {key: _get(parallel, key, None) for key in PIPELINE_KEYS}, degrees["pp"]
            ),
            ep=ep,
            moe=model is not None and routed_experts(model) > 0,
        )
        dims._check_product()
        refusal = expert_layout.layout_refusal(dims, model) or layout_refusal(dims, model, parallel)
        if refusal:
            raise ConfigError(refusal)
        dims._check_model(parallel, model)
        dims._check_nodes(parallel)
        return dims

    def _check_product(self) -> None:
        product = prod(self.shape)
        if product != self.world_size:
            named = " x ".join(f"parallel.{n}={v}" for n, v in self.degrees.items())
            raise ConfigError(
                f"{named} = {product}, but the world size is {self.world_size}; make "
                "the product match (set one degree to -1 to infer it) or change "
                "launcher.nproc_per_node / launcher.nnodes"
            )

    def _check_model(self, parallel: ParallelConfig, model: Optional[ModelConfig]) -> None:
        if model is None:
            return
        n_heads = model.n_heads
        # Only grouped-query families (Llama) have n_kv_heads.
        n_kv_heads = getattr(model, "n_kv_heads", None) or n_heads
        for key, value in (("model.n_heads", n_heads), ("model.n_kv_heads", n_kv_heads)):
            if value % self.tp:
                raise ConfigError(
                    f"parallel.tp={self.tp} does not divide {key}={value}; choose a "
                    f"tp degree that divides {value}"
                )
        seq_len = model.seq_len
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ConfigError(
                f"model.seq_len={seq_len} is not divisible by 2 x parallel.cp={self.cp}: context "
                f"parallel cuts each sequence into {2 * self.cp} chunks and gives every cp rank "
                "one from each end (load balancing under the causal mask); use a multiple of "
                f"{2 * self.cp} or another parallel.cp"
            )
        if self.tp > 1 and parallel.sequence_parallel and seq_len % (self.cp * self.tp):
            what = (
                f"parallel.tp={self.tp}"
                if self.cp == 1
                else f"parallel.cp x parallel.tp = {self.cp} x {self.tp} (each cp rank's tokens are "
                "split again over the tp ranks)"
            )
            raise ConfigError(
                f"model.seq_len={seq_len} is not divisible by {what} "
                "with parallel.sequence_parallel=true; change the sequence length "
                "or set parallel.sequence_parallel=false"
            )

    def stage_blocks(self, n_layers: int) -> list[range]:
        """The block indices of each pipeline stage of a model of ``n_layers`` blocks
        (``PipelineSettings.stage_blocks`` on this layout's pp ranks)."""
        return self.pipeline.stage_blocks(n_layers, self.pp)

    def local_stages(self, pp_rank: int) -> list[int]:
        """The stage indices the ranks at coordinate ``pp_rank`` of the ``pp`` dim hold: r,
        r + pp, ... (torch's loop placement, which the interleaved schedules expect); stage 0
        alone without pipeline parallel."""
        return list(range(pp_rank, self.pp_stages, self.pp))

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: ``pp x pp_stages_per_rank``."""
        return self.pp * self.pipeline.stages_per_rank

    def _check_nodes(self, parallel: ParallelConfig) -> None:
        node = self.node_size
        if node < 1 or self.world_size % node:
            raise ConfigError(
                f"world size {self.world_size} is not a multiple of the {node} ranks "
                "per node; give every node the same launcher.nproc_per_node "
                "(torchrun --nproc-per-node)"
            )
        crossing = self.dims_across_nodes()
        if "tp" in crossing and not parallel.allow_tp_across_nodes:
            raise ConfigError(
                f"parallel.tp={self.tp} spans nodes ({self._nodes_phrase()}): every TP layer's "
                "all-reduce/all-gather would cross the slow inter-node link; use a parallel.tp "
                f"that divides {node}, or set parallel.allow_tp_across_nodes=true to run it anyway"
            )
        if "cp" in crossing and not _get(parallel, "allow_cp_across_nodes", False):
            raise ConfigError(
                f"parallel.cp={self.cp} spans nodes ({self._nodes_phrase()}): every layer's "
                "key/value all-gather (and its gradients' reduce-scatter) would cross the slow "
                f"inter-node link; make parallel.cp x parallel.tp divide {node}, or set "
                "parallel.allow_cp_across_nodes=true to run it anyway"
            )

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
        return [
            name
            for i, name in enumerate(DIM_NAMES)
            if _group_spans_nodes(self.shape, i, self.node_size)
        ]

    def node_warnings(self) -> list[str]:
        """Messages for shard or TP groups that span nodes (their collectives run every layer)."""
        crossing, node = self.dims_across_nodes(), self.node_size
        warnings = []
        if "dp_shard" in crossing:
            warnings.append(
                f"parallel.dp_shard={self.dp_shard} spans nodes ({self._nodes_phrase()}): FSDP's "
                "per-layer all-gather and reduce-scatter cross the slow inter-node link; for "
                f"HSDP make parallel.dp_shard x parallel.cp x parallel.tp divide {node} and put "
                "the rest in parallel.dp_replicate"
            )
        for name, key in (("tp", "allow_tp_across_nodes"), ("cp", "allow_cp_across_nodes")):
            if name in crossing:
                warnings.append(
                    f"parallel.{name}={getattr(self, name)} spans nodes ({self._nodes_phrase()}; "
                    f"allowed by parallel.{key}): its per-layer collectives cross the slow "
                    "inter-node link"
                )
        return warnings

    @property
    def ep_nodes(self) -> int:
        """Nodes one ep group spans, when it holds whole nodes' worth of ranks on each (ep a
        multiple of the ranks per node: ep groups are runs of ep contiguous ranks); 1
        otherwise, an ep group inside one node or (ep not a multiple of the ranks per node,
        nor dividing them) one straddling a node boundary unevenly, which keeps the single
        all-to-all. Above 1 the token exchange runs by node (``expert_parallel``)."""
        if not self.moe or self.ep % self.node_size:
            return 1
        return self.ep // self.node_size

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of distinct batch slices per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """Ranks FSDP shards the parameters over: ``dp_shard x cp``."""
        return self.dp_shard * self.cp

    @property
    def dp_shard_cp_tp(self) -> int:
        """Ranks of one replica holding distinct tokens of a step (``dp_shard x cp x tp``, the
        MoE running on each tp rank's part of the sequence): what expert parallel borrows
        from, and what the router and shared experts are sharded over."""
        return self.dp_shard * self.cp * self.tp

    @property
    def efsdp(self) -> int:
        """Ranks each share of the experts is sharded over: ``dp_shard x cp x tp / ep``."""
        return self.dp_shard_cp_tp // self.ep

    @property
    def dp_cp(self) -> int:
        """Ranks holding distinct tokens of a step (``dp x cp``): the loss averages over them."""
        return self.dp * self.cp

    @property
    def dp_mode(self) -> DPMode:
        """Which data-parallel wrapper the degrees call for: none, ddp, fsdp or hsdp.

        FSDP shards over ``dp_shard x cp``: context-parallel ranks hold the same parameters and
        their gradients are reduced together, so cp > 1 alone is FSDP over the cp ranks.
        """
        if self.dp_replicate > 1 and self.dp_shard_cp > 1:
            return DPMode.hsdp
        if self.dp_shard_cp > 1:
            return DPMode.fsdp
        if self.dp_replicate > 1:
            return DPMode.ddp
        return DPMode.none

    @property
    def degrees(self) -> dict[str, int]:
        """{mesh dim name: degree} in ``DIM_NAMES`` order."""
        return {name: getattr(self, name) for name in DIM_NAMES}

    @property
    def shape(self) -> tuple[int, ...]:
        """The world mesh shape in ``DIM_NAMES`` order."""
        return tuple(self.degrees.values())

    @property
    def layout(self) -> str:
        """A short human name such as 'hsdp_tp', 'fsdp', 'fsdp_cp' or 'fsdp_ep'."""
        parts = ["pp"] if self.pp > 1 else []
        parts += [] if self.dp_mode is DPMode.none else [self.dp_mode.value]
        parts += [name for name in ("cp", "tp", "ep") if getattr(self, name) > 1]
        return "_".join(parts) or "single"

    def pp_rank_of(self, rank: int) -> int:
        """The ``pp`` coordinate (which stages) of global ``rank``: pp is the outermost dim of
        the row-major mesh, so each stage's ranks are contiguous."""
        return rank // (self.world_size // self.pp)

    @property
    def stage_shape(self) -> tuple[int, ...]:
        """The mesh shape of one pipeline stage: ``STAGE_DIMS`` order (all but pp)."""
        return tuple(getattr(self, name) for name in STAGE_DIMS)

    def group_size(self, name: str) -> int:
        """Ranks in one group of a mesh dim, of a flattened view (``VIEWS``, ``EXPERT_VIEWS``)
        or of the expert split (``efsdp``, ``ep``)."""
        if name in EXPERT_SPLIT:
            return getattr(self, name)
        if name in EP_STAGES:
            return self.ep_nodes if name == EP_STAGES[0] else self.ep // self.ep_nodes
        return prod(getattr(self, dim) for dim in _VIEW_DIMS.get(name, (name,)))

    def same_group(self, name: str) -> str:
        """The first of ``GROUP_ORDER`` (then the expert views) whose groups hold the same
        ranks as ``name``'s (e.g. 'dp_shard_cp' is 'dp_shard' when cp = 1, 'ep' is 'tp' when
        ep = tp): dims of size 1 add no ranks. ``name`` itself when no other matches (an
        expert split that cuts a dim)."""
        if name in EXPERT_SPLIT:
            split = expert_layout.split_dims(self)
            if split is None:
                return name
            dims = split[name]
        else:
            dims = _VIEW_DIMS.get(name, (name,))
        wanted = {dim for dim in dims if getattr(self, dim) > 1}
        for other in GROUP_ORDER + tuple(EXPERT_VIEWS):
            if {dim for dim in _VIEW_DIMS.get(other, (other,)) if getattr(self, dim) > 1} == wanted:
                return other
        return name

    def describe(self) -> dict:
        """Return the derived facts as a plain dict for logs, W&B and summary.json."""
        return {
            "world_size": self.world_size,
            "mesh_shape": list(self.shape),
            "mesh_dim_names": list(DIM_NAMES),
            "dp": self.dp,
            "dp_mode": self.dp_mode.value,
            "layout": self.layout,
            **self.degrees,
            "ep": self.ep,
            "nodes": self.nodes,
            "ranks_per_node": self.node_size,
            "dims_across_nodes": self.dims_across_nodes(),
            **(self.pipeline.describe() if self.pp > 1 else {}),
        }

    def build_mesh(self, device_type: str, timeout_s: float | None = None) -> WorldMesh:
        """Build the world mesh of these degrees once (all ranks must call this together);
        return a WorldMesh. ``timeout_s`` bounds every collective on its groups (None: the
        default process group's timeout; see ``world_mesh.build_world_mesh``). A model with
        experts (``moe``) gets the expert meshes too."""
        names = tuple(VIEWS) + ((*EXPERT_VIEWS, *EXPERT_SPLIT) if self.moe else ())
        same = {name: self.same_group(name) for name in names}
        split = (self.efsdp, self.ep) if self.moe else None
        stages = (self.ep_nodes, self.ep // self.ep_nodes) if self.ep_nodes > 1 else None
        return build_world_mesh(device_type, self.shape, same, timeout_s, split, stages)


def _group_spans_nodes(shape: tuple[int, ...], dim: int, node_size: int) -> bool:
    """True if some process group along ``dim`` of a row-major mesh holds ranks of two nodes."""
    size, stride = shape[dim], prod(shape[dim + 1 :])
    if size == 1:
        return False
    for first in range(prod(shape)):
        if (first // stride) % size:
            continue  # not the first member of its group
        if first // node_size != (first + (size - 1) * stride) // node_size:
            return True
    return False


def _get(node, key: str, default):
    """``node[key]`` of a dict, or the attribute of a config node; ``default`` when absent."""
    if isinstance(node, dict):
        return node.get(key, default)
    return getattr(node, key, default)


# Every flattened view's dims, the dense ones and the expert ones.
_VIEW_DIMS = VIEWS | EXPERT_VIEWS


def check_degree_values(degrees: dict) -> None:
    """Raise ConfigError for a degree that is neither positive nor -1 ({name: value})."""
    for name, value in degrees.items():
        if value == 0 or value < -1:
            raise ConfigError(
                f"parallel.{name}={value} is invalid; use a positive degree, "
                "or -1 to fill the rest of the world size"
            )


def infer_world_size(
    launcher: LauncherConfig, parallel: ParallelConfig, device_count: Optional[int]
) -> int:
    """Return the world size a launch will have, before any process starts.

    ``launcher.nnodes x launcher.nproc_per_node``; ``nproc_per_node`` defaults to the number of
    GPUs (``device_count``) or, on CPU, to the product of the explicit degrees in ``parallel``
    (a single run passes its own degrees; a sweep its ``parallel`` preset's, so that every
    combination runs on the same ranks and misfits are skipped).
    """
    degrees = [
        _get(parallel, name, 1) if name in LATER_DIMS else _get(parallel, name, None)
        for name in DIM_NAMES
    ]
    check_degree_values(dict(zip(DIM_NAMES, degrees)))
    nproc = launcher.nproc_per_node
    if nproc is None:
        if device_count:
            nproc = device_count
        else:
            if -1 in degrees:
                raise ConfigError(
                    "a parallel degree is -1 but on CPU the world size comes from the degrees; "
                    "set launcher.nproc_per_node (e.g. launcher.nproc_per_node=4) or give every "
                    "degree explicitly"
                )
            nproc = prod(degrees) // launcher.nnodes
            if nproc < 1:
                raise ConfigError(
                    f"launcher.nnodes={launcher.nnodes} exceeds the product of the "
                    "parallel degrees; set launcher.nproc_per_node explicitly"
                )
    return launcher.nnodes * nproc
