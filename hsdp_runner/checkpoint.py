"""Distributed checkpoints: find, check, save, resume (under any layout), HF import and export.

A checkpoint folder (``checkpoint.dir``, default ``checkpoints/`` in the job's output dir):
```
step-10/            complete: DCP shards (__<rank>_0.distcp) + .metadata + checkpoint.json
step-20.partial/    a save in progress, or one that was interrupted: never loaded
```
What is saved: the model and optimizer through DCP's ``get_state_dict`` (keys are clean
parameter names and values DTensors, so ``dcp.load`` reshards them into any other layout,
FSDP-on-TP strided shards included), the LR scheduler, and every rank's RNG states. The
manifest ``checkpoint.json`` holds the step, the data position, the model shape and the
layout it was saved under.

The data loader needs no state of its own: ``data.TokenBatches`` makes the global batch of a
step a pure function of (trainer.seed, step) and each dp rank takes its slice, so the loader
position is the step, and it is valid under any dp degree.

Crash safety: every rank writes into ``step-N.partial``; after a barrier rank 0 writes the
manifest and renames the folder to ``step-N`` (atomic on POSIX), so a checkpoint is visible
only once complete. Older checkpoints are pruned (``keep_last``) only after that, by renaming
them away before deleting. Nothing is ever overwritten: an existing ``step-N`` or a non-empty
export folder is an error.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hsdp_runner import hf
from hsdp_runner.config import DTYPES, ConfigError
from hsdp_runner.faults import inject_fault
from hsdp_runner.models.base import build_meta_model
from hsdp_runner.rank0_io import run_on_rank0

log = logging.getLogger(__name__)

MANIFEST = "checkpoint.json"
FORMAT = "hsdp_runner.dcp/1"
_COMPLETE = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^step-(\d+)(\.partial|\.deleting)$")  # an unfinished save / deletion


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete, damaged or of another model; names the path."""


@dataclass(frozen=True)
class Start:
    """Where a job's state comes from: 'checkpoint' (full state), 'hf' (weights) or 'fresh'."""

    source: str
    path: Optional[str] = None
    step: int = 0
    manifest: Optional[dict] = None


def checkpoint_dir(cfg, output_dir: Path) -> Path:
    """The folder checkpoints are saved to and resumed from."""
    return Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else Path(output_dir) / "checkpoints"


def export_dir(cfg, output_dir: Path) -> Path:
    """The folder ``checkpoint.export_at_end`` writes to."""
    return Path(cfg.checkpoint.export_dir).expanduser() if cfg.checkpoint.export_dir else Path(output_dir) / "hf"


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Return [(step, path)] of the complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _COMPLETE.match(p.name)) and (p / MANIFEST).is_file()]
    return sorted(found)


def newest_checkpoint(cfg, output_dir: Path) -> str | None:
    """The path of the newest complete checkpoint in the job's checkpoint dir, or None."""
    found = complete_checkpoints(checkpoint_dir(cfg, output_dir))
    return str(found[-1][1]) if found else None


def resolve(path: Path, key: str) -> Path:
    """Return the checkpoint ``path`` names: itself if it is one, else the newest inside it."""
    if not path.exists():
        raise CheckpointError(f"{key}={path} does not exist; point it at a step-N checkpoint "
                              "folder or at a folder of them")
    if (path / MANIFEST).is_file() or path.name.endswith(".partial"):
        return path
    found = complete_checkpoints(path)
    if not found:
        hint = "; for a Hugging Face folder use checkpoint.init_from_hf" \
            if (path / hf.CONFIG_FILE).is_file() else ""
        raise CheckpointError(f"{key}={path} is neither a checkpoint (no {MANIFEST}) nor a folder "
                              f"holding complete step-N checkpoints{hint}")
    return found[-1][1]


def expected_shapes(model_cfg) -> dict[str, tuple]:
    """Parameter name -> shape of the model ``model_cfg`` describes (its shared meta model)."""
    return {k: tuple(v.shape) for k, v in build_meta_model(model_cfg).state_dict().items()}


def inspect(path: Path, model_cfg) -> dict:
    """Check that ``path`` is a complete, intact checkpoint of this model; return its manifest.

    Reads only the manifest and DCP's ``.metadata``: every shard file must exist and be as long
    as the metadata says (a truncated write is caught here), and every model tensor must have
    the shape ``model_cfg`` needs (None: the model the manifest records). Raises
    CheckpointError naming the path and the problem.
    """
    from torch.distributed.checkpoint import FileSystemReader

    if path.name.endswith(".partial") or not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MANIFEST}): its save was "
                              "interrupted or it is not an hsdp_runner checkpoint; use an earlier one")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # json, pickle and OS errors alike mean a damaged checkpoint
        raise CheckpointError(f"checkpoint {path} is damaged: its {MANIFEST} or .metadata cannot "
                              f"be read ({type(err).__name__}: {err}); use an earlier one") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"holds {have} bytes"
            raise CheckpointError(f"checkpoint {path} is truncated: {name} {state}, its .metadata "
                                  f"expects {size}; use an earlier checkpoint")
    _check_shapes(path, metadata, manifest,
                  OmegaConf.create(manifest["model"]) if model_cfg is None else model_cfg)
    return manifest


