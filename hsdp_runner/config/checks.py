"""Checks on a composed config that need no world size, and the choice checks on the command line.

The typed schema (``schema.py``) rejects a wrong type and, for a choice field, a value outside
its Enum at composition. What is left here: on the plain config, before it becomes the typed
``RunConfig`` (``compose.to_run_config``), keys added with ``+`` and the choice check (a plain
dict never met the schema); on the typed config, cross-field rules and ranges
(``validate_config``); and, before Hydra composes, the choice check for overrides on the
command line, so a typo there costs one clear line. Checks on degrees live in
``distributed.parallel_dims.ParallelDims``.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing

from hsdp_runner.config.schema import (
    DataConfig,
    LauncherConfig,
    PrecisionConfig,
    RunConfig,
    TrainerConfig,
)
from hsdp_runner.core.choices import (
    AC,
    Choice,
    DataKind,
    Dtype,
    FaultKind,
    Float8Recipe,
    LauncherName,
)
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.core.signal_names import parse_signal
from hsdp_runner.models.base import family_schema, model_spec, routed_experts


def _field_types(schema, prefix: str = "") -> dict[str, type]:
    """Every dotted key of a schema dataclass -> its type (Optional unwrapped); nested
    sections, optional ones (e.g. ``cluster``, null in a job) included."""
    found = {}
    hints = typing.get_type_hints(schema)
    for spec in dataclasses.fields(schema):
        kind = hints[spec.name]
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is typing.Union and len(inner) == 1:
            kind = inner[0]
        found[prefix + spec.name] = kind
        if dataclasses.is_dataclass(kind):
            found.update(_field_types(kind, f"{prefix}{spec.name}."))
    return found


SCHEMA_TYPES = _field_types(RunConfig)
# The schema's Enum fields, and fault.kind: a str in the schema (see FaultConfig), same check.
CHOICE_FIELDS: dict[str, type[Choice]] = {
    key: kind
    for key, kind in SCHEMA_TYPES.items()
    if isinstance(kind, type) and issubclass(kind, Choice)
} | {"fault.kind": FaultKind}


def check_choice(key: str, value) -> None:
    """Raise ConfigError unless ``value`` is one of the choice field ``key``'s values."""
    choices = CHOICE_FIELDS[key]
    if isinstance(value, choices) or value in choices.names():
        return
    raise ConfigError(
        f"{key}={value!r} is not one of {', '.join(choices.names())}; set {key} to one of them"
    )


def bad_choice_override(argv: list[str]) -> str | None:
    """The error of the first command-line override that sets a choice field to a value
    outside its Enum (``parallel.ac=sometimes``, or one value of a sweep list ``a,b``), else
    None. Values Hydra computes (interpolations, sweep functions) are left to composition."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in CHOICE_FIELDS or any(c in value for c in "${}()[]'\""):
            continue
        for one in value.split(","):
            try:
                check_choice(key, one.strip())
            except ConfigError as err:
                return str(err)
    return None


def _require_positive(key: str, value) -> None:
    if value is None or value < 1:
        raise ConfigError(f"{key}={value} must be a positive integer; set {key}>=1")


def _select(plain: dict, key: str):
    """The value at dotted ``key`` of a plain config, None where a section is absent or null."""
    for part in key.split("."):
        if not isinstance(plain, dict):
            return None
        plain = plain.get(part)
    return plain


def check_plain_config(plain: dict) -> None:
    """Check a plain config (a resolved container) before it becomes typed: every choice field
    holds one of its Enum's values, and no key is unknown to the schema. Raises ConfigError."""
    for key in CHOICE_FIELDS:
        value = _select(plain, key)
        if value is not None:  # a choice inside a null section (e.g. cluster in a job)
            check_choice(key, value)
    _reject_unknown_keys(plain)


