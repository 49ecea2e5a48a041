"""What of expert parallel's token exchange the experts' compute hides, on the chunked schedule
the runtime runs (``distributed/exchange_overlap.py``, ``parallel.ep_chunks``).

A forward pass of one MoE layer in C chunks: the C dispatches leave back to back; the experts
compute chunk i once its dispatch has arrived and chunk i-1 is done; chunk i's combine leaves
when its experts end, behind whatever the link still carries. Backward mirrors it (every
combine's gradient first, each chunk's dispatch gradient after its experts' backward), so
one timeline prices both, with the pass's own expert compute. On one link, dispatch and
combine carry equal shares (the busiest rank's rows in and out), and a pass's exchange is
spread evenly over its chunks. What the timeline takes beyond the experts' compute is
exposed: the whole exchange with one chunk; with many, the first dispatch and the last
combine (a 1/C share) where compute is the longer, the exchange less the compute where the
link is. The exchange by node (its ``ep_inter`` stage over the NICs, then its ``ep_intra``
stage over NVLink, each way) is timed as one exchange of both stages' seconds: one chunk's
NIC stage could run beside another's NVLink stage, which this leaves out (it errs towards
exposing more).

Which passes exchange: every forward, once more under full activation checkpointing (the
block's forward recomputed in backward, its exchange with it), and the backward; which
compute hides them: the experts' grouped matmuls, forward one part, backward two, plus the
recompute share (``matmul_shapes.recompute_share``) in the recomputed forward under full AC
and in the backward otherwise (selective AC recomputes matmuls, never the exchange).
"""

from __future__ import annotations


def chunked_timeline(exchange: float, compute: float, chunks: int) -> float:
    """Seconds of one pass's ``exchange`` (dispatch + combine) and ``compute`` (the experts)
    in ``chunks`` chunks on the schedule above, from the first dispatch to the last
    combine's arrival."""
    move = exchange / (2 * chunks)  # one chunk's dispatch, and its combine
    work = compute / chunks
    link = chunks * move  # the dispatches, back to back
    done = 0.0
    for i in range(chunks):
        done = max((i + 1) * move, done) + work
        link = max(done, link) + move
    return link


def exposed_exchange(
    exchange: float,
    experts: float,
    chunks: int,
    recompute: float,
    full_ac: bool,
    overlap: float = 1.0,
) -> float:
    """Seconds of a step's token ``exchange`` (every all-to-all of it) that its ``experts``
    (the grouped matmuls' seconds, recompute included) do not hide with ``chunks`` chunks;
    ``recompute``: the share of a forward that backward recomputes; ``full_ac``: the exchange
    runs again with it (module docstring); ``overlap``: ``cluster.overlap``, the share of
    compute a collective can hide behind (as for FSDP's: 1.0 on a GPU, measured on a CPU,
    where gloo's threads and the experts share the cores)."""
    if chunks == 1 or exchange <= 0:
        return exchange
    forwards = 2 if full_ac else 1
    per_pass = exchange / (forwards + 1)
    unit = overlap * experts / (3 + recompute)
    backward = unit * (2 if full_ac else 2 + recompute)
    exposed = chunked_timeline(per_pass, backward, chunks) - backward
    for _ in range(forwards):
        exposed += chunked_timeline(per_pass, unit, chunks) - unit
    return exposed
