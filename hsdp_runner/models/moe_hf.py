"""The MoE family's Hugging Face mapping: ``transformers``' Qwen3-MoE (``Qwen3MoeForCausalLM``,
``model_type`` ``qwen3_moe``) names and layout and back, the ``config.json`` of a model of this
shape, and what Qwen3-MoE cannot express.

``MoEHF`` implements ``models/base.py``'s ``HFAdapter`` over the fields of the MoE config it is
mixed into (``moe.MoEConfig``: dim, n_experts, top_k, ...); ``checkpoint/hf.py`` does the file
work for any family.

Layout. Our experts' weights are stacked per layer (n_experts, out, in); a Qwen3-MoE folder
holds one Linear weight per expert (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``):
what ``save_pretrained`` writes and ``from_pretrained`` reads (transformers 5 fuses them into
``gate_up_proj`` / ``down_proj`` in memory, and splits them again on save). Our RoPE rotates
interleaved channel pairs, HF's the two halves of a head: the rows of ``wq`` / ``wk`` are
permuted within each head as for Llama, and so are the QK-norm weights, which scale the
channels of a head before RoPE. The router's ``expert_bias`` (loss-free balancing) has no HF
counterpart: it is left out of an export, which it must not change (``check_export``), and
zeros on import.

What Qwen3-MoE computes: softmax router scores, top-k, optional renormalisation, no scale,
no shared experts, QK-norm always, the dense layers first (``mlp_only_layers``). A model with
other settings is refused at export and at import, naming the ``model.*`` key.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import HFNames, rope_rows_from_hf, rope_rows_to_hf


class MoEHF:
    """The HF half of ``MoEConfig`` (a mixin: it reads the config's own fields)."""

    hf_model_type = "qwen3_moe"
    hf_ignored = ("rotary_emb.inv_freq",)  # a buffer some HF folders carry
    hf_dropped = (".moe.router.expert_bias",)  # zero in any export (check_export), zeros on import

    def hf_names(self) -> HFNames:
        """Our parameter names and Hugging Face Qwen3-MoE's (the stacked experts under the
        names of HF's stacked modules: the files hold them per expert, see ``to_hf``)."""
        return HF_NAMES

    def to_hf(self, state: dict) -> dict:
        """Our full state dict in HF names and layout: experts one tensor each, ``wq`` / ``wk``
        rows and QK-norm weights in HF's RoPE order, ``expert_bias`` left out."""
        out = {}
        for name, tensor in state.items():
            match = _OUR_EXPERTS.match(name)
            if match:
                proj = _EXPERT_PROJ[match[2]]
                for e, weight in enumerate(tensor.unbind(0)):
                    # A copy: safetensors refuses tensors that share one storage.
                    out[f"model.layers.{match[1]}.mlp.experts.{e}.{proj}.weight"] = weight.clone()
            elif not name.endswith(self.hf_dropped):
                out[HF_NAMES.to_hf(name)] = self._rope_order(name, tensor, rope_rows_to_hf)
        return out

    def from_hf(self, state: dict) -> dict:
        """An HF Qwen3-MoE state dict (experts one tensor each) in our names and layout, with
        every MoE layer's ``expert_bias`` zero."""
        out, experts = {}, {}
        for hf_name, tensor in state.items():
            match = _HF_EXPERT.match(hf_name)
            if match:
                experts.setdefault((match[1], match[3]), {})[int(match[2])] = tensor
                continue
            name = HF_NAMES.from_hf(hf_name)
            out[name] = self._rope_order(name, tensor, rope_rows_from_hf)
        for (layer, proj), per_expert in experts.items():
            stacked = torch.stack([per_expert[e] for e in range(len(per_expert))])
            out[f"layers.{layer}.moe.experts.{_OUR_PROJ[proj]}"] = stacked
        for layer in range(self.n_dense_layers, self.n_layers):
            out[f"layers.{layer}.moe.router.expert_bias"] = torch.zeros(self.n_experts)
        return out

    def _rope_order(self, name: str, tensor: torch.Tensor, permute) -> torch.Tensor:
        """``tensor`` with ``permute`` (to or from HF's RoPE order) applied within each head
        when ``name`` is a RoPE-rotated projection or a QK-norm weight, else as is."""
        if name.endswith("attention.wq.weight"):
            return permute(tensor, self.n_heads)
        if name.endswith("attention.wk.weight"):
            return permute(tensor, self.n_kv_heads or self.n_heads)
        if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return permute(tensor[:, None], 1)[:, 0]  # one head's channels
        return tensor

    def hf_config(self, dtype: torch.dtype) -> dict:
        """The ``config.json`` of a Qwen3MoeForCausalLM with this shape (ConfigError for a
        model Qwen3-MoE cannot express, see ``check_export``)."""
        self._check_expressible()
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads or self.n_heads,
            "head_dim": self.attention_head_dim(),
            "num_experts": self.n_experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.expert_ffn_dim,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(self.n_dense_layers)),
            # Used by transformers only when training with output_router_logits=true, where
            # it weighs its own (batch-wise) balance loss; ours is DeepSeek-V3's sequence-wise.
            "router_aux_loss_coef": self.aux_loss_coef,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "initializer_range": self.init_std,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def model_keys_from_hf_config(self, config_json: dict) -> dict:
        """Our ``model.*`` values (shape and numerics) a ``qwen3_moe`` ``config.json`` implies
        (``ffn_hidden_dim`` None when no layer is dense: HF's ``intermediate_size`` is unused)."""
        rope = config_json.get("rope_parameters") or {}
        heads = config_json["num_attention_heads"]
        dense = len(_dense_layers(config_json))
        return {
            "dim": config_json["hidden_size"],
            "n_layers": config_json["num_hidden_layers"],
            "n_heads": heads,
            "n_kv_heads": config_json.get("num_key_value_heads") or heads,
            "head_dim": config_json.get("head_dim") or config_json["hidden_size"] // heads,
            "vocab_size": config_json["vocab_size"],
            "n_dense_layers": dense,
            "ffn_hidden_dim": config_json["intermediate_size"] if dense else None,
            "n_experts": _n_experts(config_json),
            "top_k": config_json["num_experts_per_tok"],
            "expert_ffn_dim": config_json["moe_intermediate_size"],
            "norm_topk_prob": bool(config_json.get("norm_topk_prob", False)),
            "n_shared_experts": 0,
            "score_func": "softmax",
            "route_scale": 1.0,
            "qk_norm": True,
            "norm_eps": config_json.get("rms_norm_eps", 1e-6),
            "rope_theta": config_json.get("rope_theta", rope.get("rope_theta", 10000.0)),
        }

    def check_hf_config(self, config_json: dict, path) -> None:
        """Refuse Qwen3-MoE options this model does not compute (ConfigError naming ``path``):
        RoPE scaling, sliding windows, attention biases, tied embeddings, another activation,
        dense layers that are not the first ones."""
        scaling = config_json.get("rope_scaling") or config_json.get("rope_parameters") or {}
        differ = {
            "rope_type": scaling.get("rope_type", scaling.get("type", "default")) != "default",
            "use_sliding_window": config_json.get("use_sliding_window", False),
            "attention_bias": config_json.get("attention_bias", False),
            "tie_word_embeddings": config_json.get("tie_word_embeddings", False),
            "hidden_act": config_json.get("hidden_act", "silu") != "silu",
        }
        bad = [
            f"{key}={config_json.get(key, scaling.get(key))!r}" for key, d in differ.items() if d
        ]
        if bad:
            raise ConfigError(
                f"{path} sets {', '.join(bad)}; hsdp_runner's MoE computes plain RoPE, full "
                "causal attention without biases, SiLU experts and an untied output layer, "
                "so these weights would compute something else"
            )
        dense = _dense_layers(config_json)
        if dense != list(range(len(dense))):
            raise ConfigError(
                f"{path} makes layers {dense} dense (mlp_only_layers="
                f"{config_json.get('mlp_only_layers')}, decoder_sparse_step="
                f"{config_json.get('decoder_sparse_step', 1)}); hsdp_runner's MoE has its dense "
                "layers first (model.n_dense_layers), so it cannot load this layout"
            )

    def check_export(self, state: Optional[dict]) -> None:
        """Raise ConfigError naming the ``model.*`` key when the model, or the weights
        ``state`` about to be written (None: the settings alone), cannot be exported to
        Qwen3-MoE: the settings ``_check_expressible`` refuses, and a loss-free balancing bias
        (``model.bias_update_speed`` > 0, or a nonzero ``expert_bias``), which changes which
        experts a token picks and has no place in Qwen3-MoE's router."""
        self._check_expressible()
        fix = "Qwen3-MoE's router has no bias, so transformers would route tokens differently"
        if self.bias_update_speed > 0:
            raise ConfigError(
                f"model.bias_update_speed={self.bias_update_speed} trains a loss-free balancing "
                f"bias that changes which experts each token picks; {fix}. A model to export "
                "needs model.bias_update_speed=0 (balance with model.aux_loss_coef instead)"
            )
        for name, tensor in (state or {}).items():
            if name.endswith(self.hf_dropped) and tensor.any():
                raise ConfigError(
                    f"{name} is nonzero (a loss-free balancing bias from training with "
                    f"model.bias_update_speed > 0): it changes which experts each token "
                    f"picks; {fix}. Export a model trained with model.bias_update_speed=0"
                )

    def _check_expressible(self) -> None:
        """Raise ConfigError naming the first ``model.*`` setting Qwen3-MoE has no way to
        express (it would load and compute something else)."""
        refusals = (
            (self.n_shared_experts > 0, "n_shared_experts", "has no shared experts", 0),
            (self.score_func != "softmax", "score_func", "scores experts by softmax", "softmax"),
            (self.route_scale != 1.0, "route_scale", "does not scale routed weights", 1.0),
            (not self.qk_norm, "qk_norm", "always normalises queries and keys", True),
        )
        for refused, key, what, fix in refusals:
            if refused:
                raise ConfigError(
                    f"model.{key}={getattr(self, key)}: Hugging Face's Qwen3-MoE (qwen3_moe) "
                    f"{what}, so this model can neither be exported to nor loaded from one; "
                    f"set model.{key}={fix} to train a model it can hold"
                )


