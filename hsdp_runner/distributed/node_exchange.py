"""Expert parallel's token exchange when an ep group spans nodes: each token crosses to a node
once, however many of its experts sit there, and its outputs come back once, summed there.

The flat exchange (``expert_parallel.TokenExchange``) sends every routed copy of a token to
the rank holding its expert: a token whose top-k experts sit on three ranks of another node
crosses that node's NICs three times, and three outputs cross back. Published MoE systems
(DeepEP's internode kernels, Megatron's "flex" dispatcher over them) send a token once per
destination node over the inter-node link and forward it inside the node over NVLink; the
combine sums a token's weighted expert outputs on that node before sending one row back.
``NodeExchange`` does the same with two all-to-alls each way over the two stage groups of the
ep group (``world_mesh.EP_STAGES``: ep = nodes x ranks per node, row-major as ranks sit on
nodes; ep rank r = (node r // k, place r % k) holds experts [r L, (r+1) L)):

- **stage 1, ``ep_inter``** (the ep ranks with this rank's place on their node, one per
  node): each distinct (destination node, token) pair once, to the peer with this rank's
  place on that node (the *relay*; a rank is its own relay for its own node), with, per
  routed copy, the index of its token among those sent to that node (int64) and its router
  weight (fp32, differentiable: the experts weigh their outputs with it);
  first the counts: per destination node its experts' copy counts and the distinct tokens;
- **stage 2, ``ep_intra``** (the ep ranks of this node): the relay forwards one row and one
  weight per copy to the rank holding its expert, ordered (destination place, source node,
  local expert); first the counts, (source node, local expert) for each destination place.
  The expert rank reorders what arrived to local-expert-major for the grouped matmul;
- **combine**: the experts' weighted outputs back to the relay over ``ep_intra``, summed per
  token there (the layer's ``sum_copies``: fp32 sums, rounded once to the compute dtype),
  one row per (node, token) back over ``ep_inter``, and the source sums its tokens' rows
  from every node in fp32, rounded once.

Backward is autograd's: torch's functional ``all_to_all_single`` is differentiable, the
index operations too. The counts are host values (two reads a layer and pass: the relay's
counts, then the expert rank's), as the flat exchange's split sizes are.

Results equal the flat exchange's up to the order of a token's sum: its copies on one node
are summed there first, ``(a + b) + (c + d)`` where the flat exchange sums ``((a + b) + c)
+ d`` in expert order; in the compute dtype, each node's partial sum is rounded once more
before crossing back. Bit for bit only where no token has two copies on a node other than
its first.
"""

from __future__ import annotations

import functools

import torch

from hsdp_runner.core.choices import ExchangeOrder
from hsdp_runner.distributed.exchange_overlap import BY_NODE, arrive, pipelined, send, wait


