"""The least memory any layout of a world can hold a model's training state in: a refusal in
seconds for a model that fits nowhere, before anything is measured.

Whatever the layout, each parameter's master copy, its gradient and AdamW's two moments are
held somewhere, and no layout spreads them over more than every rank: TP, FSDP, cp, ep and
pipeline stages only decide how they are split. So (parameters + 3 x trainable parameters) x
the master dtype's bytes / the world size, plus the cluster's ``memory_reserve_gib``, is a
lower bound of every layout's peak (activations, gathered weights and buffers come on top).
When it exceeds a device's memory, measuring layouts (about a minute for a 70B model) can
only end in "fits nowhere": the planner and ``parallel=auto`` say so at once.
"""

from __future__ import annotations

import math

from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import build_meta_model
from hsdp_runner.models.params import frozen_names, torch_dtype

GIB = 2**30


def state_lower_bound_gib(run: RunConfig, world_size: int, reserve_gib: float) -> float:
    """GiB per rank that every layout of ``world_size`` ranks needs at least for ``run``'s model
    (module docstring): its parameters, gradients and AdamW moments spread over every rank,
    plus ``reserve_gib``."""
    params = dict(build_meta_model(run.model).named_parameters())
    frozen = set(frozen_names(params, run.trainer.freeze))
    total = sum(p.numel() for p in params.values())
    trainable = sum(p.numel() for name, p in params.items() if name not in frozen)
    master = torch_dtype(run.precision.master_dtype).itemsize
    return (total + 3 * trainable) * master / world_size / GIB + reserve_gib


def check_state_fits(run: RunConfig, world_size: int, device_gib: float, reserve_gib: float):
    """Raise ConfigError when ``state_lower_bound_gib`` exceeds ``device_gib``: the model fits
    on no layout of ``world_size`` devices, with the ranks it would need at least."""
    need = state_lower_bound_gib(run, world_size, reserve_gib)
    if need <= device_gib:
        return
    state_gib = (need - reserve_gib) * world_size
    ranks = math.ceil(state_gib / max(device_gib - reserve_gib, 1e-9))
    raise ConfigError(
        f"model {run.model.name} fits on no layout of {world_size} x {device_gib:.1f} GiB "
        f"devices: its parameters, gradients and AdamW state alone ({state_gib:.1f} GiB in "
        f"{run.precision.master_dtype}) need {need:.1f} GiB per rank even sharded over every "
        f"rank; use at least {ranks} ranks (cluster.nodes, launcher.nnodes), devices with more "
        "memory, or a smaller model"
    )
