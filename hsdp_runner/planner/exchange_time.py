"""What of expert parallel's token exchange the experts' compute hides, on the chunked schedule
the runtime runs (``distributed/exchange_overlap.py``, ``parallel.ep_chunks``).

The runtime runs the exchange's stages in ``parallel.ep_order``'s order
(``exchange_overlap.schedule``): breadth first, each stage on every chunk before the next
stage, or per chunk (the exchange by node only: chunk i+1's relay after chunk i's experts,
chunk i's sums sent as soon as its outputs are back). A stage is an all-to-all on one link
(the flat exchange: ``ep``; the exchange by node: ``ep_inter`` over the NICs, then
``ep_intra`` over NVLink on the way out, the reverse on the way back), started once the
compute before it (on the rank's one compute stream, in the order the host issued it; on a
CPU the host itself) has run; the experts compute each chunk once its last dispatch stage
has arrived. ``timeline`` plays that order out with each link a
queue of its own (so one chunk's NIC stage runs beside another's NVLink stage) and the
compute in issue order (so, breadth first, the relay's work on chunk i+1, issued before chunk
i's experts, waits for chunk i+1's rows first). What it takes beyond the experts' compute is
exposed: the whole exchange in one chunk; in many, about a 1/C share where compute is the
longer, the exchange less the compute where a link is. Backward mirrors forward (every
combine's gradient first, each chunk's dispatch gradient after its experts' backward): the same
timeline with the backward's compute.

Which passes exchange: every forward, once more under full activation checkpointing (the
block's forward recomputed in backward, its exchange with it), and the backward; which
compute hides them: the experts' grouped matmuls, forward one part, backward two, plus the
recompute share (``matmul_shapes.recompute_share``) in the recomputed forward under full AC
and in the backward otherwise (selective AC recomputes matmuls, never the exchange). A pass's
exchange on a link is spread evenly over its chunks and split evenly between dispatch and
combine (the busiest rank's rows in and out).
"""

from __future__ import annotations

from hsdp_runner.core.choices import ExchangeOrder
from hsdp_runner.distributed.exchange_overlap import (
    BY_NODE,
    BY_NODE_LINKS,
    FLAT,
    FLAT_LINKS,
    schedule,
)


def timeline(
    links: list[float],
    compute: float,
    chunks: int,
    by_node: bool = False,
    order: ExchangeOrder = ExchangeOrder.breadth_first,
) -> float:
    """Seconds of one pass from the first dispatch to the last combine's arrival: ``links``
    each link's seconds of the pass (the flat exchange: ``ep``; by node: ``ep_inter``, then
    ``ep_intra``), half of them each way; ``compute`` the experts'; in ``chunks`` chunks run
    in ``exchange_overlap.schedule``'s order through the exchange's segments (``FLAT`` or
    ``BY_NODE``; by node in ``order``): a segment's compute starts when the compute issued
    before it has run and the rows it waits for have arrived; a link stage when its link's
    queue is free and the compute issued before it has run."""
    segments, stage_links = (BY_NODE, BY_NODE_LINKS) if by_node else (FLAT, FLAT_LINKS)
    move = [links[link] / (2 * chunks) if link < len(links) else 0.0 for link in stage_links]
    free: dict[int, float] = {}  # when each link's queue is next free
    arrived: dict[tuple[int, int], float] = {}  # (link stage, chunk): when its rows arrive
    busy = 0.0  # when the compute issued so far has run
    for index, chunk in schedule(segments, chunks, order):
        segment = segments[index]
        if segment.waits is not None:
            busy = max(busy, arrived[segment.waits, chunk])
        if segment.experts:
            busy += compute / chunks
        if segment.issues is not None:
            link = stage_links[segment.issues]
            start = max(free.get(link, 0.0), busy)
            free[link] = arrived[segment.issues, chunk] = start + move[segment.issues]
    return busy


def exposed_exchange(
    links: list[float],
    experts: float,
    chunks: int,
    recompute: float,
    full_ac: bool,
    overlap: float = 1.0,
    by_node: bool = False,
    order: ExchangeOrder = ExchangeOrder.breadth_first,
) -> float:
    """Seconds of a step's token exchange (``links``: each link's seconds of it, every
    all-to-all of the step, as ``timeline`` takes them; ``by_node``: the exchange by node's)
    that its ``experts`` (the grouped matmuls' seconds, recompute included) do not hide with
    ``chunks`` chunks; ``recompute``: the share of a forward that backward recomputes;
    ``full_ac``: the exchange runs again with it (module docstring: full AC, or ``moe``'s
    recompute of the MoE layer alone); ``overlap``:
    ``cluster.overlap``, the share of compute a collective can hide behind (as for FSDP's: 1.0
    on a GPU, measured on a CPU, where gloo's threads and the experts share the cores);
    ``order``: the exchange by node's (``parallel.ep_order``)."""
    if chunks == 1 or sum(links) <= 0:
        return sum(links)
    forwards = 2 if full_ac else 1
    per_pass = [seconds / (forwards + 1) for seconds in links]
    unit = overlap * experts / (3 + recompute)
    backward = unit * (2 if full_ac else 2 + recompute)
    exposed = timeline(per_pass, backward, chunks, by_node, order) - backward
    for _ in range(forwards):
        exposed += timeline(per_pass, unit, chunks, by_node, order) - unit
    return exposed
