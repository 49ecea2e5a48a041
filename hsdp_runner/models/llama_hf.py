"""Llama's Hugging Face mapping: our names to ``transformers``' LlamaForCausalLM's and back,
the RoPE row order of ``wq``/``wk``, and the ``config.json`` of a model of this shape.

``LlamaHF`` implements ``models/base.py``'s ``HFAdapter`` over the fields of the Llama config it
is mixed into (``llama.LlamaConfig``: dim, n_heads, n_kv_heads, ...); ``checkpoint/hf.py`` does
the file work for any family.
"""

from __future__ import annotations

from typing import Optional

import torch

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import HFNames, rope_rows_from_hf, rope_rows_to_hf


class LlamaHF:
    """The HF half of ``LlamaConfig`` (a mixin: it reads the config's own fields)."""

    hf_model_type = "llama"
    hf_ignored = ("rotary_emb.inv_freq",)  # a buffer some HF Llama folders carry
    hf_dropped = ()  # every parameter has an HF counterpart

    def hf_names(self) -> HFNames:
        """Our parameter names and Hugging Face Llama's."""
        return HF_NAMES

    def to_hf(self, state: dict) -> dict:
        """Our full state dict in HF names and HF's RoPE row order (see ``rope_rows_to_hf``)."""
        out = {}
        for name, tensor in state.items():
            heads = self._rope_heads(name)
            out[HF_NAMES.to_hf(name)] = rope_rows_to_hf(tensor, heads) if heads else tensor
        return out

    def from_hf(self, state: dict) -> dict:
        """An HF Llama state dict in our names and RoPE row order."""
        out = {}
        for hf_name, tensor in state.items():
            name = HF_NAMES.from_hf(hf_name)
            heads = self._rope_heads(name)
            out[name] = rope_rows_from_hf(tensor, heads) if heads else tensor
        return out

    def _rope_heads(self, name: str) -> Optional[int]:
        if name.endswith("attention.wq.weight"):
            return self.n_heads
        if name.endswith("attention.wk.weight"):
            return self.n_kv_heads or self.n_heads
        return None

    def hf_config(self, dtype: torch.dtype) -> dict:
        """The ``config.json`` of a LlamaForCausalLM with this shape."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads or self.n_heads,
            "head_dim": self.dim // self.n_heads,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": self.init_std,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def model_keys_from_hf_config(self, config_json: dict) -> dict:
        """Our ``model.*`` values (shape and numerics) an HF Llama ``config.json`` implies."""
        rope = config_json.get("rope_parameters") or {}
        return {
            "dim": config_json["hidden_size"],
            "n_layers": config_json["num_hidden_layers"],
            "n_heads": config_json["num_attention_heads"],
            "n_kv_heads": config_json.get("num_key_value_heads")
            or config_json["num_attention_heads"],
            "vocab_size": config_json["vocab_size"],
            "ffn_hidden_dim": config_json["intermediate_size"],
            "norm_eps": config_json.get("rms_norm_eps", 1e-6),
            "rope_theta": config_json.get("rope_theta", rope.get("rope_theta", 10000.0)),
        }

    def check_hf_config(self, config_json: dict, path) -> None:
        """Refuse RoPE scaling, which this model does not apply (ConfigError naming ``path``)."""
        scaling = config_json.get("rope_scaling") or config_json.get("rope_parameters") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default":
            raise ConfigError(
                f"{path} asks for rope_type={kind!r}; hsdp_runner's model applies "
                "plain RoPE only, so these weights would compute something else"
            )

    def check_export(self, state: Optional[dict]) -> None:
        """Nothing to refuse: LlamaForCausalLM expresses every Llama this family builds."""


# --- Hugging Face names -------------------------------------------------------------------------
# Our model and ``transformers``' LlamaForCausalLM compute the same function, but names differ
# (``layers.0.attention.wq.weight`` vs ``model.layers.0.self_attn.q_proj.weight``), and our
# RoPE (``apply_rope``) rotates interleaved channel pairs (2i, 2i+1), Meta's original layout,
# while HF rotates the two halves of a head (i, i + head_dim/2). So the rows of ``wq`` and
# ``wk`` are permuted within each head on export and back on import (``base.rope_rows_to_hf``).

HF_NAMES = HFNames(
    (
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
        ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
        ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
        ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
        ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
        ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
        ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
        ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    )
)
