"""The mixture-of-experts family (models/moe.py, models/moe_routing.py), single process: the
grouped-matmul experts against the per-expert loop, the routing rules, the balance statistics
and the auxiliary loss, parameter counts of the presets, and short training runs."""

from __future__ import annotations

import copy

import torch

from hsdp_runner.config.compose import compose
from hsdp_runner.models.base import model_spec
from hsdp_runner.models.moe_routing import GroupedExperts


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
    results = []
    for experts in (grouped, loop):
        xi = x.clone().requires_grad_()
        out = experts(xi, counts)
        (out * g).sum().backward()
        results.append((out, xi.grad, *(w.grad for w in experts.parameters())))
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
