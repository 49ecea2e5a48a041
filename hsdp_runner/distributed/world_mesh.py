"""The world DeviceMesh: its dim names, its flattened views, and the one place it is built.

The mesh has one dim per degree (``DIM_NAMES``, size-1 dims included, so code can always ask
for ``mesh["tp"]``; ``pp``, the pipeline stages, is outermost) and the flattened views (``VIEWS``): ``dp`` (replicate x shard: which rows
of the batch a rank reads), ``dp_shard_cp`` (shard x cp: what FSDP shards parameters over,
since cp ranks hold the same parameters and see different tokens) and ``dp_cp`` (replicate x
shard x cp: what the loss and the step statistics average over). ``build_world_mesh`` creates
the process groups once, each with the job's collective timeout; ``WorldMesh`` hands out
submeshes by name. The degrees themselves are ``ParallelDims``' (``parallel_dims.py``), whose
``build_mesh`` calls ``build_world_mesh``.
"""

from __future__ import annotations

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


def build_world_mesh(
    device_type: str, shape: tuple[int, ...], same_group: dict[str, str], timeout_s: float | None
) -> WorldMesh:
    """Build the world mesh of ``shape`` (``DIM_NAMES`` order) and its flattened views once
    (all ranks must call this together); return a WorldMesh.

    ``same_group``: for each view of ``VIEWS``, the first name of ``GROUP_ORDER`` whose groups
    hold the same ranks (``ParallelDims.same_group``); such a view reuses that mesh instead of
    creating a group. ``timeout_s`` bounds every collective on the mesh's groups: DeviceMesh
    creates its groups with torch's 30-minute default unless their backend options carry a
    timeout, whatever the default process group was given. None: the default group's timeout.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if timeout_s is None:
        timeout_s = default_group_timeout_s(device_type)
    # One options object per group, as torch builds them: NCCL's communicator split
    # writes into the options it is given, so groups must not share one.
    per_dim = (
        {name: _backend_with_timeout(device_type, timeout_s) for name in DIM_NAMES}
        if timeout_s is not None
        else None
    )
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES, backend_override=per_dim)
    # Flattening is a private DeviceMesh API; it is used here and nowhere else. Slicing a
    # flattened dim back out of the root mesh is deprecated, so the views are kept here.
    # A view whose other dims are all of size 1 is that dim's mesh (no new group).
    views = {}
    for name, dims in VIEWS.items():
        same = same_group[name]
        views[name] = (
            views[same]
            if same in views
            else mesh[same]
            if same in DIM_NAMES
            else mesh[dims]._flatten(
                name, backend_override=_backend_with_timeout(device_type, timeout_s)
            )
        )
    return WorldMesh(mesh, views)


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

    def local_rank_in(self, name: str) -> int:
        """This rank's coordinate along the named (possibly flattened) dim."""
        return self[name].get_local_rank()

    def fsdp_mesh(self, replicate: bool):
        """The mesh FSDP shards over: ``dp_shard_cp`` (1-D), or with ``replicate`` the 2-D
        (``dp_replicate``, ``dp_shard_cp``) of HSDP. Joining a dim and a flattened view is a
        private DeviceMesh API (``_concatenate``, what FSDP itself uses to add the TP dim)."""
        shard = self["dp_shard_cp"]
        if not replicate:
            return shard
        name = shard.mesh_dim_names[0]
        if name in DIM_NAMES:  # cp = 1 or dp_shard = 1: a plain slice of the root mesh
            return self.root["dp_replicate", name]
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh._concatenate([self.root["dp_replicate"], shard])
