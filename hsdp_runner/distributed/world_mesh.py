"""The world DeviceMesh: its dim names, its flattened views, and the one place it is built.

The mesh has one dim per degree (``DIM_NAMES``, size-1 dims included, so code can always ask
for ``mesh["tp"]``; ``pp``, the pipeline stages, is outermost) and the flattened views (``VIEWS``): ``dp`` (replicate x shard: which rows
of the batch a rank reads), ``dp_shard_cp`` (shard x cp: what FSDP shards parameters over,
since cp ranks hold the same parameters and see different tokens) and ``dp_cp`` (replicate x
shard x cp: what the loss and the step statistics average over). ``build_world_mesh`` creates
the process groups once, each with the job's collective timeout (a dim or view over every rank
is the default group itself where its timeout is the job's); ``WorldMesh`` hands out
submeshes by name. The degrees themselves are ``ParallelDims``' (``parallel_dims.py``), whose
``build_mesh`` calls ``build_world_mesh``.

A model with experts (``parallel.ep``, ``distributed/expert_parallel.py``) gets the expert
meshes too, built with the others: the views ``EXPERT_VIEWS`` (``dp_shard_cp_tp``: the ranks of
one replica holding distinct tokens, which the router and shared experts are sharded over and
expert parallel borrows its ranks from; ``cp_tp``: the ranks holding the parts of one sequence)
and ``dp_shard_cp_tp`` split row-major into ``efsdp`` x ``ep`` (``EXPERT_SPLIT``; ep innermost:
the experts are shared out over ``ep`` and each share sharded over ``efsdp``). A dense job's
mesh is unchanged. Every mesh here derives from the one root, which FSDP2 needs to shard a
parameter that is already a DTensor over another of them.

When an ep group spans nodes (``ParallelDims.ep_nodes`` > 1), the ``ep`` mesh is unflattened
once more into ``EP_STAGES``: ``ep_inter`` (the ep ranks with this rank's place on their node,
one per node: the by-node exchange's first stage) x ``ep_intra`` (the ep ranks of this rank's
node: its second stage), row-major as the ranks sit on nodes. ``_unflatten`` always makes new
process groups, so these two are the token exchange's own even where their ranks are another
group's (the communication counter names them by their group, ``comm_counting``).
"""

from __future__ import annotations

import math
from datetime import timedelta

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The dims inside one pipeline stage: what the planner enumerates (it plans pp = 1 layouts).
STAGE_DIMS = DIM_NAMES[1:]
# Degrees that configs written before they existed lack (they default to 1).
LATER_DIMS = ("pp", "cp")


def full_shape(shape) -> list[int]:
    """A recorded mesh shape (summary.json's ``mesh_shape``) in ``DIM_NAMES`` order: shapes
    written before the pp dim (4 entries) or before the cp dim too (3 entries) get 1s there."""
    shape = list(shape)
    if len(shape) == len(DIM_NAMES) - 2:  # (dp_replicate, dp_shard, tp)
        shape.insert(2, 1)
    if len(shape) == len(DIM_NAMES) - 1:  # (dp_replicate, dp_shard, cp, tp)
        shape.insert(0, 1)
    return shape


# Flattened views of adjacent mesh dims: name -> the dims it joins (see the module docstring).
VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# Every named group, mesh dims first: a group two names share (same ranks) goes by the first.
GROUP_ORDER = DIM_NAMES + tuple(VIEWS)
# The expert meshes (a model with experts only; see the module docstring): flattened views, then
# the split of ``dp_shard_cp_tp`` into (efsdp, ep), ep innermost.
EXPERT_VIEWS = {"dp_shard_cp_tp": ("dp_shard", "cp", "tp"), "cp_tp": ("cp", "tp")}
EXPERT_SPLIT = ("efsdp", "ep")
# The by-node token exchange's two stages (an ep group spanning nodes only; module docstring).
EP_STAGES = ("ep_inter", "ep_intra")


def group_order(experts: bool) -> tuple[str, ...]:
    """Every named group of a world mesh, in the order a group several names share goes by the
    first (``ParallelDims.same_group``): ``GROUP_ORDER``, then with ``experts`` (a model with
    experts: the expert meshes are built) the expert views and the expert split."""
    return GROUP_ORDER + ((*EXPERT_VIEWS, *EXPERT_SPLIT) if experts else ())


