"""A GPT-2-style decoder (learned absolute positions, LayerNorm, GELU MLP, multi-head attention,
biases everywhere) and, beside it, its tensor/sequence-parallel plan.

Read top to bottom: the config (``GPT2Config``, the family's schema and ``ModelSpec``, see
``models/base.py``), building blocks, the model, initialisation, then ``tp_plan``. Parameter
names follow ``transformers``' GPT2LMHeadModel without its ``transformer.`` prefix, except
that q, k and v are separate Linear layers here (a fused qkv cannot be split by heads with one
column-parallel layer); the Hugging Face mapping (``gpt2_hf.py``, mixed into the config) fuses
them and transposes HF's Conv1D weights.

Embeddings are untied: ``lm_head`` has its own weight (``tie_word_embeddings: false`` in the
exported config.json). Tying would make one parameter both the vocab-parallel embedding and the
column-parallel output layer, two placements, and one FSDP unit's parameter used at both ends
of the step; untied keeps TP, FSDP and checkpoints as simple as Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import ModelConfig
from hsdp_runner.models.common import (
    ReplicatedParams,
    TPStyles,
    causal_attention,
    initial_value,
    output_layer_style,
)
from hsdp_runner.models.gpt2_hf import GPT2HF
from hsdp_runner.models.params import copy_full_into


@dataclass
class GPT2Config(ModelConfig, GPT2HF):
    """``model.*`` of a GPT-2 (conf/model/gpt2_*.yaml); built, it is the ``ModelSpec``."""

    norm_eps: float = 1e-5

    def validate(self) -> None:
        """Raise ConfigError for a GPT-2-specific bad value (naming the key)."""
        if not self.norm_eps > 0:
            raise ConfigError(
                f"model.norm_eps={self.norm_eps} must be positive (LayerNorm epsilon)"
            )

    def build(self) -> GPT2:
        """The model on the current default device."""
        return GPT2(self)

    def tp_split_dim(self, param: str, sequence_parallel: bool) -> Optional[int]:
        """The dim ``tp_plan`` splits parameter ``param`` on (None: whole on every rank)."""
        key = ".".join(param.split(".")[-2:])
        if key == "wpe.weight":
            return 0 if sequence_parallel else None
        return TP_SPLIT_DIM.get(key)

    def tp_partial_grad_numels(self) -> list[int]:
        """The LayerNorms' weights and biases (2 norms per block and the final one)."""
        return [self.dim] * (2 * (2 * self.n_layers + 1))

    def count_params(self) -> dict:
        """{'total', 'embedding' (tokens and positions), 'matmul' (Linear weights)}."""
        d, layers = self.dim, self.n_layers
        attn = 4 * d * d + 4 * d
        mlp = 8 * d * d + 4 * d + d
        block = attn + mlp + 4 * d  # two LayerNorms with weight and bias
        embedding = self.vocab_size * d + self.seq_len * d
        output = self.vocab_size * d
        return {
            "total": embedding + layers * block + 2 * d + output,
            "embedding": embedding,
            "matmul": layers * 12 * d * d + output,
        }

    def flops_per_token(self) -> float:
        """6 x matmul weights + 12 x layers x dim x seq_len (attention), as Llama's count."""
        return 6.0 * self.count_params()["matmul"] + 12.0 * self.n_layers * self.dim * self.seq_len

    def block_forward_flops_per_token(self) -> float:
        """2 x the blocks' matmul weights + the forward attention term."""
        return (
            2.0 * 12 * self.n_layers * self.dim**2 + 4.0 * self.n_layers * self.dim * self.seq_len
        )

    def kv_dim(self) -> int:
        """The width: multi-head attention has as many key/value heads as query heads."""
        return self.dim

    def check_parallel(self, cp: int, tp: int, sequence_parallel: bool) -> None:
        """Refuse context parallel with sequence-parallel TP: the position table is split by
        position over the tp ranks (``PositionParallel``) in natural order, while a cp rank's
        tokens come in head-tail order, so a tp rank would not hold its tokens' vectors."""
        if cp > 1 and tp > 1 and sequence_parallel:
            raise ConfigError(
                f"parallel.cp={cp} with parallel.tp={tp} and parallel.sequence_parallel=true is "
                "not supported for GPT-2 (its learned position table is split by position over "
                "the tp ranks); set parallel.sequence_parallel=false or parallel.tp=1"
            )

    def selective_recompute_flops_per_token(self) -> float:
        """k_proj and attention's c_proj of every block (called 2nd and 4th; dim^2 weights
        each), 2 FLOPs per weight. The 6th, the MLP's c_proj, is not recomputed: nothing
        backward needs comes after it, and torch's checkpoint stops recomputing there."""
        return 2.0 * self.n_layers * 2 * self.dim**2

    def no_weight_decay(self, name: str) -> bool:
        """The token and position embeddings, the LayerNorms and every bias get no weight
        decay (GPT-2's matmul weights alone are decayed)."""
        return (
            name in ("wte.weight", "wpe.weight") or name.endswith(".bias") or ".ln_" in f".{name}"
        )

    def hf_adapter(self) -> GPT2Config:
        """This config is its own HF mapping (``gpt2_hf.GPT2HF``, mixed in)."""
        return self


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        # Replaced under context parallel (``GPT2.shard_sequence``).
        self.attend = causal_attention
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them.
        q, k, v = (
            proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = self.attend(q, k, v)
        return self.c_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # HF's "gelu_new"


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg.dim, cfg.n_heads)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))


