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
  routed copy, the index of its token among those sent to that node (int64) and, in
  combine, its router weight (fp32, differentiable: the weighted sum happens on the relay,
  with the layer's own ``WeightedCombine``, which ``combine`` is handed);
  first the counts: per destination node its experts' copy counts and the distinct tokens;
- **stage 2, ``ep_intra``** (the ep ranks of this node): the relay forwards one row per
  copy to the rank holding its expert, ordered (destination place, source node, local
  expert); first the counts, (source node, local expert) for each destination place. The
  expert rank reorders what arrived to local-expert-major for the grouped matmul;
- **combine**: the experts' outputs back to the relay over ``ep_intra``, weighed and summed
  per token there (``WeightedCombine``: fp32 products and sums, rounded once to the compute
  dtype), one row per (node, token) back over ``ep_inter``, and the source sums its tokens'
  rows from every node in fp32, rounded once.

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

import torch


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


def _all_to_all(rows: torch.Tensor, received: list[int], sent: list[int], group, size: int):
    """torch's functional all-to-all of ``rows`` at uneven splits; a one-rank group (one rank
    per node: no second stage) hands them through."""
    if size == 1:
        return rows
    from torch.distributed._functional_collectives import all_to_all_single

    return all_to_all_single(rows, received, sent, group)


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

    def __init__(self, ep_mesh, inter_mesh, intra_mesh):
        self.group, self.ep = ep_mesh.get_group(), ep_mesh.size()
        self.inter, self.nodes = inter_mesh.get_group(), inter_mesh.size()
        self.intra, self.per_node = intra_mesh.get_group(), intra_mesh.size()
        # While a list (``expert_parallel.recording_routing``): per forward dispatch (rows
        # sent and received over ep_inter, copies sent and received over it, rows the
        # experts received over ep_intra); what the comm model reads (``moe_comm``).
        self.routing: list[tuple[int, ...]] | None = None

    def dispatch(self, tokens: torch.Tensor, token: torch.Tensor, counts: torch.Tensor):
        """Send each of ``tokens`` (T, dim) once to every node holding one of its copies'
        experts (``token``: (N,) the token of each copy, sorted by global expert; ``counts``:
        (n_experts,) int64 copies per expert), then on to the ranks of those experts.
        Returns (local tokens (M, dim) sorted by local expert, local counts (L,), the state
        ``combine`` needs)."""
        rows, slot_in, by_source, splits, pairs = self._to_nodes(tokens, token, counts)
        mine, landed, relay_order, order, places = self._to_experts(rows, slot_in, by_source)
        if self.rows_dynamic:
            torch._dynamo.maybe_mark_dynamic(mine, 0)
        if self.routing is not None and torch._C._current_graph_task_id() == -1:
            sent, received = sum(splits["rows_out"]), sum(splits["rows_in"])
            self.routing.append((sent, received, token.numel(), slot_in.numel(), mine.shape[0]))
        shape = (tokens.shape, tokens.dtype)
        state = (splits, places, order, relay_order, slot_in, pairs, shape)
        return mine, landed.sum((0, 1)), state

    def _to_nodes(self, tokens: torch.Tensor, token: torch.Tensor, counts: torch.Tensor):
        """Stage 1 over ``ep_inter``: the counts, then each distinct (node, token) pair's row
        and each copy's slot among its node's rows. Returns (the rows arrived, source node by
        source node; each arrived copy's row among them, in (source node, node expert) order;
        the arrived copies per (source node, place, local expert); the split sizes; the
        pairs sent, node-major)."""
        from torch.distributed._functional_collectives import all_to_all_single

        nodes, n_tokens, device = self.nodes, tokens.shape[0], counts.device
        node_experts = counts.numel() // nodes
        expert = torch.repeat_interleave(
            torch.arange(counts.numel(), device=device), counts, output_size=token.numel()
        )
        node = expert // node_experts
        # Distinct (node, token) pairs, node-major: what crosses to each node, and per copy
        # its pair (the slot its token takes among the rows sent to its node).
        pairs, slot = torch.unique(node * n_tokens + token, return_inverse=True)
        rows_out = torch.zeros(nodes, dtype=torch.int64, device=device)
        rows_out.scatter_add_(0, pairs // n_tokens, torch.ones_like(pairs))
        header = torch.cat([counts.view(nodes, node_experts), rows_out[:, None]], 1)
        arrived = all_to_all_single(header.flatten(), None, None, self.inter).view(nodes, -1)
        sent_host, arrived_host = torch.stack([header, arrived]).tolist()
        splits = {  # host values
            "rows_out": [row[-1] for row in sent_host],
            "rows_in": [row[-1] for row in arrived_host],
            "copies_out": [sum(row[:-1]) for row in sent_host],
            "copies_in": [sum(row[:-1]) for row in arrived_host],
        }
        first = torch.cumsum(rows_out, 0) - rows_out
        picked = tokens.index_select(0, pairs % n_tokens)
        rows = _all_to_all(picked, splits["rows_in"], splits["rows_out"], self.inter, nodes)
        slot_in = _all_to_all(
            slot - first[node], splits["copies_in"], splits["copies_out"], self.inter, nodes
        )
        # Each copy's row among those arrived: its source node's block first.
        rows_in = torch.tensor(splits["rows_in"], device=device)
        source = torch.repeat_interleave(
            torch.arange(nodes, device=device),
            torch.tensor(splits["copies_in"], device=device),
            output_size=slot_in.numel(),
        )
        slot_in = slot_in + (torch.cumsum(rows_in, 0) - rows_in)[source]
        by_source = arrived[:, :-1].reshape(nodes, self.per_node, -1)
        return rows, slot_in, by_source, splits, pairs

    def _to_experts(self, rows: torch.Tensor, slot_in: torch.Tensor, by_source: torch.Tensor):
        """Stage 2 over ``ep_intra``: the relay's copies, from (source node, node expert) order
        to (place, source node, local expert), one row each, to the ranks of their experts,
        counts first; there reordered to local-expert-major. Returns (the rows, the counts
        arrived per (relay, source node, local expert), the relay's order and the expert
        rank's, the split sizes (sent to each place, received from each relay))."""
        per_node = self.per_node
        relay_order = permute_blocks(by_source, (1, 0, 2), slot_in.numel())
        onward = by_source.permute(1, 0, 2).contiguous()
        landed = _all_to_all(onward.flatten(), None, None, self.intra, per_node)
        landed = landed.view(per_node, self.nodes, -1)
        places = torch.stack([onward.sum((1, 2)), landed.sum((1, 2))]).tolist()  # one read
        forwarded = _all_to_all(
            rows.index_select(0, slot_in[relay_order]), places[1], places[0], self.intra, per_node
        )
        order = permute_blocks(landed, (2, 0, 1), forwarded.shape[0])
        return forwarded.index_select(0, order), landed, relay_order, order, places

    def combine(self, outputs: torch.Tensor, weight: torch.Tensor, state, weighted_sum):
        """The local experts' ``outputs`` (M, dim, dispatch's order) back to the relays, there
        weighed by their copies' ``weight`` (N,) and summed per token (``weighted_sum``: the
        layer's ``WeightedCombine.apply``), one row per (node, token) back to the source,
        which sums its tokens' rows; returns (T, dim) in the tokens' dtype."""
        splits, (places_out, places_in), order, relay_order, slot_in, pairs, shape = state
        (n_tokens, dim), dtype = shape
        back = _all_to_all(
            outputs.index_select(0, _inverse(order)),
            places_out,
            places_in,
            self.intra,
            self.per_node,
        )
        copies = back.index_select(0, _inverse(relay_order))
        weight_in = _all_to_all(
            weight, splits["copies_in"], splits["copies_out"], self.inter, self.nodes
        )
        partial = weighted_sum(copies, weight_in, slot_in, sum(splits["rows_in"]), dtype)
        rows = _all_to_all(partial, splits["rows_out"], splits["rows_in"], self.inter, self.nodes)
        total = torch.zeros((n_tokens, dim), dtype=torch.float32, device=rows.device)
        return total.index_add(0, pairs % n_tokens, rows.float()).to(dtype)
