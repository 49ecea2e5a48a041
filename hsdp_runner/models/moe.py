"""A mixture-of-experts decoder (Qwen3-MoE / DeepSeek-V3 style) and, beside it, its tensor/
sequence-parallel plan.

Read top to bottom: the config (``MoEConfig``, the family's schema and ``ModelSpec``, see
``models/base.py``), attention (Llama's grouped-query attention with RoPE, a head width of its
own and Qwen3's optional QK-norm), the blocks (the first ``n_dense_layers`` with a dense SwiGLU
``feed_forward``, the rest with a ``moe``), the model, initialisation, then ``tp_plan``. The
MoE layer itself (router, experts, token exchange, balance statistics) is ``moe_routing.py``'s.
The runtime finds the MoE layers of a built model through ``MoETransformer.moe_layers()`` (the
seam: ``models.base.moe_layers(model)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import MISSING
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

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
from hsdp_runner.models.moe_hf import MoEHF
from hsdp_runner.models.moe_routing import MoE
from hsdp_runner.models.norm_rope import RMSNorm, apply_rope

SCORE_FUNCS = ("softmax", "sigmoid")
# Counts that must be >= 1, and counts and coefficients that must be >= 0 (0: feature off).
POSITIVE = ("n_experts", "top_k", "expert_ffn_dim")
NON_NEGATIVE = ("n_dense_layers", "n_shared_experts", "aux_loss_coef", "bias_update_speed")


@dataclass
class MoEConfig(ModelConfig, MoEHF):
    """``model.*`` of a mixture-of-experts decoder (conf/model/moe_*.yaml, qwen3_*.yaml);
    built, it is the ``ModelSpec``. Its Hugging Face mapping (Qwen3-MoE) is ``moe_hf.MoEHF``'s,
    mixed in."""

    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None  # None: dim / n_heads
    qk_norm: bool = False
    ffn_hidden_dim: int = MISSING
    n_dense_layers: int = 0
    n_experts: int = MISSING
    top_k: int = MISSING
    expert_ffn_dim: int = MISSING
    n_shared_experts: int = 0
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0
    bias_update_speed: float = 0.0
    grouped_mm: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    def attention_head_dim(self) -> int:
        """The width of one attention head (``head_dim``, or dim / n_heads when unset)."""
        return self.head_dim or self.dim // self.n_heads

    def validate(self) -> None:
        """Raise ConfigError for an MoE-specific bad value (naming the key and the fix)."""
        for keys, low in ((POSITIVE, 1), (NON_NEGATIVE, 0)):
            for key in keys:
                if getattr(self, key) < low:
                    raise ConfigError(f"model.{key}={getattr(self, key)} must be >= {low}")
        problems = [message for bad, message in self._checks() if bad]
        if problems:
            raise ConfigError(problems[0])

    def _checks(self) -> list[tuple[bool, str]]:
        n_kv, head_dim = self.n_kv_heads or self.n_heads, self.attention_head_dim()
        return [
            (
                self.top_k > self.n_experts,
                f"model.top_k={self.top_k} exceeds model.n_experts={self.n_experts}; lower it",
            ),
            (
                self.n_dense_layers >= self.n_layers,
                f"model.n_dense_layers={self.n_dense_layers} leaves no MoE block of model."
                f"n_layers={self.n_layers}; lower it (a model without one: a llama preset)",
            ),
            (
                self.n_dense_layers > 0 and self.ffn_hidden_dim < 1,
                f"model.ffn_hidden_dim={self.ffn_hidden_dim} must be >= 1 for the dense blocks",
            ),
            (
                self.score_func not in SCORE_FUNCS,
                f"model.score_func={self.score_func!r} is not one of {', '.join(SCORE_FUNCS)}",
            ),
            (self.route_scale <= 0, f"model.route_scale={self.route_scale} must be > 0"),
            (
                self.head_dim is None and self.dim % self.n_heads != 0,
                f"model.n_heads={self.n_heads} does not divide model.dim={self.dim}; set "
                "model.head_dim",
            ),
            (
                head_dim % 2 != 0,
                f"the head width {head_dim} (model.head_dim, or model.dim/model.n_heads) must "
                "be even for rotary embeddings",
            ),
            (
                self.n_heads % n_kv != 0,
                f"model.n_kv_heads={n_kv} does not divide model.n_heads={self.n_heads}",
            ),
            (
                self.grouped_mm and (self.dim % 8 or self.expert_ffn_dim % 8),
                f"model.grouped_mm=true needs model.dim={self.dim} and model.expert_ffn_dim="
                f"{self.expert_ffn_dim} to be multiples of 8 (the grouped matmul's 16-byte "
                "row alignment in bf16); change them or set model.grouped_mm=false",
            ),
        ]

    def build(self) -> MoETransformer:
        """The model on the current default device."""
        return MoETransformer(self)

    def tp_split_dim(self, param: str, sequence_parallel: bool) -> Optional[int]:
        """The dim ``tp_plan`` splits parameter ``param`` on (None: whole on every rank; every
        MoE weight: the layer runs on the rank's sequence shard)."""
        if ".moe." in f".{param}":
            return None
        return ROTARY_TP_SPLIT_DIM.get(param.split(".")[-2])

    def tp_partial_grad_numels(self) -> list[int]:
        """In parameter order: per block attention_norm (dim), q_norm and k_norm (head_dim,
        with ``qk_norm``: their input is split over the heads, so their gradients are partial
        over tp with or without sequence parallel), ffn_norm (dim); then the final norm. The
        MoE weights are not listed: their gradients are partial over tp too, but FSDP over
        the ranks holding distinct tokens sums them (the expert-parallel meshes)."""
        qk = [self.attention_head_dim()] * 2 if self.qk_norm else []
        return [self.dim, *qk, self.dim] * self.n_layers + [self.dim]

    def tp_partial_without_sequence_parallel(self, param: str) -> bool:
        """The q/k norms' weights: their input is split over the heads
        (``ReplicatedParams(Shard(2))``), so their gradients are partial over tp with or
        without sequence parallel."""
        return param.split(".")[-2] in ("q_norm", "k_norm")

    def count_params(self) -> dict:
        """See ``count_params``."""
        return count_params(self)

    def flops_per_token(self) -> float:
        """6 x the active matmul weights + the attention term (see ``count_params``)."""
        return 6.0 * count_params(self)["active_matmul"] + 3 * self._attention_flops()

    def block_forward_flops_per_token(self) -> float:
        """2 x the blocks' active matmul weights + the forward attention term."""
        return 2.0 * sum(sum(self.block_matmuls(i)) for i in range(self.n_layers)) + (
            self._attention_flops()
        )

    def moe_recompute_flops_per_token(self) -> float:
        """The forward matmul FLOPs of the MoE blocks' feed-forward (router gate, routed and
        shared experts): what ``parallel.ac=moe`` runs again."""
        return 2.0 * sum(
            sum(self.block_matmuls(i)[4:]) for i in range(self.n_dense_layers, self.n_layers)
        )

    def selective_recompute_flops_per_token(self) -> float:
        """The forward FLOPs of each block's 2nd, 4th, ... matmul in call order (the expert
        matmuls counted as matmuls: ``torch._grouped_mm`` is in the policy's matmul set):
        dense blocks wk, wo, w3; MoE blocks wk, wo, the experts' w1 and w2, then the shared
        experts' w1 and w2."""
        return 2.0 * sum(sum(self.block_matmuls(i)[1::2]) for i in range(self.n_layers))

    def block_matmuls(self, layer: int) -> list[int]:
        """The active weights per token of block ``layer``'s matmuls in call order: wq, wk,
        wv, wo, then w1, w3, w2 (dense) or the router gate, the routed experts' w1, w3, w2
        (top_k experts each) and the shared experts' w1, w3, w2."""
        head_dim, n_kv = self.attention_head_dim(), self.n_kv_heads or self.n_heads
        q, kv = self.dim * self.n_heads * head_dim, self.dim * n_kv * head_dim
        attention = [q, kv, kv, q]
        if layer < self.n_dense_layers:
            return attention + [self.dim * self.ffn_hidden_dim] * 3
        routed = [self.top_k * self.dim * self.expert_ffn_dim] * 3
        shared = [self.n_shared_experts * self.dim * self.expert_ffn_dim] * 3
        return attention + [self.n_experts * self.dim] + routed + (shared if shared[0] else [])

    def _attention_flops(self) -> float:
        """Forward FLOPs per token of QK^T and AV over all layers (no causal discount)."""
        return 4.0 * self.n_layers * self.n_heads * self.attention_head_dim() * self.seq_len

    def kv_dim(self) -> int:
        """n_kv_heads x head_dim."""
        return (self.n_kv_heads or self.n_heads) * self.attention_head_dim()

    def check_parallel(self, cp: int, tp: int, sequence_parallel: bool) -> None:
        """Under TP the MoE layers run on each rank's part of the sequence (with or without
        sequence parallel): seq_len must split evenly over cp x tp."""
        if tp > 1 and self.seq_len % (cp * tp):
            raise ConfigError(
                f"model.seq_len={self.seq_len} does not divide by parallel.cp x parallel.tp="
                f"{cp * tp}: the MoE layers run on each TP rank's part of the sequence; "
                "change model.seq_len or parallel.tp"
            )

    def no_weight_decay(self, name: str) -> bool:
        """The token embedding and the RMSNorm weights (q/k norms too) get no weight decay."""
        return name == "tok_embeddings.weight" or name.endswith("norm.weight")

    def hf_adapter(self) -> MoEConfig:
        """This config is its own HF mapping (``moe_hf.MoEHF``, mixed in: Qwen3-MoE)."""
        return self


class Attention(nn.Module):
    """Grouped-query attention with RoPE (Llama's), heads ``head_dim`` wide, and with
    ``qk_norm_eps`` Qwen3's QK-norm: an RMSNorm over each head's channels of q and of k
    before RoPE. Local head counts come from the projections' outputs (TP splits heads)."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm_eps: Optional[float]
    ):
        super().__init__()
        self.head_dim = head_dim
        # Replaced under context parallel (``MoETransformer.shard_sequence``).
        self.attend = causal_attention
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        norm = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if norm else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: attention, then a dense SwiGLU (``feed_forward``) or an MoE (``moe``).
    ``recompute_moe`` (set by the runtime for ``parallel.ac=moe``): an MoE block keeps only its
    feed-forward's input and runs its norm and MoE layer again in backward."""

    recompute_moe = False

    def __init__(self, cfg: MoEConfig, dense: bool):
        super().__init__()
        self.dense = dense
        n_kv = cfg.n_kv_heads or cfg.n_heads
        qk_eps = cfg.norm_eps if cfg.qk_norm else None
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.n_heads, n_kv, cfg.attention_head_dim(), qk_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if dense:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)
        else:
            self.moe = MoE(
                cfg.dim,
                cfg.n_experts,
                cfg.top_k,
                cfg.expert_ffn_dim,
                cfg.n_shared_experts,
                score_func=cfg.score_func,
                norm_topk_prob=cfg.norm_topk_prob,
                route_scale=cfg.route_scale,
                grouped_mm=cfg.grouped_mm,
                aux_loss_coef=cfg.aux_loss_coef,
                seq_len=cfg.seq_len,
            )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        if self.dense:
            return h + self.feed_forward(self.ffn_norm(h))
        if self.recompute_moe:
            return h + checkpoint(self._moe, h, use_reentrant=False, preserve_rng_state=False)
        return h + self._moe(h)

    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(self.ffn_norm(h))


