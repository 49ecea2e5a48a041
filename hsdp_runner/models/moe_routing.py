"""The mixture-of-experts layer of ``moe.py``: router, experts, token exchange and the
load-balance statistics, read top to bottom in the order a token meets them.

- ``Router``: scores every expert (fp32 softmax or sigmoid of a linear gate), picks each
  token's top-k experts by score + ``expert_bias`` (DeepSeek-V3's loss-free balancing bias: it
  changes the choice, never the weights) and weighs them by their scores (renormalised to sum
  1 if asked, times ``route_scale``). Dropless: every token reaches all k of its experts.
- ``TokenExchange`` / ``LocalExchange``: the seam expert parallel enters through (as
  ``attend`` is context parallel's): the layer hands its tokens, their copies' order (sorted
  by expert) and each copy's router weight to ``exchange.dispatch``, which brings the copies
  and their weights to the experts, and takes each token's sum of its experts' weighted
  outputs back from ``exchange.combine``, to which it hands how to sum (``sum_copies``):
  where the sum is taken is the exchange's choice, so one that sends a token to a node once
  can sum its copies there. The default keeps every expert on this process; the runtime
  installs one that all-to-alls.
- ``GroupedExperts``: the SwiGLU experts' weights stacked (experts, out, in), run on tokens
  sorted by expert either in three grouped matmuls (``torch._grouped_mm``, the op torch's
  public ``F.grouped_mm`` calls and the one torchao's float8 weight wrapper intercepts by
  name) or, as the reference, in a loop over experts (``model.grouped_mm``). Under float8
  (``distributed/float8.py`` sets ``group_rows`` = 16) each expert's rows are first padded
  with zero rows to a multiple of 16 (``aligned_groups``), which float8's grouped matmul
  needs.
- ``WeightedSwiGLU`` (``expert_activation``): the experts' activation times each row's router
  weight, saving its two inputs and the weights only (``silu`` recomputed in backward); under
  ``parallel.ac=moe_act``, ``WeightedSwiGLUDown``, which keeps not even its output, the down
  projection's input. The weight is applied before the down projection, as Megatron's
  grouped experts apply their permuted probabilities in the activation:
  ``w2(p h) = p w2(h)``, so the output is the same sum, and the combine then needs nothing
  of the experts' outputs for backward. Weighing after the experts instead (HF's and
  torchtitan's order) makes the weight's gradient read every routed output, so the layer
  keeps one more (rows, dim) tensor per routed copy: about a third of what an MoE layer
  saves.
- ``sum_copies`` (``SumCopies``): each token's copies summed in fp32 and rounded once,
  saving only the index.
- ``MoE``: the layer (router, exchange, experts, shared experts), plus the hooks the runtime
  reads and sets: ``Router.tokens_per_expert`` (counts of the step's forwards),
  ``MoE.aux_loss_sum`` (the sequence-wise auxiliary loss' value), ``MoE.sequence_sum`` (sums
  per-sequence counts over the ranks a sequence is split over) and ``MoE.aux_grad_scale``.
  Neither statistic is counted again when activation checkpointing recomputes the forward.
- ``AuxLossScaler``: how the auxiliary loss' gradient enters without changing any loss value
  (Megatron's ``MoEAuxLossAutoScaler``): identity on the layer's output in forward, and in
  backward a gradient of ``aux_grad_scale`` into the auxiliary loss, whose graph carries it to
  the router's scores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hsdp_runner.models.common import FeedForward
from hsdp_runner.models.expert_activation import WeightedSwiGLU, WeightedSwiGLUDown


def recomputing() -> bool:
    """True inside a backward pass: activation checkpointing is recomputing a forward, whose
    statistics the first forward already counted."""
    return torch._C._current_graph_task_id() != -1


def expert_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(n_experts,) int64 copies routed to each expert by ``chosen`` (any shape of expert
    ids). A scatter into a fixed-size tensor rather than ``bincount``, whose output shape
    depends on the values (the planner runs the model on fake tensors)."""
    flat = chosen.flatten()
    counts = torch.zeros(n_experts, dtype=torch.int64, device=chosen.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class Router(nn.Module):
    """Top-k routing of ``dim``-wide tokens over ``n_experts`` experts (module docstring)."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        score_func: str,
        norm_topk_prob: bool,
        route_scale: float,
    ):
        super().__init__()
        self.top_k, self.score_func = top_k, score_func
        self.norm_topk_prob, self.route_scale = norm_topk_prob, route_scale
        self.gate = nn.Linear(dim, n_experts, bias=False)
        # Updated by the runtime between steps (model.bias_update_speed); saved in checkpoints.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        # Copies routed to each expert over the step's training forwards; the runtime reads,
        # all-reduces and zeroes it.
        self.register_buffer(
            "tokens_per_expert", torch.zeros(n_experts, dtype=torch.float32), persistent=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens ``x`` (N, dim). Returns (weights (N, k) fp32, chosen experts (N, k)
        int64, scores (N, n_experts) fp32 normalised to sum 1 per token: the auxiliary loss'
        probabilities)."""
        logits = self.gate(x).float()
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.route_scale
        if self.training and not recomputing():
            with torch.no_grad():
                self.tokens_per_expert += expert_counts(chosen, self.tokens_per_expert.numel())
        if self.score_func != "softmax":
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return weights, chosen, scores


class TokenExchange(Protocol):
    """Moves routed token copies and their router weights to the ranks holding their experts
    and the weighted outputs back."""

    def dispatch(
        self, tokens: torch.Tensor, token: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """tokens: (T, dim) this rank's tokens; token: (N,) int64 the token of each routed
        copy, the copies sorted by global expert id (stable); counts: (n_experts,) int64
        copies per global expert; weight: (N,) fp32 the router's weight of each copy, in the
        copies' order. Returns (local_tokens (M, dim) sorted by LOCAL expert, local_counts
        (n_local_experts,) int64, local_weight (M,) their weights, state) where the rank
        holds experts [r*E/ep, (r+1)*E/ep) of ep rank r."""

    def combine(self, outputs: torch.Tensor, state: Any, sum_copies: Callable) -> torch.Tensor:
        """outputs: (M, dim) the local experts' weighted outputs in dispatch's order;
        sum_copies: the layer's ``sum_copies`` (rows, token index, tokens, dtype). Returns (T,
        dim) in the tokens' dtype: each token's copies summed with it."""


class LocalExchange:
    """Every expert on this process: dispatch gathers the copies, combine sums them.
    ``chunks`` > 1 (the planner's trace of a chunked exchange's kernels,
    ``planner/traffic.py``; no job runs it: without expert parallel nothing travels) runs the
    layer's chunks one after another through ``overlap``."""

    def __init__(self, chunks: int = 1):
        self.chunks = chunks

    def overlap(self, tokens, routing, compute, weights, sum_copies):
        """Each chunk's copies through ``compute`` and summed (the arguments as the
        exchanges' ``overlap``, ``distributed/exchange_overlap.py``): each chunk's (T_i,
        dim)."""
        return [
            sum_copies(compute(rows[token], counts, weight), token, rows.shape[0], rows.dtype)
            for rows, (token, counts), weight in zip(tokens, routing, weights)
        ]

    def dispatch(self, tokens, token, counts, weight):
        """Returns (the copies ``tokens[token]``, counts, their weights, what combine sums
        by)."""
        return tokens[token], counts, weight, (token, tokens.shape[0], tokens.dtype)

    def combine(self, outputs, state, sum_copies):
        """Each token's copies of ``outputs`` summed."""
        return sum_copies(outputs, *state)


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked expert weight (``.to_local()`` of a DTensor sharded
    over ``ep`` on dim 0; the tensor itself otherwise)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts of hidden width ``hidden_dim``, weights stacked per expert
    in Linear layout (out, in): w1, w3 (E, hidden, dim), w2 (E, dim, hidden). Each row's
    output is weighed by its router weight (``WeightedSwiGLU``)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, grouped_mm: bool):
        super().__init__()
        self.grouped_mm = grouped_mm
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    # Rows of each expert's group a multiple of this (1: as routed). ``float8.convert`` sets
    # 16 on experts it converts: torch._scaled_grouped_mm reads each group's rows at a
    # 16-byte aligned start in float8 (the weight gradient's reduction runs over them).
    group_rows = 1
    # True (``parallel.ac=moe_act``, set by the runtime): the activation's output, the down
    # projection's input, is recomputed in backward instead of kept (``WeightedSwiGLUDown``).
    recompute_act = False

    def forward(self, x, counts, weight, overlap: Callable | None = None):
        """``compute(x, counts, weight)``; with ``overlap`` (the exchange's, chunks of tokens:
        ``exchange_overlap``), ``x`` is the chunks' tokens, ``counts`` their routing and
        ``weight`` their copies' weights, and ``overlap(x, counts, compute, weight)``
        exchanges them and runs the experts on what arrives, one call of this module (one
        FSDP unshard) for all the chunks. The weights reach this module in fp32: its FSDP
        unit does not cast its inputs (``expert_parallel.apply_expert_parallel``)."""
        if overlap is not None:
            return overlap(x, counts, self.compute, weight)
        return self.compute(x, counts, weight)

    def compute(self, x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Run tokens ``x`` (M, dim), sorted by local expert with ``counts`` (n_local,) int64
        per expert, through the experts this rank holds (as many as the local w1's dim 0),
        each row's output times its ``weight`` (M,). Returns (M, dim). The gradient reaching
        the output must be contiguous (torch 2.13's grouped matmul backward fails on an
        expanded one); the MoE layer's is. torch 2.13's kernels take fp32 and bf16, but its
        meta function (fake tensors: torch.compile, the planner's memory run) takes bf16
        only: those run the grouped path in bf16 alone."""
        w1, w2, w3 = (local_weight(w) for w in (self.w1, self.w2, self.w3))
        if not self.grouped_mm:
            return self._loop(x, counts, weight, w1, w2, w3)
        rows = None
        if self.group_rows > 1:
            x, counts, rows = aligned_groups(x, counts, self.group_rows)
            # Padded rows weigh zero (their outputs are zero anyway).
            weight = weight.new_zeros(x.shape[0]).index_copy(0, rows, weight)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        if self.recompute_act:
            out = WeightedSwiGLUDown.apply(gate, up, weight, w2, offs)
        else:
            hidden = WeightedSwiGLU.apply(gate, up, weight)
            out = torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offs)
        return out if rows is None else out[rows]

    def _loop(self, x, counts, weight, w1, w2, w3) -> torch.Tensor:
        """The reference: one SwiGLU per local expert on its rows (``counts`` read on the
        host; compiled blocks keep it out of their graphs: ``expert_parallel``)."""
        outputs = []
        sizes = counts.tolist()
        for expert, (part, part_weight) in enumerate(
            zip(torch.split(x, sizes), torch.split(weight, sizes))
        ):
            gate, up = part @ w1[expert].T, part @ w3[expert].T
            if self.recompute_act:
                outputs.append(WeightedSwiGLUDown.apply(gate, up, part_weight, w2[expert], None))
            else:
                outputs.append(WeightedSwiGLU.apply(gate, up, part_weight) @ w2[expert].T)
        return torch.cat(outputs)


def aligned_groups(
    x: torch.Tensor, counts: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (M, dim), rows sorted by expert (``counts`` (E,) per expert), copied into zero
    rows so that every expert's group starts at a multiple of ``align`` and holds a multiple
    of it. Returns (padded (P, dim), padded counts (E,), rows (M,) int64: where each row of
    ``x`` went, so ``out[rows]`` gives the rows back in ``x``'s order).

    P = round_up(M + (align - 1) E, align), a size known without reading ``counts`` on the
    host (no sync; compiled code sees one shape per M); the last expert's group takes the
    spare zero rows, so every row lies in some group and none is left uninitialised. Zero
    rows change nothing: their outputs are zero, their gradient is zero, and they add zero
    to the weights' gradients (and to no float8 scale: a scale is a row's or a group's amax)."""
    n, experts = x.shape[0], counts.shape[0]
    padded = (counts + align - 1) // align * align
    size = (n + (align - 1) * experts + align - 1) // align * align
    padded = torch.cat([padded[:-1], (size - padded[:-1].sum()).reshape(1)])
    start = torch.cumsum(padded, 0) - padded  # each group's first padded row
    first = torch.cumsum(counts, 0) - counts  # each group's first row in x
    group = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=n)
    rows = start[group] + torch.arange(n, device=x.device) - first[group]
    out = x.new_zeros((size, x.shape[1])).index_copy(0, rows, x)
    return out, padded, rows


class SumCopies(torch.autograd.Function):
    """``apply(rows (M, dim), token (M,) int64, n_tokens, dtype)`` -> (n_tokens, dim): each
    token's copies among ``rows`` summed, ``out[t] = sum of rows[i]`` over ``token[i] == t``,
    in fp32 (float64 rows in float64), rounded once to ``dtype``. Saves ``token`` only; its
    backward gathers the output's gradient for each copy. Our own function, not
    ``zeros.index_add(0, token, rows.float())``: autograd of ``index_add`` keeps its source
    for the gradient's shape, an fp32 copy of every routed row."""

    @staticmethod
    def forward(ctx, rows, token, n_tokens: int, dtype: torch.dtype):
        ctx.save_for_backward(token)
        ctx.rows_dtype = rows.dtype
        acc = torch.promote_types(rows.dtype, torch.float32)
        out = torch.zeros((n_tokens, rows.shape[1]), dtype=acc, device=rows.device)
        return out.index_add_(0, token, rows.to(acc)).to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (token,) = ctx.saved_tensors
        return grad_out.index_select(0, token).to(ctx.rows_dtype), None, None, None


def sum_copies(
    rows: torch.Tensor, token: torch.Tensor, n_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """Each token's copies among ``rows`` (M, dim) summed (``SumCopies``): (n_tokens, dim)
    in ``dtype``, ``token`` (M,) the token of each row."""
    return SumCopies.apply(rows, token, n_tokens, dtype)


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``output``; backward also sends ``scale`` as the gradient of ``aux_loss``
    (a 0-dim function of the router's scores), so the auxiliary loss trains the router
    without being added to any loss value."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def sum_over_nothing(counts: torch.Tensor) -> torch.Tensor:
    """``MoE.sequence_sum`` of one process (each sequence whole on it): ``counts`` itself."""
    return counts


class MoE(nn.Module):
    """Routed experts plus optional shared experts on the tokens of (batch, seq, dim) input
    (the arguments: ``moe.MoEConfig``'s keys of the same names).

    Plain attributes the runtime sets: ``exchange`` (``TokenExchange``, default
    ``LocalExchange()``), ``sequence_sum`` (sums (batch, n_experts) per-sequence counts over
    the ranks holding parts of each sequence; default: identity) and ``aux_grad_scale`` (the
    auxiliary loss gradient's factor; default 1.0). ``aux_loss_sum`` (0-dim fp32 buffer)
    accumulates the auxiliary loss' value times that scale over the step's training forwards.
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        expert_ffn_dim: int,
        n_shared_experts: int,
        *,
        score_func: str,
        norm_topk_prob: bool,
        route_scale: float,
        grouped_mm: bool,
        aux_loss_coef: float,
        seq_len: int,
    ):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.aux_loss_coef, self.seq_len = aux_loss_coef, seq_len
        self.router = Router(dim, n_experts, top_k, score_func, norm_topk_prob, route_scale)
        self.experts = GroupedExperts(dim, expert_ffn_dim, n_experts, grouped_mm)
        shared_width = n_shared_experts * expert_ffn_dim
        self.shared_experts = FeedForward(dim, shared_width) if shared_width else None
        self.exchange: TokenExchange = LocalExchange()
        self.sequence_sum: Callable[[torch.Tensor], torch.Tensor] = sum_over_nothing
        self.aux_grad_scale = 1.0
        self.register_buffer("aux_loss_sum", torch.zeros((), dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, chosen, scores = self.router(tokens)
        chunks = min(getattr(self.exchange, "chunks", 1), tokens.shape[0])
        if chunks > 1:
            out = self._routed_in_chunks(tokens, weights, chosen, chunks)
        else:
            out = self._routed(tokens, weights, chosen)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(bsz, seq, dim)
        if self.training and self.aux_loss_coef > 0:
            aux = self.aux_loss(chosen.view(bsz, -1), scores.view(bsz, seq, -1))
            if not recomputing():
                self.aux_loss_sum += aux.detach() * self.aux_grad_scale
            out = AuxLossScaler.apply(out, aux, self.aux_grad_scale)
        return out

    def _routed(self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor):
        """Each of ``tokens`` (T, dim) through its ``chosen`` (T, k) experts, weighed by
        ``weights`` (T, k) and summed: (T, dim) in the tokens' dtype."""
        # Each token's k copies, sorted (stably) by expert: the order the experts read.
        order = chosen.flatten().argsort(stable=True)
        counts = expert_counts(chosen, self.n_experts)
        # One index tensor for the gather and the combine: autograd keeps it once for both.
        token = order // self.top_k
        local, local_counts, local_weights, state = self.exchange.dispatch(
            tokens, token, counts, weights.flatten()[order]
        )
        # Weighed in the experts, summed per token in fp32, returned in x's dtype.
        return self.exchange.combine(
            self.experts(local, local_counts, local_weights), state, sum_copies
        )

    def _routed_in_chunks(self, tokens, weights, chosen, chunks: int) -> torch.Tensor:
        """``_routed`` with the tokens cut into ``chunks`` contiguous chunks, each routed on
        its own and exchanged while the experts compute another (``exchange.overlap``)."""
        parts, routing, copy_weights = [], [], []
        for t, w, c in zip(*(x.tensor_split(chunks) for x in (tokens, weights, chosen))):
            order = c.flatten().argsort(stable=True)
            parts.append(t)
            routing.append((order // self.top_k, expert_counts(c, self.n_experts)))
            copy_weights.append(w.flatten()[order])
        overlap = functools.partial(self.exchange.overlap, sum_copies=sum_copies)
        return torch.cat(self.experts(parts, routing, copy_weights, overlap=overlap))

    def aux_loss(self, chosen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss of this rank's tokens: ``chosen`` (batch,
        local seq * k) experts, ``scores`` (batch, local seq, E) normalised per token.
        coef * mean over sequences of sum_i f_i P_i with f_i = E / (k T) * copies to expert i
        in the whole sequence (``sequence_sum``), P_i = (1/T) * this rank's scores of expert i
        (partial: the ranks' pieces add up), T = the model's seq_len."""
        with torch.no_grad():
            shape, fp32 = (chosen.shape[0], self.n_experts), torch.float32
            counts = torch.zeros(shape, dtype=fp32, device=chosen.device)
            counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=counts.dtype))
            f = self.sequence_sum(counts) * (self.n_experts / (self.top_k * self.seq_len))
        p = scores.sum(dim=1) / self.seq_len
        return self.aux_loss_coef * (f * p).sum(dim=-1).mean()