class LearnedPositions(nn.Module):
    """Adds one learned vector per position to the token embeddings.

    The weight is used as a tensor, not looked up: under sequence parallel it is split over the
    TP ranks by position (``PositionParallel``), so each rank adds its own positions' vectors to
    its sequence shard with no communication. Sequences are model.seq_len long (data.py) when
    sequence parallel is on. Under context parallel the rank's tokens are at ``positions``.
    """

    def __init__(self, seq_len: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(seq_len, dim))

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return x + (weight[: x.shape[1]] if positions is None else weight[positions])


class GPT2(nn.Module):
    """Decoder-only transformer. ``forward(tokens)`` returns logits (batch, seq, vocab)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = LearnedPositions(cfg.seq_len, cfg.dim)
        # A ModuleDict keyed "0".."n-1" keeps block names stable when blocks are wrapped.
        self.h = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Set by the sharding applier when compiled blocks follow a TP embedding (see parallelize).
        self.clone_embedding_output = False
        self.sequence_shard = None  # set under context parallel (``shard_sequence``)

    def blocks(self) -> nn.ModuleDict:
        """The transformer blocks (what AC, compile and FSDP wrap)."""
        return self.h

    def pipeline_ends(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Token and position embeddings before the blocks; final LayerNorm and head after."""
        return ("wte", "wpe"), ("ln_f", "lm_head")

    def shard_sequence(self, shard) -> None:
        """Take this rank's positions and attention from ``shard`` (see ``models/base.py``)."""
        self.sequence_shard = shard
        for block in self.h.values():
            block.attn.attend = shard.attention

    def tp_plan(self, tp_mesh, sequence_parallel: bool, styles=None, loss_parallel=False) -> None:
        """Apply ``tp_plan`` (below) to this model."""
        tp_plan(self, tp_mesh, sequence_parallel, styles, loss_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = (
            None
            if self.sequence_shard is None
            else self.sequence_shard.positions(tokens.shape[1], tokens.device)
        )
        if self.wte is None:  # a later pipeline stage: the previous stage's hidden state
            h = tokens
        else:
            h = self.wpe(self.wte(tokens), positions)
            if self.clone_embedding_output:
                h = h.clone()
        for block in self.h.values():
            h = block(h)
        if self.lm_head is None:  # a pipeline stage before the last
            return h
        return self.lm_head(self.ln_f(h))

    def init_weights(self, seed: int) -> None:
        """Fill every parameter deterministically from ``seed``: LayerNorms 1 (weights) and 0
        (biases), every bias 0, the rest N(0, init_std^2) drawn by ``common.initial_value``
        from (seed, name), the residual projections (``c_proj``) scaled by 1/sqrt(2 x layers)
        as GPT-2 does. See ``Llama.init_weights`` for why each value is drawn whole."""
        std = self.cfg.init_std
        depth_std = std / (2 * self.cfg.n_layers) ** 0.5
        with torch.no_grad():
            for name, param in self.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                if name.endswith("bias"):
                    full = torch.zeros(param.shape, device=local.device)
                elif ".ln_" in f".{name}":
                    full = torch.ones(param.shape, device=local.device)
                else:
                    scale = depth_std if name.endswith("c_proj.weight") else std
                    full = initial_value(name, tuple(param.shape), seed, scale, local.device)
                copy_full_into(param, full)


class PositionParallel(ParallelStyle):
    """Split ``LearnedPositions`` by position over the TP ranks (with sequence parallel), or keep
    it whole on each as a Replicate DTensor (without). torch has no style for a weight that is
    added to a sequence-sharded stream rather than looked up."""

    def __init__(self, sequence_parallel: bool):
        super().__init__()
        self.placement = Shard(0) if sequence_parallel else Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(
                    pname, nn.Parameter(distribute_tensor(param, mesh, [self.placement]))
                )

        return distribute_module(module, device_mesh, partition_fn=partition)


# The dim each parameter is split on by ``tp_plan``, keyed by its last two name parts: column-
# parallel weights and their biases on 0, row-parallel weights on 1 (their biases stay whole:
# added once, after the partial sums are reduced), the embedding over the vocab (0). The
# position table (``wpe.weight``) is split on 0 only with sequence parallel (``tp_split_dim``).
TP_SPLIT_DIM = {
    "wte.weight": 0,
    "lm_head.weight": 0,
    "c_fc.weight": 0,
    "c_fc.bias": 0,
    "c_proj.weight": 1,
    **{f"{p}_proj.{kind}": 0 for p in "qkv" for kind in ("weight", "bias")},
}


def tp_plan(
    model: GPT2,
    tp_mesh,
    sequence_parallel: bool,
    styles: Optional[TPStyles] = None,
    loss_parallel: bool = False,
) -> None:
    """Apply Megatron-style TP (and optional sequence parallel) to ``model`` on ``tp_mesh``.

    As Llama's plan: q/k/v and ``c_fc`` column-parallel, the ``c_proj`` layers row-parallel;
    with sequence parallel the LayerNorms and the residual stream are sharded on the sequence
    dim between blocks, and the position table by position. The blocks' linears and their
    inputs take ``styles`` (float8 ones under float8 training); with ``loss_parallel`` the
    logits stay sharded over the vocabulary (``common.output_layer_style``).
    """
    styles = styles or TPStyles()
    stream = Shard(1) if sequence_parallel else Replicate()
    norm_style = SequenceParallel if sequence_parallel else ReplicatedParams
    top = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "wpe": PositionParallel(sequence_parallel),
        "ln_f": norm_style(),
        "lm_head": output_layer_style(stream, loss_parallel),
    }
    # A pipeline stage holds some of these modules only (the others are None).
    top = {name: style for name, style in top.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, top)
    for block in model.h.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "ln_1": norm_style(),
                "attn": styles.prepare_input(
                    input_layouts=(stream,), desired_input_layouts=(Replicate(),)
                ),
                "attn.q_proj": styles.colwise(),
                "attn.k_proj": styles.colwise(),
                "attn.v_proj": styles.colwise(),
                "attn.c_proj": styles.rowwise(output_layouts=stream),
                "ln_2": norm_style(),
                "mlp": styles.prepare_input(
                    input_layouts=(stream,), desired_input_layouts=(Replicate(),)
                ),
                "mlp.c_fc": styles.colwise(),
                "mlp.c_proj": styles.rowwise(output_layouts=stream),
            },
        )
