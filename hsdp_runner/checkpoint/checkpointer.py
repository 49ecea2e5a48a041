"""Distributed checkpoints: save, resume (under any layout), HF import and export.

Finding and checking checkpoints and planning where a job starts is ``start.py``'s.

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

Synthetic and text data need no loader state: ``data.TokenBatches`` makes the global batch of
a step a pure function of (trainer.seed, step) and each dp rank takes its slice, so the loader
position is the step, valid under any dp degree. ``data=hf`` streams have a position
(``hf_batches.position``: every lane's state and the global sample cursor), gathered from all
ranks into one ``data_position`` entry of the checkpoint; lanes belong to the global batch,
not to ranks, so it resumes under any dp degree too.

Crash safety: every rank writes into ``step-N.partial``; after a barrier rank 0 writes the
manifest and renames the folder to ``step-N`` (atomic on POSIX), so a checkpoint is visible
only once complete. Older checkpoints are pruned (``keep_last``) only after that, by renaming
them away before deleting. Nothing is ever overwritten: an existing ``step-N`` or a non-empty
export folder is an error.
"""

from __future__ import annotations

import copy
import datetime
import io
import json
import logging
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from hsdp_runner.checkpoint import hf
from hsdp_runner.checkpoint.rank0_io import run_on_rank0
from hsdp_runner.checkpoint.start import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    Start,
    checkpoint_dir,
    complete_checkpoints,
    expected_shapes,
    export_dir,
    load_failure,
    load_full_weights,
)
from hsdp_runner.config.schema import CheckpointConfig, DataConfig, PrecisionConfig, TrainerConfig
from hsdp_runner.core.choices import FaultPhase, StartSource
from hsdp_runner.core.faults import inject_fault
from hsdp_runner.distributed import float8
from hsdp_runner.distributed.pipeline import merged_view
from hsdp_runner.models.base import ModelConfig, model_fields
from hsdp_runner.models.params import torch_dtype
from hsdp_runner.train import hf_batches
from hsdp_runner.train.hf_tokenizer import export_tokenizer
from hsdp_runner.train.trainer import Trainer

log = logging.getLogger(__name__)

_LEFTOVER = re.compile(r"^step-(\d+)(\.partial|\.deleting)$")  # an unfinished save / deletion