class MoETransformer(RotaryDecoder):
    """Decoder-only MoE transformer (``common.RotaryDecoder`` with dense then MoE blocks).
    ``forward(tokens)`` returns logits (batch, seq, vocab)."""

    # The experts' stacked down projections are output projections too.
    DEPTH_SCALED = ("wo.weight", "w2.weight", "experts.w2")

    def __init__(self, cfg: MoEConfig):
        blocks = [TransformerBlock(cfg, i < cfg.n_dense_layers) for i in range(cfg.n_layers)]
        super().__init__(cfg, blocks, cfg.attention_head_dim())

    def moe_layers(self) -> list[MoE]:
        """The MoE layers this model (or pipeline stage) holds, in block order, found through
        any wrapper: where the runtime sets the exchange and reads the balance statistics."""
        return [module for module in self.layers.modules() if isinstance(module, MoE)]

    def tp_plan(self, tp_mesh, sequence_parallel: bool, styles=None, loss_parallel=False) -> None:
        """Apply ``tp_plan`` (below) to this model."""
        tp_plan(self, tp_mesh, sequence_parallel, styles, loss_parallel)

    def init_weights(self, seed: int) -> None:
        """``RotaryDecoder.init_weights`` (the experts' ``w2`` depth-scaled too), then the
        balancing bias and the statistics at 0."""
        super().init_weights(seed)
        with torch.no_grad():
            for moe in self.moe_layers():
                moe.router.expert_bias.zero_()
                moe.router.tokens_per_expert.zero_()
                moe.aux_loss_sum.zero_()


