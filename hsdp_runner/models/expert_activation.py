"""The routed experts' activation and its recomputing variant, the autograd functions
``moe_routing.GroupedExperts`` runs between its up and down projections.

- ``WeightedSwiGLU``: ``silu(gate) * up`` times each row's router weight, saving its three
  inputs only (the SiLU and the product recomputed in backward).
- ``WeightedSwiGLUDown``: the same activation and the down projection after it in one
  function (``parallel.ac=moe_act``, Megatron's ``--recompute-modules moe_act``): the
  activation's output, the down projection's input, is not kept for backward but computed
  again there from what the activation saves anyway. One (rows, hidden) tensor per routed
  copy less, for two elementwise kernels in backward and no matmul: backward calls the down
  projection's two gradient matmuls itself, with the recomputed input. Autograd offers no
  way to drop one saved input of a matmul and refill it before that matmul's backward
  (``torch.utils.checkpoint`` would run the down projection's forward matmul again);
  Megatron's ``CheckpointWithoutOutput`` does this by hand the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activation(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # In place: the product with the fp32 weight computed in fp32 and stored in gate's
    # dtype, one kernel and no fp32 copy (``* weight`` then ``.to`` would write one).
    return (F.silu(gate) * up).mul_(weight[:, None])


def _activation_backward(grad_out, gate, up, weight, weight_grad: bool):
    """The gradients of ``_activation`` for ``grad_out`` (rows, hidden): (gate's, up's,
    weight's or None). The ops autograd of ``(silu(gate) * up * weight[:, None]).to(dtype)``
    would run: the weight's gradient from fp32 products summed in fp32, the rest through
    ``silu_backward``."""
    silu = F.silu(gate)
    grad_weight = None
    if weight_grad:
        # addcmul with a zero of the weight's dtype computes in it (type promotion): the
        # products of the two rows without an fp32 copy of either.
        zero = torch.zeros((1, 1), dtype=weight.dtype, device=gate.device)
        grad_weight = torch.addcmul(zero, grad_out, silu * up).sum(dim=-1)
    grad = (grad_out * weight[:, None]).to(gate.dtype)
    grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
    return grad_gate, grad * silu, grad_weight


class WeightedSwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` times each row's router ``weight``: ``apply(gate (M, hidden), up
    (M, hidden), weight (M,) fp32)`` -> (M, hidden) in gate's dtype, the product with the
    weight in fp32 and rounded once. Saves its three inputs only: backward recomputes
    ``silu(gate) * up`` (two elementwise ops) where autograd of the expression would keep the
    SiLU's output and the product besides, two more (M, hidden) tensors per routed copy."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        return _activation(gate, up, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        return _activation_backward(grad_out, gate, up, weight, ctx.needs_input_grad[2])


class WeightedSwiGLUDown(torch.autograd.Function):
    """``WeightedSwiGLU`` then the down projection, its output not kept for backward:
    ``apply(gate, up, weight, w2, offs)`` -> (M, dim), ``w2`` the experts' down weights
    (E, dim, hidden) with ``offs`` (E,) int32 the groups' cumulative row counts (the grouped
    matmul's), or one expert's (dim, hidden) with ``offs`` None (a plain matmul). The same
    values and gradients as the two calls apart, bit for bit: backward recomputes the
    activation, then runs the grouped matmul's own two backward matmuls (torch's
    ``_grouped_mm_mat1_backward`` / ``_mat2_backward`` for a row-major input and a
    column-major weight), then the activation's backward. Saves gate, up, weight, w2 (the
    tensor the matmul would save) and offs."""

    @staticmethod
    def forward(ctx, gate, up, weight, w2, offs):
        ctx.save_for_backward(gate, up, weight, w2, offs)
        hidden = _activation(gate, up, weight)
        if offs is None:
            return hidden @ w2.transpose(-2, -1)
        return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up, weight, w2, offs = ctx.saved_tensors
        hidden = _activation(gate, up, weight)
        if offs is None:
            grad_hidden = grad_out @ w2
            grad_w2 = grad_out.transpose(-2, -1) @ hidden if ctx.needs_input_grad[3] else None
        else:
            grad_hidden = torch._grouped_mm(grad_out, w2, offs=offs)
            grad_w2 = None
            if ctx.needs_input_grad[3]:
                grad_w2 = torch._grouped_mm(grad_out.transpose(-2, -1), hidden, offs=offs)
        del hidden
        grads = _activation_backward(grad_hidden, gate, up, weight, ctx.needs_input_grad[2])
        return (*grads, grad_w2, None)