def validate_config(cfg: RunConfig) -> None:
    """Check the fields that need no world size; raise ConfigError naming key, value and fix.

    Takes the typed config (``compose.to_run_config``). Degree checks are ParallelDims'.
    """
    c = cfg
    for key in ("param_dtype", "reduce_dtype", "master_dtype"):
        if getattr(c.precision, key) == Dtype.float16:
            # fp16 gradients underflow without loss scaling, and the trainer has no scaler.
            raise ConfigError(
                f"precision.{key}=float16 needs a gradient scaler, which the "
                "runner does not have; use bfloat16 (precision=bf16 or bf16_pure)"
            )
    validate_float8(c.precision)
    for key in (
        "trainer.steps",
        "trainer.global_batch_size",
        "trainer.grad_accum_steps",
        "trainer.log_every",
        "model.dim",
        "model.n_layers",
        "model.n_heads",
        "model.vocab_size",
        "model.seq_len",
        "launcher.nnodes",
        "launcher.timeout_s",
    ):
        section, field = key.split(".")
        _require_positive(key, getattr(getattr(c, section), field))
    if c.launcher.requeue and not c.checkpoint.enable:
        raise ConfigError(
            f"launcher.requeue={c.launcher.requeue} needs checkpoint.enable=true: a "
            "requeued job resumes from its checkpoint (without one it starts over)"
        )
    if c.launcher.nproc_per_node is not None:
        _require_positive("launcher.nproc_per_node", c.launcher.nproc_per_node)
    if c.trainer.eval_batches < 0:
        raise ConfigError(
            f"trainer.eval_batches={c.trainer.eval_batches} must be >= 0 (0 = no eval)"
        )
    if c.trainer.val_every < 0:
        raise ConfigError(
            f"trainer.val_every={c.trainer.val_every} must be >= 0 (0 = no validation)"
        )
    if c.trainer.val_every:
        _require_positive("trainer.val_batches", c.trainer.val_batches)
    if c.data.kind == DataKind.hf:
        _validate_hf_data(c.data)
    _validate_launcher(c.launcher)
    if c.metrics.warmup_steps < 0:
        raise ConfigError(f"metrics.warmup_steps={c.metrics.warmup_steps} must be >= 0")
    if c.metrics.memory_steps < 0:
        raise ConfigError(
            f"metrics.memory_steps={c.metrics.memory_steps} must be >= 0 (0 turns "
            "the tensor-memory measurement off)"
        )
    if c.metrics.comm_step is not None and not 1 <= c.metrics.comm_step <= c.trainer.steps:
        raise ConfigError(
            f"metrics.comm_step={c.metrics.comm_step} is not a step of this run "
            f"(1..trainer.steps={c.trainer.steps}); pick one in range or null"
        )
    if c.profile.enable:
        _require_positive("profile.start_step", c.profile.start_step)
        _require_positive("profile.steps", c.profile.steps)
        last = c.profile.start_step + c.profile.steps - 1
        if last > c.trainer.steps:
            raise ConfigError(
                f"profile.start_step={c.profile.start_step} + profile.steps="
                f"{c.profile.steps} ends at step {last}, after trainer.steps="
                f"{c.trainer.steps}; start earlier or profile fewer steps"
            )
    if c.metrics.peak_tflops is not None and c.metrics.peak_tflops <= 0:
        raise ConfigError(
            f"metrics.peak_tflops={c.metrics.peak_tflops} must be a positive number "
            "(TFLOP/s of one device) or null to look it up"
        )
    if c.model.dim % c.model.n_heads:
        raise ConfigError(
            f"model.dim={c.model.dim} is not divisible by model.n_heads="
            f"{c.model.n_heads}; pick a head count that divides the width"
        )
    model_spec(c.model).validate()  # the family's own checks
    moe_blocks = c.model.n_layers - (getattr(c.model, "n_dense_layers", 0) or 0)
    ac = AC(c.parallel.ac)
    if ac.needs_moe and (routed_experts(c.model) == 0 or moe_blocks < 1):
        what = "feed-forward" if ac is AC.moe else "routed experts' activation"
        raise ConfigError(
            f"parallel.ac={ac.value} recomputes the MoE blocks' {what}, and model.name="
            f"{c.model.name} has no MoE block; set parallel.ac=full or selective"
        )
    if ac is AC.moe_act and c.precision.float8_experts:
        # torchao's float8 grouped matmul is its own autograd function: it saves its inputs
        # its way, and the recomputing function would run its backward in bf16.
        raise ConfigError(
            "parallel.ac=moe_act with precision.float8_experts=true: the experts' float8 "
            "matmuls keep their own saved inputs, so their activation cannot be recomputed; "
            "set precision.float8_experts=false or parallel.ac=none (or moe)"
        )
    _validate_sp_save_shard(c)
    if c.data.kind == DataKind.text and c.model.vocab_size < 256:
        raise ConfigError(
            f"model.vocab_size={c.model.vocab_size} is too small for the byte-level "
            "tokenizer of data.kind=text; it needs at least 256"
        )
    if not 0.0 <= c.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={c.optim.min_lr_ratio} must lie in [0, 1]")
    if c.optim.lr <= 0:
        raise ConfigError(f"optim.lr={c.optim.lr} must be positive")