def build_world_mesh(
    device_type: str,
    shape: tuple[int, ...],
    same_group: dict[str, str],
    timeout_s: float | None,
    expert_split: tuple[int, int] | None = None,
    ep_stages: tuple[int, int] | None = None,
) -> WorldMesh:
    """Build the world mesh of ``shape`` (``DIM_NAMES`` order) and its flattened views once
    (all ranks must call this together); return a WorldMesh.

    ``same_group``: for each view of ``VIEWS`` (and of ``EXPERT_VIEWS`` and ``EXPERT_SPLIT``
    with experts), the first name whose groups hold the same ranks (``ParallelDims.same_group``);
    such a view reuses that mesh instead of creating a group. ``timeout_s`` bounds every
    collective on the mesh's groups: DeviceMesh creates its groups with torch's 30-minute
    default unless their backend options carry a timeout, whatever the default process group
    was given. None: the default group's timeout. ``expert_split``: (efsdp, ep) sizes for a
    model with experts (the expert meshes are built), None for a dense one. ``ep_stages``:
    (nodes, ranks per node) of an ep group spanning nodes (``EP_STAGES`` built), else None.
    """
    from torch.distributed.device_mesh import init_device_mesh

    default_timeout_s = default_group_timeout_s(device_type)
    if timeout_s is None:
        timeout_s = default_timeout_s
    world = math.prod(shape)
    # A group spanning the world with the default group's timeout is the default group: given
    # no options, DeviceMesh reuses it (with options it would make a copy of it, on a GPU one
    # more NCCL communicator over every rank, with its buffers and its start-up).
    reuse = timeout_s is None or timeout_s == default_timeout_s

    def override(size: int):
        return None if reuse and size == world else _backend_with_timeout(device_type, timeout_s)

    # One options object per group, as torch builds them: NCCL's communicator split
    # writes into the options it is given, so groups must not share one.
    per_dim = {
        name: options
        for name, size in zip(DIM_NAMES, shape)
        if (options := override(size)) is not None
    }
    mesh = init_device_mesh(
        device_type, shape, mesh_dim_names=DIM_NAMES, backend_override=per_dim or None
    )
    # Flattening is a private DeviceMesh API; it is used here and nowhere else. Slicing a
    # flattened dim back out of the root mesh is deprecated, so the views are kept here.
    # A view whose other dims are all of size 1 is that dim's mesh (no new group).
    views: dict = {}
    for name, dims in (VIEWS | (EXPERT_VIEWS if expert_split else {})).items():
        views[name] = _existing(same_group[name], views, mesh)
        if views[name] is None:
            size = math.prod(shape[DIM_NAMES.index(dim)] for dim in dims)
            views[name] = mesh[dims]._flatten(name, backend_override=override(size))
    if expert_split:
        views.update(_expert_split(views, mesh, same_group, expert_split, device_type, timeout_s))
    if ep_stages:
        options = {name: _backend_with_timeout(device_type, timeout_s) for name in EP_STAGES}
        stages = views["ep"]._unflatten(
            0, ep_stages, EP_STAGES, backend_override=options if timeout_s is not None else None
        )
        views.update({name: stages[name] for name in EP_STAGES})
    return WorldMesh(mesh, views)


def _existing(name: str, views: dict, mesh):
    """The mesh already built for group ``name`` (a view of ``views`` or a dim of the root
    ``mesh``), or None."""
    if name in views:
        return views[name]
    return mesh[name] if name in DIM_NAMES else None


def _expert_split(
    views: dict, mesh, same_group: dict, sizes: tuple[int, int], device_type, timeout_s
) -> dict:
    """{'efsdp': mesh, 'ep': mesh}: ``dp_shard_cp_tp`` split row-major into ``sizes`` (efsdp,
    ep). Where ep's groups are whole dims (ep = tp, or cp x tp, ...), both are meshes built
    already (``same_group``); else ``dp_shard_cp_tp`` is unflattened into two new dims (a
    private DeviceMesh API; the result keeps the root, as FSDP2 requires)."""
    found = {name: _existing(same_group[name], views, mesh) for name in EXPERT_SPLIT}
    if all(found[name] is not None for name in EXPERT_SPLIT):
        return found
    options = {name: _backend_with_timeout(device_type, timeout_s) for name in EXPERT_SPLIT}
    split = views["dp_shard_cp_tp"]._unflatten(
        0, sizes, EXPERT_SPLIT, backend_override=options if timeout_s is not None else None
    )
    return {name: split[name] for name in EXPERT_SPLIT}


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

    @property
    def has_experts(self) -> bool:
        """Whether the expert meshes were built (a model with experts)."""
        return EXPERT_SPLIT[-1] in self._flattened

    def __contains__(self, name: str) -> bool:
        """Whether the view ``name`` was built (``EP_STAGES`` only for an ep group spanning
        nodes)."""
        return name in self._flattened or name in DIM_NAMES

    def local_rank_in(self, name: str) -> int:
        """This rank's coordinate along the named (possibly flattened) dim."""
        return self[name].get_local_rank()

    def fsdp_mesh(self, replicate: bool, shard: str = "dp_shard_cp"):
        """The mesh FSDP shards over: the view ``shard`` (1-D; ``dp_shard_cp`` for the dense
        weights, ``efsdp`` or ``dp_shard_cp_tp`` for a mixture of experts' ones), or with
        ``replicate`` the 2-D (``dp_replicate``, ``shard``) of HSDP. Joining a dim and a
        flattened view is a private DeviceMesh API (``_concatenate``, what FSDP itself uses to
        add the TP dim)."""
        mesh = self[shard]
        if not replicate:
            return mesh
        name = mesh.mesh_dim_names[0]
        if name in DIM_NAMES[DIM_NAMES.index("dp_replicate") + 1 :]:
            return self.root["dp_replicate", name]  # a plain slice of the root mesh
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh._concatenate([self.root["dp_replicate"], mesh])
