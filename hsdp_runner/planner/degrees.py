"""Which degree tuples the planner tries: every ``(dp_replicate, dp_shard, cp, tp, ep)`` of a
world (``PLANNED_DIMS``).

The data-parallel and TP degrees are always enumerated in full (every factorisation of the
world size; ``ParallelDims`` then says which are invalid and why). Context parallel is
enumerated over ``plan.cp_degrees``; left null, over the degrees that can be valid at all for
the model and cluster (``auto_cp_degrees``): a cp that cannot split ``model.seq_len`` into
``2 x cp`` load-balancing chunks, or that would cross nodes without
``parallel.allow_cp_across_nodes``, is invalid for every choice of the other degrees, and
listing it once per choice would only fill the table with the same reason.

Expert parallel (a model with experts) multiplies nothing: it borrows ranks from ``dp_shard x
cp x tp``, so each degree tuple of the other dims is tried with every ep of ``ep_degrees``
that divides those ranks and the experts (``plan.ep_degrees``; null: the powers of two that
do). A dense model plans ep = 1 alone.

Pipeline degrees are chosen here too (``pp_degrees``: ``plan.pp_degrees``, checked, or the
default powers of two of whole nodes with enough blocks a stage); ``planner.pipeline`` prices
each one from its stage.
"""

from __future__ import annotations

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.world_mesh import STAGE_DIMS

# The degrees of a planned layout, in the order of its ``shape`` (pp is priced apart:
# ``planner.pipeline``; its degrees are chosen here, ``pp_degrees``).
PLANNED_DIMS = (*STAGE_DIMS, "ep")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def auto_cp_degrees(
    seq_len: int, world: int, ranks_per_node: int, allow_across_nodes: bool
) -> list[int]:
    """Context-parallel degrees worth enumerating: divisors of ``world`` that split ``seq_len``
    into ``2 x cp`` equal chunks and (unless ``allow_across_nodes``) fit inside one node of
    ``ranks_per_node`` ranks. Always holds 1."""
    node = ranks_per_node or world
    return [
        cp
        for cp in divisors(world)
        if cp == 1 or (seq_len % (2 * cp) == 0 and (allow_across_nodes or node % cp == 0))
    ]


def cp_degrees(
    asked, seq_len: int, world: int, ranks_per_node: int, allow_across_nodes: bool
) -> list[int]:
    """The cp degrees to enumerate: ``asked`` (``plan.cp_degrees``, a list) as given, or the
    automatic ones when it is None. Raises ConfigError for a degree that does not divide the
    world size."""
    if asked is None:
        return auto_cp_degrees(seq_len, world, ranks_per_node, allow_across_nodes)
    values = sorted({int(cp) for cp in asked})
    bad = [cp for cp in values if cp < 1 or world % cp]
    if bad or not values:
        raise ConfigError(
            f"plan.cp_degrees={list(asked)}: each context-parallel degree must be "
            f">= 1 and divide the world size {world}; e.g. "
            f"plan.cp_degrees=[{','.join(map(str, divisors(world)[:3]))}], or "
            "null for every degree the model and cluster allow"
        )
    return values


def check_ep_degrees(asked, experts: int) -> None:
    """Raise ConfigError for ``plan.ep_degrees`` values (``asked``, a list or None) that no
    layout can take: below 1, or above 1 for a model without experts (``experts`` = 0)."""
    if asked is None:
        return
    values = [int(ep) for ep in asked]
    if not values or min(values) < 1:
        raise ConfigError(
            f"plan.ep_degrees={list(asked)}: each expert-parallel degree must be >= 1, e.g. "
            "plan.ep_degrees=[1,2,4], or null for every degree the experts and ranks allow"
        )
    if not experts and max(values) > 1:
        raise ConfigError(
            f"plan.ep_degrees={list(asked)}: the model has no routed experts (model.n_experts), "
            "so expert parallel has nothing to share out; drop plan.ep_degrees or plan a "
            "mixture-of-experts model"
        )