def _check_shapes(path: Path, metadata, manifest: dict, model_cfg) -> None:
    saved = {k.removeprefix("model."): tuple(v.size) for k, v in metadata.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(v, "size")}
    wanted = expected_shapes(model_cfg)
    bad = [f"{k} is {saved.get(k)} there, {shape} here" for k, shape in wanted.items()
           if saved.get(k) != shape] + [f"{k} is not in this model" for k in saved if k not in wanted]
    if bad:
        theirs = manifest.get("model", {})
        keys = [f"model.{k}={theirs.get(k)} there, {getattr(model_cfg, k, None)} here"
                for k in theirs if k != "name" and theirs[k] != getattr(model_cfg, k, None)]
        raise CheckpointError(f"checkpoint {path} holds another model shape: {'; '.join(bad[:3])}"
                              f" ({'; '.join(keys) or 'see its ' + MANIFEST}); load it with the "
                              "model config it was saved with")


def plan_start(cfg, output_dir: Path) -> Start:
    """Decide where the job's state comes from; check that source. Raises CheckpointError.

    Order: the newest complete checkpoint in ``checkpoint.dir`` (with resume=auto), so a
    restarted job continues its own run; else ``load_path``; else ``init_from_hf``; else fresh.
    """
    c = cfg.checkpoint
    found = complete_checkpoints(checkpoint_dir(cfg, output_dir)) if c.resume == "auto" else []
    path = found[-1][1] if found else (resolve(Path(c.load_path).expanduser(), "checkpoint.load_path")
                                       if c.load_path else None)
    if path is not None:
        manifest = inspect(path, cfg.model)
        return Start("checkpoint", str(path), int(manifest["step"]), manifest)
    if c.init_from_hf:
        folder = Path(c.init_from_hf).expanduser()
        if not folder.is_dir() or (folder / MANIFEST).is_file():
            what = "is an hsdp_runner checkpoint (use checkpoint.load_path)" if folder.is_dir() \
                else "does not exist or is not a folder"
            raise CheckpointError(f"checkpoint.init_from_hf={folder} {what}; point it at a Hugging "
                                  "Face safetensors folder")
        hf.check_folder(folder, cfg.model, expected_shapes(cfg.model))
        return Start("hf", str(folder))
    return Start("fresh")


def validate(cfg, output_dir: Path) -> Start:
    """Check the ``checkpoint`` keys and paths before any worker starts; return the Start."""
    c = cfg.checkpoint
    if c.resume not in ("auto", "never"):
        raise ConfigError(f"checkpoint.resume={c.resume!r} is not one of auto, never")
    for key in ("interval", "keep_last"):
        if c[key] is not None and c[key] < 1:
            raise ConfigError(f"checkpoint.{key}={c[key]} must be >= 1, or null")
    if c.export_dtype not in DTYPES:
        raise ConfigError(f"checkpoint.export_dtype={c.export_dtype!r} is not one of {', '.join(DTYPES)}")
    if c.rank0_wait_s <= 0:
        raise ConfigError(f"checkpoint.rank0_wait_s={c.rank0_wait_s} must be positive (seconds)")
    if c.export_max_shard_gib <= 0:
        raise ConfigError(f"checkpoint.export_max_shard_gib={c.export_max_shard_gib} must be positive")
    folder = checkpoint_dir(cfg, output_dir)
    if c.enable and c.resume == "never" and complete_checkpoints(folder):
        raise CheckpointError(f"checkpoint.dir={folder} already holds checkpoints and "
                              "checkpoint.resume=never would write beside them; continue with "
                              "checkpoint.resume=auto or choose an empty checkpoint.dir")
    start = plan_start(cfg, output_dir)
    if start.step >= cfg.trainer.steps:
        raise CheckpointError(f"checkpoint {start.path} is at step {start.step}, nothing is left "
                              f"to train with trainer.steps={cfg.trainer.steps}; raise "
                              "trainer.steps or start elsewhere")
    if c.export_at_end:
        hf.require_empty_destination(export_dir(cfg, output_dir), "checkpoint.export_dir")
    return start


