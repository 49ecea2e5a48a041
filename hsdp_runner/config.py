"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The root schema ``RunConfig`` is the first entry of ``conf/config.yaml``'s defaults list, so
every YAML choice is merged into a typed node: a wrong type or an unknown key fails at
composition with the key's name. Cross-field checks that need no world size live in
``validate_config``; checks on degrees live in ``mesh.ParallelDims``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

# The model group's base schema: the fields every family shares. Each family extends it with a
# dataclass of its own (models/base.py), stored by register_schemas as model/<family>_schema;
# a conf/model/*.yaml names its family's schema first in its defaults list, so the node is typed
# by the family's dataclass (Hydra's pattern for a group of schemas that extend one base).
from hsdp_runner.models.base import ModelConfig, family_schema, family_schemas, model_spec


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the key, the value and a fix."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sequence_parallel: bool = True
    reshard_after_forward: bool = True
    ac: str = "none"
    compile: bool = False
    ddp_impl: str = "replicate"
    allow_tp_across_nodes: bool = False


@dataclass
class PrecisionConfig:
    name: str = MISSING
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    master_dtype: str = "float32"


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass
class DataConfig:
    kind: str = "synthetic"
    path: Optional[str] = None


@dataclass
class LoggerConfig:
    name: str = "none"
    project: str = "hsdp_runner"
    entity: Optional[str] = None
    mode: str = "offline"
    group: Optional[str] = None


@dataclass
class LauncherConfig:
    name: str = "local"
    nnodes: int = 1
    nproc_per_node: Optional[int] = None
    timeout_s: int = 300
    # SLURM only (launcher=slurm / slurm_local); conf/launcher/slurm.yaml feeds them to
    # hydra-submitit-launcher.
    gpus_per_node: Optional[int] = None
    timeout_min: int = 60
    partition: Optional[str] = None
    account: Optional[str] = None
    # Stop signals (hsdp_runner/interrupt.py): the time-limit signal SLURM sends
    # signal_delay_s before --time (besides TERM, INT and USR2), and how many times a job it
    # stopped is requeued (submitit's max_num_timeout).
    signal: Optional[str] = None
    signal_delay_s: int = 120
    requeue: int = 0
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None


# launcher=slurm with launcher.mem_gb=null asks for this much memory per GPU (per task on a CPU
# partition): rank 0 gathers the full state on the CPU for an HF export (fp32 8B: 32 GB).
SLURM_MEM_GB_PER_GPU = 64


def slurm_mem_gb(launcher) -> int:
    """Memory per node in GB that a SLURM job asks for (sbatch --mem): ``launcher.mem_gb``, or
    ``SLURM_MEM_GB_PER_GPU`` x GPUs per node (x tasks per node without GPUs)."""
    if launcher.mem_gb is not None:
        return launcher.mem_gb
    return SLURM_MEM_GB_PER_GPU * (launcher.gpus_per_node or launcher.nproc_per_node or 1)


@dataclass
class TrainerConfig:
    steps: int = 20
    seed: int = 0
    global_batch_size: int = 8
    grad_accum_steps: int = 1
    log_every: int = 1
    eval_batches: int = 0
    freeze: list = field(default_factory=list)
    on_nan: str = "stop"


@dataclass
class MetricsConfig:
    warmup_steps: int = 2
    peak_tflops: Optional[float] = None
    comm_step: Optional[int] = 1


@dataclass
class ProfileConfig:
    """torch.profiler trace of a step window (see hsdp_runner/profiling.py)."""

    enable: bool = False
    start_step: int = 3
    steps: int = 2
    all_ranks: bool = False


@dataclass
class FaultConfig:
    rank: Optional[int] = None
    step: int = 1
    kind: str = "exception"
    phase: str = "step"


@dataclass
class CheckpointConfig:
    """Checkpoint saving, resuming, Hugging Face import/export (see hsdp_runner/checkpoint.py)."""

    enable: bool = False
    interval: Optional[int] = None
    dir: Optional[str] = None
    resume: str = "auto"
    load_path: Optional[str] = None
    keep_last: Optional[int] = None
    init_from_hf: Optional[str] = None
    export_at_end: bool = False
    export_dir: Optional[str] = None
    export_dtype: str = "bfloat16"
    export_max_shard_gib: float = 5.0
    rank0_wait_s: float = 3600.0


@dataclass
class ClusterConfig:
    """A machine the planner predicts for (conf/cluster/*.yaml; see hsdp_runner/cluster.py)."""

    name: str = MISSING
    device: str = MISSING
    gpus_per_node: int = MISSING
    nodes: int = 1
    device_memory_gib: Optional[float] = None
    peak_tflops: Optional[float] = None
    compute_efficiency: float = MISSING
    intra_node_gbps: float = MISSING
    inter_node_gbps: float = MISSING
    intra_node_latency_us: float = MISSING
    inter_node_latency_us: float = MISSING
    overlap: float = 1.0
    memory_reserve_gib: float = 0.0
    measure: bool = False
    calibration: Optional[str] = None