def _validate_sp_save_shard(c: RunConfig) -> None:
    """``parallel.sp_save_shard`` needs autograd's saved tensors to itself
    (``distributed/sp_saves.py``): no compile, no float8 linears (torchao's TP styles gather
    float8). Where it has nothing to change (tp 1, no sequence parallel, a checkpoint of the
    whole block) it does nothing, as ``loss_parallel`` does without TP: the planner varies
    those keys."""
    p = c.parallel
    if not p.sp_save_shard:
        return
    key = "parallel.sp_save_shard=true"
    if p.compile:
        raise ConfigError(
            f"{key} with parallel.compile=true: compiled blocks save their own tensors, out "
            "of reach of the saved-tensor hooks it uses; set one of them false"
        )
    if Float8Recipe(c.precision.float8) is not Float8Recipe.none:
        raise ConfigError(
            f"{key} with precision.float8={Float8Recipe(c.precision.float8).value}: the "
            "float8 linears gather their inputs in float8 themselves; set precision.float8="
            "none or sp_save_shard=false"
        )


def _validate_hf_data(data: DataConfig) -> None:
    """The ranges of the ``data=hf`` keys (the path and the tokenizer, which data=hf needs,
    are checked with their files before launch: ``train/hf_checks.py``)."""
    if not 0.0 < data.val_fraction < 1.0:
        raise ConfigError(
            f"data.val_fraction={data.val_fraction} must lie between 0 and 1 (the share of "
            "documents held out when data.val_split is null)"
        )
    for key, low in (("shuffle_buffer", 0), ("workers", 0), ("prefetch", 1)):
        if getattr(data, key) < low:
            raise ConfigError(f"data.{key}={getattr(data, key)} must be >= {low}")


def validate_float8(precision: PrecisionConfig, tp: int = 1) -> None:
    """Refuse float8 settings torchao does not support (``tp``: the TP degree, once known):
    float8 experts without float8 training, float8 all-gather without tensorwise scaling, and
    TP with rowwise scaling (torchao's float8
    TP styles are tensorwise only). Raises ConfigError naming the key and the fix."""
    recipe = Float8Recipe(precision.float8)
    if precision.float8_experts and recipe is Float8Recipe.none:
        raise ConfigError(
            "precision.float8_experts=true with precision.float8=none: the experts' float8 "
            "matmuls come with float8 training; use precision=float8 (or float8_rowwise) or "
            "set precision.float8_experts=false"
        )
    if precision.float8_all_gather and recipe is not Float8Recipe.tensorwise:
        raise ConfigError(
            f"precision.float8_all_gather=true with precision.float8={recipe}: torchao gathers "
            "float8 weights with tensorwise scales only; set precision.float8_all_gather=false "
            "or precision.float8=tensorwise (precision=float8)"
        )
    if tp > 1 and recipe in (Float8Recipe.rowwise, Float8Recipe.rowwise_with_gw_hp):
        raise ConfigError(
            f"precision.float8={recipe} with parallel.tp={tp}: torchao's float8 tensor-parallel "
            "styles assume tensorwise scaling; use precision=float8 (tensorwise) or parallel.tp=1"
        )


