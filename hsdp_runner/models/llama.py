"""A Llama-3-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) and,
beside it, its tensor/sequence-parallel plan.

Read top to bottom: the config (``LlamaConfig``, the family's schema and ``ModelSpec``, see
``models/base.py``), building blocks, the model, initialisation, then ``tp_plan``. The Hugging
Face mapping (names, RoPE row order, config.json) is ``llama_hf.py``'s, mixed into the config.
Attention infers its local head count from the projection output, so the same
code runs whole or with its heads split over a TP mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import MISSING
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import ModelConfig
from hsdp_runner.models.common import (
    ROTARY_TP_SPLIT_DIM,
    FeedForward,
    ReplicatedParams,
    RotaryDecoder,
    TPStyles,
    causal_attention,
    output_layer_style,
)
from hsdp_runner.models.llama_hf import LlamaHF
from hsdp_runner.models.norm_rope import RMSNorm, apply_rope


@dataclass
class LlamaConfig(ModelConfig, LlamaHF):
    """``model.*`` of a Llama (conf/model/llama3_*.yaml); built, it is the ``ModelSpec``."""

    n_kv_heads: Optional[int] = None
    ffn_hidden_dim: int = MISSING
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    def validate(self) -> None:
        """Raise ConfigError for a Llama-specific bad value (naming the key)."""
        if self.ffn_hidden_dim < 1:
            raise ConfigError(
                f"model.ffn_hidden_dim={self.ffn_hidden_dim} must be a positive "
                "integer; set model.ffn_hidden_dim>=1"
            )
        n_kv = self.n_kv_heads or self.n_heads
        if self.n_heads % n_kv:
            raise ConfigError(
                f"model.n_kv_heads={n_kv} does not divide model.n_heads={self.n_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(
                f"model.dim/model.n_heads={self.dim // self.n_heads} must be even "
                "for rotary embeddings"
            )

    def build(self) -> Llama:
        """The model on the current default device."""
        return Llama(self)

    def tp_split_dim(self, param: str, sequence_parallel: bool) -> Optional[int]:
        """The dim ``tp_plan`` splits parameter ``param`` on (None: whole on every rank)."""
        return ROTARY_TP_SPLIT_DIM.get(param.split(".")[-2])

    def tp_partial_grad_numels(self) -> list[int]:
        """The norm weights (2 per block and the final one), ``dim`` elements each."""
        return [self.dim] * (2 * self.n_layers + 1)

    def count_params(self) -> dict:
        """See ``count_params``."""
        return count_params(self)

    def flops_per_token(self) -> float:
        """See ``flops_per_token``."""
        return flops_per_token(self)

    def block_forward_flops_per_token(self) -> float:
        """2 x the blocks' matmul weights + the forward attention term."""
        blocks = count_params(self)["matmul"] - self.vocab_size * self.dim
        return 2.0 * blocks + 4.0 * self.n_layers * self.dim * self.seq_len

    def selective_recompute_flops_per_token(self) -> float:
        """wk, wo and w3 of every block (called 2nd, 4th and 6th), 2 FLOPs per weight."""
        kv_dim = (self.n_kv_heads or self.n_heads) * (self.dim // self.n_heads)
        return 2.0 * self.n_layers * self.dim * (kv_dim + self.dim + self.ffn_hidden_dim)

    def kv_dim(self) -> int:
        """n_kv_heads x head_dim (grouped-query attention: narrower than the width)."""
        return (self.n_kv_heads or self.n_heads) * (self.dim // self.n_heads)

    def check_parallel(self, cp: int, tp: int, sequence_parallel: bool) -> None:
        """Every degree the mesh accepts runs (RoPE angles are looked up per position)."""

    def no_weight_decay(self, name: str) -> bool:
        """The token embedding and the RMSNorm weights get no weight decay."""
        return name == "tok_embeddings.weight" or name.endswith("norm.weight")

    def hf_adapter(self) -> LlamaConfig:
        """This config is its own HF mapping (``llama_hf.LlamaHF``, mixed in)."""
        return self


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        # Replaced under context parallel (``Llama.shard_sequence``).
        self.attend = causal_attention
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(RotaryDecoder):
    """Decoder-only transformer (``common.RotaryDecoder`` with Llama's blocks).
    ``forward(tokens)`` returns logits (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig):
        blocks = [TransformerBlock(cfg) for _ in range(cfg.n_layers)]
        super().__init__(cfg, blocks, cfg.dim // cfg.n_heads)

    def tp_plan(self, tp_mesh, sequence_parallel: bool, styles=None, loss_parallel=False) -> None:
        """Apply ``tp_plan`` (below) to this model."""
        tp_plan(self, tp_mesh, sequence_parallel, styles, loss_parallel)


def count_params(cfg: LlamaConfig) -> dict:
    """Return parameter counts: total, embedding, and matmul (those in Linear layers)."""
    n_kv = cfg.n_kv_heads or cfg.n_heads
    head_dim = cfg.dim // cfg.n_heads
    attn = cfg.dim * cfg.dim * 2 + 2 * cfg.dim * n_kv * head_dim
    ffn = 3 * cfg.dim * cfg.ffn_hidden_dim
    norms = 2 * cfg.dim
    block = attn + ffn + norms
    embedding = cfg.vocab_size * cfg.dim
    output = cfg.vocab_size * cfg.dim
    matmul = cfg.n_layers * (attn + ffn) + output
    return {
        "total": embedding + cfg.n_layers * block + cfg.dim + output,
        "embedding": embedding,
        "matmul": matmul,
    }


def flops_per_token(cfg: LlamaConfig) -> float:
    """Training FLOPs per token: 6 x matmul params + 12 x layers x dim x seq_len (attention).

    The 6 counts forward (2) and backward (4) multiply-adds of every Linear weight; the attention
    term counts QK^T and AV for forward and backward without the causal discount, as torchtitan
    and the PaLM paper do. The embedding lookup is not a matmul and is left out.
    """
    return 6.0 * count_params(cfg)["matmul"] + 12.0 * cfg.n_layers * cfg.dim * cfg.seq_len


def tp_plan(
    model: Llama,
    tp_mesh,
    sequence_parallel: bool,
    styles: Optional[TPStyles] = None,
    loss_parallel: bool = False,
) -> None:
    """Apply Megatron-style TP (and optional sequence parallel) to ``model`` on ``tp_mesh``.

    Attention and FFN inputs are column-parallel, their outputs row-parallel; with sequence
    parallel the norms and residual stream are sharded on the sequence dim between blocks.
    The blocks' linears and their inputs take ``styles`` (float8 ones under float8 training);
    the embedding and output layer stay in torch's; with ``loss_parallel`` the logits stay
    sharded over the vocabulary (``common.output_layer_style``).
    """

    styles = styles or TPStyles()
    stream = Shard(1) if sequence_parallel else Replicate()
    norm_style = SequenceParallel if sequence_parallel else ReplicatedParams
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": output_layer_style(stream, loss_parallel),
    }
    top["norm"] = norm_style()
    # A pipeline stage holds some of these modules only (the others are None).
    top = {name: style for name, style in top.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attention": styles.prepare_input(
                input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": styles.colwise(),
            "attention.wk": styles.colwise(),
            "attention.wv": styles.colwise(),
            "attention.wo": styles.rowwise(output_layouts=stream),
            "feed_forward": styles.prepare_input(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": styles.colwise(),
            "feed_forward.w2": styles.rowwise(output_layouts=stream),
            "feed_forward.w3": styles.colwise(),
        }
        plan["attention_norm"] = norm_style()
        plan["ffn_norm"] = norm_style()
        parallelize_module(block, tp_mesh, plan)
