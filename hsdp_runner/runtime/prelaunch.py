"""The checks a job passes before any worker process starts, in the launching process.

Everything that can be checked without a process group is checked here (``validate``), so a
bad degree or path costs seconds, not a node-hour: in the process that starts the workers, in
every torchrun or SLURM rank, and for every job of a SLURM sweep on the submitting node before
anything is queued (``check_before_submit``). A ``parallel=auto`` job is planned here too.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from pathlib import Path

import torch
from omegaconf import DictConfig

from hsdp_runner.checkpoint import start as checkpoint_start
from hsdp_runner.config.checks import validate_batch, validate_config, validate_float8
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.choices import DataKind, LauncherName
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.core.exit_codes import EXIT_CONFIG
from hsdp_runner.distributed import expert_parallel, float8, float8_experts
from hsdp_runner.distributed.hardware import (
    check_torch_apis,
    check_visible_gpus,
    cuda_fallback_warning,
    usable_gpus,
)
from hsdp_runner.distributed.parallel_dims import ParallelDims, infer_world_size
from hsdp_runner.distributed.pipeline_settings import job_refusal
from hsdp_runner.models.base import build_meta_model, model_spec
from hsdp_runner.models.params import frozen_names
from hsdp_runner.runtime import auto_job
from hsdp_runner.train.data import load_corpus
from hsdp_runner.train.hf_checks import check_data, check_resume


def under_torchrun() -> bool:
    """True when an external launcher (torchrun, SLURM export) made this process a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def validate(
    cfg: RunConfig | DictConfig,
    output_dir: Path,
    submitting: bool = False,
    size_degrees: dict | None = None,
    overrides: list[str] = (),
) -> ParallelDims:
    """Run every pre-launch check; return the job's ParallelDims or raise ConfigError.

    Takes the typed config, or a composed one (the app, parity, the tests), converted here.

    ``submitting``: this process only submits the job to SLURM (a login node, often without
    GPUs), so the checks against this machine's GPUs are left to the job's own tasks.
    Layout warnings (e.g. a shard group spanning nodes) go to stderr; in a rank, rank 0's only.
    ``size_degrees`` (a sweep's preset degrees, see ``app.preset_degrees``) replace the job's
    own degrees where the world size comes from degrees (CPU, no ``launcher.nproc_per_node``).
    With ``parallel.auto`` the degrees are settled here (planned, or received from the process
    that planned: ``auto_job``) and written into ``cfg``, which must then be the composed
    DictConfig the workers' config is made from (``overrides``: the job's command line,
    recorded in its plan.md; ``output_dir``: the job's own dir, which gets the plan).
    """
    composed = None if isinstance(cfg, RunConfig) else cfg
    if composed is not None:
        cfg = to_run_config(composed)
    validate_config(cfg)
    check_torch_apis()
    gpus = 0 if submitting else usable_gpus(cfg.device)
    if cfg.parallel.auto:
        auto_job.check_launch(cfg, gpus, submitting)
    world_size, ranks_per_node = _world_layout(cfg, gpus, size_degrees)
    if cfg.parallel.auto:
        if composed is None:
            raise TypeError("parallel=auto plans into the composed config: pass the DictConfig")
        _check_writable(output_dir)
        auto_job.settle(composed, world_size, ranks_per_node, gpus, output_dir, list(overrides))
        cfg = to_run_config(composed)
    if gpus and under_torchrun():
        check_visible_gpus(ranks_per_node, gpus)
    fallback = None if submitting else cuda_fallback_warning(cfg.device)
    if fallback and (not under_torchrun() or int(os.environ["RANK"]) == 0):
        print(f"hsdp_runner: warning: {fallback}", file=sys.stderr)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world_size, ranks_per_node)
    refusal = job_refusal(dims, cfg)  # every pipeline check the degrees alone do not decide
    if refusal:
        raise ConfigError(refusal)
    model_spec(cfg.model).check_parallel(dims.cp, dims.tp, cfg.parallel.sequence_parallel)
    refusal = expert_parallel.compile_refusal(
        cfg.parallel, cfg.precision, cfg.model
    ) or expert_parallel.chunks_refusal(cfg.parallel, dims)
    if refusal:
        raise ConfigError(refusal)
    validate_batch(cfg.trainer, dims.dp)
    if (
        gpus
        and "bfloat16" in (cfg.precision.param_dtype, cfg.precision.reduce_dtype)
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ConfigError(
            f"precision={cfg.precision.name} needs bfloat16, which this GPU does not "
            "support; use precision=fp32"
        )
    if float8.enabled(cfg.precision):
        float8.torchao_float8()
        float8.check_device(cfg.precision, gpus)
        float8_experts.check_experts(
            cfg.precision,
            cfg.model,
            gpus,
            cfg.parallel.compile,
            torch.cuda.get_device_capability(0) if gpus else None,
        )
        validate_float8(cfg.precision, dims.tp)
        float8.check_tp(cfg.model, dims.tp, cfg.parallel.sequence_parallel)
    if cfg.data.kind == DataKind.text:
        load_corpus(cfg.data.path, cfg.model.seq_len + 1)
    if cfg.data.kind == DataKind.hf:
        check_data(cfg.data, cfg.trainer, cfg.model.vocab_size, cfg.model.seq_len)
    if cfg.trainer.freeze:
        frozen_names(dict(build_meta_model(cfg.model).named_parameters()), cfg.trainer.freeze)
    _check_writable(output_dir)
    start = checkpoint_start.validate(cfg.checkpoint, cfg.model, cfg.trainer.steps, output_dir)
    if cfg.data.kind == DataKind.hf:
        check_resume(cfg.data, cfg.trainer, start.manifest)
    if not under_torchrun() or int(os.environ["RANK"]) == 0:
        for message in dims.node_warnings():
            print(f"hsdp_runner: warning: {message}", file=sys.stderr)
    return dims


def _world_layout(cfg: RunConfig, gpus: int, size_degrees: dict | None = None) -> tuple[int, int]:
    """Return (world size, ranks per node): from torchrun's / SLURM's environment in a rank,
    else from ``launcher.nnodes`` x ``launcher.nproc_per_node`` (on CPU without it, from the
    degrees: a sweep's ``size_degrees``, else the job's own)."""
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        return world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if cfg.launcher.nnodes > 1 and cfg.launcher.name == LauncherName.local:
        raise ConfigError(
            f"launcher.nnodes={cfg.launcher.nnodes}: the built-in launcher starts "
            "ranks on this node only; use torchrun on every node or launcher=slurm "
            "(docs/many_nodes.md), or keep launcher.nnodes=1"
        )
    sizing = dataclasses.replace(cfg.parallel, **size_degrees) if size_degrees else cfg.parallel
    world_size = infer_world_size(cfg.launcher, sizing, gpus)
    nproc = world_size // cfg.launcher.nnodes
    if gpus and nproc > gpus:
        raise ConfigError(
            f"launcher.nproc_per_node={nproc} exceeds the {gpus} visible GPUs; "
            f"use at most {gpus} ranks per node or set device=cpu"
        )
    return world_size, nproc


def _check_writable(output_dir: Path) -> None:
    probe = output_dir / f".write-probe-{uuid.uuid4().hex}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"output dir {output_dir} is not writable ({err.strerror}); set "
            "hydra.run.dir (or hydra.sweep.dir) to a writable folder"
        ) from None


def check_before_submit(config_loader, sweep_config: DictConfig, job_overrides, first_num: int):
    """Validate each job of a SLURM sweep on the submitting node; exit 2 if any is bad.

    Takes Hydra's config loader, the sweep's master config, the jobs' override lists and the
    first job number; composes each job's config as its tasks will and runs ``validate``
    (which plans a ``parallel=auto`` job, into the dir Hydra will give it).
    """
    sweep_dir = Path(str(sweep_config.hydra.sweep.dir))
    for num, overrides in enumerate(job_overrides, start=first_num):
        cfg = config_loader.load_sweep_config(sweep_config, list(overrides))
        try:
            if cfg.parallel.auto:  # planned here, into the job's dir; its tasks run that plan
                job_dir = auto_job.submitted_job_dir(cfg, num)
                validate(cfg, job_dir, submitting=True, overrides=list(overrides))
            else:
                validate(to_run_config(cfg), sweep_dir, submitting=True)
        except ConfigError as err:
            job = " ".join(overrides) or "no overrides"
            print(
                f"hsdp_runner: config error in job #{num} ({job}): {err}; nothing was submitted",
                file=sys.stderr,
            )
            raise SystemExit(EXIT_CONFIG) from None