def agree_on_start(cfg, output_dir: Path) -> Start:
    """Rank 0 plans the start (``plan_start``) and every rank receives the same Start."""
    box = [plan_start(cfg, output_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rng_state(device: torch.device) -> bytes:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return pickle.dumps(state)


def _set_rng_state(blob: bytes, device: torch.device) -> None:
    state = pickle.loads(blob)  # our own checkpoint; DCP unpickles its non-tensor data too
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def load_failure(err: BaseException) -> str:
    """One line on why DCP could not load: its CheckpointException (a BaseException) carries
    each failing rank's exception and a long traceback; keep the first sentence of the first."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]  # (exception, stack summary)
    first = (str(err).strip().splitlines() or [""])[0].split(". ")[0]
    return f"{type(err).__name__}: {first}"


def _remove(path: Path) -> bool:
    """Delete a folder the runner wrote; log a failure instead of raising. True if gone."""
    errors = []
    shutil.rmtree(path, onerror=lambda func, name, exc: errors.append(f"{name}: {exc[1]}"))
    if errors:
        log.warning("could not delete %s (%s); delete it by hand", path, "; ".join(errors[:3]))
    return not errors


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Saves and restores one job's training state; every rank holds one and calls it together.

    Takes the resolved config, ParallelDims, the job's output dir and the trainer's model,
    optimizer and LR scheduler (already sharded; the optimizer built over them).
    """

    def __init__(self, cfg, dims, output_dir: Path, model, optimizer, scheduler,
                 device: torch.device):
        self.cfg, self.dims, self.device = cfg, dims, device
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.folder = checkpoint_dir(cfg, output_dir)
        self.export_folder = export_dir(cfg, output_dir)
        self.rank = dist.get_rank()
        self._wait_s = cfg.checkpoint.rank0_wait_s
        self.facts = {"start_step": 0, "loaded_from": None, "last_checkpoint": None, "export": None}

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def restore(self, start: Start) -> int:
        """Load what ``start`` names into model/optimizer/scheduler/RNG; return the first step."""
        if start.source == "checkpoint":
            self._load(Path(start.path), start.manifest)
            unused = [f"checkpoint.{k}" for k in ("load_path", "init_from_hf") if self.cfg.checkpoint[k]]
            if self.rank == 0 and unused and Path(start.path).parent == self.folder:
                log.info("%s not used: this job continues from its own checkpoint %s",
                         " and ".join(unused), start.path)
        elif start.source == "hf":
            self._load_hf(Path(start.path))
        self.facts.update(start_step=start.step, loaded_from=start.path)
        return start.step

    def _load(self, path: Path, manifest: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = {**self._state(), "rng": None}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, dcp.CheckpointException) as err:
            raise CheckpointError(f"checkpoint {path} could not be loaded ({load_failure(err)}); "
                                  "it may be damaged, use an earlier one") from err
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if len(state["rng"]) == self.dims.world_size:
            _set_rng_state(state["rng"][self.rank], self.device)
        if self.rank == 0:
            self._report_carry_over(path, manifest, len(state["rng"]))

    def _report_carry_over(self, path: Path, manifest: dict, rng_ranks: int) -> None:
        saved = manifest["layout"]
        log.info("resumed from %s at step %d (saved under %s on %d ranks, now %s on %d)", path,
                 manifest["step"], saved["layout"], saved["world_size"], self.dims.layout,
                 self.dims.world_size)
        log.info("data position carries over: the batch of step s is a function of "
                 "(trainer.seed, s) split over the dp ranks, so step %d is the same batch at "
                 "dp=%d as it was at dp=%d", manifest["step"] + 1, self.dims.dp, saved["dp"])
        now = {"kind": self.cfg.data.kind, "path": self.cfg.data.path, "seed": self.cfg.trainer.seed,
               "global_batch_size": self.cfg.trainer.global_batch_size,
               "seq_len": self.cfg.model.seq_len}
        changed = [f"{k} {manifest['data'].get(k)!r} -> {v!r}" for k, v in now.items()
                   if manifest["data"].get(k) != v]
        if changed:
            log.warning("the data differ from the saved run's (%s): the batches from step %d on "
                        "are not the ones it would have seen", ", ".join(changed), manifest["step"] + 1)
        if rng_ranks != self.dims.world_size:
            log.warning("RNG states not restored: saved for %d ranks, this job has %d (training "
                        "draws no random numbers, so the losses are unaffected)", rng_ranks,
                        self.dims.world_size)

    def _load_hf(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Rank 0 reads the whole folder; set_model_state_dict broadcasts each tensor and keeps
        # every rank's shard. A row permutation (RoPE order) cannot be applied to sharded
        # DTensors locally, which is why DCP's HuggingFaceStorageReader is not used here.
        full = run_on_rank0(f"reading the Hugging Face folder {folder}", lambda: hf.read_folder(
            folder, self.cfg.model, expected_shapes(self.cfg.model)), self._wait_s) or {}
        set_model_state_dict(self.model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        if self.rank == 0:
            log.info("weights from Hugging Face folder %s (fine-tuning start; optimizer, LR "
                     "schedule and step start fresh)", folder)

    def after_step(self, step: int) -> None:
        """Save when ``step`` (1-based, just finished) is on the interval or the last one."""
        c = self.cfg.checkpoint
        if c.enable and (step == self.cfg.trainer.steps or (c.interval and step % c.interval == 0)):
            self.save(step)

    def save(self, step: int) -> Path:
        """Write ``step-<step>`` crash-safely (see the module docstring); return its path."""
        import torch.distributed.checkpoint as dcp


        final, partial = self.folder / f"step-{step}", self.folder / f"step-{step}.partial"

        def prepare():
            if final.exists():
                raise CheckpointError(f"checkpoint {final} already exists; refusing to overwrite it")
            shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted save of this step
            partial.mkdir(parents=True)

        # Rank-0 file work is waited for outside collectives (rank0_io): a slow filesystem
        # must not run into launcher.timeout_s.
        run_on_rank0(f"preparing {partial}", prepare, self._wait_s)
        rng = [None] * self.dims.world_size
        dist.all_gather_object(rng, _rng_state(self.device))
        dist.barrier()
        dcp.save({**self._state(), "rng": rng}, checkpoint_id=str(partial))
        inject_fault(self.cfg.fault, self.rank, step, phase="save")
        dist.barrier()

        def commit_and_prune():
            self._commit(partial, final, step)
            self._prune(step)

        run_on_rank0(f"committing {final} and pruning older checkpoints", commit_and_prune,
                     self._wait_s)
        self.facts["last_checkpoint"] = str(final)
        return final

    def _manifest(self, step: int) -> dict:
        return {"format": FORMAT, "step": step,
                "saved_at": datetime.datetime.now().isoformat(timespec="seconds"),
                "torch_version": torch.__version__, "layout": self.dims.describe(),
                "model": OmegaConf.to_container(self.cfg.model, resolve=True),
                "master_dtype": self.cfg.precision.master_dtype,
                "data": {"next_step": step, "kind": self.cfg.data.kind, "path": self.cfg.data.path,
                         "seed": self.cfg.trainer.seed, "seq_len": self.cfg.model.seq_len,
                         "global_batch_size": self.cfg.trainer.global_batch_size,
                         "loader": "stateless: batch(step) = f(seed, step), sliced by dp rank"}}

    def _commit(self, partial: Path, final: Path, step: int) -> None:
        with open(partial / MANIFEST, "w") as f:
            json.dump(self._manifest(step), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.rename(partial, final)
        _fsync_dir(self.folder)
        log.info("checkpoint saved: %s", final)

    def _prune(self, newest: int) -> None:
        """Delete what earlier saves left: interrupted saves and deletions, and (``keep_last``)
        complete checkpoints older than the newest K. Only names this class writes are
        touched (a user's ``step-10.bak`` stays); a failed deletion is logged, never fatal."""
        for stale in self.folder.iterdir():
            m = _LEFTOVER.match(stale.name)
            if m and (m.group(2) == ".deleting" or int(m.group(1)) < newest):
                _remove(stale)
        keep = self.cfg.checkpoint.keep_last
        for _, old in (complete_checkpoints(self.folder)[:-keep] if keep else []):
            # Renamed first so a crash mid-delete cannot leave a half-deleted "complete" one.
            doomed = old.with_name(old.name + ".deleting")
            try:
                os.rename(old, doomed)
            except OSError as err:
                log.warning("could not prune checkpoint %s (%s); it stays", old, err)
                continue
            if _remove(doomed):
                log.info("checkpoint pruned (checkpoint.keep_last=%d): %s", keep, old)

    def export_at_end(self) -> None:
        """With ``checkpoint.export_at_end``, write the weights as an HF folder (rank 0)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        c = self.cfg.checkpoint
        if not c.export_at_end:
            return
        # Gathered on rank 0's CPU: the RoPE row permutation needs whole heads.
        full = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))

        def write():
            dtype = getattr(torch, c.export_dtype)
            hf.write_folder(hf.to_hf(full, self.cfg.model, dtype), hf.hf_config(self.cfg.model, dtype),
                            self.export_folder, int(c.export_max_shard_gib * 2**30))
            log.info("exported Hugging Face weights (%s) to %s", c.export_dtype, self.export_folder)

        run_on_rank0(f"exporting to {self.export_folder}", write, self._wait_s)
        self.facts["export"] = str(self.export_folder)
