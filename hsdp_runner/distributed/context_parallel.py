"""Context parallel: each sequence split over the ``cp`` ranks, attention over all of it.

Order (head-tail, for load balance): a sequence of S tokens is cut into 2 x cp chunks and cp
rank i holds chunks i and 2cp-1-i, so under the causal mask every rank has the same attention
work (an early chunk attends to few keys, its partner at the end to many). Everything a rank
sees of a sequence follows this order: its input tokens and targets (``train/data.py``), its
positions (RoPE angles or learned position vectors, through ``positions``) and its queries.

Attention (``SequenceShard.attention``): the rank's keys and values are all-gathered over the
cp group, one collective per layer holding both, n_kv_heads wide (the approach of Llama 3's
long-context training; grouped-query heads are repeated after it only where plain attention
repeats them, ``common.grouped_kv``), and put in position order; each of the rank's two query
chunks then attends to the keys up to its own end, causally within the chunk (a lower-right
causal bias). The all-gather is torch's functional collective, whose autograd formula
reduce-scatters the keys' and values' gradients back to the ranks that produced them in
backward. The two chunks' outputs are joined in the layout the fused kernels write, and what
attention saves of them is the joined tensor the output projection saves too
(``_SharedOutput``): one copy of the rank's attention output through backward, not two.

Why not torch's ``context_parallel``: on CPU it has no sharding rule for the CPU attention
kernel, and flex attention (its all-gather mode) has no CPU backward; this one runs the same
code on CPU (the tests) and GPU. Ring attention is not offered.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hsdp_runner.models.common import grouped_kv


def head_tail_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions (int64, length seq_len / cp) cp rank ``rank`` holds, in its order:
    chunk ``rank`` then chunk ``2 cp - 1 - rank`` of ``2 cp`` equal chunks."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of ``tensor`` along its sequence dim ``dim`` (head-tail order)."""
    if cp == 1:
        return tensor
    index = head_tail_positions(tensor.shape[dim], cp, rank).to(tensor.device)
    return tensor.index_select(dim, index)


class SequenceShard:
    """What a model needs to run on one cp rank's part of each sequence (``models/base.py``
    hands it to the model): its token positions and causal attention over the whole sequence.

    Takes the 1-D ``cp`` DeviceMesh, the sequence length (``model.seq_len``: the data's) and
    ``share_output``: whether attention's saved outputs may be packed as views of the
    concatenated output (``_SharedOutput``; only where no activation checkpoint or compile
    packs the block's saved tensors: ``parallelize.apply_cp``).
    """

    def __init__(self, cp_mesh, seq_len: int, share_output: bool = False):
        self.mesh, self.cp, self.rank = cp_mesh, cp_mesh.size(), cp_mesh.get_local_rank()
        self.share_output = share_output
        self.local_len = seq_len // self.cp
        self._positions = head_tail_positions(seq_len, self.cp, self.rank)
        self._order = torch.cat(
            [head_tail_positions(seq_len, self.cp, r) for r in range(self.cp)]
        ).argsort()
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # Each of the rank's two chunks attends to the keys up to its end: (query chunk start,
        # key count, bias). The biases are made here: torch's CausalBias, a tensor subclass,
        # cannot be created while a TorchDispatchMode is active (the communication counter).
        chunk = self.local_len // 2
        self._chunks = [
            (part * chunk, (index + 1) * chunk, _causal_lower_right(chunk, (index + 1) * chunk))
            for part, index in enumerate((self.rank, 2 * self.cp - 1 - self.rank))
        ]

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's positions, the gathered tokens' order by position) on ``device``."""
        if device not in self._on:  # copied once per device, not every step
            self._on[device] = (self._positions.to(device), self._order.to(device))
        return self._on[device]

    def _check_length(self, local_len: int) -> None:
        if local_len != self.local_len:
            raise ValueError(
                f"context parallel was set up for {self.local_len} tokens per cp "
                f"rank (model.seq_len / parallel.cp), got {local_len}"
            )

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """This rank's positions in the full sequence of its ``local_len`` tokens, in the order
        they arrive (int64 on ``device``)."""
        self._check_length(local_len)
        return self._tables(device)[0]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the local queries over the whole sequence's keys.

        Takes (batch, heads, local seq, head_dim) queries and (batch, kv_heads, local seq,
        head_dim) keys and values (kv_heads divides heads); returns the queries' outputs.
        Each of the rank's two chunks attends to the keys up to its end, causally within its
        own chunk: a lower-right-aligned causal bias, which torch runs with its flash or
        memory-efficient kernel on CUDA (no mask is materialised there) and as a mask on CPU.
        """
        from torch.distributed._functional_collectives import all_gather_single

        bsz, kv_heads, seq, head_dim = k.shape
        self._check_length(seq)
        # One collective for both: (2, b, h, s, d) gathered on dim 0 -> (cp * 2, b, h, s, d).
        gathered = all_gather_single(torch.stack((k, v)).contiguous(), 0, self.mesh)
        gathered = gathered.view(self.cp, 2, bsz, kv_heads, seq, head_dim)
        order = self._tables(q.device)[1]
        k_all, v_all = (
            gathered[:, i]
            .permute(1, 2, 0, 3, 4)
            .reshape(bsz, kv_heads, self.cp * seq, head_dim)
            .index_select(2, order)
            for i in range(2)
        )
        # Grouped-query heads as plain attention takes them (``common.grouped_kv``): in bf16
        # the gathered keys and values are saved un-repeated. torch 2.13's lower-right causal
        # bias (``CausalBias._dispatch``) passes ``enable_gqa`` on: on CUDA it checks the flash
        # kernel with it and calls ``_scaled_dot_product_flash_attention`` on the un-repeated
        # keys (flash takes grouped heads); on CPU it runs SDPA with the bias as a mask.
        k_all, v_all, gqa = grouped_kv(q, k_all, v_all)
        chunk = seq // 2
        shared = _SharedOutput() if self.share_output and torch.is_grad_enabled() else None
        outs = []
        for start, end, bias in self._chunks:
            with shared.saving() if shared else contextlib.nullcontext():
                outs.append(
                    F.scaled_dot_product_attention(
                        q[:, :, start : start + chunk],
                        k_all[:, :, :end],
                        v_all[:, :, :end],
                        attn_mask=bias,
                        enable_gqa=gqa,
                    )
                )
        # Joined in (batch, seq, heads, dim) order, the layout the fused kernels write: the
        # caller's transpose and reshape for the output projection are then views of it.
        out = torch.cat([o.transpose(1, 2) for o in outs], dim=1)
        if shared:
            shared.point_at(outs, out)
        return out.transpose(1, 2)


