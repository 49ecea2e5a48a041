"""Float8 training of the linear layers and the routed experts (``precision.float8``),
through torchao.

torchao's ``convert_to_float8_training`` swaps the chosen ``nn.Linear`` layers for its
``Float8Linear``: each matmul casts its operands to float8 with dynamic scales (one per tensor
or per row, the recipe's choice) and multiplies them on float8 tensor cores. Nothing else
changes: parameters, gradients, optimizer state and checkpoints keep the master dtype, so a
float8 checkpoint resumes under bf16 and back, and HF export is the same.

- ``keeps_high_precision``: the module filter. The output layer (the one linear that produces
  the vocabulary's logits: float8 there costs accuracy for little time), a MoE router's gate
  (its logits choose the experts; a small matmul) and every linear whose local matmul dims
  (after TP) are not multiples of 16 (``torch._scaled_mm``'s constraint) stay in
  ``param_dtype``.
- The routed experts (``GroupedExperts``, models with ``model.n_experts``) stay in
  ``param_dtype`` unless ``precision.float8_experts=true`` (measured 5.2x slower than bf16 on
  an H200): then ``float8_experts.py`` wraps them in torchao's float8 rowwise grouped matmul,
  refuses what it cannot run, and says why.
- ``convert``: applied to the meta model before TP, AC, compile and FSDP (torchtitan's order).
  ``emulate=True`` exactly when the device is the CPU (casts and scales as on a GPU, matmuls in
  higher precision); on a GPU it never emulates: ``check_device`` refuses a GPU without float8
  tensor cores before any worker starts.
- FSDP/HSDP gather the weights in float8 (``precision.float8_all_gather``, tensorwise only):
  torchao's weight subclass casts each shard before the all-gather; its scales come from
  ``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step (``after_update``).
- TP: on GPUs torchao's float8 styles (``tp_styles``) all-gather activations in float8
  (tensorwise); on CPU, where gloo cannot carry float8, torch's styles in the compute dtype.
- The console: torchao is imported here only (``torchao_float8``). On a CPU-only torch build
  its import logs "Failed to load ..._C_mxfp8...so / _C_cutlass_90a..." (its CUDA kernels)
  and "Detected no triton", and torch logs a ``register_constant`` deprecation for each Enum
  torchao registers; those exact lines are filtered during the import, and one line says
  which kernels are missing and why emulation does not need them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from hsdp_runner.core.choices import DPMode, Float8Recipe
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import ModelConfig, build_meta_model, model_spec
from hsdp_runner.models.common import TPStyles

if TYPE_CHECKING:  # annotations only: benchmarks/float8_gpu_check.py runs without Hydra
    from hsdp_runner.config.schema import PrecisionConfig

# torch._scaled_mm needs both matmul dims of the weight to be multiples of 16.
FLOAT8_ALIGN = 16
# Float8 tensor cores: Ada (8.9) and Hopper (9.0) onward.
MIN_CAPABILITY = (8, 9)
# The router's linear, kept in param_dtype (keeps_high_precision).
ROUTER_GATE = "router.gate"
TORCHAO_FIX = "pip install torchao==0.18.0 (the release pyproject.toml pins)"
log = logging.getLogger(__name__)


def enabled(precision: PrecisionConfig) -> bool:
    """True when ``precision`` trains linear layers in float8."""
    return Float8Recipe(precision.float8) is not Float8Recipe.none


class _ImportNoise(logging.Filter):
    """Drops what torchao logs while it is imported that concerns no job: on a CPU-only torch
    build its CUDA kernel libraries failing to load and Triton missing (``kernels`` keeps
    their names), and torch's deprecation of ``register_constant`` on the Enum subclasses
    torchao registers."""

    def __init__(self, cpu_build: bool):
        super().__init__()
        self.cpu_build, self.kernels = cpu_build, []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torch.utils._pytree":
            return _PYTREE_ENUM not in message
        failed = _KERNEL_LOAD.match(message) if record.name == "torchao" else None
        if self.cpu_build and failed:
            self.kernels.append(Path(failed.group(1)).name.split(".")[0])
            return False
        if self.cpu_build and record.name == _INTMM and _NO_TRITON in message:
            self.kernels.append("Triton (int8 matmuls)")
            return False
        return True


# torchao/__init__.py: logger.warning(f"Failed to load {file}: {e}") for each _C*.so;
# torchao/kernel/intmm.py: "Warning: Detected no triton, ..."; torch/utils/_pytree.py: "...
# Calling register_constant() on Enum subclasses is deprecated ...".
_KERNEL_LOAD = re.compile(r"Failed to load (\S+?): ")
_INTMM, _NO_TRITON = "torchao.kernel.intmm", "Detected no triton"
_PYTREE_ENUM = "Calling register_constant() on Enum subclasses is deprecated"


def _import_torchao_float8():
    """Import ``torchao.float8`` with ``_ImportNoise`` on the two loggers it fills; say once,
    in one line, which kernel libraries did not load and why that does not matter here."""
    noise = _ImportNoise(cpu_build=not (torch.version.cuda or torch.version.hip))
    loggers = [logging.getLogger(name) for name in ("torchao", _INTMM, "torch.utils._pytree")]
    for logger in loggers:
        logger.addFilter(noise)
    try:
        import torchao.float8 as ao_float8
    finally:
        for logger in loggers:
            logger.removeFilter(noise)
    if noise.kernels:
        log.info(
            "torchao: its GPU kernels (%s) are not available in this CPU-only torch build; "
            "precision.float8 does not use them here: it is emulated on the CPU (float8 casts "
            "and scales, matmuls in float32)",
            ", ".join(noise.kernels),
        )
    return ao_float8


def torchao_float8():
    """The ``torchao.float8`` module (imported once, without torchao's import-time noise:
    ``_import_torchao_float8``); ConfigError naming the fix when torchao is absent."""
    if "torchao.float8" in sys.modules:
        return sys.modules["torchao.float8"]
    try:
        return _import_torchao_float8()
    except ImportError as err:
        raise ConfigError(
            f"precision.float8 needs torchao, which does not import here ({err}); {TORCHAO_FIX}"
        ) from None


def check_device(precision: PrecisionConfig, gpus: int, capability=None, name=None) -> None:
    """Raise ConfigError when float8 is asked for on GPUs without float8 tensor cores.

    ``gpus``: GPUs the job uses (0 on CPU, where torchao emulates float8). ``capability`` and
    ``name`` default to ``torch.cuda``'s for GPU 0 (tests pass their own)."""
    if not enabled(precision) or not gpus:
        return
    capability = tuple(capability or torch.cuda.get_device_capability(0))
    if capability >= MIN_CAPABILITY:
        return
    name = name or torch.cuda.get_device_name(0)
    raise ConfigError(
        f"precision.float8={precision.float8} needs float8 tensor cores (compute capability "
        f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: L4/L40S, H100, H200, B200); {name} is "
        f"{capability[0]}.{capability[1]}. Use precision=bf16 (float8 is emulated on device=cpu "
        "only, never on a GPU)"
    )


