"""The Hugging Face Llama format: parameter names, RoPE row order, config.json, safetensors folders.

Our model and ``transformers``' LlamaForCausalLM compute the same function, but
- names differ (``layers.0.attention.wq.weight`` vs ``model.layers.0.self_attn.q_proj.weight``);
- our RoPE (``models/llama.apply_rope``) rotates interleaved channel pairs (2i, 2i+1), Meta's
  original layout, while HF rotates the two halves of a head (i, i + head_dim/2). So the rows of
  ``wq`` and ``wk`` are permuted within each head on export and back on import, exactly as
  HF's own ``convert_llama_weights_to_hf.py`` does for Meta checkpoints.

A folder is ``config.json`` plus ``model.safetensors``, or above the size limit
``model-0000i-of-0000N.safetensors`` files and ``model.safetensors.index.json``. We write the
files with ``safetensors`` ourselves: torch's ``HuggingFaceStorageWriter`` always writes the
sharded naming plus an index, even for one file, and huggingface_hub's splitter is not a
runtime dependency.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch

from hsdp_runner.config import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# (ours, Hugging Face); "{i}" is the block index.
NAMES = (
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
# Model config keys that fix the tensor shapes, and those that only change the arithmetic.
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim")
NUMERIC_KEYS = ("norm_eps", "rope_theta")


class HFFormatError(ConfigError):
    """A Hugging Face folder that cannot be read or written; the message names the path."""


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_HF = [(_pattern(ours), hf) for ours, hf in NAMES]
_FROM_HF = [(_pattern(hf), ours) for ours, hf in NAMES]


def _rename(name: str, rules) -> str | None:
    for pattern, template in rules:
        match = pattern.match(name)
        if match:
            return template.replace("{i}", match.group(1)) if match.groups() else template
    return None


def _rope_rows_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved pairs (ours) to halves (HF)."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_rows_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of ``_rope_rows_to_hf``."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(name: str, model_cfg) -> int | None:
    if name.endswith("attention.wq.weight"):
        return model_cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return model_cfg.n_kv_heads or model_cfg.n_heads
    return None


def to_hf(state: dict[str, torch.Tensor], model_cfg, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Map our full (unsharded) state dict to HF names, RoPE row order and ``dtype``."""
    out = {}
    for name, tensor in state.items():
        hf_name = _rename(name, _TO_HF)
        if hf_name is None:
            raise HFFormatError(f"parameter {name!r} has no Hugging Face Llama name")
        heads = _rope_heads(name, model_cfg)
        tensor = _rope_rows_to_hf(tensor, heads) if heads else tensor
        out[hf_name] = tensor.detach().to("cpu", dtype).contiguous()
    return out


def from_hf(state: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """Map an HF Llama state dict (HF names) back to our names and RoPE row order."""
    out = {}
    for hf_name, tensor in state.items():
        name = _rename(hf_name, _FROM_HF)
        heads = _rope_heads(name, model_cfg)
        out[name] = _rope_rows_from_hf(tensor, heads) if heads else tensor
    return out


def hf_config(model_cfg, dtype: torch.dtype) -> dict:
    """The ``config.json`` of a LlamaForCausalLM with our model's shape."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": model_cfg.dim, "intermediate_size": model_cfg.ffn_hidden_dim,
        "num_hidden_layers": model_cfg.n_layers, "num_attention_heads": model_cfg.n_heads,
        "num_key_value_heads": model_cfg.n_kv_heads or model_cfg.n_heads,
        "head_dim": model_cfg.dim // model_cfg.n_heads, "vocab_size": model_cfg.vocab_size,
        "max_position_embeddings": model_cfg.seq_len, "rms_norm_eps": model_cfg.norm_eps,
        "rope_theta": model_cfg.rope_theta, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": model_cfg.init_std, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def model_keys_from_hf_config(config: dict) -> dict:
    """Our ``model.*`` values that an HF Llama ``config.json`` implies (shape and numerics)."""
    rope = config.get("rope_parameters") or {}
    return {"dim": config["hidden_size"], "n_layers": config["num_hidden_layers"],
            "n_heads": config["num_attention_heads"],
            "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
            "vocab_size": config["vocab_size"], "ffn_hidden_dim": config["intermediate_size"],
            "norm_eps": config.get("rms_norm_eps", 1e-6),
            "rope_theta": config.get("rope_theta", rope.get("rope_theta", 10000.0))}


def require_empty_destination(out_dir: Path, what: str) -> None:
    """Raise HFFormatError if ``out_dir`` exists and is not an empty folder (never overwrite)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise HFFormatError(f"{what} {out_dir} already exists and is not empty; refusing to "
                            "overwrite it. Remove it or choose another folder")


def _split(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict]:
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    return shards + [current] if current else shards


def write_folder(tensors: dict[str, torch.Tensor], config: dict, out_dir: Path,
                 max_shard_bytes: int) -> list[Path]:
    """Write an HF folder: config.json and one or more safetensors files (+ index).

    ``tensors`` has HF names. Files go to a temporary sibling folder that is renamed to
    ``out_dir`` when complete. Raises HFFormatError if ``out_dir`` holds files. Returns the
    written weight files.
    """
    from safetensors.torch import save_file

    require_empty_destination(out_dir, "export folder")
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    shards = _split(tensors, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    try:
        for name, shard in zip(names, shards):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            os.chmod(tmp / name, 0o644)  # safetensors writes 0600 files; exports are for sharing
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                    for t in tensors.values())},
                     "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    os.replace(tmp, out_dir)
    return [out_dir / name for name in names]