def permute_blocks(sizes: torch.Tensor, perm: tuple[int, ...], total: int) -> torch.Tensor:
    """The gather index that reorders ``total`` rows laid out as blocks of ``sizes[i, j, ...]``
    rows in the row-major order of ``sizes`` into the row-major order of
    ``sizes.permute(perm)`` (each block's rows keep their order)."""
    flat = sizes.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(sizes).permute(perm).flatten()
    per_block = sizes.permute(perm).flatten()
    new_starts = torch.cumsum(per_block, 0) - per_block
    shift = torch.repeat_interleave(starts - new_starts, per_block, output_size=total)
    return torch.arange(total, device=sizes.device) + shift


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class NodeExchange:
    """The ``MoE.exchange`` of expert parallel over an ep group spanning ``inter_mesh.size()``
    nodes of ``intra_mesh.size()`` ranks each (module docstring); ``ep_mesh`` is the whole
    group (what the planner's memory run exchanges over: ``planner.expert_memory``)."""

    # Set under compiled blocks (``expert_parallel.keep_out_of_compiled_code``).
    rows_dynamic = False
    # What a compiled block runs eagerly: all of it (host reads and data-dependent indices).
    EAGER = ("dispatch", "combine")

    def __init__(
        self,
        ep_mesh,
        inter_mesh,
        intra_mesh,
        chunks: int = 1,
        order: ExchangeOrder = ExchangeOrder.breadth_first,
    ):
        from torch.distributed._functional_collectives import _resolve_group_name

        self.group, self.ep = ep_mesh.get_group(), ep_mesh.size()
        self.inter, self.nodes = inter_mesh.get_group(), inter_mesh.size()
        self.intra, self.per_node = intra_mesh.get_group(), intra_mesh.size()
        self.names = {"inter": _resolve_group_name(self.inter)}
        self.names["intra"] = _resolve_group_name(self.intra)
        # > 1: the MoE layer exchanges its tokens in this many chunks (``overlap``).
        self.chunks = chunks
        # The order the chunks run through the stages (``exchange_overlap.schedule``).
        self.order = order
        # While a list (``expert_parallel.recording_routing``): per forward dispatch (rows
        # sent and received over ep_inter, copies sent and received over it, rows the
        # experts received over ep_intra); what the comm model reads (``moe_comm``).
        self.routing: list[tuple[int, ...]] | None = None

    def dispatch(
        self, tokens: torch.Tensor, token: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor
    ):
        """Send each of ``tokens`` (T, dim) once to every node holding one of its copies'
        experts (``token``: (N,) the token of each copy, sorted by global expert; ``counts``:
        (n_experts,) int64 copies per expert), then on to the ranks of those experts, each
        copy with its router ``weight`` (N,). Returns (local tokens (M, dim) sorted by local
        expert, local counts (L,), their weights (M,), the state ``combine`` needs)."""
        (state,) = self._plan([tokens], [(token, counts, weight)])
        state = self._relay(self._send_pairs(state))
        mine, mine_weight, order = self._at_experts(state)
        if self.rows_dynamic:
            for rows in (mine, mine_weight):
                torch._dynamo.maybe_mark_dynamic(rows, 0)
        state["order"] = order
        return mine, state["landed"].sum((0, 1)), mine_weight, state

    def combine(self, outputs: torch.Tensor, state, sum_copies):
        """The local experts' weighted ``outputs`` (M, dim, dispatch's order) back to the
        relays, there summed per token (``sum_copies``: the layer's), one row per (node,
        token) back to the source, which sums its tokens' rows; returns (T, dim) in the
        tokens' dtype."""
        state = self._back_to_relay(state, outputs.index_select(0, _inverse(state["order"])))
        return self._sum_at_source(self._sum_on_relay(state, sum_copies), sum_copies)

    def overlap(self, tokens, routing, compute, weights, sum_copies) -> list[torch.Tensor]:
        """C chunks' exchange with ``compute`` (the experts) between its stages, each stage of
        a chunk in flight while another chunk computes (``exchange_overlap.pipelined``, in
        ``self.order``; the arguments as ``exchange_overlap.flat_overlap``'s): each chunk's
        (T_i, dim)."""

        def experts(state):
            mine, mine_weight, order = self._at_experts(state)
            out = compute(mine, state["landed"].sum((0, 1)), mine_weight)
            return self._back_to_relay(state, out.index_select(0, _inverse(order)))

        # ``exchange_overlap.BY_NODE``'s segments, which the planner times in the same order.
        on_relay = functools.partial(self._sum_on_relay, sum_copies=sum_copies)
        at_source = functools.partial(self._sum_at_source, sum_copies=sum_copies)
        segments = [self._send_pairs, self._relay, experts, on_relay, at_source]
        routing = [(token, counts, weight) for (token, counts), weight in zip(routing, weights)]
        return pipelined(self._plan(tokens, routing), segments, BY_NODE, self.order)

    def _plan(self, tokens: list, routing: list) -> list[dict]:
        """Every chunk's routing by node and both stages' counts, for all the chunks at once:
        over ``ep_inter`` per destination node its experts' copy counts and the distinct
        tokens, then over ``ep_intra`` per destination place the copies by (source node,
        local expert); two host reads. ``routing``: per chunk (token, counts, weight). Returns each chunk's state (the split sizes as host values)."""
        from torch.distributed._functional_collectives import all_to_all_single

        nodes, per_node, states = self.nodes, self.per_node, []
        for rows, (token, counts, weight) in zip(tokens, routing):
            node_experts, device = counts.numel() // nodes, counts.device
            expert = torch.repeat_interleave(
                torch.arange(counts.numel(), device=device), counts, output_size=token.numel()
            )
            node = expert // node_experts
            # Distinct (node, token) pairs, node-major: what crosses to each node, and per
            # copy its pair (the slot its token takes among the rows sent to its node).
            pairs, slot = torch.unique(node * rows.shape[0] + token, return_inverse=True)
            rows_out = torch.zeros(nodes, dtype=torch.int64, device=device)
            rows_out.scatter_add_(0, pairs // rows.shape[0], torch.ones_like(pairs))
            header = torch.cat([counts.view(nodes, node_experts), rows_out[:, None]], 1)
            states.append(
                dict(tokens=rows, token=token, weight=weight, node=node, pairs=pairs, slot=slot)
            )
            states[-1].update(rows_out=rows_out, header=header)
        chunks = len(states)
        headers = torch.stack([state["header"] for state in states])  # (C, nodes, E/nodes + 1)
        arrived = all_to_all_single(headers.transpose(0, 1).flatten(), None, None, self.inter)
        arrived = arrived.view(nodes, chunks, -1).transpose(0, 1)
        sent_host, arrived_host = torch.stack([headers, arrived]).tolist()
        onward = []
        for state, sent_c, arrived_c, got in zip(states, sent_host, arrived_host, arrived):
            state["splits"] = {  # host values
                "rows_out": [row[-1] for row in sent_c],
                "rows_in": [row[-1] for row in arrived_c],
                "copies_out": [sum(row[:-1]) for row in sent_c],
                "copies_in": [sum(row[:-1]) for row in arrived_c],
            }
            state["by_source"] = got[:, :-1].reshape(nodes, per_node, -1)
            onward.append(state["by_source"].permute(1, 0, 2))
        onward = torch.stack(onward)  # (C, place, source node, local expert)
        landed = onward.transpose(0, 1).flatten()
        if per_node > 1:
            landed = all_to_all_single(landed, None, None, self.intra)
        landed = landed.view(per_node, chunks, nodes, -1).transpose(0, 1)
        places = torch.stack([onward.sum((2, 3)), landed.sum((2, 3))], 1).tolist()  # one read
        for state, landed_c, (out, into) in zip(states, landed, places):
            state["landed"] = landed_c
            state["splits"].update(places_out=out, places_in=into)
        if self.routing is not None and torch._C._current_graph_task_id() == -1:
            self.routing.append(
                tuple(
                    sum(sum(s["splits"][key]) for s in states)
                    for key in ("rows_out", "rows_in", "copies_out", "copies_in", "places_in")
                )
            )
        return states

    def _send(self, rows: torch.Tensor, into: str, out: str, state: dict, stage: str):
        """Start the all-to-all of ``rows`` over ``stage`` ('inter' or 'intra') at the split
        sizes ``state["splits"][into]`` received and ``[out]`` sent: what ``_land`` takes (a
        one-rank stage, one rank a node, hands the rows through)."""
        received, sent = state["splits"][into], state["splits"][out]
        if stage == "intra" and self.per_node == 1:
            return rows, None, None, None, None
        return (*send(rows, received, sent, self.names[stage]), received, sent, self.names[stage])

    @staticmethod
    def _land(sent: tuple) -> torch.Tensor:
        """The rows of a ``_send`` once arrived (a node of the graph: ``exchange_overlap``)."""
        return sent[0] if sent[1] is None else arrive(*sent)

    def _send_pairs(self, state: dict) -> dict:
        """Stage 1 out: each distinct (node, token) pair's row, each copy's slot among its
        node's rows and its router weight, over ``ep_inter``."""
        rows_out, node, tokens = state["rows_out"], state["node"], state["tokens"]
        first = torch.cumsum(rows_out, 0) - rows_out
        picked = tokens.index_select(0, state["pairs"] % tokens.shape[0])
        state["rows"] = self._send(picked, "rows_in", "rows_out", state, "inter")
        state["slots"] = self._send(
            state["slot"] - first[node], "copies_in", "copies_out", state, "inter"
        )
        state["weights"] = self._send(state["weight"], "copies_in", "copies_out", state, "inter")
        return state

    def _relay(self, state: dict) -> dict:
        """Stage 2 out, on the relay: each arrived copy's row (by its slot, from (source node,
        node expert) order to (place, source node, local expert)) and its weight to the rank
        of its expert over ``ep_intra``."""
        rows = self._land(state["rows"])
        slot_in = wait(state["slots"][0])
        splits, device = state["splits"], slot_in.device
        rows_in = torch.tensor(splits["rows_in"], device=device)
        source = torch.repeat_interleave(
            torch.arange(self.nodes, device=device),
            torch.tensor(splits["copies_in"], device=device),
            output_size=slot_in.numel(),
        )
        # Each copy's row among those arrived: its source node's block first.
        slot_in = slot_in + (torch.cumsum(rows_in, 0) - rows_in)[source]
        relay_order = permute_blocks(state["by_source"], (1, 0, 2), slot_in.numel())
        state.update(slot_in=slot_in, relay_order=relay_order)
        state["forward"] = self._send(
            rows.index_select(0, slot_in[relay_order]), "places_in", "places_out", state, "intra"
        )
        weight_in = self._land(state["weights"]).index_select(0, relay_order)
        state["forward_weights"] = self._send(weight_in, "places_in", "places_out", state, "intra")
        return state

    def _at_experts(self, state: dict):
        """(The rows arrived at this rank's experts, local-expert-major; their weights; their
        order from (relay, source node, local expert))."""
        forwarded = self._land(state["forward"])
        weights = self._land(state["forward_weights"])
        order = permute_blocks(state["landed"], (2, 0, 1), forwarded.shape[0])
        return forwarded.index_select(0, order), weights.index_select(0, order), order

    def _back_to_relay(self, state: dict, outputs: torch.Tensor) -> dict:
        """The experts' ``outputs`` (in the order their rows arrived) back to the relays."""
        state["back"] = self._send(outputs, "places_out", "places_in", state, "intra")
        return state

    def _sum_on_relay(self, state: dict, sum_copies) -> dict:
        """On the relay: the copies' weighted outputs summed per (node, token) pair, the sums
        sent back to their sources over ``ep_inter``."""
        back = self._land(state["back"])
        copies = back.index_select(0, _inverse(state["relay_order"]))
        rows = sum(state["splits"]["rows_in"])
        partial = sum_copies(copies, state["slot_in"], rows, state["tokens"].dtype)
        state["partial"] = self._send(partial, "rows_out", "rows_in", state, "inter")
        return state

    def _sum_at_source(self, state: dict, sum_copies) -> torch.Tensor:
        """Each token's rows from every node summed in fp32, rounded once: (T, dim)."""
        rows, tokens = self._land(state["partial"]), state["tokens"]
        return sum_copies(rows, state["pairs"] % tokens.shape[0], tokens.shape[0], tokens.dtype)
