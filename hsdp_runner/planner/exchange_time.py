"""What of expert parallel's token exchange the experts' compute hides, on the chunked schedule
the runtime runs (``distributed/exchange_overlap.py``, ``parallel.ep_chunks``).

The runtime runs the exchange's stages breadth first: each stage on every chunk before the
next stage. A stage is an all-to-all on one link (the flat exchange: ``ep``; the exchange by
node: ``ep_inter`` over the NICs, then ``ep_intra`` over NVLink on the way out, the reverse on
the way back), started once the compute before it (on the rank's one compute stream, in the
order the host issued it; on a CPU the host itself) has run; the experts compute each chunk
once its last dispatch stage has arrived. ``timeline`` plays that order out with each link a
queue of its own (so one chunk's NIC stage runs beside another's NVLink stage) and the
compute in issue order (so the relay's work on chunk i+1, issued before chunk i's experts,
waits for chunk i+1's rows first). What it takes beyond the experts' compute is exposed: the
whole exchange in one chunk; in many, about a 1/C share where compute is the longer, the
exchange less the compute where a link is. Backward mirrors forward (every combine's
gradient first, each chunk's dispatch gradient after its experts' backward): the same
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


def timeline(links: list[float], compute: float, chunks: int) -> float:
    """Seconds of one pass from the first dispatch to the last combine's arrival: ``links``
    the seconds of each link's stage in dispatch order (dispatch and combine together; the
    combine runs them in reverse), ``compute`` the experts', in ``chunks`` chunks."""
    stages = len(links)
    move = [seconds / (2 * chunks) for seconds in links]  # one chunk's stage, each way
    work = compute / chunks
    free = [0.0] * stages  # when each link's queue is next free
    busy = 0.0  # when the compute issued so far has run
    ready = [0.0] * chunks  # per chunk: when what its next step needs has arrived

    def on_link(stage: int) -> None:
        nonlocal busy
        for c in range(chunks):
            busy = max(busy, ready[c])  # the host's (or stream's) work before the issue
            start = max(free[stage], busy)
            free[stage] = ready[c] = start + move[stage]

    for stage in range(stages):
        on_link(stage)
    for c in range(chunks):  # the experts, chunk by chunk, each combine issued after
        busy = max(busy, ready[c]) + work
        start = max(free[-1], busy)
        free[-1] = ready[c] = start + move[-1]
    for stage in reversed(range(stages - 1)):
        on_link(stage)
    return max(busy, *ready)


def exposed_exchange(
    links: list[float],
    experts: float,
    chunks: int,
    recompute: float,
    full_ac: bool,
    overlap: float = 1.0,
) -> float:
    """Seconds of a step's token exchange (``links``: each link's seconds of it, every
    all-to-all of the step, in dispatch order) that its ``experts`` (the grouped matmuls'
    seconds, recompute included) do not hide with ``chunks`` chunks; ``recompute``: the share
    of a forward that backward recomputes; ``full_ac``: the exchange runs again with it
    (module docstring); ``overlap``: ``cluster.overlap``, the share of compute a collective
    can hide behind (as for FSDP's: 1.0 on a GPU, measured on a CPU, where gloo's threads and
    the experts share the cores)."""
    if chunks == 1 or sum(links) <= 0:
        return sum(links)
    forwards = 2 if full_ac else 1
    per_pass = [seconds / (forwards + 1) for seconds in links]
    unit = overlap * experts / (3 + recompute)
    backward = unit * (2 if full_ac else 2 + recompute)
    exposed = timeline(per_pass, backward, chunks) - backward
    for _ in range(forwards):
        exposed += timeline(per_pass, unit, chunks) - unit
    return exposed
