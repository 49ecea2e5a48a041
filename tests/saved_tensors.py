"""What autograd keeps for backward, for the tests of what a layer saves (the MoE layer's
combine, the dense norms and RoPE)."""

from __future__ import annotations

import torch


def saved_by(module, *inputs) -> list[torch.Tensor]:
    """The tensors autograd keeps for backward while ``module(*inputs)`` runs, each storage
    once, the module's parameters and the inputs aside; backward then runs on them (so a
    saved tensor that backward cannot use would fail here)."""
    params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
    skip = {t.untyped_storage().data_ptr() for t in [*params, *inputs]}
    saved = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = module(*inputs)
    out.float().square().sum().backward()
    return list(saved.values())
