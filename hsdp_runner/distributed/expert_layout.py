"""Expert parallel's degree (``parallel.ep``): every check of it, and how it splits the ranks.

``ep`` multiplies nothing into the world size: it borrows its ranks from the ``dp_shard x cp x
tp`` ranks of one replica (``TOKEN_DIMS``: the ranks holding distinct tokens; tp too, since a
mixture of experts runs on each tp rank's part of the sequence), split row-major into ``efsdp
x ep`` with ep innermost. ``ParallelDims`` holds the degree and raises what ``layout_refusal``
returns before any worker starts; ``split_dims`` says when ep's and efsdp's groups are whole
mesh dims, so the world mesh reuses their groups (``ParallelDims.same_group``). The parity
runner skips a layout ``expert_refusal`` refuses for its model.
"""

from __future__ import annotations

from typing import Optional, Protocol

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.world_mesh import EXPERT_VIEWS
from hsdp_runner.models.base import ModelConfig, routed_experts

# The dims expert parallel borrows its ranks from, outer to inner (row-major: ep innermost).
TOKEN_DIMS = EXPERT_VIEWS["dp_shard_cp_tp"]


class Layout(Protocol):
    """What the checks read of a layout's degrees (``ParallelDims``, which imports this
    module)."""

    dp_shard: int
    cp: int
    tp: int
    ep: int


def check_ep_value(ep) -> None:
    """Raise ConfigError for an expert-parallel degree below 1 (it is never inferred)."""
    if not isinstance(ep, int) or ep < 1:
        raise ConfigError(
            f"parallel.ep={ep} is invalid; use a positive degree (1: no expert parallel). It "
            "is never inferred (-1): it borrows ranks from parallel.dp_shard x parallel.cp x "
            "parallel.tp instead of adding to the world size"
        )


def layout_refusal(dims: Layout, model: Optional[ModelConfig]) -> Optional[str]:
    """Why ``dims`` cannot run expert parallel with ``model`` (None: not checked), a message
    naming the keys and the fix, or None: ep not dividing the ``dp_shard x cp x tp`` ranks it
    borrows, or what ``expert_refusal`` finds."""
    borrowed = dims.dp_shard * dims.cp * dims.tp
    if borrowed % dims.ep:
        return (
            f"parallel.ep={dims.ep} does not divide parallel.dp_shard x parallel.cp x "
            f"parallel.tp = {dims.dp_shard} x {dims.cp} x {dims.tp} = {borrowed}: expert "
            "parallel borrows its ranks from those of one replica holding distinct tokens; use "
            f"a parallel.ep dividing {borrowed}, or raise those degrees"
        )
    return expert_refusal(dims.ep, model)


def expert_refusal(ep: int, model: Optional[ModelConfig]) -> Optional[str]:
    """Why the model ``model`` (None: not checked) cannot run expert parallel over ``ep`` ranks
    (a message naming the keys and the fix), or None: a dense model with ep > 1, or ep not
    dividing its experts."""
    if model is None:
        return None
    experts = routed_experts(model)
    if ep > 1 and not experts:
        return (
            f"parallel.ep={ep} needs a model with experts, but model={model.name} is dense (no "
            "model.n_experts); set parallel.ep=1, or choose a mixture-of-experts model (e.g. "
            "model=moe_tiny)"
        )
    if experts % ep:
        return (
            f"parallel.ep={ep} does not divide model.n_experts={experts}: each ep rank holds "
            f"n_experts / ep of them; use a parallel.ep dividing {experts}"
        )
    return None


def split_dims(dims: Layout) -> Optional[dict[str, tuple[str, ...]]]:
    """{'efsdp': dims, 'ep': dims} when ep's groups are whole dims of ``TOKEN_DIMS`` (the
    innermost ones whose sizes multiply to ep, e.g. tp or cp x tp; size-1 dims left out), the
    rest efsdp's; None when ep cuts a dim (the world mesh then makes both groups anew)."""
    inner = [dim for dim in TOKEN_DIMS if getattr(dims, dim) > 1]
    size, cut = 1, len(inner)
    while size < dims.ep and cut > 0:
        cut -= 1
        size *= getattr(dims, inner[cut])
    if size != dims.ep:
        return None
    return {"efsdp": tuple(inner[:cut]), "ep": tuple(inner[cut:])}
