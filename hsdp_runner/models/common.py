"""What model families share: the seeded initial values, the parameter name without wrapper
prefixes, the Llama-style building blocks (RMSNorm, rotary embeddings, the SwiGLU feed-forward),
causal attention (grouped-query keys and values kept un-repeated in fp16/bf16), the TP style
that keeps a module whole on the TP mesh, and the decoder skeleton of the Llama-style families
(``RotaryDecoder``).

A family module (``llama.py``, ``moe.py``, ``gpt2.py``) imports these instead of another family's module,
so each family reads on its own. Helpers the runner uses outside the models (dtype names,
freezing, copying a full value into a shard) are ``params``'.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from hsdp_runner.models.base import ModelConfig
from hsdp_runner.models.params import copy_full_into


@dataclass(frozen=True)
class TPStyles:
    """The ParallelStyle classes a TP plan gives the blocks' linear layers and their inputs:
    torch's by default; under float8 training torchao's float8 ones (same arguments), handed
    in by the sharding applier so a model file imports no torchao."""

    colwise: type = ColwiseParallel
    rowwise: type = RowwiseParallel
    prepare_input: type = PrepareModuleInput


def output_layer_style(stream, loss_parallel: bool) -> ColwiseParallel:
    """The output layer's TP style: column-parallel over the vocabulary from the residual
    stream's layout ``stream``. With ``loss_parallel`` its logits stay a DTensor sharded over
    the vocabulary (the loss runs on the shards under torch's ``loss_parallel``, see
    ``train/trainer.py``); without, they are all-gathered whole on every TP rank."""
    if loss_parallel:
        return ColwiseParallel(
            input_layouts=stream, output_layouts=Shard(-1), use_local_output=False
        )
    return ColwiseParallel(input_layouts=stream, output_layouts=Replicate())


# Modules torch inserts into parameter names when it wraps a block: activation checkpointing
# (checkpoint_wrapper) and torch.compile.
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """A parameter name as the unwrapped model names it (wrapper prefixes removed), so a rule
    keyed by name (initial values, weight decay) holds whatever wraps the module."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def initial_value(
    name: str, shape: tuple, seed: int, std: float, device: torch.device
) -> torch.Tensor:
    """The full fp32 value N(0, std^2) of parameter ``name``, drawn on ``device`` from a
    ``device`` generator seeded by (seed, clean name): every layout starts from equal weights."""
    gen = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=gen, device=device) * std