@dataclass
class PlanConfig:
    """The planner's options (hsdp_runner/plan.py); ``source`` is also set in planned jobs."""

    source: Optional[str] = None
    top_k: int = 4
    write_sweep: Optional[str] = None
    out_dir: Optional[str] = None
    layers_measured: list = field(default_factory=lambda: [1, 2])


@dataclass
class RunConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # Only the planner composes a cluster (conf/plan.yaml); a job's is null.
    cluster: Optional[ClusterConfig] = None
    device: str = "auto"


AC_MODES = ("none", "full", "selective")
DDP_IMPLS = ("replicate", "fully_shard")
DTYPES = ("float32", "bfloat16", "float16")
DATA_KINDS = ("synthetic", "text")
WANDB_MODES = ("offline", "online", "disabled")
LOGGERS = ("wandb", "none")
DEVICES = ("auto", "cpu", "cuda")
FAULT_KINDS = ("exception", "sigkill", "sigterm", "nan", "hang", "abort")
ON_NAN = ("stop", "skip")
LAUNCHERS = ("local", "slurm", "slurm_local")
SUBMITIT_LAUNCHERS = ("slurm", "slurm_local")
FAULT_PHASES = ("step", "save")


def register_schemas() -> None:
    """Store ``RunConfig`` as ``run_schema`` so ``conf/config.yaml`` can extend it, and each
    model family's schema as ``model/<family>_schema`` for its ``conf/model/*.yaml``."""
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for name, schema in family_schemas().items():
        store.store(group="model", name=name, node=schema)


def _require_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}; set {key} to one of them")


def _require_positive(key: str, value: Any) -> None:
    if value is None or value < 1:
        raise ConfigError(f"{key}={value} must be a positive integer; set {key}>=1")


def validate_config(cfg: DictConfig | dict) -> None:
    """Check the fields that need no world size; raise ConfigError naming key, value and fix.

    Takes the composed config (DictConfig or plain dict). Degree checks are ParallelDims'.
    """
    c = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    _reject_unknown_keys(c)
    _require_choice("parallel.ac", c.parallel.ac, AC_MODES)
    _require_choice("optim.name", c.optim.name, ("adamw",))
    _require_choice("parallel.ddp_impl", c.parallel.ddp_impl, DDP_IMPLS)
    for key in ("param_dtype", "reduce_dtype", "master_dtype"):
        _require_choice(f"precision.{key}", c.precision[key], DTYPES)
        if c.precision[key] == "float16":
            # fp16 gradients underflow without loss scaling, and the trainer has no scaler.
            raise ConfigError(f"precision.{key}=float16 needs a gradient scaler, which the "
                              "runner does not have; use bfloat16 (precision=bf16 or bf16_pure)")
    _require_choice("data.kind", c.data.kind, DATA_KINDS)
    _require_choice("logger.name", c.logger.name, LOGGERS)
    _require_choice("logger.mode", c.logger.mode, WANDB_MODES)
    _require_choice("device", c.device, DEVICES)
    _require_choice("fault.kind", c.fault.kind, FAULT_KINDS)
    _require_choice("trainer.on_nan", c.trainer.on_nan, ON_NAN)
    _require_choice("fault.phase", c.fault.phase, FAULT_PHASES)
    for key in ("trainer.steps", "trainer.global_batch_size", "trainer.grad_accum_steps",
                "trainer.log_every", "model.dim", "model.n_layers", "model.n_heads",
                "model.vocab_size", "model.seq_len",
                "launcher.nnodes", "launcher.timeout_s"):
        _require_positive(key, OmegaConf.select(c, key))
    if c.launcher.requeue and not c.checkpoint.enable:
        raise ConfigError(f"launcher.requeue={c.launcher.requeue} needs checkpoint.enable=true: a "
                          "requeued job resumes from its checkpoint (without one it starts over)")
    if c.launcher.nproc_per_node is not None:
        _require_positive("launcher.nproc_per_node", c.launcher.nproc_per_node)
    if c.trainer.eval_batches < 0:
        raise ConfigError(f"trainer.eval_batches={c.trainer.eval_batches} must be >= 0 (0 = no eval)")
    _validate_launcher(c.launcher)
    if c.metrics.warmup_steps < 0:
        raise ConfigError(f"metrics.warmup_steps={c.metrics.warmup_steps} must be >= 0")
    if c.metrics.comm_step is not None and not 1 <= c.metrics.comm_step <= c.trainer.steps:
        raise ConfigError(f"metrics.comm_step={c.metrics.comm_step} is not a step of this run "
                          f"(1..trainer.steps={c.trainer.steps}); pick one in range or null")
    if c.profile.enable:
        _require_positive("profile.start_step", c.profile.start_step)
        _require_positive("profile.steps", c.profile.steps)
        last = c.profile.start_step + c.profile.steps - 1
        if last > c.trainer.steps:
            raise ConfigError(f"profile.start_step={c.profile.start_step} + profile.steps="
                              f"{c.profile.steps} ends at step {last}, after trainer.steps="
                              f"{c.trainer.steps}; start earlier or profile fewer steps")
    if c.metrics.peak_tflops is not None and c.metrics.peak_tflops <= 0:
        raise ConfigError(f"metrics.peak_tflops={c.metrics.peak_tflops} must be a positive number "
                          "(TFLOP/s of one device) or null to look it up")
    if c.model.dim % c.model.n_heads:
        raise ConfigError(f"model.dim={c.model.dim} is not divisible by model.n_heads="
                          f"{c.model.n_heads}; pick a head count that divides the width")
    model_spec(c.model).validate()  # the family's own checks
    if c.data.kind == "text" and c.model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={c.model.vocab_size} is too small for the byte-level "
                          "tokenizer of data.kind=text; it needs at least 256")
    if not 0.0 <= c.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={c.optim.min_lr_ratio} must lie in [0, 1]")
    if c.optim.lr <= 0:
        raise ConfigError(f"optim.lr={c.optim.lr} must be positive")