class _SharedOutput:
    """The two query chunks' attention outputs, saved once (why torch alone does not).

    Each chunk's attention saves its output for backward, and the output projection saves
    the two joined (``torch.cat`` copies them): two copies of the rank's attention output
    through backward, 64 MiB a block for 16 query heads x 16,384 tokens in bf16. Within
    ``saving`` each saved tensor is packed in a box; ``point_at`` then swaps each chunk's
    saved output for the view of the joined output that holds the same values (same shape,
    dtype and strides but the batch's), so the chunks' own outputs are freed. Used only where
    nothing else packs these tensors (``SequenceShard``'s ``share_output``)."""

    def __init__(self):
        self.boxes: list[list] = []

    @contextlib.contextmanager
    def saving(self):
        def pack(tensor):
            box = [tensor]
            self.boxes.append(box)
            return box

        with torch.autograd.graph.saved_tensors_hooks(pack, _unbox):
            yield

    def point_at(self, outs: list[torch.Tensor], joined: torch.Tensor) -> None:
        """Swap every box holding one of ``outs`` (in ``joined``'s dim 1 order) for its
        view of ``joined``, (batch, seq, heads, dim)."""
        start, views = 0, []
        for o in outs:
            views.append(joined[:, start : start + o.shape[2]].transpose(1, 2))
            start += o.shape[2]
        for box in self.boxes:
            for o, view in zip(outs, views):
                if box[0] is o:
                    box[0] = view
        self.boxes = []


def _unbox(box: list) -> torch.Tensor:
    return box[0]


def _causal_lower_right(q_len: int, kv_len: int):
    """torch's lower-right-aligned causal bias for ``q_len`` queries over ``kv_len`` keys.

    torch 2.13's CausalBias hands its arguments to Tensor.__new__, which allocates a
    (2, q_len, kv_len) float32 tensor the bias never reads (8 GiB for 8k queries over 128k
    keys, held as long as the bias): build it at 1 x 1, then set the two lengths, the only
    state it reads.
    """
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(1, 1)
    bias.seq_len_q, bias.seq_len_kv = q_len, kv_len
    return bias