def count_params(cfg: MoEConfig) -> dict:
    """Parameter counts: total, embedding, matmul (every Linear-like weight, all experts
    included: what memory holds) and active_matmul (what one token multiplies: attention,
    dense blocks, router gate, its top_k experts, the shared experts and the output layer)."""
    head_dim, n_kv = cfg.attention_head_dim(), cfg.n_kv_heads or cfg.n_heads
    attention = 2 * cfg.dim * (cfg.n_heads + n_kv) * head_dim
    dense = 3 * cfg.dim * cfg.ffn_hidden_dim
    router = cfg.n_experts * cfg.dim
    expert = 3 * cfg.dim * cfg.expert_ffn_dim
    shared = cfg.n_shared_experts * expert
    n_moe = cfg.n_layers - cfg.n_dense_layers
    norms = 2 * cfg.dim + (2 * head_dim if cfg.qk_norm else 0)
    embedding = output = cfg.vocab_size * cfg.dim
    base = cfg.n_layers * attention + cfg.n_dense_layers * dense + output
    matmul = base + n_moe * (router + cfg.n_experts * expert + shared)
    return {
        "total": embedding + matmul + cfg.n_layers * norms + cfg.dim,
        "embedding": embedding,
        "matmul": matmul,
        "active_matmul": base + n_moe * (router + cfg.top_k * expert + shared),
    }


