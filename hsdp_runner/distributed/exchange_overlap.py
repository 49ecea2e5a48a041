"""Expert parallel's token exchange in chunks, each chunk's all-to-alls in flight while the
experts compute another chunk (``parallel.ep_chunks``; ``expert_parallel.exchange_chunks``).

The exchange in one piece waits for every routed row before the experts start and for every
output before the layer goes on: its all-to-alls are exposed whole, in forward and backward.
Here the MoE layer cuts its tokens into C chunks (``moe_routing.MoE``), routes each chunk on
its own, and hands the chunks to the experts in one call (one FSDP unshard and one
post-backward reduce-scatter), whose exchange runs them through its segments (each waits
what the previous one issued, computes, and issues what the next one waits) in the order
``parallel.ep_order`` names (``schedule``, ``pipelined``): **breadth first**, each segment on
every chunk before the next, or **per chunk**, which takes each chunk on past the experts as
soon as they are done with it (the exchange by node only; the flat exchange's orders are
one). The segments are described once (``Segment``: ``FLAT``, ``BY_NODE``), for the runtime
and for the planner, which times the same order (``planner/exchange_time.py``). The flat
exchange (``flat_overlap``) has three:

    dispatch: the counts of all chunks (one all-to-all, one host read); issue each chunk's rows
              and their router weights
    experts:  per chunk i: wait its rows and weights, the experts on them (each row's output
              weighed), issue its outputs back
    combine:  per chunk: wait its outputs, sum each token's copies

so dispatch i+1 (and combine i) travel while the experts compute chunk i (i+1): what stays
exposed is the first dispatch and the last combine, a 1/C share of the exchange, where the
experts' compute is the longer of the two. The exchange by node (``node_exchange``) has five
(the pairs to the relays over ``ep_inter``, the relays on to the experts over ``ep_intra``,
the experts and their weighted outputs back to the relays, the relays' sums back over
``ep_inter``, the sum at the source), each stage of one chunk in flight while another chunk computes.

Backward mirrors forward, and autograd gives it that order: the engine runs the
latest-created ready node first. The all-to-alls are issued outside autograd (``issue``:
``torch.ops._c10d_functional``, the ops torch's functional collectives call, so the
communication count and selective activation checkpointing see them as they see the
one-piece exchange's) and each enters the graph through ``Arrival``, created where it is
waited: in breadth-first order, chunk i's node sits after chunk i-1's compute of the same
stage, so backward reaches it (and issues its mirror) right after chunk i's compute of the
next stage, before chunk i-1's. ``Arrival.backward`` returns the gradient in flight as
torch's ``AsyncCollectiveTensor``, which waits where it is first used, so the engine goes
on to the next ready node meanwhile. torch's differentiable ``all_to_all_single`` waits
inside its backward, which is why the exchange does not use it here.

On a GPU the all-to-alls run on NCCL's stream beside the experts' kernels; on CPU (gloo) in
gloo's threads. The losses and gradients equal the one-piece exchange's up to the order of
the weights' gradient sums (the grouped matmuls run per chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hsdp_runner.core.choices import ExchangeOrder


def issue(rows: torch.Tensor, received: list[int], sent: list[int], group_name: str):
    """Start an all-to-all of ``rows`` (``sent[r]`` rows to rank r, ``received[r]`` from it);
    returns its output, in flight until ``wait_tensor`` (or ``arrive``)."""
    return torch.ops._c10d_functional.all_to_all_single(
        rows.contiguous(), received, sent, group_name
    )


def wait(pending: torch.Tensor) -> torch.Tensor:
    """The rows of an all-to-all ``issue`` started that carries no gradient."""
    return torch.ops._c10d_functional.wait_tensor(pending)


class Arrival(torch.autograd.Function):
    """``apply(pending, source, received, sent, group_name)``: the rows of the all-to-all
    ``pending`` (a one-item list: the in-flight output, issued from ``source`` with these
    splits) once arrived; backward sends the gradient back the other way and returns it in
    flight (module docstring)."""

    @staticmethod
    def forward(ctx, pending, source, received, sent, group_name):
        ctx.splits, ctx.group_name = (received, sent), group_name
        return wait(pending.pop())

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        received, sent = ctx.splits
        back = issue(grad, sent, received, ctx.group_name)
        return None, AsyncCollectiveTensor(back), None, None, None


def arrive(pending: torch.Tensor, source: torch.Tensor, received, sent, group_name: str):
    """The rows of ``pending`` (issued from ``source`` at these splits), a node of the graph
    created here: where backward issues its mirror (module docstring)."""
    return Arrival.apply([pending], source, received, sent, group_name)


def send(rows: torch.Tensor, received: list[int], sent: list[int], group_name: str):
    """``issue`` outside autograd (``arrive`` brings the rows into the graph): (the pending
    output, the rows it was issued from)."""
    with torch.no_grad():
        return issue(rows, received, sent, group_name), rows


@dataclass(frozen=True)
class Segment:
    """One step of an exchange's schedule for one chunk: it waits for the rows of link stage
    ``waits`` (None: nothing), runs the experts if ``experts``, and starts link stage
    ``issues`` (None: nothing). What the runtime runs (``pipelined``) and the planner times
    (``planner/exchange_time.py``) from one description."""

    waits: int | None
    experts: bool
    issues: int | None


# The flat exchange: link stages 0 (dispatch) and 1 (combine), both over ``ep`` (link 0).
FLAT = (Segment(None, False, 0), Segment(0, True, 1), Segment(1, False, None))
FLAT_LINKS = (0, 0)
# The exchange by node: out over ``ep_inter`` (stage 0, link 0) then ``ep_intra`` (stage 1,
# link 1), back over ``ep_intra`` (2) then ``ep_inter`` (3); the relays' work between the
# stages, the experts after stage 1.
BY_NODE = (
    Segment(None, False, 0),
    Segment(0, False, 1),
    Segment(1, True, 2),
    Segment(2, False, 3),
    Segment(3, False, None),
)
BY_NODE_LINKS = (0, 1, 1, 0)


def schedule(
    segments: tuple[Segment, ...], chunks: int, order: ExchangeOrder = ExchangeOrder.breadth_first
) -> list[tuple[int, int]]:
    """The (segment, chunk) order an exchange of ``segments`` (``FLAT``, ``BY_NODE``) runs
    ``chunks`` chunks in. ``breadth_first``: each segment on every chunk before the next.
    ``per_chunk``: the first segment (the first issue) and the last (the last wait) on every
    chunk as in breadth first; between them, after chunk 0's segments up to the experts, per
    chunk i its experts, then chunk i+1's segments up to the experts (the relay), then chunk
    i's segments after the experts (its sums sent back). For the flat exchange (no segment
    between the first issue and the experts, none between the experts and the last wait) the
    two orders are one."""
    if ExchangeOrder(order) is ExchangeOrder.breadth_first:
        return [(segment, chunk) for segment in range(len(segments)) for chunk in range(chunks)]
    experts = next(i for i, segment in enumerate(segments) if segment.experts)
    last = len(segments) - 1
    before, after = range(1, experts), range(experts + 1, last)
    steps = [(0, chunk) for chunk in range(chunks)] + [(segment, 0) for segment in before]
    for chunk in range(chunks):
        steps.append((experts, chunk))
        if chunk + 1 < chunks:
            steps += [(segment, chunk + 1) for segment in before]
        steps += [(segment, chunk) for segment in after]
    return steps + [(last, chunk) for chunk in range(chunks)]


def pipelined(
    states: list,
    segments: list[Callable],
    described: tuple[Segment, ...],
    order: ExchangeOrder = ExchangeOrder.breadth_first,
) -> list:
    """Run ``segments`` (state -> state; ``described`` by ``FLAT`` or ``BY_NODE``) on the
    chunks' ``states`` in ``schedule``'s ``order``: a segment waits what the previous one
    issued and issues what the next waits, so while it runs on chunk i what was issued for
    another chunk travels. Returns the chunks' last states."""
    states = list(states)
    for segment, chunk in schedule(described, len(states), order):
        states[chunk] = segments[segment](states[chunk])
    return states


