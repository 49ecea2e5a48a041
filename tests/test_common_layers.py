"""The shared dense layers of ``models/norm_rope.py`` and ``models/common.py``: RMSNorm (``RMSNormFunction``) and RoPE
(``RopeFunction``) compute what the plain torch expressions they replaced computed, forward
bit for bit, and keep for backward only the input in its own dtype and a per-row fp32 rstd
(RMSNorm) or nothing but the tables (RoPE): a bf16 block saves no fp32 copy of an activation.
Attention with grouped-query heads (``causal_attention``) computes what repeating the keys and
values to every query head computed, and in bf16 saves them once, not once per query head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from saved_tensors import saved_by
from torch.utils._python_dispatch import TorchDispatchMode

from hsdp_runner.models import norm_rope
from hsdp_runner.models.common import causal_attention
from hsdp_runner.models.llama import LlamaConfig, TransformerBlock
from hsdp_runner.models.moe import Attention
from hsdp_runner.models.norm_rope import RMSNorm, RMSNormFunction, apply_rope, rope_tables

EPS = 1e-6


def expression_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm as the plain torch expression it was (autograd over its ops)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    return normed.type_as(x) * weight


def expression_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the plain torch expression it was (autograd over its ops)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


def value_and_grads(fn, *inputs: torch.Tensor, grad_out: torch.Tensor):
    """``fn(*inputs)`` and the gradients of ``<fn(*inputs), grad_out>`` for each input."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def norm_inputs(dtype: torch.dtype):
    """(x, weight, grad_out) of a per-head norm: (batch, seq, heads, head_dim), rows of
    varied scale, a weight away from 1."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 3, 32, generator=gen) * torch.rand(2, 8, 3, 1, generator=gen) * 4
    weight = 1 + 0.5 * torch.randn(32, generator=gen)
    grad_out = torch.randn(2, 8, 3, 32, generator=gen)
    return x.to(dtype), weight.to(dtype), grad_out.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_forward_is_the_expression_bit_for_bit(dtype):
    x, weight, _ = norm_inputs(dtype)
    norm = RMSNorm(32, EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    out = norm(x)
    assert out.dtype == dtype
    assert torch.equal(out, expression_norm(x, weight))
    # An fp32 weight on a bf16 input (no cast of the model): fp32 out, as the expression's.
    assert torch.equal(RMSNorm(32, EPS)(x), expression_norm(x, torch.ones(32)))


def test_rms_norm_fp32_gradients_are_the_expressions_to_rounding():
    x, weight, grad_out = norm_inputs(torch.float32)
    fn = lambda x, w: RMSNormFunction.apply(x, w, EPS)  # noqa: E731
    _, (gx, gw) = value_and_grads(fn, x, weight, grad_out=grad_out)
    _, (ex, ew) = value_and_grads(expression_norm, x, weight, grad_out=grad_out)
    torch.testing.assert_close(gx, ex, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, ew, rtol=1e-5, atol=1e-6)


def test_rms_norm_bf16_gradients_are_fp32_ones_rounded_once():
    """Backward in fp32 from the bf16 input and the fp32 rstd, each gradient rounded once:
    within one bf16 rounding of the float64 gradient (the expression, which rounded the
    normalised value's gradient and each of the input's two paths to bf16, is not)."""
    x, weight, grad_out = norm_inputs(torch.bfloat16)
    fn = lambda x, w: RMSNormFunction.apply(x, w, EPS)  # noqa: E731
    _, (gx, gw) = value_and_grads(fn, x, weight, grad_out=grad_out)
    _, (rx, rw) = value_and_grads(
        expression_norm, x.double(), weight.double(), grad_out=grad_out.double()
    )
    assert gx.dtype == gw.dtype == torch.bfloat16
    # One bf16 rounding (2^-9 relative), plus the reference's own difference: the forward
    # rounds the normalised value to bf16 before the weight, float64 does not.
    torch.testing.assert_close(gx.double(), rx, rtol=2**-8, atol=1e-2 * rx.abs().max().item())
    torch.testing.assert_close(gw.double(), rw, rtol=2**-7, atol=1e-2 * rw.abs().max().item())


def test_rms_norm_passes_gradcheck_in_float64():
    x, weight, _ = norm_inputs(torch.float64)
    x, weight = x[:1, :3].requires_grad_(), weight.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFunction.apply(x, w, EPS), (x, weight))


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_forward_and_gradient_are_the_expressions_bit_for_bit(dtype, table_dtype):
    """Also with tables cast to bf16 (a model cast whole): the rotation stays in fp32."""
    x, _, grad_out = norm_inputs(dtype)
    cos, sin = (t.to(table_dtype) for t in rope_tables(32, 16, 10000.0))
    ours, (gx,) = value_and_grads(lambda t: apply_rope(t, cos, sin), x, grad_out=grad_out)
    theirs, (ex,) = value_and_grads(lambda t: expression_rope(t, cos, sin), x, grad_out=grad_out)
    assert ours.dtype == gx.dtype == dtype
    assert torch.equal(ours, theirs)
    assert torch.equal(gx, ex)


class KernelCount(TorchDispatchMode):
    """Counts the ops that run a kernel on a GPU (not views, allocations or ops returning no
    tensor), by pass: ``phase`` is set by the caller."""

    def __init__(self):
        super().__init__()
        self.phase, self.counts = "forward", {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        free = func.is_view or func.__name__.startswith(("empty", "new_empty", "detach"))
        tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.counts[self.phase] += 0 if free or not tensors else 1
        return out


def kernels_of(fn, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    x = x.detach().requires_grad_()
    with KernelCount() as mode:
        out = fn(x)
        mode.phase = "backward"
        out.backward(grad_out)
    return mode.counts


def test_rope_runs_four_kernels_a_direction_where_op_by_op_took_nine():
    """bf16 input, fp32 tables (a bf16 block's RoPE): a product and a rounded sum
    (``norm_rope._rotate``) plus two small ones building the 2x2 rotation, each way; the op-by-op
    rotation it replaced (``x1 * cos - x2 * sin, x1 * sin + x2 * cos``, each half cast, then
    stacked) took nine, four of them mixed-dtype products. Values: the test above."""
    x, _, grad_out = norm_inputs(torch.bfloat16)
    cos, sin = rope_tables(32, 16, 10000.0)

    def op_by_op(t):
        c, s = cos[None, : t.shape[1], None, :], sin[None, : t.shape[1], None, :]
        x1, x2 = t.unflatten(-1, (-1, 2)).unbind(-1)
        first, second = x1 * c - x2 * s, x1 * s + x2 * c
        return torch.stack((first.to(t.dtype), second.to(t.dtype)), dim=-1).flatten(-2)

    assert kernels_of(lambda t: apply_rope(t, cos, sin), x, grad_out) == {
        "forward": 4,
        "backward": 4,
    }
    assert kernels_of(op_by_op, x, grad_out)["forward"] == 9


def test_rope_passes_gradcheck_in_float64():
    x, _, _ = norm_inputs(torch.float64)
    cos, sin = (t.double() for t in rope_tables(32, 8, 10000.0))
    x = x[:1, :, :2].requires_grad_()
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))


def test_bf16_blocks_save_no_fp32_copy_of_an_activation():
    """A bf16 Llama block and a Qwen3-style attention (q/k norms): the fp32 tensors they keep
    are per-row statistics (each norm's rstd, attention's log-sum-exp), none as large as the
    narrowest activation through the norms and RoPE (k: kv_heads x head_dim per token)."""
    tokens, dim, heads, kv_heads = 16, 64, 4, 2
    head_dim = dim // heads
    cos, sin = rope_tables(head_dim, tokens, 10000.0)
    cfg = LlamaConfig(
        name="t", dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, vocab_size=256
    )
    cfg.ffn_hidden_dim, cfg.seq_len, cfg.norm_eps = 96, tokens, EPS
    llama = TransformerBlock(cfg).to(torch.bfloat16)
    qwen = Attention(dim, heads, kv_heads, head_dim, EPS).to(torch.bfloat16)
    x = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
    narrowest = tokens * kv_heads * head_dim
    for module in (llama, qwen):
        fp32 = [t for t in saved_by(module, x, cos, sin) if t.dtype == torch.float32]
        assert all(t.numel() <= tokens * heads for t in fp32), [t.shape for t in fp32]
        assert tokens * heads < narrowest


def repeated_heads_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention as it was: keys and values repeated to every query head."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_inputs(dtype: torch.dtype, heads: int = 8, kv_heads: int = 2):
    """(q, k, v, grad_out): (batch, heads, seq, head_dim) queries, kv_heads keys and values."""
    gen = torch.Generator().manual_seed(0)
    q, grad_out = (torch.randn(2, heads, 64, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, 64, 16, generator=gen) for _ in range(2))
    return tuple(t.to(dtype) for t in (q, k, v, grad_out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_attention_equals_repeated_heads(dtype):
    """Forward and the queries' gradient bit for bit. The keys' and values' gradients: bit for
    bit in fp32 (the heads are still repeated there: ``common.grouped_kv``); in bf16 each sums
    its group of query heads inside CPU's kernel instead of after it, within 2.5e-2 of the
    largest gradient (seen: 1.7e-2 at 8 query heads per key head; the float64 gradient's
    distance, relative norm: 7e-3 against 4e-3 for the repeated heads)."""
    q, k, v, grad_out = attention_inputs(dtype)
    out, grads = value_and_grads(causal_attention, q, k, v, grad_out=grad_out)
    ref, ref_grads = value_and_grads(repeated_heads_attention, q, k, v, grad_out=grad_out)
    assert torch.equal(out, ref) and torch.equal(grads[0], ref_grads[0])
    for grad, ref_grad in zip(grads[1:], ref_grads[1:]):
        if dtype == torch.float32:
            assert torch.equal(grad, ref_grad)
        else:
            scale = float(ref_grad.abs().max())
            torch.testing.assert_close(grad, ref_grad, rtol=0, atol=2.5e-2 * scale)


def test_bf16_attention_saves_keys_and_values_once_not_per_query_head():
    """Beyond its inputs (q, k, v with kv_heads heads), bf16 attention keeps its output and the
    per-row fp32 log-sum-exp: no copy of the keys and values repeated to every query head (at
    Qwen3-235B's 64 query and 4 key heads those were 32 KB per token and block)."""
    q, k, v, _ = attention_inputs(torch.bfloat16)
    batch, heads, seq, head_dim = q.shape
    saved = saved_by(causal_attention, *(t.requires_grad_() for t in (q, k, v)))
    assert sum(t.untyped_storage().nbytes() for t in saved) == batch * heads * seq * (
        head_dim * 2 + 4
    ), [(t.shape, t.dtype) for t in saved]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_cuda_runs_torchs_fused_kernels_to_the_op_by_op_values(dtype, monkeypatch):
    """On CUDA the norm runs as ``aten._fused_rms_norm`` and its backward (forward without the
    weight, so the rounding before it stays): its values and gradients are the op-by-op
    path's within one rounding of ``dtype``, and it saves the same tensors."""
    x, weight, grad_out = (t.cuda() for t in norm_inputs(dtype))
    calls = []
    fused = norm_rope.fused_rms_norm
    monkeypatch.setattr(norm_rope, "fused_rms_norm", lambda *a: calls.append(1) or fused(*a))
    fn = lambda x, w: RMSNormFunction.apply(x, w, EPS)  # noqa: E731
    out, grads = value_and_grads(fn, x, weight, grad_out=grad_out)
    assert calls, "the fused forward did not run"
    leaves = [t.detach().requires_grad_() for t in (x, weight)]
    saved = [(t.shape, t.dtype) for t in saved_by(fn, *leaves)]
    monkeypatch.setattr(norm_rope, "FUSED_NORM_DEVICES", set())
    ref_out, ref_grads = value_and_grads(fn, x, weight, grad_out=grad_out)
    assert saved == [(t.shape, t.dtype) for t in saved_by(fn, *leaves)]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(out, ref_out, **tol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **tol)