def keeps_high_precision(
    fqn: str, weight_shape: tuple[int, int], vocab_size: int, tp: int, split_dim
) -> bool:
    """True for a linear layer that stays in ``param_dtype``: the output layer (``vocab_size``
    outputs), a router's gate (``ROUTER_GATE``) or one whose local weight (``weight_shape`` split by ``tp`` on
    ``split_dim(fqn)``, None: not split) has a dim that is not a multiple of 16."""
    out_features, in_features = weight_shape
    if out_features == vocab_size or fqn.endswith(ROUTER_GATE):
        return True
    local = [out_features, in_features]
    dim = split_dim(fqn)
    if dim is not None and tp > 1:
        local[dim] //= tp
    return any(n % FLOAT8_ALIGN for n in local)


def high_precision_linears(model_cfg: ModelConfig, tp: int, sequence_parallel: bool) -> dict:
    """{name: weight shape} of the model's linears ``keeps_high_precision`` keeps out of
    float8 at TP degree ``tp`` (the output layer among them), from a meta model."""
    spec = model_spec(model_cfg)
    kept = {}
    for fqn, module in build_meta_model(model_cfg).named_modules():
        if isinstance(module, nn.Linear) and keeps_high_precision(
            fqn,
            tuple(module.weight.shape),
            model_cfg.vocab_size,
            tp,
            lambda name: spec.tp_split_dim(f"{name}.weight", sequence_parallel),
        ):
            kept[fqn] = tuple(module.weight.shape)
    return kept


