"""GPT-2's Hugging Face mapping: our names to ``transformers``' GPT2LMHeadModel's and back,
and the ``config.json`` of a model of this shape.

Our q, k and v are separate Linear layers (a fused qkv cannot be split by heads with one
column-parallel layer): the mapping fuses them into HF's ``c_attn`` and splits it back. HF's
Conv1D layers store their weights (in, out), ours are (out, in): the mapping transposes them.
``GPT2HF`` implements ``models/base.py``'s ``HFAdapter`` over the fields of the GPT-2 config it
is mixed into (``gpt2.GPT2Config``); ``checkpoint/hf.py`` does the file work for any family.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import HFNames


class GPT2HF:
    """The HF half of ``GPT2Config`` (a mixin: it reads the config's own fields)."""

    hf_model_type = "gpt2"
    hf_ignored = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older HF files
    hf_dropped = ()  # every parameter has an HF counterpart

    def hf_names(self) -> HFNames:
        """Our parameter names and Hugging Face GPT-2's (q, k, v all map to ``c_attn``)."""
        return HF_NAMES

    def to_hf(self, state: dict) -> dict:
        """Our full state dict in HF names: q, k, v fused into ``c_attn``, Conv1D weights (in, out)."""
        out, qkv = {}, {}
        for name, tensor in state.items():
            match = _QKV.match(name)
            if match:
                qkv.setdefault((match[1], match[3]), {})[match[2]] = tensor
                continue
            out[HF_NAMES.to_hf(name)] = tensor.t() if name.endswith(_CONV1D) else tensor
        for (i, kind), parts in qkv.items():
            fused = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
            out[f"transformer.h.{i}.attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused
        return out

    def from_hf(self, state: dict) -> dict:
        """An HF GPT-2 state dict in our names and layout (inverse of ``to_hf``)."""
        out = {}
        for hf_name, tensor in state.items():
            match = _C_ATTN.match(hf_name)
            if match:
                fused = tensor.t() if match[2] == "weight" else tensor
                for part, chunk in zip("qkv", fused.chunk(3, dim=0)):
                    out[f"h.{match[1]}.attn.{part}_proj.{match[2]}"] = chunk.contiguous()
                continue
            name = HF_NAMES.from_hf(hf_name)
            out[name] = tensor.t().contiguous() if name.endswith(_CONV1D) else tensor
        return out

    def hf_config(self, dtype: torch.dtype) -> dict:
        """The ``config.json`` of a GPT2LMHeadModel with this shape (untied, no dropout).

        No special tokens: our data has none, and transformers' GPT-2 defaults (50256, the
        end-of-text id of OpenAI's 50,257-token vocabulary) do not exist in a smaller one."""
        return {
            "bos_token_id": None,
            "eos_token_id": None,
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.seq_len,
            "n_embd": self.dim,
            "n_layer": self.n_layers,
            "n_head": self.n_heads,
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.norm_eps,
            "initializer_range": self.init_std,
            "tie_word_embeddings": False,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def model_keys_from_hf_config(self, config_json: dict) -> dict:
        """Our ``model.*`` values (shape and numerics) an HF GPT-2 ``config.json`` implies."""
        return {
            "dim": config_json["n_embd"],
            "n_layers": config_json["n_layer"],
            "n_heads": config_json["n_head"],
            "vocab_size": config_json["vocab_size"],
            "seq_len": config_json["n_positions"],
            "norm_eps": config_json.get("layer_norm_epsilon", 1e-5),
        }

    def check_hf_config(self, config_json: dict, path) -> None:
        """Refuse HF GPT-2 options this model does not compute (ConfigError naming ``path``)."""
        n_inner = config_json.get("n_inner")
        differ = {
            "activation_function": config_json.get("activation_function", "gelu_new")
            not in ("gelu_new", "gelu_pytorch_tanh"),
            "n_inner": n_inner not in (None, 4 * config_json["n_embd"]),
            "tie_word_embeddings": config_json.get("tie_word_embeddings", True),
            "scale_attn_by_inverse_layer_idx": config_json.get("scale_attn_by_inverse_layer_idx"),
            "reorder_and_upcast_attn": config_json.get("reorder_and_upcast_attn"),
        }
        bad = [f"{key}={config_json.get(key)!r}" for key, differs in differ.items() if differs]
        if bad:
            raise ConfigError(
                f"{path} sets {', '.join(bad)}; hsdp_runner's GPT-2 computes a tanh "
                "GELU MLP of 4 x n_embd with an untied lm_head and plain attention "
                "scaling, so these weights would compute something else"
            )

    def check_export(self, state: Optional[dict]) -> None:
        """Nothing to refuse: GPT2LMHeadModel expresses every GPT-2 this family builds."""


# --- Hugging Face names -------------------------------------------------------------------------

_PAIRS = [
    ("wte.weight", "transformer.wte.weight"),
    ("wpe.weight", "transformer.wpe.weight"),
    ("ln_f.weight", "transformer.ln_f.weight"),
    ("ln_f.bias", "transformer.ln_f.bias"),
    ("lm_head.weight", "lm_head.weight"),
]
for _kind in ("weight", "bias"):
    _PAIRS += [
        (f"h.{{i}}.{m}.{_kind}", f"transformer.h.{{i}}.{m}.{_kind}")
        for m in ("ln_1", "ln_2", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    _PAIRS += [
        (f"h.{{i}}.attn.{p}_proj.{_kind}", f"transformer.h.{{i}}.attn.c_attn.{_kind}")
        for p in "qkv"
    ]
HF_NAMES = HFNames(tuple(_PAIRS))
_QKV = re.compile(r"^h\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$")
_C_ATTN = re.compile(r"^transformer\.h\.(\d+)\.attn\.c_attn\.(weight|bias)$")
_CONV1D = ("c_proj.weight", "c_fc.weight")  # HF stores these (in, out)
