"""Hugging Face folders: config.json and safetensors files, read, checked and written.

The names, tensor layout and ``config.json`` of a family's Hugging Face model are the
family's own (the ``HFAdapter`` its ``ModelSpec.hf_adapter`` returns, see ``models/base.py``);
this module does the file work for any family that has one.

A folder is ``config.json`` plus ``model.safetensors``, or above the size limit
``model-0000i-of-0000N.safetensors`` files and ``model.safetensors.index.json``. We write the
files with ``safetensors`` ourselves: torch's ``HuggingFaceStorageWriter`` always writes the
sharded naming plus an index, even for one file, and huggingface_hub's splitter is not a
runtime dependency.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import HFAdapter, ModelConfig, model_spec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class HFFormatError(ConfigError):
    """A Hugging Face folder that cannot be read or written; the message names the path."""


def _hf_spec(model_cfg: ModelConfig) -> HFAdapter:
    """The HF mapping of the model ``model_cfg`` describes; HFFormatError if it has none."""
    spec = model_spec(model_cfg)
    adapter = spec.hf_adapter()
    if adapter is None:
        raise HFFormatError(
            f"model {spec.name} ({type(spec).__name__}) has no Hugging Face "
            "mapping; Hugging Face export and import need one (models/base.py)"
        )
    return adapter


def to_hf(
    state: dict[str, torch.Tensor], model_cfg: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Map our full (unsharded) state dict to the family's HF names, layout and ``dtype``;
    ConfigError (naming the ``model.*`` key) for weights the family's HF model cannot hold."""
    spec = _hf_spec(model_cfg)
    spec.check_export(state)
    unnamed = [
        name
        for name in state
        if spec.hf_names().to_hf(name) is None and not name.endswith(spec.hf_dropped)
    ]
    if unnamed:
        raise HFFormatError(
            f"parameter {unnamed[0]!r} has no Hugging Face {spec.hf_model_type} name"
        )
    return {
        name: tensor.detach().to("cpu", dtype).contiguous()
        for name, tensor in spec.to_hf(state).items()
    }


