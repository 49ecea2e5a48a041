"""Which degree tuples the planner tries: every ``(dp_replicate, dp_shard, cp, tp)`` of a world.

The data-parallel and TP degrees are always enumerated in full (every factorisation of the
world size; ``ParallelDims`` then says which are invalid and why). Context parallel is
enumerated over ``plan.cp_degrees``; left null, over the degrees that can be valid at all for
the model and cluster (``auto_cp_degrees``): a cp that cannot split ``model.seq_len`` into
``2 x cp`` load-balancing chunks, or that would cross nodes without
``parallel.allow_cp_across_nodes``, is invalid for every choice of the other degrees, and
listing it once per choice would only fill the table with the same reason.
"""

from __future__ import annotations

from hsdp_runner.core.errors import ConfigError


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


def degree_shapes(world: int, cps: list[int]) -> list[tuple[int, int, int, int]]:
    """Every (dp_replicate, dp_shard, cp, tp) with product ``world`` and cp in ``cps``: by tp,
    then cp, then dp_shard ascending."""
    out = []
    for tp in divisors(world):
        for cp in (c for c in cps if (world // tp) % c == 0):
            for shard in divisors(world // tp // cp):
                out.append((world // tp // cp // shard, shard, cp, tp))
    return out