def name_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` (its clean name) under the run's ``seed``."""
    digest = hashlib.sha256(f"{seed}:{clean_name(name)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the norms and RoPE compute in for input ``x``: fp32 for bf16, fp16 and fp32
    (float64 stays float64, so gradcheck can check them)."""
    return torch.promote_types(x.dtype, torch.float32)


# Devices whose torch build has fused RMSNorm kernels (``aten._fused_rms_norm`` and its
# backward; CUDA builds register them for CUDA; elsewhere the forward is a composite of the
# same ops as ``RMSNormFunction``'s and the backward has no kernel). The planner's trace adds
# "meta" while it prices a GPU's step.
FUSED_NORM_DEVICES = {"cuda"}


def fused_rms_norm(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused RMSNorm of ``x`` over its last dim without a weight: (the normalised
    ``x`` in its dtype, computed in fp32 and rounded once; the fp32 rstd of each row, shape
    ``x.shape[:-1] + (1,)``). One kernel reading ``x`` once; a module-level function so the
    planner's trace can count it as that kernel."""
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)


def fused_rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, needs: list
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """torch's fused RMSNorm backward of ``y = normalised(x) * weight`` (fp32 inside): the
    gradients of ``x`` and ``weight`` from the output's ``grad``, each only where ``needs``
    (two bools) asks, else None."""
    return torch.ops.aten._fused_rms_norm_backward(
        grad, x, [x.shape[-1]], rstd, weight, list(needs)
    )


def _rows_whole(x: DTensor) -> bool:
    # Every rank holds whole rows (the last dim unsplit) and no pending sum: a row's norm
    # needs nothing from another rank.
    return not any(
        p.is_partial() or (p.is_shard() and p.dim % x.ndim == x.ndim - 1) for p in x.placements
    )


def _fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the norm of ``x`` with ``weight`` runs as torch's fused kernels: on a device of
    ``FUSED_NORM_DEVICES`` with the weight in x's dtype (else the output, and its gradient,
    would not be the kernel's dtype); a DTensor ``x`` (sequence parallel) when its rows are
    whole on each rank and the weight is replicated over its mesh."""
    if x.device.type not in FUSED_NORM_DEVICES or weight.dtype != x.dtype:
        return False
    if not isinstance(x, DTensor):
        return not isinstance(weight, DTensor)
    return (
        isinstance(weight, DTensor)
        and weight.device_mesh == x.device_mesh
        and all(p.is_replicate() for p in weight.placements)
        and _rows_whole(x)
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(local: torch.Tensor, like: torch.Tensor, placements=None) -> torch.Tensor:
    """``local`` as a DTensor laid out as ``like`` (``placements`` instead of its own where
    given) when ``like`` is one, else ``local``."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local,
        like.device_mesh,
        placements or like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


class RMSNormFunction(torch.autograd.Function):
    """``(x * rsqrt(mean(x^2) + eps)).type_as(x) * weight`` over the last dim, the norm in fp32,
    keeping for backward only ``x`` (in its own dtype), the fp32 ``rstd`` of each row and the
    weight.

    Why not autograd over torch ops: that expression (and torch 2.13's ``F.rms_norm`` on CPU
    and meta, a composite of the same ops) saves two fp32 copies of ``x`` and the rounded
    normalised value, 10 bytes an element under bf16 against 2 here. Why not
    ``F.rms_norm`` either: it multiplies by the weight before rounding, so bf16 values would
    change. The forward runs the same ops as the expression (bit-identical values); backward
    recomputes the normalised value from ``x`` and ``rstd`` and computes in fp32, rounding
    each gradient once to its input's dtype. DTensor inputs (sequence-parallel or per-head
    norms under TP) run through the same ops; the weight's gradient, a sum over the rows, is
    then ``Partial`` over the mesh, as autograd's was.

    On a device with torch's fused kernels (``_fused``: ``FUSED_NORM_DEVICES``; a DTensor's
    rows on each rank, its weight's gradient then ``Partial`` as above) the norm runs as them
    instead of about six eager kernels forward and ten backward: the forward
    without the weight (so the rounding before the weight stays), the backward with it (the
    input's gradient exactly as above, in fp32 and rounded once; the weight's from the fp32
    normalised value rather than its rounded copy, within the compute dtype's rounding of
    the op-by-op one). Saved tensors are the same."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The normalised ``x`` times ``weight`` (class docstring)."""
        if _fused(x, weight):
            # rstd stays a local tensor: only this function's backward reads it.
            normed, rstd = fused_rms_norm(_local(x), eps)
            normed = _like(normed, x)
        else:
            xf = x.to(compute_dtype(x))
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            normed = (xf * rstd).type_as(x)
        ctx.save_for_backward(x, weight, rstd)
        return normed * weight

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        """Gradients of ``x`` and ``weight`` in fp32 from the saved ``x`` and ``rstd``."""
        x, weight, rstd = ctx.saved_tensors
        if _fused(x, weight):
            if isinstance(x, DTensor) and grad_out.placements != x.placements:
                grad_out = grad_out.redistribute(x.device_mesh, x.placements)
            grad_x, grad_w = fused_rms_norm_backward(
                _local(grad_out).contiguous(),
                _local(x),
                rstd,
                _local(weight),
                ctx.needs_input_grad[:2],
            )
            if grad_x is not None:
                grad_x = _like(grad_x, x)
            if grad_w is not None and isinstance(x, DTensor):
                # Each rank summed its own rows: a pending sum over the dims x is split on.
                partial = [Partial() if p.is_shard() else Replicate() for p in x.placements]
                grad_w = _like(grad_w, weight, partial)
            return grad_x, grad_w, None
        compute = compute_dtype(x)
        normed = x.to(compute) * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_normed = grad_out.to(compute) * weight.to(compute)
            dot = (grad_normed * normed).mean(-1, keepdim=True)
            grad_x = ((grad_normed - normed * dot) * rstd).to(x.dtype)
        if ctx.needs_input_grad[1]:
            rows = tuple(range(x.dim() - 1))
            grad_w = (grad_out.to(compute) * normed.type_as(x)).sum(rows).to(weight.dtype)
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32, rounded to the input's
    dtype, times a learned weight (``RMSNormFunction``: saves ``x`` and a per-row fp32 rstd)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cos, sin) tables of shape (seq_len, head_dim // 2) for rotary embeddings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation of each channel pair as a 2x2 matrix ``[[cos, -sin], [sin, cos]]``: shape
    ``cos.shape + (2, 2)``, rows the output channels (its transpose rotates back)."""
    return torch.stack((cos, -sin, sin, cos), dim=-1).unflatten(-1, (2, 2))


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Each channel pair (2i, 2i+1) of ``x`` times its 2x2 ``rotation`` (``rope_rotation``), in
    the rotation's dtype (fp32: ``x`` is promoted element by element, no fp32 copy of ``x``),
    rounded to ``x``'s dtype.

    Two kernels: one product of every channel with the two entries of its row, one sum of each
    row's two products written in ``x``'s dtype (the rounding in the same kernel where ``x`` is
    a plain tensor; a DTensor takes one cast more). The values are those of
    ``x1 * cos - x2 * sin, x1 * sin + x2 * cos`` op by op: each product is the same fp32
    product (negating a table entry is exact), ``a + (-b)`` is ``a - b`` in IEEE arithmetic
    (signed zeros too) and each sum is rounded once. Op by op it took nine kernels (four
    products whose bf16 x fp32 operands a GPU runs in its slow mixed-dtype kernel, a sum, a
    difference, two casts and a stack)."""
    products = x.unflatten(-1, (-1, 1, 2)) * rotation
    first, second = products[..., 0], products[..., 1]
    if isinstance(x, DTensor) or first.dtype == x.dtype:
        return (first + second).to(x.dtype).flatten(-2)
    out = torch.empty(first.shape, dtype=x.dtype, device=x.device)
    return torch.add(first, second, out=out).flatten(-2)


class RopeFunction(torch.autograd.Function):
    """RoPE's rotation, saving no activation: it is linear in ``x``, so the gradient is the
    gradient rotated back (by -angle, the transposed rotation), from the tables alone.

    Why not autograd over torch ops: it saved nothing per token either (each product saves
    its table), but its forward copied ``x`` to fp32 first and its backward formed the fp32
    gradient, a negation and a stack of fp32 halves; here the products read ``x`` (and in
    backward the gradient) in their own dtype and each pair's sums are rounded once
    (``_rotate``: two kernels a direction, plus two small ones building the rotation from the
    tables; the saved tables are the caller's views, the rotation is rebuilt in backward). The
    values are the same: bf16 to fp32 is exact, so every product and sum is the fp32 one of
    the expression, rounded once to the input's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` rotated (``_rotate``)."""
        ctx.save_for_backward(cos, sin)
        return _rotate(x, rope_rotation(cos, sin))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The gradient rotated back: (g1 cos + g2 sin, g2 cos - g1 sin) per pair."""
        cos, sin = ctx.saved_tensors
        return _rotate(grad, rope_rotation(cos, sin).transpose(-1, -2)), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by position-dependent angles
    (``RopeFunction``): in fp32 (``compute_dtype``), rounded to x's dtype. The tables are taken
    in fp32 whatever their dtype (a model cast whole to bf16 casts its buffers too)."""
    compute = compute_dtype(x)
    cos, sin = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    cos, sin = cos.to(compute), sin.to(compute)
    return RopeFunction.apply(x, cos, sin)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1(x)) * w3(x))``, hidden width ``hidden_dim``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# Where keys and values go to attention with their own heads, fewer than the queries' (SDPA's
# ``enable_gqa``), so autograd saves them un-repeated: kv_heads / heads of the bytes (Qwen3-235B:
# 2 KB per token and block where the repeated copies took 32 KB). In torch 2.13 the fused CUDA
# kernels that take grouped heads, flash and cuDNN, run fp16 and bf16 only, flash with head_dim
# up to 256 (on sm80 and later, the GPUs this runner targets); the memory-efficient kernel, which
# runs the rest (fp32 above all), rejects grouped heads (its dense check is
# ``check_batch_size_and_num_heads_dense<false>``: read in torch's sources, not run here), so
# there SDPA would fall to the math backend and hold seq x seq scores: the heads are repeated
# first, as before. The CPU kernel takes grouped heads in every dtype; the rule goes by dtype and
# width alone so that the planner, measuring on CPU, holds what a GPU job holds.
GROUPED_HEADS_DTYPES = (torch.float16, torch.bfloat16)
GROUPED_HEADS_MAX_HEAD_DIM = 256


def grouped_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(k, v, enable_gqa) to hand SDPA with (batch, heads, seq, head_dim) queries ``q``: k and v
    as they are with ``enable_gqa`` where their heads are fewer, ``q``'s dtype is one of
    ``GROUPED_HEADS_DTYPES`` and its head_dim at most ``GROUPED_HEADS_MAX_HEAD_DIM``, else
    repeated to every query head (or already as many)."""
    repeat = q.shape[1] // k.shape[1]
    if repeat == 1:
        return k, v, False
    if q.dtype in GROUPED_HEADS_DTYPES and q.shape[-1] <= GROUPED_HEADS_MAX_HEAD_DIM:
        return k, v, True
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), False


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of (batch, heads, seq, head_dim) queries over keys and values with
    ``kv_heads`` dividing ``heads`` (grouped-query heads: ``grouped_kv``)."""
    k, v, gqa = grouped_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class ReplicatedParams(ParallelStyle):
    """Keep a module whole on every TP rank but make its parameters Replicate DTensors.

    Used for the norms when sequence parallel is off, so every parameter lives on the TP mesh
    (the optimizer's foreach kernels and grad clipping cannot mix DTensors with plain tensors).
    torch has no built-in style for this. ``input_layout`` is how the module's local input
    is laid out over the mesh: whole on every rank (``Replicate()``, the default) or, for a
    norm over each attention head's channels, split over the heads (``Shard(2)`` of
    (batch, seq, heads, head_dim)): the weight's gradient is then ``Partial`` over the mesh
    (each rank's heads' part), summed like a sequence-parallel norm's.
    """

    def __init__(self, input_layout=None):
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


# The dim each weight of a Llama-style decoder is split on by its family's TP plan (column-
# parallel: 0, row-parallel: 1; the embedding is row-parallel over the vocab, i.e. dim 0), keyed
# by the module's name. Weights not listed (the norms) stay whole on every TP rank. The
# communication model (hsdp_runner/distributed/comm_model.py) reads it through ``tp_split_dim``.
ROTARY_TP_SPLIT_DIM = {
    "tok_embeddings": 0,
    "output": 0,
    "wq": 0,
    "wk": 0,
    "wv": 0,
    "wo": 1,
    "w1": 0,
    "w3": 0,
    "w2": 1,
}


class RotaryDecoder(nn.Module):
    """The decoder the Llama-style families share: token embedding, the blocks (keyed
    "0".."n-1", each called as ``block(h, cos, sin)``), final RMSNorm, output layer and the RoPE
    tables of ``head_dim``-wide heads. ``forward(tokens)`` returns logits (batch, seq, vocab).

    A family builds it with its blocks and names its output projections in ``DEPTH_SCALED``
    (name suffixes initialised at std / sqrt(2 n_layers)); what it holds beyond that (the
    TP plan, buffers of its own) it adds in a subclass.
    """

    DEPTH_SCALED: tuple[str, ...] = ("wo.weight", "w2.weight")

    def __init__(self, cfg: ModelConfig, blocks: list[nn.Module], head_dim: int):
        # cfg: a family's config (LlamaConfig, MoEConfig), which adds norm_eps and rope_theta.
        super().__init__()
        self.cfg, self.head_dim = cfg, head_dim
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0".."n-1" keeps block names stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Set by the sharding applier when compiled blocks follow a TP embedding (see parallelize).
        self.clone_embedding_output = False
        self.sequence_shard = None  # set under context parallel (``shard_sequence``)

    def blocks(self) -> nn.ModuleDict:
        """The transformer blocks (what AC, compile and FSDP wrap)."""
        return self.layers

    def pipeline_ends(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The token embedding before the blocks; the final norm and output layer after."""
        return ("tok_embeddings",), ("norm", "output")

    def shard_sequence(self, shard) -> None:
        """Take this rank's positions and attention from ``shard`` (see ``models/base.py``)."""
        self.sequence_shard = shard
        for block in self.layers.values():
            block.attention.attend = shard.attention

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A later pipeline stage (no embedding) takes the previous stage's hidden state.
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        if self.clone_embedding_output and self.tok_embeddings is not None:
            h = h.clone()
        cos, sin = self.rope_cos, self.rope_sin
        if self.sequence_shard is not None:  # the rank's tokens are not positions 0, 1, ...
            # A later stage's input, a hidden state, is split over tp too under sequence
            # parallel; its blocks' attention sees (and checks) the cp rank's whole part.
            first = self.tok_embeddings is not None
            local_len = tokens.shape[1] if first else self.sequence_shard.local_len
            positions = self.sequence_shard.positions(local_len, cos.device)
            cos, sin = cos[positions], sin[positions]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.output is None:  # a pipeline stage before the last
            return h
        return self.output(self.norm(h))

    def init_weights(self, seed: int) -> None:
        """Fill every parameter and the RoPE tables deterministically from ``seed``.

        Norms start at 1; every other parameter's full value is drawn on the parameter's own
        device (``initial_value``) from a generator seeded by (seed, name), then cut to this
        rank's shard, so every layout starts from identical weights and a GPU draws even a 70B
        model in seconds. (The DTensor RNG would also be deterministic, but its stream depends
        on the mesh.) On CPU the values are those of torch's CPU generator. On CUDA they come
        from a CUDA generator: equally a function of (seed, name), the same on every rank and
        in every layout of a job, but not equal to the CPU values, and not promised equal
        across GPU models or torch versions (torch may split the draw differently over another
        GPU's multiprocessors).
        """
        std = self.cfg.init_std
        depth_std = std / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                if name.endswith("norm.weight"):
                    full = torch.ones(param.shape, device=local.device)
                else:
                    scale = depth_std if name.endswith(self.DEPTH_SCALED) else std
                    full = initial_value(name, tuple(param.shape), seed, scale, local.device)
                copy_full_into(param, full)
            cos, sin = rope_tables(self.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
