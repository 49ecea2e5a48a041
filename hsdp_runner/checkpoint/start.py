"""Where a job's state comes from: find checkpoints on disk, check them, plan the start.

A job starts from the newest complete checkpoint in its own ``checkpoint.dir`` (with
``checkpoint.resume=auto``), else from ``checkpoint.load_path``, else from the Hugging Face
folder ``checkpoint.init_from_hf``, else fresh. ``validate`` checks that plan in the launching
process before any worker starts; in the job, rank 0 plans again (a requeued job may find a
newer checkpoint) and every rank receives its ``Start`` (``agree_on_start``). Saving and
loading are ``checkpointer.Checkpointer``'s.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hsdp_runner.checkpoint import hf
from hsdp_runner.config.schema import CheckpointConfig
from hsdp_runner.core.choices import Resume, StartSource
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import ModelConfig, build_meta_model, model_fields, model_spec

MANIFEST = "checkpoint.json"
FORMAT = "hsdp_runner.dcp/1"
_COMPLETE = re.compile(r"^step-(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete, damaged or of another model; names the path."""


@dataclass(frozen=True)
class Start:
    """Where a job's state comes from: a checkpoint (full state), an HF folder (weights) or
    fresh weights; ``path`` names the folder, ``step`` the first step to train."""

    source: StartSource
    path: Optional[str] = None
    step: int = 0
    manifest: Optional[dict] = None


def checkpoint_dir(ckpt_cfg: CheckpointConfig, output_dir: Path) -> Path:
    """The folder checkpoints are saved to and resumed from (``ckpt_cfg``: the ``checkpoint``
    config node)."""
    return Path(ckpt_cfg.dir).expanduser() if ckpt_cfg.dir else Path(output_dir) / "checkpoints"


def export_dir(ckpt_cfg: CheckpointConfig, output_dir: Path) -> Path:
    """The folder ``checkpoint.export_at_end`` writes to."""
    return (
        Path(ckpt_cfg.export_dir).expanduser() if ckpt_cfg.export_dir else Path(output_dir) / "hf"
    )


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Return [(step, path)] of the complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _COMPLETE.match(p.name)) and (p / MANIFEST).is_file()
    ]
    return sorted(found)


def newest_checkpoint(ckpt_cfg: CheckpointConfig, output_dir: Path) -> str | None:
    """The path of the newest complete checkpoint in the job's checkpoint dir, or None."""
    found = complete_checkpoints(checkpoint_dir(ckpt_cfg, output_dir))
    return str(found[-1][1]) if found else None


def resolve(path: Path, key: str) -> Path:
    """Return the checkpoint ``path`` names: itself if it is one, else the newest inside it."""
    if not path.exists():
        raise CheckpointError(
            f"{key}={path} does not exist; point it at a step-N checkpoint "
            "folder or at a folder of them"
        )
    if (path / MANIFEST).is_file() or path.name.endswith(".partial"):
        return path
    found = complete_checkpoints(path)
    if not found:
        hint = (
            "; for a Hugging Face folder use checkpoint.init_from_hf"
            if (path / hf.CONFIG_FILE).is_file()
            else ""
        )
        raise CheckpointError(
            f"{key}={path} is neither a checkpoint (no {MANIFEST}) nor a folder "
            f"holding complete step-N checkpoints{hint}"
        )
    return found[-1][1]


def expected_shapes(model_cfg: ModelConfig) -> dict[str, tuple]:
    """Parameter name -> shape of the model ``model_cfg`` describes (its shared meta model)."""
    return {k: tuple(v.shape) for k, v in build_meta_model(model_cfg).state_dict().items()}


def inspect(path: Path, model_cfg: ModelConfig | None) -> dict:
    """Check that ``path`` is a complete, intact checkpoint of this model; return its manifest.

    Reads only the manifest and DCP's ``.metadata``: every shard file must exist and be as long
    as the metadata says (a truncated write is caught here), and every model tensor must have
    the shape ``model_cfg`` needs (None: the model the manifest records). Raises
    CheckpointError naming the path and the problem.
    """
    from torch.distributed.checkpoint import FileSystemReader

    if path.name.endswith(".partial") or not (path / MANIFEST).is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {MANIFEST}): its save was "
            "interrupted or it is not an hsdp_runner checkpoint; use an earlier one"
        )
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # json, pickle and OS errors alike mean a damaged checkpoint
        raise CheckpointError(
            f"checkpoint {path} is damaged: its {MANIFEST} or .metadata cannot "
            f"be read ({type(err).__name__}: {err}); use an earlier one"
        ) from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"holds {have} bytes"
            raise CheckpointError(
                f"checkpoint {path} is truncated: {name} {state}, its .metadata "
                f"expects {size}; use an earlier checkpoint"
            )
    recorded = model_spec(manifest["model"]) if model_cfg is None else model_cfg
    _check_shapes(path, metadata, manifest, recorded)
    return manifest