def rng_state(device: torch.device) -> bytes:
    """This rank's RNG states (Python's, torch's CPU one, and the device's on CUDA), serialised
    by ``torch.save`` so that ``set_rng_state`` can read them back with ``weights_only``."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def set_rng_state(blob: bytes, device: torch.device) -> bool:
    """Restore the states ``rng_state`` wrote; return False (and restore nothing) when ``blob``
    is not such a record, e.g. a checkpoint written before they were saved this way.

    ``weights_only=True`` reads tensors, ints and tuples, nothing that runs code. (DCP itself
    still unpickles a checkpoint's metadata: a checkpoint is trusted input.)"""
    try:
        with warnings.catch_warnings():  # on an older record torch warns of its protocol
            warnings.simplefilter("ignore")
            state = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception:  # an older pickled record, or not torch.save's format at all
        return False
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    return True


# What else decides a data=hf stream's batches, recorded beside the keys every kind has.
HF_DATA_KEYS = ("tokenizer", "text_field", "split", "val_split", "val_fraction", "shuffle_buffer")


def data_facts(data_cfg: DataConfig, train: TrainerConfig, seq_len: int) -> dict:
    """What decides the batches of a step, as a checkpoint manifest records it (``data``):
    the ``data`` config (data=hf: also ``HF_DATA_KEYS``), ``trainer.seed`` and
    ``trainer.global_batch_size``, the sequence length."""
    hf_keys = HF_DATA_KEYS if str(data_cfg.kind) == "hf" else ()
    return {
        "kind": str(data_cfg.kind),
        "path": data_cfg.path,
        **{key: getattr(data_cfg, key) for key in hf_keys},
        "seed": train.seed,
        "global_batch_size": train.global_batch_size,
        "seq_len": seq_len,
    }


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


def own_param_groups(own: list[dict], saved: list[dict]) -> list[dict]:
    """The optimizer's parameter groups to load on this rank: its ``own`` groups (the names of
    the parameters it holds), each with the hyperparameters (lr, betas, ...) of the ``saved``
    group of the same weight decay, the first where several share it.

    DCP keeps one copy of a value that every rank saves under the same key, so a checkpoint
    holds one rank's groups, whose parameter names are that rank's only: under pipeline
    parallel the other stages' names are missing, and torch's distributed state dict then
    loads those ranks' groups without their hyperparameters (torch 2.13: ``KeyError:
    'betas'`` at the next step). The groups differ between ranks only in their names.
    """
    loaded = []
    for group in own:
        match = next((g for g in saved if g.get("weight_decay") == group.get("weight_decay")), {})
        loaded.append({**group, **{k: v for k, v in match.items() if k != "params"}})
    return loaded


class Checkpointer:
    """Saves and restores one job's training state; every rank holds one and calls it together.

    Takes the ``checkpoint`` config, the Trainer whose state it saves (its sharded model,
    optimizer and LR scheduler, ParallelDims, device, ``trainer`` and ``fault`` configs) and
    the job's output dir; then the ``model``, ``precision`` (the stored master dtype) and
    ``data`` configs a manifest records.
    """

    def __init__(
        self,
        ckpt_cfg: CheckpointConfig,
        trainer: Trainer,
        output_dir: Path,
        *,
        model: ModelConfig,
        precision: PrecisionConfig,
        data: DataConfig,
    ):
        self.ckpt, self.model_cfg = ckpt_cfg, model
        self.dims, self.device = trainer.dims, trainer.device
        self.model, self.optimizer, self.scheduler = (
            merged_view(trainer.parts),  # a pipeline rank's stage chunks, by their names
            trainer.optimizer,
            trainer.scheduler,
        )
        self.total_steps, self.master_dtype = trainer.train.steps, precision.master_dtype
        self.trainer = trainer  # its data position (a data=hf stream's) is saved and restored
        self.data, self.fault = data_facts(data, trainer.train, model.seq_len), trainer.fault
        self.folder = checkpoint_dir(ckpt_cfg, output_dir)
        self.export_folder = export_dir(ckpt_cfg, output_dir)
        self.rank = dist.get_rank()
        self._wait_s = ckpt_cfg.rank0_wait_s
        self.facts = {"start_step": 0, "loaded_from": None, "last_checkpoint": None, "export": None}

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        # Float8 weights are torchao wrappers; checkpoints hold the plain tensors they wrap.
        model_sd, optim_sd = float8.plain_state(model_sd), float8.plain_state(optim_sd)
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def restore(self, start: Start) -> int:
        """Load what ``start`` names into model/optimizer/scheduler/RNG; return the first step."""
        if start.source is StartSource.checkpoint:
            self._load(Path(start.path), start.manifest)
            unused = [
                f"checkpoint.{k}" for k in ("load_path", "init_from_hf") if getattr(self.ckpt, k)
            ]
            if self.rank == 0 and unused and Path(start.path).parent == self.folder:
                log.info(
                    "%s not used: this job continues from its own checkpoint %s",
                    " and ".join(unused),
                    start.path,
                )
        elif start.source is StartSource.hf:
            self._load_hf(Path(start.path))
        self.facts.update(start_step=start.step, loaded_from=start.path)
        return start.step

    def _load(self, path: Path, manifest: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = {**self._state(), "rng": None}
        # Copied: dcp.load writes the saved groups into these very dicts.
        own_groups = copy.deepcopy(state["optimizer"]["param_groups"])
        has_position = "position" in manifest.get("data", {})
        if has_position and self.trainer.batches.stateful:
            state["data_position"] = None
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, dcp.CheckpointException) as err:
            raise CheckpointError(
                f"checkpoint {path} could not be loaded ({load_failure(err)}); "
                "it may be damaged, use an earlier one"
            ) from err
        state["optimizer"]["param_groups"] = own_param_groups(
            own_groups, state["optimizer"]["param_groups"]
        )
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("data_position") is not None:
            self.trainer.batches.restore(json.loads(state["data_position"]))
        restored = len(state["rng"]) == self.dims.world_size and set_rng_state(
            state["rng"][self.rank], self.device
        )
        if self.rank == 0:
            self._report_carry_over(path, manifest, len(state["rng"]), restored)

    def _report_carry_over(
        self, path: Path, manifest: dict, rng_ranks: int, rng_restored: bool
    ) -> None:
        saved = manifest["layout"]
        log.info(
            "resumed from %s at step %d (saved under %s on %d ranks, now %s on %d)",
            path,
            manifest["step"],
            saved["layout"],
            saved["world_size"],
            self.dims.layout,
            self.dims.world_size,
        )
        position = manifest["data"].get("position")
        if position is not None and self.trainer.batches.stateful:
            log.info(
                "data position carries over: the data=hf stream continues at sample %d of "
                "its %d lanes (step %d), now split over dp=%d (saved at dp=%d)",
                position["samples"],
                position["lanes"],
                manifest["step"] + 1,
                self.dims.dp,
                saved["dp"],
            )
        elif not self.trainer.batches.stateful:
            log.info(
                "data position carries over: the batch of step s is a function of "
                "(trainer.seed, s) split over the dp ranks, so step %d is the same batch at "
                "dp=%d as it was at dp=%d",
                manifest["step"] + 1,
                self.dims.dp,
                saved["dp"],
            )
        changed = [
            f"{k} {manifest['data'].get(k)!r} -> {v!r}"
            for k, v in self.data.items()
            if manifest["data"].get(k) != v
        ]
        if changed:
            log.warning(
                "the data differ from the saved run's (%s): the batches from step %d on "
                "are not the ones it would have seen",
                ", ".join(changed),
                manifest["step"] + 1,
            )
        if rng_ranks != self.dims.world_size:
            log.warning(
                "RNG states not restored: saved for %d ranks, this job has %d (training "
                "draws no random numbers, so the losses are unaffected)",
                rng_ranks,
                self.dims.world_size,
            )
        elif not rng_restored:
            log.warning(
                "RNG states not restored: %s holds them in an older, pickled form, "
                "which is not read (training draws no random numbers, so the losses "
                "are unaffected)",
                path,
            )

    def _load_hf(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Rank 0 reads the whole folder; set_model_state_dict broadcasts each tensor and keeps
        # every rank's shard. A row permutation (RoPE order) cannot be applied to sharded
        # DTensors locally, which is why DCP's HuggingFaceStorageReader is not used here.
        full = (
            run_on_rank0(
                f"reading the Hugging Face folder {folder}",
                lambda: hf.read_folder(folder, self.model_cfg, expected_shapes(self.model_cfg)),
                self._wait_s,
            )
            or {}
        )
        # Under pp rank 0's folder holds every stage's weights (read_folder checked the names
        # and shapes against the whole model) and each rank keeps those of its own stage: the
        # others are not "unexpected", but a parameter of this stage left unset would be.
        pipelined = self.dims.pp > 1
        keys = set_model_state_dict(
            self.model,
            full,
            options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=not pipelined
            ),
        )
        if keys.missing_keys:
            raise CheckpointError(
                f"Hugging Face folder {folder} set no value for {', '.join(keys.missing_keys)}"
            )
        if self.rank == 0:
            log.info(
                "weights from Hugging Face folder %s (fine-tuning start; optimizer, LR "
                "schedule and step start fresh)",
                folder,
            )

    def after_step(self, step: int) -> None:
        """Save when ``step`` (1-based, just finished) is on the interval or the last one."""
        c = self.ckpt
        if c.enable and (step == self.total_steps or (c.interval and step % c.interval == 0)):
            self.save(step)

    def save(self, step: int) -> Path:
        """Write ``step-<step>`` crash-safely (see the module docstring); return its path."""
        import torch.distributed.checkpoint as dcp

        final, partial = self.folder / f"step-{step}", self.folder / f"step-{step}.partial"

        def prepare():
            if final.exists():
                raise CheckpointError(
                    f"checkpoint {final} already exists; refusing to overwrite it"
                )
            shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted save of this step
            partial.mkdir(parents=True)

        # Rank-0 file work is waited for outside collectives (rank0_io): a slow filesystem
        # must not run into launcher.timeout_s.
        run_on_rank0(f"preparing {partial}", prepare, self._wait_s)
        rng = [None] * self.dims.world_size
        dist.all_gather_object(rng, rng_state(self.device))
        extra = {"rng": rng}
        if self.trainer.batches.stateful:
            extra["data_position"] = self._data_position(step)
        dist.barrier()
        dcp.save({**self._state(), **extra}, checkpoint_id=str(partial))
        inject_fault(self.fault, self.rank, step, phase=FaultPhase.save)
        dist.barrier()

        def commit_and_prune():
            self._commit(partial, final, step)
            self._prune(step)

        run_on_rank0(
            f"committing {final} and pruning older checkpoints", commit_and_prune, self._wait_s
        )
        self.facts["last_checkpoint"] = str(final)
        return final

    def _data_position(self, step: int) -> bytes:
        """Every lane's state after ``step`` (each rank holds its own lanes'; all gathered),
        as the JSON bytes every rank saves alike (DCP keeps one copy)."""
        every = [None] * self.dims.world_size
        dist.all_gather_object(every, self.trainer.data_state(step))
        states = {lane: state for part in every for lane, state in part.items()}
        gbs = self.trainer.batches.global_batch
        return json.dumps(hf_batches.position(states, step, gbs)).encode()

    def _manifest(self, step: int) -> dict:
        return {
            "format": FORMAT,
            "step": step,
            "saved_at": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch_version": torch.__version__,
            "layout": self.dims.describe(),
            "model": model_fields(self.model_cfg),
            "master_dtype": str(self.master_dtype),
            "data": {"next_step": step, **self.data, **self.trainer.batches.manifest_facts(step)},
        }

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
        keep = self.ckpt.keep_last
        for _, old in complete_checkpoints(self.folder)[:-keep] if keep else []:
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

        c = self.ckpt
        if not c.export_at_end:
            return
        full = None
        if self.dims.pp == 1:
            # Gathered on rank 0's CPU: the RoPE row permutation needs whole heads.
            full = float8.plain_state(
                get_model_state_dict(
                    self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
                )
            )

        def write():
            weights = full
            if weights is None:
                # Under pp rank 0 holds its own stage; the last step's checkpoint (saved just
                # before: the checks make checkpoint.enable a condition) holds every stage's
                # shards, read whole in this process as python -m hsdp_runner.export does. A
                # job that trained no step started from a checkpoint of its last step.
                source = self.facts["last_checkpoint"] or self.facts["loaded_from"]
                weights, _ = load_full_weights(Path(source))
            dtype = torch_dtype(c.export_dtype)
            hf.write_export(
                weights, self.model_cfg, dtype, self.export_folder, c.export_max_shard_gib
            )
            if isinstance(self.trainer.batches, hf_batches.HFBatches):  # its tokenizer too
                export_tokenizer(self.trainer.batches.tokenizer, self.export_folder)
            log.info("exported Hugging Face weights (%s) to %s", c.export_dtype, self.export_folder)

        run_on_rank0(f"exporting to {self.export_folder}", write, self._wait_s)
        self.facts["export"] = str(self.export_folder)