def from_hf(state: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map an HF state dict (HF names) back to our names and layout."""
    return _hf_spec(model_cfg).from_hf(state)


def check_exportable(model_cfg: ModelConfig) -> None:
    """Raise ConfigError before training (``checkpoint.export_at_end``) when the model
    ``model_cfg`` describes cannot be exported: its family has no HF mapping, or its settings
    are ones the family's HF model cannot express."""
    _hf_spec(model_cfg).check_export(None)


def hf_config(model_cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The family's ``config.json`` for our model's shape, weights in ``dtype``."""
    return _hf_spec(model_cfg).hf_config(dtype)


def require_empty_destination(out_dir: Path, what: str) -> None:
    """Raise HFFormatError if ``out_dir`` exists and is not an empty folder (never overwrite)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise HFFormatError(
            f"{what} {out_dir} already exists and is not empty; refusing to "
            "overwrite it. Remove it or choose another folder"
        )


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


def write_folder(
    tensors: dict[str, torch.Tensor], config_json: dict, out_dir: Path, max_shard_bytes: int
) -> list[Path]:
    """Write an HF folder: config.json (``config_json``) and one or more safetensors files
    (+ index).

    ``tensors`` has HF names. Files go to a temporary sibling folder that is renamed to
    ``out_dir`` when complete. Raises HFFormatError if ``out_dir`` holds files. Returns the
    written weight files.
    """
    from safetensors.torch import save_file

    require_empty_destination(out_dir, "export folder")
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    shards = _split(tensors, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    try:
        for name, shard in zip(names, shards):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            os.chmod(tmp / name, 0o644)  # safetensors writes 0600 files; exports are for sharing
        if len(shards) > 1:
            index = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in tensors.values())
                },
                "weight_map": {k: name for name, shard in zip(names, shards) for k in shard},
            }
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(config_json, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    os.replace(tmp, out_dir)
    return [out_dir / name for name in names]


def write_export(
    weights: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    dtype: torch.dtype,
    out_dir: Path,
    max_shard_gib: float,
) -> list[Path]:
    """Write the runner's full ``weights`` of ``model_cfg`` as a Hugging Face folder in
    ``dtype`` (weights and config.json, shards above ``max_shard_gib``); return the weight
    files."""
    return write_folder(
        to_hf(weights, model_cfg, dtype),
        hf_config(model_cfg, dtype),
        out_dir,
        int(max_shard_gib * 2**30),
    )


def read_config(folder: Path, model_cfg: ModelConfig) -> dict:
    """Return the folder's config.json; HFFormatError if it is missing or of another family
    (or asks for what the model cannot compute)."""
    spec = _hf_spec(model_cfg)
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HFFormatError(
            f"{path} cannot be read ({err}); a Hugging Face folder needs "
            "config.json beside its safetensors files"
        ) from None
    if config.get("model_type") != spec.hf_model_type:
        raise HFFormatError(
            f"{path} has model_type={config.get('model_type')!r}; model "
            f"{model_spec(model_cfg).name} loads only model_type "
            f"{spec.hf_model_type!r} folders"
        )
    try:
        spec.check_hf_config(config, path)
    except ConfigError as err:
        raise HFFormatError(str(err)) from None
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


def check_folder(
    folder: Path, model_cfg: ModelConfig, expected_shapes: dict[str, tuple]
) -> dict[str, Path]:
    """Check an HF folder against the model without reading the weights.

    ``expected_shapes`` maps our parameter names to shapes. Checks config.json (shape and
    numerics against ``model_cfg``), tensor names and shapes (from the safetensors headers).
    Returns {HF name: file}; raises HFFormatError naming the folder and the first mismatch.
    """
    from safetensors import safe_open

    spec = _hf_spec(model_cfg)
    implied = spec.model_keys_from_hf_config(read_config(folder, model_cfg))
    # Our values as our own config.json would state them (e.g. n_kv_heads=null -> n_heads).
    ours = spec.model_keys_from_hf_config(spec.hf_config(torch.float32))
    differ = [
        f"model.{k}={ours[k]} but config.json implies {implied[k]}"
        for k in implied
        if ours[k] != implied[k]
    ]
    if differ:
        raise HFFormatError(
            f"{folder} was written for another model: {'; '.join(differ)}; set "
            "those model.* keys to the folder's values"
        )
    files = weight_files(folder)
    # The HF names and shapes: our mapping applied to shape-only (meta) tensors.
    wanted = {
        name: tuple(t.shape)
        for name, t in spec.to_hf(
            {k: torch.empty(shape, device="meta") for k, shape in expected_shapes.items()}
        ).items()
    }
    ignored = spec.hf_ignored
    missing = sorted(set(wanted) - set(files))
    extra = sorted(n for n in set(files) - set(wanted) if not n.endswith(ignored))
    if missing or extra:
        raise HFFormatError(
            f"{folder} does not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for hf_name, shape_wanted in wanted.items():
        try:
            with safe_open(str(files[hf_name]), framework="pt") as f:
                shape = tuple(f.get_slice(hf_name).get_shape())
        except Exception as err:  # safetensors raises its own error types for bad files
            raise HFFormatError(f"{files[hf_name]} cannot be read ({err})") from None
        if shape != shape_wanted:
            raise HFFormatError(
                f"{files[hf_name]}: {hf_name} has shape {shape}, the model needs {shape_wanted}"
            )
    return {hf_name: files[hf_name] for hf_name in wanted}


def read_folder(
    folder: Path, model_cfg: ModelConfig, expected_shapes: dict[str, tuple]
) -> dict[str, torch.Tensor]:
    """Check (``check_folder``) and read an HF folder into our names and layout."""
    from safetensors import safe_open

    files = check_folder(folder, model_cfg, expected_shapes)
    tensors = {}
    for hf_name, file in files.items():
        with safe_open(str(file), framework="pt") as f:
            tensors[hf_name] = f.get_tensor(hf_name)
    return _hf_spec(model_cfg).from_hf(tensors)