def _check_shapes(path: Path, metadata, manifest: dict, model_cfg: ModelConfig) -> None:
    saved = {
        k.removeprefix("model."): tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    wanted = expected_shapes(model_cfg)
    bad = [
        f"{k} is {saved.get(k)} there, {shape} here"
        for k, shape in wanted.items()
        if saved.get(k) != shape
    ] + [f"{k} is not in this model" for k in saved if k not in wanted]
    if bad:
        theirs, ours = manifest.get("model", {}), model_fields(model_cfg)
        keys = [
            f"model.{k}={theirs.get(k)} there, {ours.get(k)} here"
            for k in theirs
            if k not in ("name", "_target_") and theirs[k] != ours.get(k)
        ]
        raise CheckpointError(
            f"checkpoint {path} holds another model shape: {'; '.join(bad[:3])}"
            f" ({'; '.join(keys) or 'see its ' + MANIFEST}); load it with the "
            "model config it was saved with"
        )


def load_full_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a checkpoint's model weights unsharded into this process.

    Checks the checkpoint first (``inspect``). Returns ({name: full tensor}, manifest).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    manifest = inspect(path, None)
    metadata = FileSystemReader(str(path)).read_metadata()
    weights = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: intended here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": weights}, checkpoint_id=str(path), no_dist=True)
    except (Exception, dcp.CheckpointException) as err:
        raise CheckpointError(
            f"checkpoint {path} could not be read ({load_failure(err)}); it may be damaged"
        ) from err
    return weights, manifest


def plan_start(ckpt_cfg: CheckpointConfig, model_cfg: ModelConfig, output_dir: Path) -> Start:
    """Decide where the job's state comes from; check that source. Raises CheckpointError.

    Takes the ``checkpoint`` and ``model`` config nodes and the job's output dir. Order: the
    newest complete checkpoint in ``checkpoint.dir`` (with resume=auto), so a restarted job
    continues its own run; else ``load_path``; else ``init_from_hf``; else fresh.
    """
    c = ckpt_cfg
    found = complete_checkpoints(checkpoint_dir(c, output_dir)) if c.resume == Resume.auto else []
    path = (
        found[-1][1]
        if found
        else (
            resolve(Path(c.load_path).expanduser(), "checkpoint.load_path") if c.load_path else None
        )
    )
    if path is not None:
        manifest = inspect(path, model_cfg)
        return Start(StartSource.checkpoint, str(path), int(manifest["step"]), manifest)
    if c.init_from_hf:
        folder = Path(c.init_from_hf).expanduser()
        if not folder.is_dir() or (folder / MANIFEST).is_file():
            what = (
                "is an hsdp_runner checkpoint (use checkpoint.load_path)"
                if folder.is_dir()
                else "does not exist or is not a folder"
            )
            raise CheckpointError(
                f"checkpoint.init_from_hf={folder} {what}; point it at a Hugging "
                "Face safetensors folder"
            )
        hf.check_folder(folder, model_cfg, expected_shapes(model_cfg))
        return Start(StartSource.hf, str(folder))
    return Start(StartSource.fresh)


def validate(
    ckpt_cfg: CheckpointConfig, model_cfg: ModelConfig, steps: int, output_dir: Path
) -> Start:
    """Check the ``checkpoint`` keys and paths before any worker starts; return the Start.

    Takes the ``checkpoint`` and ``model`` configs, the run's ``trainer.steps`` and the output
    dir (the pre-flight check of ``launch``).
    """
    c = ckpt_cfg
    for key in ("interval", "keep_last"):
        value = getattr(c, key)
        if value is not None and value < 1:
            raise ConfigError(f"checkpoint.{key}={value} must be >= 1, or null")
    if c.rank0_wait_s <= 0:
        raise ConfigError(f"checkpoint.rank0_wait_s={c.rank0_wait_s} must be positive (seconds)")
    if c.export_max_shard_gib <= 0:
        raise ConfigError(
            f"checkpoint.export_max_shard_gib={c.export_max_shard_gib} must be positive"
        )
    folder = checkpoint_dir(c, output_dir)
    if c.enable and c.resume == Resume.never and complete_checkpoints(folder):
        raise CheckpointError(
            f"checkpoint.dir={folder} already holds checkpoints and "
            "checkpoint.resume=never would write beside them; continue with "
            "checkpoint.resume=auto or choose an empty checkpoint.dir"
        )
    start = plan_start(c, model_cfg, output_dir)
    if start.step >= steps:
        raise CheckpointError(
            f"checkpoint {start.path} is at step {start.step}, nothing is left "
            f"to train with trainer.steps={steps}; raise "
            "trainer.steps or start elsewhere"
        )
    if c.export_at_end:
        hf.require_empty_destination(export_dir(c, output_dir), "checkpoint.export_dir")
        hf.check_exportable(model_cfg)
    return start


def agree_on_start(ckpt_cfg: CheckpointConfig, model_cfg: ModelConfig, output_dir: Path) -> Start:
    """Rank 0 plans the start (``plan_start``) and every rank receives the same Start."""
    box = [plan_start(ckpt_cfg, model_cfg, output_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_failure(err: BaseException) -> str:
    """One line on why DCP could not load: its CheckpointException (a BaseException) carries
    each failing rank's exception and a long traceback; keep the first sentence of the first."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]  # (exception, stack summary)
    first = (str(err).strip().splitlines() or [""])[0].split(". ")[0]
    return f"{type(err).__name__}: {first}"
