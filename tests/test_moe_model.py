"""The mixture-of-experts family (models/moe.py, models/moe_routing.py), single process: the
grouped-matmul experts against the per-expert loop, the routing rules, the balance statistics
and the auxiliary loss, parameter counts of the presets, and short training runs."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from saved_tensors import saved_by

from hsdp_runner.config.compose import compose
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import build_meta_model, model_spec, moe_layers
from hsdp_runner.models.common import clean_name, initial_value
from hsdp_runner.models.expert_activation import WeightedSwiGLU, WeightedSwiGLUDown
from hsdp_runner.models.moe_routing import GroupedExperts, MoE, Router, sum_copies


def tiny_spec(*overrides: str):
    """The moe_tiny preset's spec with ``model.*`` overrides."""
    return model_spec(compose(["model=moe_tiny", *(f"model.{o}" for o in overrides)]).model)


def built(spec, seed: int = 0):
    """The model of ``spec`` with its initial weights."""
    model = spec.build()
    model.init_weights(seed)
    return model


def test_grouped_experts_match_the_per_expert_loop_with_an_empty_expert():
    """Outputs and every gradient of the grouped-matmul path equal the loop's (fp32), the
    expert that receives no token included (its weight gradients are zero)."""
    torch.manual_seed(0)
    grouped = GroupedExperts(dim=16, hidden_dim=8, n_experts=4, grouped_mm=True)
    for w in grouped.parameters():
        torch.nn.init.normal_(w, std=0.3)
    loop = copy.deepcopy(grouped)
    loop.grouped_mm = False
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 16)
    g = torch.randn(10, 16)
    weight = torch.rand(10)
    results = []
    for experts in (grouped, loop):
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = experts(xi, counts, wi)
        (out * g).sum().backward()
        results.append((out, xi.grad, wi.grad, *(w.grad for w in experts.parameters())))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(w.grad[1].abs().max() == 0 for w in grouped.parameters())
    assert all(w.grad[0].abs().max() > 0 for w in grouped.parameters())


def test_model_grouped_and_loop_paths_agree_on_loss_and_every_gradient():
    """The whole model (aux loss on, in training mode) computes the same loss and gradients
    through ``model.grouped_mm=true`` and ``false``."""
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    grads = []
    for grouped in (True, False):
        model = built(tiny_spec(f"grouped_mm={str(grouped).lower()}"))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        grads.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = grads
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7, msg=name)
    assert grads_a["layers.1.moe.experts.w1"].abs().max() > 0


def router(score_func="softmax", norm_topk_prob=True, route_scale=1.0, n_experts=6, top_k=2):
    """A Router over 8-wide tokens with a random gate."""
    torch.manual_seed(2)
    r = Router(8, n_experts, top_k, score_func, norm_topk_prob, route_scale)
    torch.nn.init.normal_(r.gate.weight)
    return r


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_weighs_the_top_k_scores(score_func, norm_topk_prob):
    """Scores are the softmax or sigmoid of the gate; the chosen experts are the top-k scores;
    their weights are those scores (renormalised to sum 1 with norm_topk_prob) x route_scale;
    the returned probabilities are the scores normalised per token."""
    r = router(score_func, norm_topk_prob, route_scale=2.5)
    x = torch.randn(5, 8)
    weights, chosen, probs = r(x)
    logits = x @ r.gate.weight.T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    top, expected_chosen = scores.topk(2, dim=-1)
    assert torch.equal(chosen.sort(-1).values, expected_chosen.sort(-1).values)
    expected = top / top.sum(-1, keepdim=True) if norm_topk_prob else top
    torch.testing.assert_close(weights, 2.5 * expected)
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True))


def test_expert_bias_changes_the_choice_but_not_the_weights():
    """A large bias on one expert makes every token choose it; its weight is still its score
    (no bias), and without renormalisation every weight is the unbiased score."""
    r = router(norm_topk_prob=False, n_experts=16)
    x = torch.randn(3, 8)
    _, unbiased, _ = r(x)
    never = next(e for e in range(16) if not (unbiased == e).any())
    r.expert_bias[never] = 10.0
    weights, chosen, probs = r(x)
    assert (chosen == never).any(dim=-1).all()
    torch.testing.assert_close(weights, probs.gather(-1, chosen))
    assert (weights < 1).all()


