"""Parameter helpers shared by the model, the sharding applier and the pre-flight checks.

They know tensors and names, not meshes or layouts: a model file copies its initial values with
``copy_full_into`` without importing the sharding applier, and the launcher and communication
model resolve ``trainer.freeze`` patterns on a meta model with ``frozen_names``.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from hsdp_runner.core.errors import ConfigError


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name ('float32', 'bfloat16', 'float16', or a ``Dtype`` member) to a torch
    dtype: the one place a config's dtype name becomes a ``torch.dtype``."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{name!r} is not a torch dtype; use float32, bfloat16 or float16")
    return dtype


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full (unsharded) value ``full`` into ``param``, keeping only this rank's shard.

    Works for plain tensors and for DTensors with any placements, strided sharding included:
    the full value is wrapped as a replicated DTensor and redistributed, which slices locally.
    """
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(param, DTensor):
        mesh = param.device_mesh
        replicated = DTensor.from_local(
            full.to(param.device, param.dtype), mesh, [Replicate()] * mesh.ndim, run_check=False
        )
        param.to_local().copy_(replicated.redistribute(mesh, param.placements).to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


def frozen_names(names, patterns) -> list[str]:
    """The parameter ``names`` matching any of ``patterns`` (fnmatch), sorted.

    Raises ConfigError naming ``trainer.freeze`` when a pattern matches nothing (a typo would
    train everything).
    """
    names = list(names)
    frozen = set()
    for pattern in patterns:
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise ConfigError(
                f"trainer.freeze pattern {pattern!r} matches no parameter; names "
                f"look like {names[0]!r}, {names[1]!r}"
            )
        frozen.update(matched)
    return sorted(frozen)


def freeze_parameters(model: nn.Module, patterns) -> list[str]:
    """Set requires_grad=False on parameters whose name matches a pattern (fnmatch).

    Call before any wrapping, on plain names. Returns the frozen names; raises ConfigError as
    ``frozen_names`` does.
    """
    params = dict(model.named_parameters())
    frozen = frozen_names(params, patterns)
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen
