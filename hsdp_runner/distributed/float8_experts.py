"""Float8 for the routed experts' grouped matmuls (``precision.float8_experts=true``), through
torchao's MoE training recipe: which models it converts (``converts_experts``), what it
refuses (``check_experts``) and the conversion (``convert``: a job's build calls it right
after ``float8.convert``, which converts the linears).

The wrapper (``torchao.prototype.moe_training``: ``quantize_`` with ``Float8TrainingOpConfig``)
has a ``__torch_function__`` that turns each ``torch._grouped_mm`` into a float8 rowwise
``torch._scaled_grouped_mm`` (dynamic per-row scales, e4m3 for every operand, bf16 out),
forward and both backward matmuls: the one recipe torchao has for grouped matmuls in float8,
whatever ``precision.float8`` names for the linears. The weights stay in the master dtype and
FSDP gathers them in ``param_dtype`` (the wrapper's FSDP2 hooks: no float8 all-gather). Each
expert's rows are padded with zero rows to a multiple of 16 (``GroupedExperts.group_rows``).

Off by default: measured on an H200 (torch 2.11, torchao 0.17, eager; docs/precision.md,
"Routed experts") the experts' forward + backward ran 5.2x slower than bf16, a 2-block
Qwen3-30B step at 0.68x bf16's tokens/s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed import float8
from hsdp_runner.models.base import ModelConfig, routed_experts

if TYPE_CHECKING:  # annotations only, as in float8.py (its GPU check runs without Hydra)
    from hsdp_runner.config.schema import PrecisionConfig

# torch._scaled_grouped_mm (the experts' float8 matmul) runs on these compute capabilities
# only ("only supported on CUDA devices with compute capability = [9.0, 10.0]", torch 2.11
# to 2.13): H100/H200 and B200, not Ada (8.9) nor 12.x.
GROUPED_CAPABILITIES = ((9, 0), (10, 0))


def converts_experts(precision: PrecisionConfig, model_cfg: ModelConfig) -> bool:
    """True when ``precision`` trains ``model_cfg``'s routed experts in float8 (``convert``
    wraps them: experts running grouped matmuls), as the planner prices them."""
    return (
        float8.enabled(precision)
        and precision.float8_experts
        and routed_experts(model_cfg) > 0
        and bool(getattr(model_cfg, "grouped_mm", True))
    )


def check_experts(
    precision: PrecisionConfig,
    model_cfg: ModelConfig,
    gpus: int,
    compile: bool = False,
    capability=None,
) -> None:
    """Raise ConfigError for ``precision.float8_experts=true`` (float8 training of a model's
    routed experts) where torchao's float8 grouped matmul (``convert``'s expert path) cannot
    run; without the switch the experts stay in ``param_dtype`` and nothing is refused: on the CPU (``gpus`` 0:
    its kernels are Triton and CUDA); on a GPU outside ``GROUPED_CAPABILITIES``
    (``capability``: the job's GPU's, ``check_device``'s (major, minor); None, as the planner
    passes, is not checked); with expert dims that are not multiples of 16; with the per-expert loop
    (``model.grouped_mm=false``: plain matmuls the wrapper does not convert, so the experts
    would silently stay in bf16); with ``compile`` (``parallel.compile``: torchao 0.17/0.18
    skip their own float8 rowwise MoE test under torch.compile, "'FakeTensor' object has no
    attribute '__tensor_flatten__'"). Expert parallel, FSDP/HSDP and TP (which leaves the
    experts whole) are not refused: the wrapper survives ``distribute_tensor`` and carries
    FSDP2's all-gather hooks."""
    experts = routed_experts(model_cfg)
    if not float8.enabled(precision) or not experts or not precision.float8_experts:
        return
    head = (
        f"precision.float8={precision.float8} with a model with experts (model.n_experts={experts})"
    )
    if not gpus:
        raise ConfigError(
            f"{head}: torchao's float8 grouped matmul runs on GPUs only; use precision=bf16"
        )
    if not getattr(model_cfg, "grouped_mm", True):
        raise ConfigError(
            f"{head} and model.grouped_mm=false: float8 converts the experts' grouped matmuls, "
            "not the per-expert loop; set model.grouped_mm=true or use precision=bf16"
        )
    dims = {"model.dim": model_cfg.dim, "model.expert_ffn_dim": model_cfg.expert_ffn_dim}
    bad = {key: n for key, n in dims.items() if n % float8.FLOAT8_ALIGN}
    if bad:
        key, n = next(iter(bad.items()))
        raise ConfigError(
            f"{head}: {key}={n} is not a multiple of {float8.FLOAT8_ALIGN}, which torchao's float8 "
            f"grouped matmul needs of both expert dims; use widths that are multiples of "
            f"{float8.FLOAT8_ALIGN} or precision=bf16"
        )
    if compile:
        raise ConfigError(
            f"{head} and parallel.compile=true: torchao's float8 rowwise grouped matmul does "
            "not compile in torchao 0.17/0.18 (its own test is skipped: 'FakeTensor' object "
            "has no attribute '__tensor_flatten__'); set parallel.compile=false or use "
            "precision=bf16"
        )
    if capability is not None and tuple(capability) not in GROUPED_CAPABILITIES:
        shown = ", ".join(f"{a}.{b}" for a, b in GROUPED_CAPABILITIES)
        raise ConfigError(
            f"{head}: torch._scaled_grouped_mm, the experts' float8 matmul, runs on compute "
            f"capability {shown} only (H100, H200, B200); this GPU is "
            f"{capability[0]}.{capability[1]}; use precision=bf16"
        )


def _grouped_experts(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of ``model``'s routed experts that run grouped matmuls: the modules
    with ``models/moe_routing.GroupedExperts``' ``group_rows`` and ``grouped_mm`` set (by
    what they hold, not their class: the runner reaches model families only through
    ``models.base``)."""
    return {
        fqn: m
        for fqn, m in model.named_modules()
        if hasattr(m, "group_rows") and getattr(m, "grouped_mm", False) is True
    }


def convert_experts(model: nn.Module, device: torch.device) -> list[str]:
    """Wrap the stacked weights of ``model``'s routed experts in torchao's float8 MoE
    training weight (``quantize_`` with ``Float8TrainingOpConfig()``: float8 rowwise grouped
    matmuls, bf16 out, no token padding of its own) and set their ``group_rows`` to 16, the
    padding that matmul needs; returns the wrapped weights' names. ConfigError on the CPU
    (``check_experts`` refused such a job already)."""
    found = _grouped_experts(model)
    if not found:
        return []
    if device.type == "cpu":
        raise ConfigError(
            "precision.float8 with a model with experts: torchao's float8 grouped matmul "
            "runs on GPUs only; use precision=bf16"
        )
    float8.torchao_float8()  # its import, without the noise
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization.quant_api import quantize_

    modules = {id(m) for m in found.values()}
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: id(m) in modules)
    names = []
    for fqn, module in found.items():
        module.group_rows = float8.FLOAT8_ALIGN
        names += [f"{fqn}.{name}" for name, _ in module.named_parameters(recurse=False)]
    return names


def convert(model: nn.Module, precision: PrecisionConfig, device: torch.device) -> list[str]:
    """Wrap ``model``'s routed experts (``convert_experts``) when ``precision`` asks for them
    (float8 training with ``precision.float8_experts``); returns the wrapped weights' names."""
    if not (float8.enabled(precision) and precision.float8_experts):
        return []
    return convert_experts(model, device)
