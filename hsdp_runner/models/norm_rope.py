"""The Llama-style pointwise layers: RMSNorm (``RMSNormFunction``) and rotary position
embeddings (``RopeFunction``), each an autograd function that keeps for backward only what it
needs (no fp32 copies of a bf16 activation), and, on a device with them, torch's fused RMSNorm
kernels (``FUSED_NORM_DEVICES``; the planner's trace counts them as such).

Why a module of their own: they are where the runner's eager kernel count and activation
bytes are decided (``benchmarks/block_ops.py``, ``planner/precision_cost.py``), apart from the
decoder skeleton and the TP styles in ``common.py``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate


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
