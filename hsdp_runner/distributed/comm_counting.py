"""Measured communication: calls and bytes of every collective in one training step.

``CommCounter`` is a ``TorchDispatchMode`` that sees the collectives as they are dispatched:
FSDP2's c10d ops (``_allgather_base_``, ``_reduce_scatter_base_``, ``allreduce_``), the
functional collectives DTensor/TP issue (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce``), and plain ``dist.*`` calls. torch's ``CommDebugMode`` sees the same ops but only
counts them per op; it neither sums bytes nor says which mesh dim a collective ran on, so this
mode reads the tensors and the process group itself.

Bytes are the logical size of the collective's full tensor on one rank: the gathered output of
an all-gather, the input of a reduce-scatter, the tensor of an all-reduce or broadcast, the input
of an all-to-all (its rows for the rank itself included), the tensor a point-to-point send sends
(receives are not counted: they are the peer's sends). That is
the convention the analytic model (``comm_model``) uses; wire traffic of a ring algorithm is
this times (n-1)/n (x2 for an all-reduce).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hsdp_runner.distributed.world_mesh import EP_STAGES, GROUP_ORDER, group_order

# Mesh dims first, then the flattened views: a group two names share is reported by the first.
# A world with experts names its expert groups after these (``world_mesh.group_order``).
GROUP_NAMES = GROUP_ORDER

_c10d, _funcol = torch.ops.c10d, torch.ops._c10d_functional
# op packet -> (kind, which tensor argument gives the bytes, multiply by group size?)
COLLECTIVES = {
    _c10d._allgather_base_: ("all_gather", "output_tensor", False),
    _c10d.allgather_into_tensor_coalesced_: ("all_gather", "outputs", False),
    _c10d._reduce_scatter_base_: ("reduce_scatter", "input_tensor", False),
    _c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", "inputs", False),
    _c10d.allreduce_: ("all_reduce", "tensors", False),
    _c10d.allreduce_coalesced_: ("all_reduce", "tensors", False),
    _c10d.broadcast_: ("broadcast", "tensors", False),
    # dist.all_to_all_single and dist.all_to_all: what the rank's input holds (its rows for
    # itself included, as an all-gather's output holds its own shard).
    _c10d.alltoall_base_: ("all_to_all", "input", False),
    _c10d.alltoall_: ("all_to_all", "input_tensors", False),
    # Point to point (pipeline stages): what a rank sends; its receives are a peer's sends.
    _c10d.send: ("send", "tensors", False),
    _funcol.all_gather_into_tensor: ("all_gather", "input", True),
    _funcol.all_gather_into_tensor_coalesced: ("all_gather", "inputs", True),
    _funcol.reduce_scatter_tensor: ("reduce_scatter", "input", False),
    _funcol.reduce_scatter_tensor_coalesced: ("reduce_scatter", "inputs", False),
    _funcol.all_reduce: ("all_reduce", "input", False),
    _funcol.all_reduce_coalesced: ("all_reduce", "inputs", False),
    _funcol.all_to_all_single: ("all_to_all", "input", False),
    _funcol.broadcast: ("broadcast", "input", False),
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(v) for v in value or ())


def group_names(world) -> dict[tuple[int, ...], str]:
    """Map the ranks of each mesh dim's process group (and each flattened view's) to its name.

    Takes the job's WorldMesh. Groups are matched by their ranks, not their identity: DTensor
    and ``_flatten`` may create a second group over the same ranks. Ranks shared by two names
    (``dp`` when only one dp dim is larger than 1) go to the first of ``GROUP_NAMES`` (then,
    in a world with experts, of the expert groups: ``efsdp``, ``ep``, ``dp_shard_cp_tp``,
    ``cp_tp``), as ``ParallelDims.same_group`` says.
    """
    names: dict[tuple[int, ...], str] = {}
    for name in group_order(world.has_experts):
        ranks = tuple(sorted(dist.get_process_group_ranks(world[name].get_group())))
        names.setdefault(ranks, name)
    return names


def _group(group) -> dist.ProcessGroup:
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    return group


class CommCounter(TorchDispatchMode):
    """Counts calls and bytes per (collective kind, mesh dim) while active.

    Collectives over one-rank groups are left out. ``totals`` maps ``'<kind>/<dim>'`` to
    ``{'calls': n, 'bytes': b}``; a group that spans no mesh dim is reported as ``world`` (all
    ranks) or ``ranks[...]``.
    """

    def __init__(self, world):
        super().__init__()
        self._names = group_names(world)
        # Process group name -> reported name. The by-node token exchange's stage groups
        # (``world_mesh.EP_STAGES``) are its own, made anew whatever their ranks: named by
        # the group, as the comm model names them, even where another group has their ranks.
        self._dims: dict[str, str] = {
            world[name].get_group().group_name: name for name in EP_STAGES if name in world
        }
        self.totals: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})

    def _dim_of(self, group: dist.ProcessGroup) -> str:
        key = group.group_name
        if key not in self._dims:
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
            self._dims[key] = self._names.get(
                ranks, "world" if len(ranks) == dist.get_world_size() else f"ranks{list(ranks)}"
            )
        return self._dims[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor desugar the op into local ops and collectives first; this mode then
            # sees those (a mode runs before subclasses, and is off while its handler runs).
            return NotImplemented
        kwargs = kwargs or {}
        entry = (
            None
            if isinstance(func, torch._ops.HigherOrderOperator)
            else COLLECTIVES.get(func._overloadpacket)
        )
        if entry is not None:
            kind, tensor_arg, times_group = entry
            bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
            group = _group(bound.get("process_group", bound.get("group_name")))
            if group.size() > 1:  # a one-rank group moves nothing
                size = _nbytes(bound[tensor_arg]) * (group.size() if times_group else 1)
                slot = self.totals[f"{kind}/{self._dim_of(group)}"]
                slot["calls"] += 1
                slot["bytes"] += size
        return func(*args, **kwargs)

    def result(self) -> dict[str, dict[str, int]]:
        """Return the counts as a plain dict sorted by key."""
        return {key: dict(self.totals[key]) for key in sorted(self.totals)}


@contextlib.contextmanager
def counting(counter: CommCounter | None):
    """Run the block under ``counter`` (a ``CommCounter``) if there is one, with every
    ``torch.compile``d function running eagerly meanwhile; without a counter, as it is.

    Dynamo does not compile a frame first called under a dispatch mode, and such a frame stays
    uncompiled afterwards (seen with torch 2.13 here and 2.11 on an H100): a counted first step
    left a job's compiled blocks eager for the whole run, float8 + compile at half its speed.
    Under the ``force_eager`` stance nothing is compiled while the counter is on, so the next
    step compiles the blocks as it would have. The collectives counted are the same: FSDP's are
    issued outside the compiled blocks, and a compiled block runs the same TP collectives as
    its eager code.
    """
    if counter is None:
        yield
        return
    with torch.compiler.set_stance("force_eager"), counter:
        yield
