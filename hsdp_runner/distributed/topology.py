"""How the process groups of each mesh dim sit on nodes: the facts a collective's price needs.

For a mesh dim (or a flattened view such as ``dp`` = ``dp_replicate`` x ``dp_shard``, or
``world``) a ``Placement`` says how many ranks one group has (``size``), how many of them share
a node (``ranks_per_node``, k), how many groups of that dim have ranks on one node
(``groups_per_node``; all of them run the same collective at the same moment) and how many
nodes one group touches (``nodes``). Two sources give the same facts:

- ``placement``: arithmetic on the mesh shape, as ``ParallelDims.build_mesh`` lays it out
  (row-major over the named dims, the last innermost) with ranks placed on nodes contiguously
  (rank r on node r // ranks_per_node, as torchrun and SLURM's block distribution number them);
  the planner prices collectives with it;
- ``observed_placements``: the ranks of the real process groups of a built mesh and the node
  each rank runs on (the launcher's node rank), gathered from every rank; a job records it so
  that a test can check the arithmetic against what torch built.

Generic over the dims: nothing here names a dim except the flattened views' definition.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from math import prod

from hsdp_runner.distributed.parallel_dims import EXPERT_VIEWS, VIEWS

# Flattened views of the world mesh, by name: the dims they join, outermost first; a model
# with experts has the expert views too. ParallelDims owns their definition.
FLATTENED = VIEWS
_ANY_VIEW = {**VIEWS, **EXPERT_VIEWS}
WORLD = "world"


@dataclass(frozen=True)
class Placement:
    """Where the groups of one mesh dim sit: see the module docstring."""

    size: int  # ranks in one group
    ranks_per_node: int  # k: the fewest ranks one group has on a node it uses
    groups_per_node: int  # groups of this dim with ranks on one node (the most on any node)
    nodes: int  # nodes one group spans (the most of any group)

    @property
    def spans_nodes(self) -> bool:
        """True if a group of this dim holds ranks of more than one node."""
        return self.nodes > 1

    def describe(self) -> dict:
        """Plain dict for plan.json and summary.json."""
        return asdict(self)


def group_dims(name: str, dim_names: Sequence[str]) -> tuple[str, ...]:
    """The mesh dims a group name spans: itself, a flattened view's dims, or all for 'world'.

    Raises ValueError for a name that is none of these.
    """
    if name in dim_names:
        return (name,)
    if name == WORLD:
        return tuple(dim_names)
    if name in _ANY_VIEW and set(_ANY_VIEW[name]) <= set(dim_names):
        return _ANY_VIEW[name]
    raise ValueError(
        f"{name!r} is neither a mesh dim of {tuple(dim_names)}, a flattened view "
        f"({', '.join(_ANY_VIEW)}) nor {WORLD!r}"
    )


def mesh_groups(
    shape: Sequence[int], dim_names: Sequence[str], group: Sequence[str]
) -> list[list[int]]:
    """Every process group (its global ranks, ascending) along the dims ``group`` of a row-major
    mesh of ``shape``: ranks that differ only in those dims' coordinates."""
    strides = [prod(shape[i + 1 :]) for i in range(len(shape))]
    inside = [i for i, name in enumerate(dim_names) if name in group]
    groups: dict[tuple, list[int]] = {}
    for rank in range(prod(shape)):
        key = tuple((rank // strides[i]) % shape[i] for i in range(len(shape)) if i not in inside)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def placement_of_groups(groups: Sequence[Sequence[int]], node_of: dict[int, object]) -> Placement:
    """The Placement of ``groups`` (lists of ranks) whose ranks run on ``node_of[rank]``."""
    per_node: dict[object, set[int]] = {}
    k, spans = None, 1
    for index, ranks in enumerate(groups):
        counts: dict[object, int] = {}
        for rank in ranks:
            counts[node_of[rank]] = counts.get(node_of[rank], 0) + 1
            per_node.setdefault(node_of[rank], set()).add(index)
        k = min(counts.values()) if k is None else min(k, min(counts.values()))
        spans = max(spans, len(counts))
    return Placement(
        size=len(groups[0]),
        ranks_per_node=k,
        groups_per_node=max(len(g) for g in per_node.values()),
        nodes=spans,
    )


@lru_cache(maxsize=4096)
def _placement(
    shape: tuple[int, ...], dim_names: tuple[str, ...], name: str, node_size: int
) -> Placement:
    group = group_dims(name, dim_names)
    # A rank's group is named by its rank with the group's coordinates zeroed; counting
    # (group, node) pairs in integer arithmetic keeps 1,024-rank plans fast.
    inside = [(prod(shape[i + 1 :]), shape[i]) for i, n in enumerate(dim_names) if n in group]
    counts: dict[tuple[int, int], int] = {}
    for rank in range(prod(shape)):
        first = rank - sum((rank // stride) % size * stride for stride, size in inside)
        counts[first, rank // node_size] = counts.get((first, rank // node_size), 0) + 1
    per_group: dict[int, int] = {}
    per_node: dict[int, int] = {}
    for first, node in counts:
        per_group[first] = per_group.get(first, 0) + 1
        per_node[node] = per_node.get(node, 0) + 1
    return Placement(
        size=prod(size for _, size in inside),
        ranks_per_node=min(counts.values()),
        groups_per_node=max(per_node.values()),
        nodes=max(per_group.values()),
    )


def placement(
    shape: Sequence[int], dim_names: Sequence[str], name: str, node_size: int
) -> Placement:
    """The Placement of the groups called ``name`` (a dim, a flattened view or 'world') of a
    row-major mesh ``shape`` with dims ``dim_names`` and ``node_size`` contiguous ranks per node.

    Cached: a plan asks for the same few shapes many times.
    """
    return _placement(tuple(shape), tuple(dim_names), name, node_size)


def node_id() -> str:
    """This process's node, as the launcher says: torchrun's node rank (``GROUP_RANK``), else
    SLURM's (``SLURM_NODEID``), else the host name (two torchrun agents on one machine are two
    nodes to torch, so the host name alone would not tell them apart)."""
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(key) is not None:
            return f"{key}={os.environ[key]}"
    return platform.node()


def observed_placements(world_mesh, names: Sequence[str]) -> dict[str, dict]:
    """{name: Placement.describe()} read from the real process groups of ``world_mesh`` (a
    WorldMesh) for each group ``name``, with every rank's node from ``node_id``.

    A collective: every rank must call it. Returns the same dict on every rank.
    """
    import torch.distributed as dist

    mine = {
        "node": node_id(),
        "groups": {
            name: dist.get_process_group_ranks(world_mesh[name].get_group()) for name in names
        },
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    node_of = {rank: facts["node"] for rank, facts in enumerate(every)}
    out = {}
    for name in names:
        groups = {tuple(sorted(facts["groups"][name])) for facts in every}
        out[name] = placement_of_groups(sorted(groups), node_of).describe()
    return out