def tp_plan(
    model: MoETransformer,
    tp_mesh,
    sequence_parallel: bool,
    styles: Optional[TPStyles] = None,
    loss_parallel: bool = False,
) -> None:
    """Apply Megatron-style TP (and optional sequence parallel) to ``model`` on ``tp_mesh``.

    Attention and dense FFNs as Llama's (column-parallel inputs, row-parallel outputs; with
    sequence parallel the norms and residual stream sharded on the sequence). The q/k norms
    stay whole, their inputs split over the heads (``ReplicatedParams(Shard(2))``). An MoE
    layer runs on plain local tensors of the rank's sequence shard: its input is cut from the
    stream to the rank's ``Shard(1)`` part (a local slice without sequence parallel) and its
    output put back into the stream's layout (an all-gather without sequence parallel).
    """
    styles = styles or TPStyles()
    stream = Shard(1) if sequence_parallel else Replicate()
    norm_style = SequenceParallel if sequence_parallel else ReplicatedParams
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": output_layer_style(stream, loss_parallel),
        "norm": norm_style(),
    }
    # A pipeline stage holds some of these modules only (the others are None).
    top = {name: style for name, style in top.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attention_norm": norm_style(),
            "attention": styles.prepare_input(
                input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": styles.colwise(),
            "attention.wk": styles.colwise(),
            "attention.wv": styles.colwise(),
            "attention.wo": styles.rowwise(output_layouts=stream),
            "ffn_norm": norm_style(),
        }
        if block.attention.q_norm is not None:
            plan["attention.q_norm"] = ReplicatedParams(Shard(2))
            plan["attention.k_norm"] = ReplicatedParams(Shard(2))
        if not block.dense:
            plan["moe"] = PrepareModuleInputOutput(
                input_layouts=(stream,),
                desired_input_layouts=(Shard(1),),
                use_local_input=True,
                output_layouts=(Shard(1),),
                desired_output_layouts=(stream,),
            )
        else:
            plan["feed_forward"] = styles.prepare_input(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),)
            )
            plan["feed_forward.w1"] = styles.colwise()
            plan["feed_forward.w2"] = styles.rowwise(output_layouts=stream)
            plan["feed_forward.w3"] = styles.colwise()
        parallelize_module(block, tp_mesh, plan)