def _validate_launcher(launcher: LauncherConfig) -> None:
    if launcher.signal is not None:
        try:
            parse_signal(launcher.signal)
        except ValueError as err:
            raise ConfigError(
                f"launcher.signal={launcher.signal!r}: {err}; use a signal name "
                "such as USR2 (submitit's default) or USR1"
            ) from None
    if launcher.requeue < 0 or launcher.signal_delay_s < 1:
        raise ConfigError(
            f"launcher.requeue={launcher.requeue} must be >= 0 and "
            f"launcher.signal_delay_s={launcher.signal_delay_s} >= 1"
        )
    if not LauncherName(launcher.name).submitit:
        return
    choice = f"launcher={launcher.name}"
    if launcher.nproc_per_node is None:
        raise ConfigError(
            f"{choice} needs launcher.nproc_per_node (SLURM tasks = ranks per node); "
            "set it, e.g. launcher.nproc_per_node=8"
        )
    _require_positive("launcher.timeout_min", launcher.timeout_min)
    for key in ("cpus_per_task", "mem_gb"):
        if getattr(launcher, key) is not None:
            _require_positive(f"launcher.{key}", getattr(launcher, key))
    if launcher.gpus_per_node is not None and launcher.gpus_per_node < launcher.nproc_per_node:
        raise ConfigError(
            f"launcher.gpus_per_node={launcher.gpus_per_node} is less than launcher.nproc_per_node="
            f"{launcher.nproc_per_node}; each rank needs its own GPU: raise gpus_per_node, lower "
            "nproc_per_node, or set launcher.gpus_per_node=null on a CPU partition"
        )
    if launcher.name == LauncherName.slurm_local and launcher.nnodes != 1:
        raise ConfigError(
            f"launcher.nnodes={launcher.nnodes} with launcher=slurm_local: "
            "submitit's local executor runs one node; set launcher.nnodes=1 or "
            "use launcher=slurm"
        )


def _schema_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        if not prefix and key == "hydra":  # Hydra's own node (present in a sweep's job config)
            continue
        keys.append(prefix + str(key))
        if isinstance(value, dict):
            keys += _schema_keys(value, f"{prefix}{key}.")
    return keys


def _reject_unknown_keys(cfg: dict) -> None:
    """Refuse keys the schema does not know (added with ``+``, which the typed schema cannot
    stop): nothing reads them, so ``+trainer.stepz=10`` would run a full job silently.
    The message names the nearest valid key. ``hydra.*`` is not part of the job's config."""
    known = set(SCHEMA_TYPES) | set(_field_types(family_schema(cfg["model"]), "model."))
    for key in _schema_keys(cfg):
        if key in known:
            continue
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        if parent and parent not in known:
            continue  # reported at its first unknown level
        near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}? " if near else ""
        raise ConfigError(
            f"unknown config key {key} (added with +); nothing reads it: {hint}"
            "fix or drop the override (python -m hsdp_runner --cfg job lists "
            "every key)"
        )


def validate_batch(trainer: TrainerConfig, dp_size: int) -> int:
    """Check that the global batch splits evenly over dp ranks and gradient-accumulation
    micro-batches (under pipeline parallel, the pipeline's micro-batches are checked by
    ``distributed.pipeline_settings.job_refusal``; accumulation is 1 there).

    Takes the ``trainer`` config and the data-parallel size (from ParallelDims); returns the
    micro-batch size (sequences per rank per forward pass).
    """
    gbs, accum = trainer.global_batch_size, trainer.grad_accum_steps
    if gbs % (dp_size * accum):
        raise ConfigError(
            f"trainer.global_batch_size={gbs} is not divisible by the data-parallel size "
            f"{dp_size} x trainer.grad_accum_steps={accum}; use a multiple of {dp_size * accum}"
        )
    return gbs // (dp_size * accum)
