"""The model seam: what the runner needs from a model family, and the one place it is built.

A family is one module under ``hsdp_runner/models/`` holding
- a config dataclass that extends ``ModelConfig`` (the shared fields) with its own. It is the
  family's Hydra schema (so a typo in ``conf/model/*.yaml`` or an override fails at
  composition) and, built by ``hydra.utils.instantiate`` from the YAML's ``_target_``, the
  object the runner asks about the model: it implements ``ModelSpec``;
- the ``nn.Module`` that ``ModelSpec.build`` returns, which implements ``ParallelModule``.

Nothing outside ``hsdp_runner/models/`` imports a family module: the runner reaches a model
through ``model_spec`` and ``build_meta_model`` only. Families are found by walking this
package (``family_schemas``), so adding one edits no list here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import pkgutil
import re
from typing import TYPE_CHECKING, Optional, Protocol

from omegaconf import MISSING

from hsdp_runner.core.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a model is built: config/schema.py imports this module
    import torch
    from torch import nn

# The family of model configs saved before ``_target_`` existed (checkpoint manifests): Llama
# was the only one then.
LEGACY_TARGET = "hsdp_runner.models.llama.LlamaConfig"


@dataclasses.dataclass
class ModelConfig:
    """Fields every family has; the runner's shape arithmetic (mesh checks, communication
    model, planner, data) reads only these. Families add theirs in a subclass."""

    _target_: str = MISSING
    name: str = MISSING
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    vocab_size: int = MISSING
    seq_len: int = MISSING
    init_std: float = 0.02

    def tp_partial_without_sequence_parallel(self, param: str) -> bool:
        """Whether TP leaves parameter ``param``'s gradient partial over the TP ranks without
        sequence parallel too: a parameter kept whole whose input the TP plan splits (a norm
        over each attention head's channels). None by default; a family overrides this."""
        return False


class ParallelModule(Protocol):
    """The module a family builds. ``forward(tokens)`` returns logits (batch, seq, vocab).

    Cut to a pipeline stage (``keep_stage`` below), the modules a stage does not hold
    are None: without the first ones (``pipeline_ends``) forward takes the previous stage's
    hidden state (batch, seq, dim) instead of tokens, without the last ones it returns its
    hidden state instead of logits.
    """

    # Set by the sharding applier when compiled blocks follow a TP embedding: forward must
    # then clone the embedding output before the first block (see parallelize.apply_compile).
    clone_embedding_output: bool

    def blocks(self) -> nn.ModuleDict:
        """The repeated blocks, keyed "0".."n-1": activation checkpointing replaces its entries,
        compile and FSDP wrap each one (the rest of the model is FSDP's root unit)."""

    def pipeline_ends(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """How the family splits into pipeline stages: the names of the top-level modules
        that run before the blocks (the embeddings: held by the first stage) and after them
        (final norm and output layer: held by the last)."""

    def tp_plan(
        self, tp_mesh, sequence_parallel: bool, styles=None, loss_parallel: bool = False
    ) -> None:
        """Apply the family's tensor (and optionally sequence) parallel plan on ``tp_mesh``;
        the blocks' linears and their inputs take ``styles`` (``common.TPStyles``, default
        torch's); the output layer is ``common.output_layer_style(stream, loss_parallel)``."""

    def init_weights(self, seed: int) -> None:
        """Fill every parameter and buffer; each parameter's full value must be a function of
        (seed, parameter name) alone (``initial_value``), so every layout starts equal."""

    def shard_sequence(self, shard: SequenceShard) -> None:
        """Run on one context-parallel rank's part of each sequence from now on: token
        positions come from ``shard.positions`` and every block's causal attention is
        ``shard.attention`` (the model's own is ``attend``-compatible: see below)."""


class SequenceShard(Protocol):
    """One context-parallel rank's view of each sequence (``context_parallel.SequenceShard``),
    handed to the model so the model file needs no collective of its own."""

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Positions in the full sequence of the rank's ``local_len`` tokens, in their order."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the rank's queries (batch, heads, local seq, head_dim) over the
        whole sequence's keys and values (batch, kv_heads, local seq, head_dim each)."""


class ModelSpec(Protocol):
    """What the runner asks a family's config (an instance of its ``ModelConfig`` subclass)."""

    def validate(self) -> None:
        """Raise ConfigError naming the ``model.*`` key for a family-specific bad value."""

    def build(self) -> ParallelModule:
        """The model on the current default device (``torch.device('meta')`` to build empty)."""

    def tp_split_dim(self, param: str, sequence_parallel: bool) -> Optional[int]:
        """The dim parameter ``param`` is split on by the TP plan (None: whole on every rank)."""

    def tp_partial_grad_numels(self) -> list[int]:
        """Sizes of the parameters kept whole on every TP rank while their input is
        sequence-sharded (the norms): their gradients are partial and all-reduced once a step."""

    def count_params(self) -> dict:
        """{'total', 'embedding', 'matmul'} parameter counts (matmul: weights of Linear layers)."""

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward and backward)."""

    def block_forward_flops_per_token(self) -> float:
        """Forward FLOPs per token of all blocks: what full activation checkpointing repeats."""

    def selective_recompute_flops_per_token(self) -> float:
        """Forward FLOPs per token of the matmuls selective activation checkpointing recomputes
        (``parallelize._selective_contexts``: a block's 2nd, 4th, ... matmul in call order)."""

    def moe_recompute_flops_per_token(self) -> float:
        """Forward matmul FLOPs per token of the MoE blocks' feed-forward, which
        ``parallel.ac=moe`` recomputes (models with routed experts only)."""

    def kv_dim(self) -> int:
        """Width of one token's keys (and of its values) in a block: what context parallel
        all-gathers per token and layer."""

    def check_parallel(self, cp: int, tp: int, sequence_parallel: bool) -> None:
        """Raise ConfigError naming the ``parallel.*`` key for degrees the family cannot run."""

    def no_weight_decay(self, name: str) -> bool:
        """True when parameter ``name`` (its clean name, ``common.clean_name``) is kept out of
        weight decay: the family's norms, biases and embeddings."""

    def hf_adapter(self) -> Optional[HFAdapter]:
        """The family's Hugging Face mapping (export, import), or None when it has none."""


class HFAdapter(Protocol):
    """A family's mapping to and from a Hugging Face ``transformers`` model: names, tensor
    layout and ``config.json``. ``checkpoint/hf.py`` does the file work for any family."""

    hf_model_type: str  # config.json's model_type
    hf_ignored: tuple[str, ...]  # suffixes of HF tensors with no counterpart (buffers)
    # Suffixes of our state entries with no HF counterpart: ``check_export`` vouches that
    # leaving them out changes nothing, ``to_hf`` leaves them out, ``from_hf`` recreates them.
    hf_dropped: tuple[str, ...]

    def hf_names(self) -> HFNames:
        """The rename rules between our parameter names and HF's."""

    def to_hf(self, state: dict) -> dict:
        """Our full (unsharded) state dict in HF names and layout."""

    def from_hf(self, state: dict) -> dict:
        """An HF state dict in our names and layout."""

    def hf_config(self, dtype) -> dict:
        """The ``config.json`` of the HF model with this shape, weights in ``dtype``."""

    def model_keys_from_hf_config(self, config_json: dict) -> dict:
        """Our ``model.*`` values (shape and numerics) an HF ``config.json`` implies."""

    def check_hf_config(self, config_json: dict, path) -> None:
        """Raise ConfigError (naming ``path``) for what the model cannot compute."""

    def check_export(self, state: Optional[dict]) -> None:
        """Raise ConfigError naming the ``model.*`` key for what the HF model cannot express:
        of the settings alone (``state`` None: before training) or of the full state dict
        ``state`` about to be exported."""


def model_fields(model_cfg: ModelConfig | dict) -> dict:
    """The fields of a model config as a plain dict, ``_target_`` included (a manifest saved
    before ``_target_`` existed: Llama). Takes the typed config (a family's dataclass) or a
    plain dict (a checkpoint manifest's or a planner request's copy)."""
    if isinstance(model_cfg, ModelConfig):  # a built spec: its class is its target
        cls = type(model_cfg)
        fields = {
            **dataclasses.asdict(model_cfg),
            "_target_": f"{cls.__module__}.{cls.__qualname__}",
        }
    else:
        fields = dict(model_cfg)
    if not fields.get("_target_") or fields["_target_"] == MISSING:
        fields["_target_"] = LEGACY_TARGET
    return fields


def model_spec(model_cfg: ModelConfig | dict) -> ModelSpec:
    """The family config ``model_cfg`` describes, built by its ``_target_`` (Hydra
    ``instantiate``) from a plain dict (a checkpoint manifest's copy); a typed config is
    already the ``ModelSpec`` and is returned as is."""
    from hydra.utils import instantiate

    if isinstance(model_cfg, ModelConfig):
        return model_cfg
    fields = model_fields(model_cfg)
    spec = instantiate(fields)
    spec._target_ = fields["_target_"]  # instantiate consumes it; keep it for copies of the spec
    return spec


def family_schema(model_cfg: ModelConfig | dict) -> type:
    """The config dataclass (schema) of the family ``model_cfg``'s ``_target_`` names."""
    from hydra.utils import get_class

    return get_class(model_fields(model_cfg)["_target_"])


def routed_experts(model_cfg: ModelConfig) -> int:
    """The routed experts of each mixture-of-experts block of the model ``model_cfg``
    describes (its ``model.n_experts``); 0 for a dense family, which has no such key. How the
    runner asks whether expert parallel (``parallel.ep``) applies without importing a family."""
    return int(getattr(model_cfg, "n_experts", 0) or 0)


def build_meta_model(model_cfg: ModelConfig) -> ParallelModule:
    """The model ``model_cfg`` describes, on the meta device, built once per shape in a process.

    For code that reads names and shapes (pre-flight checks, checkpoint shapes, the analytic
    communication model): the instance is shared, so read it, never change it.
    """
    return _meta_model(json.dumps(model_fields(model_cfg), sort_keys=True, default=str))


@functools.lru_cache(maxsize=4)
def _meta_model(fields: str) -> ParallelModule:
    import torch

    with torch.device("meta"):
        return model_spec(json.loads(fields)).build()


def moe_layers(model: nn.Module) -> list:
    """The mixture-of-experts layers (``models/moe_routing.MoE``) of ``model`` (a whole model
    or a pipeline stage, wrapped or not), in block order: what the runtime installs the token
    exchange on and reads the balance statistics from. Empty for a family without experts
    (one without a ``moe_layers()`` method)."""
    find = getattr(model, "moe_layers", None)
    return find() if find is not None else []


def block_prefix(model: nn.Module) -> str:
    """The name under which ``model.blocks()`` sits in ``model``'s parameter names ('layers')."""
    container = model.blocks()
    return next(name for name, module in model.named_modules() if module is container)


# Pipeline stages. A family says how it splits (``ParallelModule.pipeline_ends``); the blocks
# are divided here. Cutting keeps every parameter's name as the unsplit model names it (blocks
# keep their keys in the ``blocks()`` ModuleDict, modules a stage does not hold become None),
# so checkpoints, initial values and the Hugging Face export see the same names.


def stage_blocks(
    n_layers: int, n_stages: int, first_less: int = 0, last_less: int = 0
) -> list[range]:
    """The block indices of each of ``n_stages`` stages, in order.

    The first stage counts as ``first_less`` blocks more than it holds and the last as
    ``last_less`` more (``parallel.pp_first_stage_less_blocks``, ``..._last_...``: room for the
    embedding, and for the output layer and the loss, which they also run; torchtitan's
    ``pipeline_parallel_first/last_stage_less_layers``, Megatron's embedding and loss counted
    in its pipeline split). Of the ``n_layers + first_less + last_less`` so counted each stage
    gets ``// n_stages``; the remainder goes one each to the middle stages first (1, 2, ...),
    then to the first stage, never to the last. An end stage whose weight takes all of its
    share holds no block and runs its ends alone (the embedding; the final norm, output layer
    and loss), as Megatron's layouts for DeepSeek-V3 and Qwen3-235B place them. Raises
    ConfigError when a middle stage would get no block or a weight exceeds its stage's share.
    """
    end_only = (first_less > 0) + (last_less > 0)  # end stages that may hold no block
    if n_stages > n_layers + end_only:
        raise ConfigError(
            f"model.n_layers={n_layers} cannot split over {n_stages} pipeline stages: every "
            "stage needs a block (an end stage may run the embedding or the output layer "
            "alone when parallel.pp_first/last_stage_less_blocks count them); lower "
            "parallel.pp or parallel.pp_stages_per_rank"
        )
    base, extra = divmod(n_layers + first_less + last_less, n_stages)
    takers = [*range(1, n_stages - 1), 0][:extra]
    sizes = [base + (stage in takers) for stage in range(n_stages)]
    sizes[0] -= first_less
    sizes[-1] -= last_less
    if min(sizes) < 0 or min(sizes[1:-1], default=1) < 1:
        raise ConfigError(
            f"parallel.pp_first_stage_less_blocks={first_less} and parallel.pp_last_stage_less_"
            f"blocks={last_less} weigh an end stage of {n_stages} more than its share "
            f"(model.n_layers={n_layers}); lower them"
        )
    starts = [sum(sizes[:stage]) for stage in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def keep_stage(
    model: ParallelModule, stage: int, n_stages: int, first_less: int = 0, last_less: int = 0
) -> ParallelModule:
    """Cut ``model`` (fresh, unwrapped, any device) down to pipeline stage ``stage`` of
    ``n_stages`` in place (blocks split by ``stage_blocks`` with ``first_less``, ``last_less``):
    blocks of other stages are deleted, the first modules (``pipeline_ends()[0]``) kept on
    stage 0 only, the last ones on the last stage only. Returns the model, whose forward then
    maps the stage's input to its output."""
    blocks = model.blocks()
    mine = stage_blocks(len(blocks), n_stages, first_less, last_less)[stage]
    for key in list(blocks.keys()):
        if int(key) not in mine:
            del blocks[key]
    first, last = model.pipeline_ends()
    for name in (first if stage != 0 else ()) + (last if stage != n_stages - 1 else ()):
        setattr(model, name, None)
    return model


def family_schemas() -> dict[str, type]:
    """{'<module>_schema': config dataclass} for every family module in this package.

    ``config.schema.register_schemas`` stores them in Hydra's ConfigStore (group ``model``), where a
    ``conf/model/*.yaml`` names its family's schema first in its defaults list.
    """
    import hsdp_runner.models

    found = {}
    for info in pkgutil.iter_modules(hsdp_runner.models.__path__):
        if info.name == "base":
            continue
        module = importlib.import_module(f"hsdp_runner.models.{info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, ModelConfig)
                and value is not ModelConfig
                and value.__module__ == module.__name__
            ):
                found[f"{info.name}_schema"] = value
    return found


class HFNames:
    """Rename rules between our parameter names and Hugging Face's, "{i}" being a block index.

    Takes ((ours, theirs), ...) templates; ``to_hf`` / ``from_hf`` return the other name or None.
    """

    def __init__(self, pairs: tuple[tuple[str, str], ...]):
        self.pairs = pairs
        self._to = [(self._pattern(ours), hf) for ours, hf in pairs]
        self._from = [(self._pattern(hf), ours) for ours, hf in pairs]

    @staticmethod
    def _pattern(template: str) -> re.Pattern:
        return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")

    @staticmethod
    def _rename(name: str, rules) -> str | None:
        for pattern, template in rules:
            match = pattern.match(name)
            if match:
                return template.replace("{i}", match.group(1)) if match.groups() else template
        return None

    def to_hf(self, name: str) -> str | None:
        """Hugging Face's name for our parameter ``name`` (None if it has none)."""
        return self._rename(name, self._to)

    def from_hf(self, name: str) -> str | None:
        """Our name for Hugging Face's tensor ``name`` (None if we have none)."""
        return self._rename(name, self._from)


# HF's Llama-style models rotate the two halves of each head (channels i, i + head_dim/2),
# our RoPE (``norm_rope.apply_rope``) interleaved pairs (2i, 2i+1), Meta's original layout; so a
# mapping permutes the rows of the rotated projections within each head, as HF's own
# ``convert_llama_weights_to_hf.py`` does for Meta checkpoints.


def rope_rows_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``weight`` (n_heads x head_dim rows, any columns) with each head's rows reordered from
    interleaved pairs (ours) to halves (HF)."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def rope_rows_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of ``rope_rows_to_hf``."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)
