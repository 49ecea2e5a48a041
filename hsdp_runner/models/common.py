"""What model families share: the seeded initial values, the parameter name without wrapper
prefixes, the Llama-style building blocks (the SwiGLU feed-forward; RMSNorm and rotary
embeddings are ``norm_rope``'s),
causal attention (grouped-query keys and values kept un-repeated in fp16/bf16), the TP style
that keeps a module whole on the TP mesh, and the decoder skeleton of the Llama-style families
(``RotaryDecoder``).

A family module (``llama.py``, ``moe.py``, ``gpt2.py``) imports these instead of another family's module,
so each family reads on its own. Helpers the runner uses outside the models (dtype names,
freezing, copying a full value into a shard) are ``params``'.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from hsdp_runner.models.base import ModelConfig
from hsdp_runner.models.norm_rope import RMSNorm, rope_tables
from hsdp_runner.models.params import copy_full_into


@dataclass(frozen=True)
class TPStyles:
    """The ParallelStyle classes a TP plan gives the blocks' linear layers and their inputs:
    torch's by default; under float8 training torchao's float8 ones (same arguments), handed
    in by the sharding applier so a model file imports no torchao."""

    colwise: type = ColwiseParallel
    rowwise: type = RowwiseParallel
    prepare_input: type = PrepareModuleInput


def output_layer_style(stream, loss_parallel: bool) -> ColwiseParallel:
    """The output layer's TP style: column-parallel over the vocabulary from the residual
    stream's layout ``stream``. With ``loss_parallel`` its logits stay a DTensor sharded over
    the vocabulary (the loss runs on the shards under torch's ``loss_parallel``, see
    ``train/trainer.py``); without, they are all-gathered whole on every TP rank."""
    if loss_parallel:
        return ColwiseParallel(
            input_layouts=stream, output_layouts=Shard(-1), use_local_output=False
        )
    return ColwiseParallel(input_layouts=stream, output_layouts=Replicate())


# Modules torch inserts into parameter names when it wraps a block: activation checkpointing
# (checkpoint_wrapper) and torch.compile.
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """A parameter name as the unwrapped model names it (wrapper prefixes removed), so a rule
    keyed by name (initial values, weight decay) holds whatever wraps the module."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def initial_value(
    name: str, shape: tuple, seed: int, std: float, device: torch.device
) -> torch.Tensor:
    """The full fp32 value N(0, std^2) of parameter ``name``, drawn on ``device`` from a
    ``device`` generator seeded by (seed, clean name): every layout starts from equal weights."""
    gen = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=gen, device=device) * std