def flat_overlap(
    exchange, tokens: list, routing: list, compute: Callable, weights: list, sum_copies: Callable
) -> list[torch.Tensor]:
    """The flat exchange (``expert_parallel.TokenExchange``) of C chunks on the schedule above.
    ``tokens``: each chunk's (T_i, dim); ``routing``: each chunk's (token (N_i,) the token of
    each routed copy sorted by global expert, counts (n_experts,) int64); ``compute(rows (M_i,
    dim) sorted by local expert, local counts (L,), their weights (M_i,))``: the experts;
    ``weights``: each chunk's router weight of each copy (N_i,) fp32, which travels with its
    rows; ``sum_copies``: the layer's (``moe_routing.sum_copies``). Returns each chunk's
    (T_i, dim)."""
    from torch.distributed._functional_collectives import _resolve_group_name

    group_name = _resolve_group_name(exchange.group)
    copies = [rows[token] for rows, (token, _) in zip(tokens, routing)]
    sent, received = exchange.chunk_counts(copies, [counts for _, counts in routing])
    splits = exchange.chunk_split_sizes(sent, received)
    if exchange.routing is not None and torch._C._current_graph_task_id() == -1:
        exchange.routing.append(
            (sum(sum(out) for out, _ in splits), sum(sum(into) for _, into in splits))
        )

    def dispatch(i):
        out, into = splits[i]
        return i, send(copies[i], into, out, group_name), send(weights[i], into, out, group_name)

    def experts(state):
        i, rows, weight = state
        out, into = splits[i]
        arrived = arrive(*rows, into, out, group_name)
        arrived_weight = arrive(*weight, into, out, group_name)
        order, inverse = exchange.by_local_expert(received[i], arrived.shape[0])
        local, local_weight = arrived.index_select(0, order), arrived_weight.index_select(0, order)
        outputs = compute(local, exchange.local_counts(received[i]), local_weight)
        return i, send(outputs.index_select(0, inverse), out, into, group_name)

    def combine(state):
        i, (pending, source) = state
        out, into = splits[i]
        back = arrive(pending, source, out, into, group_name)
        return sum_copies(back, routing[i][0], tokens[i].shape[0], tokens[i].dtype)

    # ``FLAT``'s segments, which the planner times in the same order (one order for both).
    return pipelined(list(range(len(tokens))), [dispatch, experts, combine], FLAT)