def ep_degrees(asked, experts: int, borrowed: int) -> list[int]:
    """The ep degrees to try for one layout whose ``dp_shard x cp x tp`` is ``borrowed``:
    [1] for a dense model (``experts`` = 0); ``asked`` (``plan.ep_degrees``) as given, those
    not dividing ``borrowed`` left out (they multiply nothing: no layout of these degrees
    has them); None: the powers of two dividing both ``experts`` and ``borrowed``."""
    if not experts:
        return [1]
    if asked is not None:
        return sorted({int(ep) for ep in asked if borrowed % int(ep) == 0})
    return [ep for ep in divisors(borrowed) if ep & (ep - 1) == 0 and experts % ep == 0]


def degree_shapes(
    world: int, cps: list[int], eps=None, experts: int = 0
) -> list[tuple[int, int, int, int, int]]:
    """Every (dp_replicate, dp_shard, cp, tp, ep) (``PLANNED_DIMS``) with product of the first
    four ``world``, cp in ``cps`` and ep of ``ep_degrees(eps, experts, dp_shard x cp x tp)``:
    by tp, then cp, then dp_shard, then ep ascending."""
    out = []
    for tp in divisors(world):
        for cp in (c for c in cps if (world // tp) % c == 0):
            for shard in divisors(world // tp // cp):
                for ep in ep_degrees(eps, experts, shard * cp * tp):
                    out.append((world // tp // cp // shard, shard, cp, tp, ep))
    return out


# The fewest blocks a stage gets among the degrees planned by default (``default_pp_degrees``):
# below it the first stage's embedding and the last one's output layer weigh like blocks of
# their own (Llama 3 8B's output layer is 2.4 blocks' parameters and matmul FLOPs), so the
# stages are unbalanced, and the busiest stage the planner prices is far above a 1/pp share.
MIN_BLOCKS_PER_STAGE = 4


def default_pp_degrees(nodes: int, n_layers: int) -> list[int]:
    """The pipeline degrees planned when ``plan.pp_degrees`` is null (the CLI and
    ``parallel=auto``): 1 and every power of two that divides ``nodes`` (a stage is whole
    nodes) and ``n_layers`` (stages of equal blocks) with ``MIN_BLOCKS_PER_STAGE`` blocks or
    more a stage. A single node, or a model that shallow, plans no pipeline."""
    out, pp = [1], 2
    while pp <= nodes:
        if nodes % pp == 0 and n_layers % pp == 0 and n_layers // pp >= MIN_BLOCKS_PER_STAGE:
            out.append(pp)
        pp *= 2
    return out


def pp_degrees(
    plan_pp_degrees: list | None, nodes: int, n_layers: int, gpus_per_node: int = 1
) -> list[int]:
    """The pipeline degrees to plan: ``plan.pp_degrees`` as given (checked:
    ``check_pp_degrees``), or ``default_pp_degrees`` when it is null."""
    if plan_pp_degrees is None:
        return default_pp_degrees(nodes, n_layers)
    check_pp_degrees(list(plan_pp_degrees), nodes, n_layers, gpus_per_node)
    return sorted(set(plan_pp_degrees))


def check_pp_degrees(degrees: list, nodes: int, n_layers: int, gpus_per_node: int = 1) -> None:
    """Raise ConfigError naming ``plan.pp_degrees`` for a degree that is not a positive
    divisor of ``nodes`` (a stage is whole nodes) or, on one node, of its ``gpus_per_node``
    (a stage is a share of them: asked for explicitly, never a default), or that exceeds the
    model's ``n_layers``."""
    for pp in degrees:
        whole = isinstance(pp, int) and pp >= 1 and nodes % pp == 0
        shared = isinstance(pp, int) and pp >= 1 and nodes == 1 and gpus_per_node % pp == 0
        if not (whole or shared) or pp > n_layers:
            raise ConfigError(
                f"plan.pp_degrees={list(degrees)}: {pp} is not a pipeline degree for "
                f"cluster.nodes={nodes} and model.n_layers={n_layers}; each must divide the "
                "nodes (a stage is whole nodes; on one node, its GPUs) and be at most the "
                "blocks, e.g. [1,2,4]"
            )