def name_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` (its clean name) under the run's ``seed``."""
    digest = hashlib.sha256(f"{seed}:{clean_name(name)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1(x)) * w3(x))``, hidden width ``hidden_dim``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# Where keys and values go to attention with their own heads, fewer than the queries' (SDPA's
# ``enable_gqa``), so autograd saves them un-repeated: kv_heads / heads of the bytes (Qwen3-235B:
# 2 KB per token and block where the repeated copies took 32 KB). In torch 2.13 the fused CUDA
# kernels that take grouped heads, flash and cuDNN, run fp16 and bf16 only, flash with head_dim
# up to 256 (on sm80 and later, the GPUs this runner targets); the memory-efficient kernel, which
# runs the rest (fp32 above all), rejects grouped heads (its dense check is
# ``check_batch_size_and_num_heads_dense<false>``: read in torch's sources, not run here), so
# there SDPA would fall to the math backend and hold seq x seq scores: the heads are repeated
# first, as before. The CPU kernel takes grouped heads in every dtype; the rule goes by dtype and
# width alone so that the planner, measuring on CPU, holds what a GPU job holds.
GROUPED_HEADS_DTYPES = (torch.float16, torch.bfloat16)
GROUPED_HEADS_MAX_HEAD_DIM = 256


def grouped_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(k, v, enable_gqa) to hand SDPA with (batch, heads, seq, head_dim) queries ``q``: k and v
    as they are with ``enable_gqa`` where their heads are fewer, ``q``'s dtype is one of
    ``GROUPED_HEADS_DTYPES`` and its head_dim at most ``GROUPED_HEADS_MAX_HEAD_DIM``, else
    repeated to every query head (or already as many)."""
    repeat = q.shape[1] // k.shape[1]
    if repeat == 1:
        return k, v, False
    if q.dtype in GROUPED_HEADS_DTYPES and q.shape[-1] <= GROUPED_HEADS_MAX_HEAD_DIM:
        return k, v, True
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), False


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of (batch, heads, seq, head_dim) queries over keys and values with
    ``kv_heads`` dividing ``heads`` (grouped-query heads: ``grouped_kv``)."""
    k, v, gqa = grouped_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class ReplicatedParams(ParallelStyle):
    """Keep a module whole on every TP rank but make its parameters Replicate DTensors.

    Used for the norms when sequence parallel is off, so every parameter lives on the TP mesh
    (the optimizer's foreach kernels and grad clipping cannot mix DTensors with plain tensors).
    torch has no built-in style for this. ``input_layout`` is how the module's local input
    is laid out over the mesh: whole on every rank (``Replicate()``, the default) or, for a
    norm over each attention head's channels, split over the heads (``Shard(2)`` of
    (batch, seq, heads, head_dim)): the weight's gradient is then ``Partial`` over the mesh
    (each rank's heads' part), summed like a sequence-parallel norm's.
    """

    def __init__(self, input_layout=None):
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


# The dim each weight of a Llama-style decoder is split on by its family's TP plan (column-
# parallel: 0, row-parallel: 1; the embedding is row-parallel over the vocab, i.e. dim 0), keyed
# by the module's name. Weights not listed (the norms) stay whole on every TP rank. The
# communication model (hsdp_runner/distributed/comm_model.py) reads it through ``tp_split_dim``.
ROTARY_TP_SPLIT_DIM = {
    "tok_embeddings": 0,
    "output": 0,
    "wq": 0,
    "wk": 0,
    "wv": 0,
    "wo": 1,
    "w1": 0,
    "w3": 0,
    "w2": 1,
}


class RotaryDecoder(nn.Module):
    """The decoder the Llama-style families share: token embedding, the blocks (keyed
    "0".."n-1", each called as ``block(h, cos, sin)``), final RMSNorm, output layer and the RoPE
    tables of ``head_dim``-wide heads. ``forward(tokens)`` returns logits (batch, seq, vocab).

    A family builds it with its blocks and names its output projections in ``DEPTH_SCALED``
    (name suffixes initialised at std / sqrt(2 n_layers)); what it holds beyond that (the
    TP plan, buffers of its own) it adds in a subclass.
    """

    DEPTH_SCALED: tuple[str, ...] = ("wo.weight", "w2.weight")

    def __init__(self, cfg: ModelConfig, blocks: list[nn.Module], head_dim: int):
        # cfg: a family's config (LlamaConfig, MoEConfig), which adds norm_eps and rope_theta.
        super().__init__()
        self.cfg, self.head_dim = cfg, head_dim
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0".."n-1" keeps block names stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Set by the sharding applier when compiled blocks follow a TP embedding (see parallelize).
        self.clone_embedding_output = False
        self.sequence_shard = None  # set under context parallel (``shard_sequence``)

    def blocks(self) -> nn.ModuleDict:
        """The transformer blocks (what AC, compile and FSDP wrap)."""
        return self.layers

    def pipeline_ends(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The token embedding before the blocks; the final norm and output layer after."""
        return ("tok_embeddings",), ("norm", "output")

    def shard_sequence(self, shard) -> None:
        """Take this rank's positions and attention from ``shard`` (see ``models/base.py``)."""
        self.sequence_shard = shard
        for block in self.layers.values():
            block.attention.attend = shard.attention

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A later pipeline stage (no embedding) takes the previous stage's hidden state.
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        if self.clone_embedding_output and self.tok_embeddings is not None:
            h = h.clone()
        cos, sin = self.rope_cos, self.rope_sin
        if self.sequence_shard is not None:  # the rank's tokens are not positions 0, 1, ...
            # A later stage's input, a hidden state, is split over tp too under sequence
            # parallel; its blocks' attention sees (and checks) the cp rank's whole part.
            first = self.tok_embeddings is not None
            local_len = tokens.shape[1] if first else self.sequence_shard.local_len
            positions = self.sequence_shard.positions(local_len, cos.device)
            cos, sin = cos[positions], sin[positions]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.output is None:  # a pipeline stage before the last
            return h
        return self.output(self.norm(h))

    def init_weights(self, seed: int) -> None:
        """Fill every parameter and the RoPE tables deterministically from ``seed``.

        Norms start at 1; every other parameter's full value is drawn on the parameter's own
        device (``initial_value``) from a generator seeded by (seed, name), then cut to this
        rank's shard, so every layout starts from identical weights and a GPU draws even a 70B
        model in seconds. (The DTensor RNG would also be deterministic, but its stream depends
        on the mesh.) On CPU the values are those of torch's CPU generator. On CUDA they come
        from a CUDA generator: equally a function of (seed, name), the same on every rank and
        in every layout of a job, but not equal to the CPU values, and not promised equal
        across GPU models or torch versions (torch may split the draw differently over another
        GPU's multiprocessors).
        """
        std = self.cfg.init_std
        depth_std = std / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                if name.endswith("norm.weight"):
                    full = torch.ones(param.shape, device=local.device)
                else:
                    scale = depth_std if name.endswith(self.DEPTH_SCALED) else std
                    full = initial_value(name, tuple(param.shape), seed, scale, local.device)
                copy_full_into(param, full)
            cos, sin = rope_tables(self.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