def check_tp(model_cfg: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """Raise ConfigError when tensorwise float8 under TP would leave a block linear in high
    precision: torchao's float8 TP styles take float8 inputs, which such a layer cannot."""
    if tp < 2:
        return
    kept = {
        fqn: shape
        for fqn, shape in high_precision_linears(model_cfg, tp, sequence_parallel).items()
        if shape[0] != model_cfg.vocab_size
    }
    if kept:
        fqn, shape = next(iter(kept.items()))
        raise ConfigError(
            f"precision.float8 with parallel.tp={tp}: {len(kept)} block linear(s) have a local "
            f"dim that is not a multiple of {FLOAT8_ALIGN} (e.g. {fqn}, weight {shape} split "
            f"{tp} ways) and would stay in high precision, which torchao's float8 TP styles "
            "cannot feed; use a smaller parallel.tp or widths that are multiples of "
            f"{FLOAT8_ALIGN} x tp"
        )


def linear_config(precision: PrecisionConfig, emulate: bool, fsdp_all_gather: bool):
    """torchao's ``Float8LinearConfig`` for ``precision.float8``'s recipe; ``emulate`` on CPU,
    float8 all-gather when FSDP/HSDP shard the weights and the precision asks for it."""
    ao = torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(str(precision.float8))
    return dataclasses.replace(
        config,
        emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp_all_gather and precision.float8_all_gather,
    )


def gathers_float8(precision: PrecisionConfig, dp_mode: DPMode) -> bool:
    """True when the weights' FSDP/HSDP all-gather carries float8 (1 byte per element)."""
    return (
        enabled(precision)
        and precision.float8_all_gather
        and DPMode(dp_mode) in (DPMode.fsdp, DPMode.hsdp)
    )


def convert(
    model: nn.Module,
    precision: PrecisionConfig,
    device: torch.device,
    dp_mode: DPMode,
    vocab_size: int,
    tp: int = 1,
    split_dim: Callable[[str], int | None] = lambda fqn: None,
) -> list[str]:
    """Swap ``model``'s eligible linears for torchao's ``Float8Linear``, in place, before any
    parallelism; returns the converted layers' names. Linears are emulated exactly when
    ``device`` is the CPU. ``split_dim(fqn)``: the dim TP splits that layer's weight on (None:
    whole). The routed experts are ``float8_experts.convert``'s (a job's build calls both)."""
    if not enabled(precision):
        return []
    ao = torchao_float8()
    if device.type == "cuda":
        check_device(precision, 1)  # never emulated on a GPU; validation refused this already
    converted = []

    def keep_float8(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        high = keeps_high_precision(
            fqn, tuple(module.weight.shape), vocab_size, tp, lambda _: split_dim(fqn)
        )
        if not high:
            converted.append(fqn)
        return not high

    config = linear_config(precision, device.type == "cpu", gathers_float8(precision, dp_mode))
    ao.convert_to_float8_training(model, module_filter_fn=keep_float8, config=config)
    return converted


def _float8_linears(model: nn.Module) -> list[nn.Module]:
    """The torchao ``Float8Linear`` layers of ``model`` (none without torchao)."""
    return [m for m in model.modules() if type(m).__name__ == "Float8Linear"]


def tp_styles(model: nn.Module, device_type: str) -> TPStyles:
    """The TP styles of ``model``'s block linears: torchao's float8 ones (activations
    all-gathered in float8; they assume tensorwise scaling) when the model was converted with
    the tensorwise recipe and the TP mesh is on a GPU; torch's otherwise. On CPU (gloo) the
    float8 styles cannot run: gloo has no float8 dtype ("Invalid scalar type" in the
    all-gather), so there the float8 linears take bf16 activations through torch's styles."""
    linears = _float8_linears(model)
    if not linears or device_type == "cpu":
        return TPStyles()
    ao = torchao_float8()
    if linears[0].config.cast_config_input.scaling_granularity != ao.ScalingGranularity.TENSORWISE:
        return TPStyles()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return TPStyles(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)


def after_update(
    chunks: list[nn.Module], precision: PrecisionConfig, dp_mode: DPMode
) -> Callable[[torch.Tensor], None] | None:
    """What runs after each optimizer step over the rank's model ``chunks`` (one, or its
    pipeline stages): with float8 all-gather, torchao's scale precompute (one all-reduce of
    every float8 weight's amax, so the next all-gather sends float8 shards with the scale of
    the whole weight); else None. The hook takes the step's ``applied`` flag (``after_update``'s
    contract) and needs none: a skipped step left the weights, hence their scales, as they were."""
    if not gathers_float8(precision, dp_mode):
        return None
    precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp

    def run(applied: torch.Tensor) -> None:
        for chunk in chunks:
            precompute(chunk)

    return run


# torchao's weight wrappers and the attribute holding the tensor each wraps: the float8
# linears' under float8 all-gather, the routed experts' (``convert_experts``).
_WRAPPERS = {
    "WeightWithDynamicFloat8CastTensor": "_tensor",
    "Float8TrainingWeightWrapperTensor": "_data",
}


def _plain(tensor):
    """``tensor`` without torchao's weight wrapper (the same storage): a DTensor whose local
    shard is a wrapper gets a DTensor of the wrapped tensor; anything else as it is."""
    from torch.distributed.tensor import DTensor

    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    attr = _WRAPPERS.get(type(local).__name__)
    inner = getattr(local, attr, None) if attr else None
    if inner is None:
        return tensor
    if not isinstance(tensor, DTensor):
        return inner
    return DTensor.from_local(
        inner,
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
    )


def plain_state(state):
    """A (nested) state dict with every float8 weight wrapper replaced by the tensor it wraps.

    With float8 all-gather, torchao wraps each float8 linear's weight (and, through
    ``zeros_like``, AdamW's moments of it) in ``WeightWithDynamicFloat8CastTensor``, and the
    routed experts' weights in ``Float8TrainingWeightWrapperTensor``; saved as is, a
    checkpoint would pickle that class and load only where torchao is imported and
    allow-listed. The checkpointer saves, loads and exports through this instead, so a float8
    checkpoint holds plain tensors of the master dtype, like any other."""
    return torch.utils._pytree.tree_map(_plain, state)