def _validate_launcher(launcher) -> None:
    _require_choice("launcher.name", launcher.name, LAUNCHERS)
    from hsdp_runner.interrupt import parse_signal

    if launcher.signal is not None:
        try:
            parse_signal(launcher.signal)
        except ValueError as err:
            raise ConfigError(f"launcher.signal={launcher.signal!r}: {err}; use a signal name "
                              "such as USR2 (submitit's default) or USR1") from None
    if launcher.requeue < 0 or launcher.signal_delay_s < 1:
        raise ConfigError(f"launcher.requeue={launcher.requeue} must be >= 0 and "
                          f"launcher.signal_delay_s={launcher.signal_delay_s} >= 1")
    if launcher.name not in SUBMITIT_LAUNCHERS:
        return
    choice = f"launcher={launcher.name}"
    if launcher.nproc_per_node is None:
        raise ConfigError(f"{choice} needs launcher.nproc_per_node (SLURM tasks = ranks per node); "
                          "set it, e.g. launcher.nproc_per_node=8")
    _require_positive("launcher.timeout_min", launcher.timeout_min)
    for key in ("cpus_per_task", "mem_gb"):
        if launcher.get(key) is not None:
            _require_positive(f"launcher.{key}", launcher[key])
    if launcher.gpus_per_node is not None and launcher.gpus_per_node < launcher.nproc_per_node:
        raise ConfigError(
            f"launcher.gpus_per_node={launcher.gpus_per_node} is less than launcher.nproc_per_node="
            f"{launcher.nproc_per_node}; each rank needs its own GPU: raise gpus_per_node, lower "
            "nproc_per_node, or set launcher.gpus_per_node=null on a CPU partition")
    if launcher.name == "slurm_local" and launcher.nnodes != 1:
        raise ConfigError(f"launcher.nnodes={launcher.nnodes} with launcher=slurm_local: "
                          "submitit's local executor runs one node; set launcher.nnodes=1 or "
                          "use launcher=slurm")


def _schema_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for key in node:
        if not prefix and key == "hydra":  # Hydra's own node (present in a sweep's job config)
            continue
        value = OmegaConf.select(node, key, throw_on_resolution_failure=False)
        keys.append(prefix + str(key))
        if OmegaConf.is_dict(value):
            keys += _schema_keys(value, f"{prefix}{key}.")
    return keys


def _dataclass_keys(schema, prefix: str = "") -> set[str]:
    """Every dotted key of a schema dataclass, optional nested sections (e.g. ``cluster``, null
    in a job) included."""
    import dataclasses
    import typing

    keys = set()
    hints = typing.get_type_hints(schema)
    for spec in dataclasses.fields(schema):
        keys.add(prefix + spec.name)
        kind = hints[spec.name]
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is typing.Union and len(inner) == 1:
            kind = inner[0]
        if dataclasses.is_dataclass(kind):
            keys |= _dataclass_keys(kind, f"{prefix}{spec.name}.")
    return keys


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """Refuse keys the schema does not know (added with ``+``, which the typed schema cannot
    stop): nothing reads them, so ``+trainer.stepz=10`` would run a full job silently.
    The message names the nearest valid key. ``hydra.*`` is not part of the job's config."""
    import difflib

    known = _dataclass_keys(RunConfig) | _dataclass_keys(family_schema(cfg.model), "model.")
    for key in _schema_keys(cfg):
        if key in known:
            continue
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        if parent and parent not in known:
            continue  # reported at its first unknown level
        near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}? " if near else ""
        raise ConfigError(f"unknown config key {key} (added with +); nothing reads it: {hint}"
                          "fix or drop the override (python -m hsdp_runner --cfg job lists "
                          "every key)")


def validate_batch(cfg: DictConfig | dict, dp_size: int) -> int:
    """Check that the global batch splits evenly over dp ranks and micro-batches.

    Takes the config and the data-parallel size (from ParallelDims); returns the micro-batch
    size (sequences per rank per forward pass).
    """
    c = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    gbs, accum = c.trainer.global_batch_size, c.trainer.grad_accum_steps
    if gbs % (dp_size * accum):
        raise ConfigError(
            f"trainer.global_batch_size={gbs} is not divisible by the data-parallel size "
            f"{dp_size} x trainer.grad_accum_steps={accum}; use a multiple of {dp_size * accum}")
    return gbs // (dp_size * accum)