def _n_experts(config_json: dict) -> int:
    """The expert count (``num_experts``; transformers 5 saves it as ``num_local_experts``)."""
    return config_json.get("num_experts", config_json.get("num_local_experts", 0))


def _dense_layers(config_json: dict) -> list[int]:
    """The layers Qwen3-MoE builds with a dense MLP, by transformers' own rule: those in
    ``mlp_only_layers``, every layer without experts, and those ``decoder_sparse_step`` skips."""
    only = set(config_json.get("mlp_only_layers") or ())
    step = config_json.get("decoder_sparse_step", 1)
    return [
        i
        for i in range(config_json["num_hidden_layers"])
        if i in only or _n_experts(config_json) == 0 or (i + 1) % step
    ]


# --- Hugging Face names -------------------------------------------------------------------------
# Names as transformers' Qwen3MoeForCausalLM has them in memory; its files (and ours) hold the
# experts one Linear weight each instead (``_HF_EXPERT``), which ``to_hf`` / ``from_hf`` split
# and stack.

HF_NAMES = HFNames(
    (
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
        ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
        ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
        ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
        ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
        ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
        ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
        ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
        ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
        ("layers.{i}.moe.router.gate.weight", "model.layers.{i}.mlp.gate.weight"),
        ("layers.{i}.moe.experts.w1", "model.layers.{i}.mlp.experts.gate_up_proj"),
        ("layers.{i}.moe.experts.w3", "model.layers.{i}.mlp.experts.gate_up_proj"),
        ("layers.{i}.moe.experts.w2", "model.layers.{i}.mlp.experts.down_proj"),
        ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    )
)
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_OUR_PROJ = {proj: ours for ours, proj in _EXPERT_PROJ.items()}
_OUR_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w[123])$")
_HF_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