def read_config(folder: Path) -> dict:
    """Return the folder's config.json; HFFormatError if it is missing or not Llama."""
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HFFormatError(f"{path} cannot be read ({err}); a Hugging Face Llama folder needs "
                            "config.json beside its safetensors files") from None
    if config.get("model_type") != "llama":
        raise HFFormatError(f"{path} has model_type={config.get('model_type')!r}; only Llama "
                            "folders (model_type 'llama') can be loaded")
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise HFFormatError(f"{path} asks for rope_type={kind!r}; hsdp_runner's model applies "
                            "plain RoPE only, so these weights would compute something else")
    return config


def weight_files(folder: Path) -> dict[str, Path]:
    """Return {HF tensor name: file} for the folder's safetensors (single file or index)."""
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as err:
            raise HFFormatError(f"{index} cannot be read ({err})") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.exists():
        raise HFFormatError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    try:
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    except Exception as err:  # safetensors raises its own error types for bad headers
        raise HFFormatError(f"{single} is not a readable safetensors file ({err})") from None


def check_folder(folder: Path, model_cfg, expected_shapes: dict[str, tuple]) -> dict[str, Path]:
    """Check an HF Llama folder against the model without reading the weights.

    ``expected_shapes`` maps our parameter names to shapes. Checks config.json (shape and
    numerics against ``model_cfg``), tensor names and shapes (from the safetensors headers).
    Returns {HF name: file}; raises HFFormatError naming the folder and the first mismatch.
    """
    from safetensors import safe_open

    implied = model_keys_from_hf_config(read_config(folder))
    ours = {key: getattr(model_cfg, key) for key in SHAPE_KEYS + NUMERIC_KEYS}
    ours["n_kv_heads"] = ours["n_kv_heads"] or ours["n_heads"]
    differ = [f"model.{k}={ours[k]} but config.json implies {implied[k]}"
              for k in implied if ours[k] != implied[k]]
    if differ:
        raise HFFormatError(f"{folder} was written for another model: {'; '.join(differ)}; set "
                            "those model.* keys to the folder's values")
    files = weight_files(folder)
    hf_names = {_rename(name, _TO_HF): name for name in expected_shapes}
    missing = sorted(set(hf_names) - set(files))
    extra = sorted(n for n in set(files) - set(hf_names) if not n.endswith("rotary_emb.inv_freq"))
    if missing or extra:
        raise HFFormatError(f"{folder} does not match the model: missing {missing[:3]}, "
                            f"unexpected {extra[:3]}")
    for hf_name, name in hf_names.items():
        try:
            with safe_open(str(files[hf_name]), framework="pt") as f:
                shape = tuple(f.get_slice(hf_name).get_shape())
        except Exception as err:  # safetensors raises its own error types for bad files
            raise HFFormatError(f"{files[hf_name]} cannot be read ({err})") from None
        if shape != expected_shapes[name]:
            raise HFFormatError(f"{files[hf_name]}: {hf_name} has shape {shape}, the model "
                                f"needs {expected_shapes[name]}")
    return {hf_name: files[hf_name] for hf_name in hf_names}


def read_folder(folder: Path, model_cfg, expected_shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Check (``check_folder``) and read an HF Llama folder into our names and row order."""
    from safetensors import safe_open

    files = check_folder(folder, model_cfg, expected_shapes)
    tensors = {}
    for hf_name, file in files.items():
        with safe_open(str(file), framework="pt") as f:
            tensors[hf_name] = f.get_tensor(hf_name)
    return from_hf(tensors, model_cfg)