def test_every_token_reaches_its_k_experts_and_the_shared_ones():
    """Dropless: the layer's output is, per token, the weighted sum of its k chosen experts
    applied to it alone, plus the shared experts; the counts add up to tokens x k."""
    spec = tiny_spec("n_experts=4")
    model = built(spec)
    moe = model.layers["1"].moe
    x = torch.randn(2, 32, 64)
    out = moe(x)
    counted = moe.router.tokens_per_expert.clone()
    tokens = x.reshape(-1, 64)
    weights, chosen, _ = moe.router(tokens)
    experts = moe.experts
    expected = moe.shared_experts(tokens)
    for t in range(tokens.shape[0]):
        for k in range(spec.top_k):
            e = chosen[t, k]
            h = torch.nn.functional.silu(tokens[t] @ experts.w1[e].T) * (
                tokens[t] @ experts.w3[e].T
            )
            expected[t] += weights[t, k] * (h @ experts.w2[e].T)
    torch.testing.assert_close(out.reshape(-1, 64), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(counted, torch.bincount(chosen.flatten(), minlength=4).float())
    assert counted.sum() == 2 * 32 * spec.top_k


def routed_copies(dtype: torch.dtype, n_tokens: int = 6, top_k: int = 3, dim: int = 16):
    """(routed (M, dim), weight (M,) fp32, token (M,)) of ``n_tokens`` tokens' ``top_k`` copies
    each, shuffled as the experts' order leaves them; the last token has no copy."""
    gen = torch.Generator().manual_seed(3)
    m = (n_tokens - 1) * top_k
    token = torch.arange(n_tokens - 1).repeat_interleave(top_k)[torch.randperm(m, generator=gen)]
    routed = torch.randn(m, dim, generator=gen).to(dtype)
    return routed, torch.rand(m, generator=gen), token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_copies_sums_each_tokens_copies_in_fp32_and_saves_only_the_index(dtype):
    """Value and gradient of ``sum_copies`` equal the autograd of the expression it replaces,
    ``zeros.index_add(token, routed.float()).to(dtype)`` (fp32 sums, one rounding to
    ``dtype``), and the float64 sum within that rounding; a token without copies gets zeros;
    autograd keeps the index only (the expression's ``index_add`` keeps its fp32 source)."""
    routed, _, token = routed_copies(dtype)
    grad_out = torch.randn(6, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    results = []
    for combine in (
        lambda r: sum_copies(r, token, 6, dtype),
        lambda r: torch.zeros(6, 16).index_add(0, token, r.float()).to(dtype),
    ):
        r = routed.clone().requires_grad_()
        out = combine(r)
        out.backward(grad_out)
        results.append((out, r.grad))
    (out, grad_routed), (want, want_routed) = results
    assert out.dtype == grad_routed.dtype == dtype
    assert torch.equal(out, want) and torch.equal(grad_routed, want_routed)
    assert out[5].abs().max() == 0
    exact = torch.zeros(6, 16, dtype=torch.float64).index_add_(0, token, routed.double())
    torch.testing.assert_close(out.double(), exact, **TOL[dtype])
    saved = saved_by(lambda r: sum_copies(r, token, 6, dtype), routed.clone().requires_grad_())
    assert [t.dtype for t in saved] == [torch.int64]


TOL = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.bfloat16: {"rtol": 8e-3, "atol": 8e-3}}


def test_weighted_swiglu_and_sum_copies_pass_gradcheck():
    """Backward against finite differences, in float64: the experts' weighted activation
    (all three inputs) and the copies' sum."""
    gen = torch.Generator().manual_seed(6)
    gate, up = (torch.randn(5, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    weight = torch.rand(5, dtype=torch.float64, generator=gen)
    inputs = tuple(t.requires_grad_() for t in (gate, up, weight))
    assert torch.autograd.gradcheck(WeightedSwiGLU.apply, inputs)
    w2 = torch.randn(3, 4, dtype=torch.float64, generator=gen).requires_grad_()
    # One expert's down projection (a plain matmul): float64 has no grouped matmul on the CPU.
    assert torch.autograd.gradcheck(WeightedSwiGLUDown.apply, (*inputs, w2, None))
    routed, _, token = routed_copies(torch.float64, n_tokens=4, top_k=2, dim=5)
    inputs = (routed.requires_grad_(), token, 4, torch.float64)
    assert torch.autograd.gradcheck(sum_copies, inputs)


def test_weighing_in_the_experts_is_weighing_their_outputs():
    """The layer's output equals the order HF's and torchtitan's MoE take (each expert's
    output times its weight, summed per token), within fp32 rounding, gradients included:
    the down projection is linear, so the weight may come before it."""
    spec = tiny_spec()
    model = built(spec)
    moe = model.moe_layers()[0]
    x = torch.randn(2, 8, spec.dim, generator=torch.Generator().manual_seed(7))
    ours = moe(x.clone().requires_grad_())
    tokens = x.reshape(-1, spec.dim)
    weights, chosen, _ = moe.router(tokens)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    theirs = torch.zeros_like(tokens)
    for slot in range(moe.top_k):
        for t in range(tokens.shape[0]):
            e = int(chosen[t, slot])
            h = torch.nn.functional.silu(tokens[t] @ w1[e].T) * (tokens[t] @ w3[e].T)
            theirs[t] += weights[t, slot] * (h @ w2[e].T)
    theirs = theirs + moe.shared_experts(tokens)
    torch.testing.assert_close(ours.reshape(-1, spec.dim), theirs, rtol=1e-5, atol=1e-6)


def test_bf16_layer_saves_no_fp32_copy_of_the_routed_outputs():
    """What a bf16 MoE layer keeps for backward (autograd's saved tensors, each storage once,
    its weights and input aside): the routed copies' inputs and outputs and three of the
    experts' SwiGLU tensors in bf16 (its two inputs and the weighted product:
    ``WeightedSwiGLU`` recomputes the SiLU), plus the router's fp32 scores, the copies'
    weights and the int64 indices (about 100 bytes a token here); no fp32 tensor as large as
    the routed rows, and none of the experts' outputs (the experts weigh them, so the combine
    keeps nothing of them)."""
    dim, k, ffn, n_experts, tokens = 64, 2, 32, 8, 64
    moe = MoE(
        dim,
        n_experts,
        k,
        ffn,
        0,
        score_func="softmax",
        norm_topk_prob=True,
        route_scale=1.0,
        grouped_mm=True,
        aux_loss_coef=0.0,
        seq_len=tokens,
    )
    moe = moe.to(torch.bfloat16)
    moe.router.expert_bias = moe.router.expert_bias.float()
    x = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
    saved = saved_by(moe, x)  # backward runs on what was saved
    routed_rows = tokens * k * dim
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= routed_rows]
    held = sum(t.untyped_storage().nbytes() for t in saved)
    needed = tokens * k * (dim + 3 * ffn) * 2  # bf16: inputs, SwiGLU
    # fp32: the scores (n_experts), the chosen ones (k) and their sum (1), the routed copies'
    # weights (k, twice: the gather's and the experts'); int64: the choice, the sort order,
    # each copy's token (k each); int32 offsets.
    small = tokens * (4 * (n_experts + 1) + k * (4 + 4 + 4 + 3 * 8)) + 4 * n_experts
    assert needed <= held <= needed + small


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_is_bit_for_bit_the_expression_it_replaces(dtype):
    """``WeightedSwiGLU`` (saving its three inputs, the SiLU and the product recomputed in
    backward): value and every gradient equal autograd's of ``(silu(gate) * up * weight[:,
    None]).to(dtype)`` with an fp32 weight, bit for bit but the weight's (its sum's order),
    and it keeps only the inputs for backward."""
    gen = torch.Generator().manual_seed(5)
    gate, up, grad_out = (torch.randn(7, 12, generator=gen).to(dtype) for _ in range(3))
    weight = torch.rand(7, generator=gen)
    results = []
    for fn in (
        WeightedSwiGLU.apply,
        lambda g, u, w: (torch.nn.functional.silu(g) * u * w[:, None]).to(dtype),
    ):
        g, u, w = (t.clone().requires_grad_() for t in (gate, up, weight))
        out = fn(g, u, w)
        out.backward(grad_out)
        results.append((out, g.grad, u.grad, w.grad))
    (*got, got_weight), (*want, want_weight) = results
    for a, b in zip(got, want):
        assert a.dtype == dtype and torch.equal(a, b)
    assert got_weight.dtype == torch.float32
    torch.testing.assert_close(got_weight, want_weight, rtol=1e-6, atol=1e-6)
    g, u, w = (t.clone().requires_grad_() for t in (gate, up, weight))
    saved = saved_by(lambda a, b, c: WeightedSwiGLU.apply(a, b, c), g, u, w)
    assert saved == []  # only the inputs, which saved_by leaves aside


@pytest.mark.parametrize(
    "dtype,grouped", [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)]
)
def test_the_recomputed_activation_changes_no_bit_and_keeps_one_tensor_less(dtype, grouped):
    """``recompute_act`` (``parallel.ac=moe_act``): the experts' output and every gradient
    equal the kept activation's bit for bit (grouped matmuls and the per-expert loop, an
    expert with no row among them), and what the experts keep for backward is one (rows,
    hidden) tensor less, the down projection's input."""
    gen = torch.Generator().manual_seed(9)
    counts = torch.tensor([5, 0, 7, 4])
    x, grad_out = (torch.randn(16, 16, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(16, generator=gen)
    results, held = [], []
    for recompute in (False, True):
        experts = GroupedExperts(dim=16, hidden_dim=8, n_experts=4, grouped_mm=grouped)
        for w in experts.parameters():
            w.data = torch.randn(w.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        experts.recompute_act = recompute
        inputs = (x.clone().requires_grad_(), counts, weight.clone().requires_grad_())
        out = experts(*inputs)
        out.backward(grad_out)
        results.append(
            [out, inputs[0].grad, inputs[2].grad, *(w.grad for w in experts.parameters())]
        )
        saved = saved_by(experts, *inputs)
        held.append(sum(t.untyped_storage().nbytes() for t in saved))
    for kept, recomputed in zip(*results):
        assert torch.equal(kept, recomputed)
    assert held[0] - held[1] == 16 * 8 * x.element_size()


def explicit_aux_loss(moe, x: torch.Tensor, coef: float) -> torch.Tensor:
    """coef * mean over sequences of sum_i f_i P_i, written out from the router's gate."""
    bsz, seq, _ = x.shape
    n, k = moe.n_experts, moe.top_k
    logits = moe.router.gate(x).float()
    scores = logits.softmax(-1) if moe.router.score_func == "softmax" else logits.sigmoid()
    chosen = scores.topk(k, dim=-1).indices
    counts = torch.nn.functional.one_hot(chosen, n).sum(dim=(1, 2)).float()  # (bsz, n)
    f = n / (k * seq) * counts
    p = (scores / scores.sum(-1, keepdim=True)).mean(dim=1)
    return coef * (f * p).sum(-1).mean()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_function_adds_the_balance_gradient_and_leaves_the_output(score_func):
    """Through ``AuxLossScaler`` the layer's output is unchanged while every gradient equals
    autograd's of output . g + scale * coef * sum f P (the explicit loss); ``aux_loss_sum``
    holds scale x the loss."""
    coef, scale = 0.5, 0.25
    model = built(tiny_spec(f"score_func={score_func}", f"aux_loss_coef={coef}"))
    moe = model.layers["1"].moe
    moe.aux_grad_scale = scale
    reference = copy.deepcopy(moe)
    reference.aux_loss_coef = 0.0
    x, g = torch.randn(2, 32, 64), torch.randn(2, 32, 64)
    out = moe(x)
    (out * g).sum().backward()
    ref_out = reference(x)
    aux = explicit_aux_loss(reference, x, coef)
    ((ref_out * g).sum() + scale * aux).backward()
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(moe.aux_loss_sum, scale * aux.detach())
    for (name, p), ref in zip(moe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-5, atol=1e-8, msg=name)
    # The loss' gradient is not negligible next to the output's.
    without = copy.deepcopy(reference)
    without.zero_grad()
    (without(x) * g).sum().backward()
    change = (moe.router.gate.weight.grad - without.router.gate.weight.grad).norm()
    assert change > 1e-3 * without.router.gate.weight.grad.norm()


def balance_statistics(ac: str, tokens: torch.Tensor):
    """(tokens_per_expert, aux_loss_sum, gradients) of one training forward and backward of
    moe_tiny under activation checkpointing ``ac``."""
    from hsdp_runner.distributed.parallelize import apply_ac

    model = built(tiny_spec())
    apply_ac(model, ac)
    model(tokens).float().square().mean().backward()
    layers = moe_layers(model)
    counts = torch.stack([m.router.tokens_per_expert for m in layers])
    aux = torch.stack([m.aux_loss_sum for m in layers])
    return counts, aux, {clean_name(n): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_balance_statistics_are_counted_once_under_recomputation(ac):
    """Recomputing a block in backward counts neither the routed copies nor the auxiliary
    loss again: both equal those without checkpointing (tokens x k copies per layer), and so
    do the gradients. An evaluation forward counts nothing."""
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    counts, aux, grads = balance_statistics("none", tokens)
    counts_ac, aux_ac, grads_ac = balance_statistics(ac, tokens)
    assert (counts.sum(-1) == 2 * 32 * 2).all()
    assert torch.equal(counts_ac, counts)
    torch.testing.assert_close(aux_ac, aux, rtol=1e-6, atol=0)
    assert (aux > 0).all()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ac[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    model = built(tiny_spec()).eval()
    with torch.no_grad():
        model(tokens)
    assert all(m.router.tokens_per_expert.sum() == 0 for m in moe_layers(model))
    assert all(m.aux_loss_sum == 0 for m in moe_layers(model))


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``torch._grouped_mm`` (torch's FlopCounterMode has no formula for it): 2 x the
    output's elements x the contracted width."""
    return 2 * math.prod(out_shape) * a_shape[-1]


def counted_flops(spec, tokens: torch.Tensor, ac: str, backward: bool = True) -> int:
    """FLOPs FlopCounterMode counts in one training forward (and backward) under ``ac``."""
    from torch.utils.flop_counter import FlopCounterMode

    from hsdp_runner.distributed.parallelize import apply_ac

    model = built(spec)
    apply_ac(model, ac)
    mapping = {torch.ops.aten._grouped_mm: grouped_mm_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        logits = model(tokens)
        if backward:
            logits.float().square().mean().backward()
    return counter.get_total_flops()


def test_forward_and_selective_recompute_flops_are_the_counted_ones():
    """One forward of moe_tiny costs the blocks' ``block_forward_flops_per_token`` (less
    attention, which FlopCounterMode does not count in torch's CPU kernel) plus the output
    layer per token; selective AC adds exactly ``selective_recompute_flops_per_token`` (the
    experts' grouped matmuls taking turns with the other matmuls), and ``parallel.ac=moe``
    exactly ``moe_recompute_flops_per_token`` (the MoE blocks' router and experts again);
    ``parallel.ac=moe_act`` nothing."""
    spec = tiny_spec()
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    forward = counted_flops(spec, tokens, "none", backward=False)
    attention = 4 * spec.n_layers * spec.n_heads * spec.attention_head_dim() * spec.seq_len
    per_token = spec.block_forward_flops_per_token() - attention + 2 * spec.vocab_size * spec.dim
    assert forward == per_token * tokens.numel()
    extra = counted_flops(spec, tokens, "selective") - counted_flops(spec, tokens, "none")
    assert extra == spec.selective_recompute_flops_per_token() * tokens.numel()
    extra = counted_flops(spec, tokens, "moe") - counted_flops(spec, tokens, "none")
    assert extra == spec.moe_recompute_flops_per_token() * tokens.numel() > 0
    # moe_act recomputes elementwise ops only: the same matmuls.
    assert counted_flops(spec, tokens, "moe_act") == counted_flops(spec, tokens, "none")


PRESETS = ["moe_tiny", "moe_debug", "qwen3_30b_a3b", "qwen3_235b_a22b"]


@pytest.mark.parametrize("preset", PRESETS)
def test_counts_are_those_of_the_built_model(preset):
    """total, embedding and matmul (every weight of two or more dims but the embedding) of the
    meta model; active_matmul is matmul less each MoE block's unchosen experts."""
    spec = model_spec(compose([f"model={preset}"]).model)
    spec.validate()
    counts = spec.count_params()
    params = dict(build_meta_model(spec).named_parameters())
    assert counts["total"] == sum(p.numel() for p in params.values())
    assert counts["embedding"] == params["tok_embeddings.weight"].numel()
    assert counts["matmul"] == sum(
        p.numel() for n, p in params.items() if p.dim() >= 2 and n != "tok_embeddings.weight"
    )
    unchosen = (spec.n_experts - spec.top_k) * 3 * spec.dim * spec.expert_ffn_dim
    moe_blocks = spec.n_layers - spec.n_dense_layers
    assert counts["active_matmul"] == counts["matmul"] - moe_blocks * unchosen
    attention = 12 * spec.n_layers * spec.n_heads * spec.attention_head_dim() * spec.seq_len
    assert spec.flops_per_token() == 6 * counts["active_matmul"] + attention


@pytest.mark.parametrize(
    "preset, total, non_embedding, active",
    [("qwen3_30b_a3b", 30.5, 29.9, 3.3), ("qwen3_235b_a22b", 235, 234, 22)],
)
def test_qwen3_presets_have_the_published_parameter_counts(preset, total, non_embedding, active):
    """The model cards' figures (billions, to the digits they give): total, non-embedding
    (total less the embedding and the untied output layer) and activated per token (the
    active matmul weights and the embedding). Active figures are truncated on the cards
    (3.35 -> 3.3)."""
    counts = model_spec(compose([f"model={preset}"]).model).count_params()
    digits = 1 if isinstance(total, float) else 0
    assert round(counts["total"] / 1e9, digits) == total
    assert round((counts["total"] - 2 * counts["embedding"]) / 1e9, digits) == non_embedding
    activated = (counts["active_matmul"] + counts["embedding"]) / 1e9
    assert active <= activated < active + 10**-digits


@pytest.mark.parametrize(
    "override, key",
    [
        ("top_k=0", "model.top_k=0"),
        ("top_k=9", "model.top_k=9"),
        ("n_experts=0", "model.n_experts=0"),
        ("n_dense_layers=3", "model.n_dense_layers=3"),
        ("n_dense_layers=-1", "model.n_dense_layers=-1"),
        ("n_shared_experts=-1", "model.n_shared_experts=-1"),
        ("score_func=relu", "model.score_func='relu'"),
        ("expert_ffn_dim=36", "model.grouped_mm=true"),
        ("head_dim=15", "model.head_dim"),
        ("n_kv_heads=3", "model.n_kv_heads=3"),
        ("aux_loss_coef=-0.1", "model.aux_loss_coef=-0.1"),
        ("bias_update_speed=-1", "model.bias_update_speed=-1"),
        ("route_scale=0", "model.route_scale=0"),
    ],
)
def test_bad_moe_values_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        tiny_spec(override).validate()


def test_the_loop_reference_takes_widths_the_grouped_matmul_refuses():
    tiny_spec("expert_ffn_dim=36", "grouped_mm=false").validate()


def test_tp_needs_the_sequence_to_split_over_cp_and_tp_even_without_sequence_parallel():
    spec = tiny_spec("seq_len=36")
    spec.check_parallel(cp=1, tp=1, sequence_parallel=False)
    spec.check_parallel(cp=1, tp=2, sequence_parallel=False)
    with pytest.raises(ConfigError, match="parallel.cp x parallel.tp=8"):
        spec.check_parallel(cp=2, tp=4, sequence_parallel=False)


def test_tp_keeps_moe_weights_whole_and_lists_the_norms_as_partial_gradients():
    """No MoE weight is TP-split; attention and the dense FFN split as Llama's; the partial
    gradients are the norms', q/k norms included, in parameter order; norms and the embedding
    get no weight decay."""
    spec = tiny_spec()
    params = dict(built(spec).named_parameters())
    assert all(spec.tp_split_dim(n, True) is None for n in params if ".moe." in n)
    assert spec.tp_split_dim("layers.1.attention.wo.weight", True) == 1
    assert spec.tp_split_dim("layers.0.feed_forward.w1.weight", True) == 0
    assert spec.tp_split_dim("layers.1.attention.q_norm.weight", True) is None
    norms = [p.numel() for n, p in params.items() if n.endswith("norm.weight")]
    assert spec.tp_partial_grad_numels() == norms and len(norms) == 4 * 3 + 1
    no_decay = {n for n in params if spec.no_weight_decay(n)}
    assert no_decay == {n for n in params if n.endswith("norm.weight")} | {"tok_embeddings.weight"}


def test_initial_weights_are_a_function_of_seed_and_name():
    """Two builds with one seed are equal (buffers too); a stacked expert weight is drawn whole
    from its name (the output projections scaled by depth), norms are 1, the bias is 0."""
    spec = tiny_spec()
    a, b = built(spec, seed=7), built(spec, seed=7)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    depth_std = spec.init_std / math.sqrt(2 * spec.n_layers)
    for name, std in (("layers.2.moe.experts.w2", depth_std), ("layers.2.moe.experts.w1", 0.02)):
        expected = initial_value(name, (8, *a.get_parameter(name).shape[1:]), 7, std, "cpu")
        assert torch.equal(a.get_parameter(name), expected)
    assert torch.equal(a.layers["1"].attention.q_norm.weight, torch.ones(16))
    assert "layers.1.moe.router.expert_bias" in a.state_dict()
    assert "layers.1.moe.router.tokens_per_expert" not in a.state_dict()
    assert not built(spec, seed=8).layers["1"].moe.experts.w1.equal(a.layers["1"].moe.experts.w1)


def tp_against_one_process(sequence_parallel: bool) -> dict:
    """On one of 2 gloo ranks: moe_tiny (auxiliary loss on, its per-sequence counts summed
    over tp) under its TP plan against the whole model in this process. Returns the largest
    logit difference, the largest relative gradient difference (MoE weights' gradients summed
    over the ranks' sequence shards, DTensor ones made whole) and whether the routed counts
    summed over the ranks equal the whole model's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    spec = tiny_spec()
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len), generator=generator)
    results = []
    for tp in (False, True):
        model = built(spec)
        if tp:
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            model.tp_plan(mesh, sequence_parallel)

            def sequence_sum(counts):
                counts = counts.clone()
                dist.all_reduce(counts)
                return counts

            for moe in moe_layers(model):
                moe.sequence_sum = sequence_sum
        logits = model(tokens)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            if isinstance(g, DTensor):
                g = g.full_tensor()
            elif tp:  # an MoE weight: this rank's sequence shard's part
                g = g.clone()
                dist.all_reduce(g)
            grads[name] = g
        counts = [m.router.tokens_per_expert.clone() for m in moe_layers(model)]
        if tp:
            for c in counts:
                dist.all_reduce(c)
        results.append((logits.detach(), grads, counts))
    (l0, g0, c0), (l1, g1, c1) = results
    worst = max(((g1[n] - g).abs().max() / g.abs().max()).item() for n, g in g0.items())
    return {
        "logits": (l1 - l0).abs().max().item(),
        "grads": worst,
        "counts": all(torch.equal(a, b) for a, b in zip(c0, c1)),
    }


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_plan_computes_what_one_process_computes(sequence_parallel):
    """Two TP ranks: attention and the dense FFN split, the q/k norms whole with their heads'
    partial gradients summed, the MoE on each rank's sequence shard (its input cut from the
    stream, its output put back), the auxiliary loss from partial P and summed counts."""
    from distributed import run_workers

    for result in run_workers(tp_against_one_process, 2, sequence_parallel).values():
        assert result["logits"] < 1e-5
        assert result["grads"] < 1e-5
        assert result["counts"]


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_moe_tiny_trains_from_the_command_line(job_dir, ac):
    """``python -m hsdp_runner model=moe_tiny parallel=single``: the loss falls over 8 steps
    under every activation checkpointing mode; the full-AC run also saves a checkpoint (the
    balancing bias among its tensors)."""
    from conftest import METERS_OFF, read_job, run_cli

    save = ["checkpoint.enable=true", "checkpoint.interval=8"] if ac == "full" else []
    result = run_cli(
        job_dir,
        "model=moe_tiny",
        "parallel=single",
        f"parallel.ac={ac}",
        "trainer.global_batch_size=8",
        "trainer.steps=8",
        "logger=none",
        *METERS_OFF,
        *save,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records, summary = read_job(job_dir)
    losses = [r["loss"] for r in records]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.05, losses
    assert summary["flops_per_token"] == tiny_spec().flops_per_token()
    if save:
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(job_dir / "checkpoints" / "step-8").read_metadata()
        assert "model.layers.2.moe.router.expert_bias" in saved.state_dict_metadata


def test_the_model_trains_on_fake_tensors_in_bf16():
    """The planner measures memory on fake tensors: routing and counting keep static shapes
    (no ``bincount``, no host sync on the grouped path). fp32 is not covered: torch 2.13's
    meta function of ``_grouped_mm`` accepts bf16 only (its kernels accept fp32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode():
            model = tiny_spec().build()
            model(torch.randint(0, 256, (2, 32))).float().square().mean().backward()
            assert model.layers["2"].moe.experts.w2.grad.shape == (8, 64, 32)
    finally:
        torch.set_default_dtype(default)
