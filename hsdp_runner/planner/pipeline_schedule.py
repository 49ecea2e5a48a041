"""What each rank of a pipeline schedule holds in flight: the activations of the micro-batches
it has run forward and not yet backward, counted per block.

A rank runs its actions in an order fixed by the schedule alone, whatever the timing: each
forward of a micro-batch through one of its stages keeps that stage's saved activations, the
backward that ends with it releases them. Walking a rank's order and summing, after every
forward, the blocks of each of its stages times that stage's micro-batches in flight gives the
most blocks' worth of one micro-batch's activations the rank ever holds. ``held_blocks`` does
this for every rank; ``planner.pipeline`` prices the largest.

The orders are those torch 2.13 builds (``torch/distributed/pipelining/schedules.py``), written
out here so the planner does not depend on a schedule's private methods (a test compares them
with torch's own ``_calculate_single_rank_operations``):

- GPipe: all m forwards, then all m backwards.
- 1F1B: ``min(m, pp - rank)`` forwards, then a backward and a forward in turn, then the rest of
  the backwards.
- Interleaved 1F1B (v stages per rank, rank r holds stages r, r + pp, ...): micro-batches go in
  rounds of ``m // max(1, m // pp)``; ``(v - 1) x round + 2 (pp - 1 - rank)`` warm-up forwards
  (at most m v), the forwards taking the rank's stages in turn a round at a time; then a forward
  and a backward in turn (the backwards taking the stages from the last), then the remaining
  backwards.
- Interleaved zero bubble (ZB1P): as interleaved 1F1B with ``(pp - 1 - rank)`` extra warm-up
  forwards instead of twice that, each backward split into its input and weight halves, the
  weight half of the k-th backward run once ``rank`` backwards more have run (then all the
  rest). A micro-batch's activations are counted held until its weight half: the weights'
  gradients need the matmuls' inputs, most of what a block saves.
"""

from __future__ import annotations

from functools import lru_cache

FORWARD, RELEASE, INPUT_BACKWARD = 1, -1, 0  # what an action does to the stage's count


def rank_order(schedule: str, pp: int, m: int, v: int, rank: int) -> list[tuple[int, int]]:
    """The actions of pipeline rank ``rank`` in the order it runs them: (its local stage index,
    ``FORWARD`` / ``RELEASE`` / ``INPUT_BACKWARD``) for ``schedule`` on ``pp`` ranks, ``m``
    micro-batches and ``v`` stages per rank (module docstring)."""
    if schedule == "gpipe":
        return [(0, FORWARD)] * m + [(0, RELEASE)] * m
    if schedule == "1f1b":
        warm = min(m, pp - rank)
        return (
            [(0, FORWARD)] * warm
            + [(0, RELEASE), (0, FORWARD)] * (m - warm)
            + [(0, RELEASE)] * warm
        )
    zero_bubble = schedule == "interleaved_zb"
    per_round = m // max(1, m // pp)
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)

    def backward_stage(op: int) -> int:
        return v - 1 - ((op - warm) // per_round) % v

    order, backwards, weights = [], [], 0
    for op in range(m * v + warm):
        if op < m * v:
            order.append(((op // per_round) % v, FORWARD))
        if op < warm:
            continue
        backwards.append(op)
        order.append((backward_stage(op), INPUT_BACKWARD if zero_bubble else RELEASE))
        if zero_bubble and op - warm >= rank:
            order.append((backward_stage(backwards[weights]), RELEASE))
            weights += 1
    if zero_bubble:
        order += [(backward_stage(op), RELEASE) for op in backwards[weights:]]
    return order


@lru_cache(maxsize=256)
def held_blocks(schedule: str, pp: int, m: int, v: int, stage_sizes: tuple[int, ...]) -> tuple:
    """Per pipeline rank, the most block-micro-batches of activations it holds at once: over
    its order (``rank_order``), the largest sum of its stages' blocks (``stage_sizes``: the
    blocks of each of the pp x v stages, stage s on rank s mod pp) times their micro-batches
    in flight."""
    held = []
    for rank in range(pp):
        blocks = stage_sizes[rank::pp]
        in_flight, peak = [0] * v, 0
        for stage, step in rank_order(schedule, pp, m, v, rank):
            in_flight[stage] += step
            if step == FORWARD:
                peak = max(peak, sum(b * n for b, n in zip(blocks, in_flight)))
        held.append(peak)
    return tuple(held)
