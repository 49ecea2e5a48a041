"""Routing the planner's memory run can know in advance, for a model with experts.

The memory child (``planner.memory``) runs one training step of the job's own model on fake
tensors, whose values do not exist: which experts the router picks is data, so the rows each
expert and each ep rank gets cannot come from the step itself (the job reads them as host
values: ``expert_parallel.TokenExchange`` splits its all-to-alls by them, the per-expert loop
splits its input by them). ``plan_routing`` gives every MoE layer an exchange whose counts are
planned, as real host tensors, while the token rows still move through the job's own code:

- every expert gets an equal share of a rank's N = tokens x ``top_k`` routed copies (what the
  router's balancing aims at);
- under expert parallel the rank receives ``plan.expert_imbalance`` x N rows (the busiest ep
  rank, whose memory is the step's peak), an equal part from each ep rank and for each of its
  local experts, through the job's all-to-alls (the fake process group moves shapes only);
- without it every expert is local: the rank runs its own N rows whatever the imbalance.

``lenient_grouped_mm_meta``: torch 2.13's meta function of ``_grouped_mm`` (what fake tensors
run) enforces CUDA's bf16-only rule, while the CPU kernel a job runs here also takes fp32; the
child accepts fp32 so that an fp32 layout is measured with the kernel it runs.
"""

from __future__ import annotations

import torch
from torch import nn

from hsdp_runner.distributed.expert_parallel import TokenExchange, moe_modules
from hsdp_runner.distributed.node_exchange import NodeExchange


def even_split(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` parts as evenly as integers allow (the first parts one
    more)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _host(values: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """A real int64 tensor of ``values`` (outside any fake mode: its values are read; inside
    one, an op on it would give a fake tensor without values)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.tensor(values, dtype=torch.int64).view(shape)


class PlannedLocalExchange:
    """Every expert on this rank (no expert parallel): the copies gathered and summed as the
    job's ``LocalExchange`` does, ``n_experts`` equal counts."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts

    def dispatch(self, tokens, token, counts, weight):
        """Returns (the copies ``tokens[token]``, planned counts (n_experts,), their weights,
        what combine sums by)."""
        planned = _host(even_split(token.shape[0], self.n_experts), (-1,))
        return tokens[token], planned, weight, (token, tokens.shape[0], tokens.dtype)

    def combine(self, outputs, state, sum_copies) -> torch.Tensor:
        """Each token's copies of ``outputs`` summed (``sum_copies``: the layer's)."""
        return sum_copies(outputs, *state)


class PlannedTokenExchange(TokenExchange):
    """The job's token exchange over ``ep`` ranks with planned counts (module docstring):
    sends its N rows evenly over the experts, receives ``imbalance`` x N rows evenly over the
    sources and its local experts."""

    def __init__(self, exchange: TokenExchange, imbalance: float):
        # The built model's exchange gives its group (TokenExchange's own init takes a mesh).
        self.group, self.ep, self.routing = exchange.group, exchange.ep, None
        self.chunks = getattr(exchange, "chunks", 1)
        self.imbalance = imbalance
        self._planned: list[list[int]] = []  # [sent, received] (ep x L, row-major)

    def send(self, tokens: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor):
        """The job's all-to-alls of the copies ``tokens`` (N, dim) and their ``weight``, with
        the planned counts; the local experts' counts returned as host values (the
        per-expert loop reads them)."""
        experts = counts.numel()
        received = round(tokens.shape[0] * self.imbalance)
        self._planned = [even_split(tokens.shape[0], experts), even_split(received, experts)]
        local, _, local_weight, state = super().send(tokens, counts, weight)
        per_expert = [
            sum(self._planned[1][r * (experts // self.ep) + e] for r in range(self.ep))
            for e in range(experts // self.ep)
        ]
        return local, _host(per_expert, (-1,)), local_weight, state

    def chunk_counts(self, copies: list[torch.Tensor], counts: list[torch.Tensor]):
        """The chunked exchange's (sent, received) (``exchange_overlap``): per chunk of
        ``copies`` (N_i rows), its N_i rows sent and ``imbalance`` x N_i received, evenly
        over the experts, as real (ep, L) tensors (``counts``, fake, are not read)."""
        experts = counts[0].numel()
        shape = (self.ep, experts // self.ep)
        sent, received = [], []
        for rows in copies:
            n = rows.shape[0]
            sent.append(_host(even_split(n, experts), shape))
            received.append(_host(even_split(round(n * self.imbalance), experts), shape))
        return sent, received

    def chunk_split_sizes(self, sent: list[torch.Tensor], received: list[torch.Tensor]):
        """``TokenExchange.chunk_split_sizes`` of the planned (real) counts, read outside the
        fake mode (inside it an op on them gives a fake tensor without values)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return super().chunk_split_sizes(sent, received)

    def local_counts(self, received: torch.Tensor) -> torch.Tensor:
        """A chunk's planned local counts as a real tensor (the per-expert loop reads them)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return received.sum(0)

    def exchange_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sent, received) (ep, L): the planned counts (``counts``, fake, is not read)."""
        shape = (self.ep, counts.numel() // self.ep)
        return _host(self._planned[0], shape), _host(self._planned[1], shape)

    def split_sizes(self, sent: torch.Tensor, received: torch.Tensor) -> list[list[int]]:
        """Rows sent to and received from each ep rank, summed from the planned counts."""
        local = len(self._planned[0]) // self.ep
        return [
            [sum(counts[r * local : (r + 1) * local]) for r in range(self.ep)]
            for counts in self._planned
        ]


def plan_routing(model: nn.Module, imbalance: float) -> None:
    """Give every MoE layer of ``model`` (built by the job's build: a ``TokenExchange`` under
    expert parallel) its planned exchange (module docstring). An ep group spanning nodes
    (``NodeExchange``) is measured with the flat exchange over it: its buffers (a node's
    distinct tokens on the relay besides the copies) are not measured."""
    for moe in moe_modules(model).values():
        if isinstance(moe.exchange, (TokenExchange, NodeExchange)):
            moe.exchange = PlannedTokenExchange(moe.exchange, imbalance)
        else:
            moe.exchange = PlannedLocalExchange(moe.n_experts)


def lenient_grouped_mm_meta() -> None:
    """Let fake tensors run ``_grouped_mm`` on fp32 operands as the CPU kernel does (module
    docstring; torch 2.13's private ``_meta_registrations`` names)."""
    import torch._meta_registrations as meta

    strict = meta._meta_grouped_mm_common
    if getattr(strict, "lenient", False):
        return

    def common(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, *args, **kwargs):
        out_dtype = kwargs.get("out_dtype", args[1] if len(args) > 1 else None)
        if scale_a is None and mat_a.dtype == mat_b.dtype == torch.float32:
            return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return strict(mat_a, mat_b, scale_a, scale_b, offs, bias, *args, **kwargs)

    common.lenient = True
    meta._meta_grouped_mm_common = common
