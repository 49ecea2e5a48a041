"""The string choices of the config, as Enum types the typed schema (``config/schema.py``) uses.

A field typed with one of these fails at composition with the allowed values listed
(OmegaConf's EnumNode), and code dispatches on the members instead of comparing strings.
Each member's name is its value, so YAML and the command line keep writing ``parallel.ac=full``.
"""

from __future__ import annotations

import enum


class Choice(str, enum.Enum):
    """A config choice that is also a ``str``: it equals, prints and serialises (JSON, W&B
    config) as its value. Python 3.11's ``enum.StrEnum`` does the same; the package still
    supports 3.10, hence this base."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def names(cls) -> list[str]:
        """The allowed values, in declaration order."""
        return [member.value for member in cls]


class AC(Choice):
    """``parallel.ac``: activation checkpointing of each block; ``moe``: of each MoE block's
    feed-forward alone (its norm, router, token exchange and experts: Megatron's
    ``--recompute-modules layernorm moe``); ``moe_act``: of the routed experts' activation
    alone (its output, the down projection's input, computed again in backward from what
    it saves anyway: Megatron's ``--recompute-modules moe_act``)."""

    none = "none"
    full = "full"
    selective = "selective"
    moe = "moe"
    moe_act = "moe_act"

    @property
    def wraps_blocks(self) -> bool:
        """True where a checkpoint wraps each whole block (full, selective); the other
        modes keep what a block saves outside its MoE feed-forward as without AC."""
        return self in (AC.full, AC.selective)

    @property
    def needs_moe(self) -> bool:
        """True for the modes that recompute part of the MoE blocks only (``moe``,
        ``moe_act``): a model without one is refused."""
        return self in (AC.moe, AC.moe_act)

    @property
    def reruns_moe_forward(self) -> bool:
        """True where backward runs each MoE layer's forward again, its token exchange
        included: full AC (the whole block) and ``moe``."""
        return self in (AC.full, AC.moe)


class CompileBackend(Choice):
    """``parallel.compile_backend``: what ``torch.compile`` hands each block's graph to. Below
    inductor, the rungs of torch's ladder for finding where a compile bug lives: ``eager``
    (Dynamo's capture only), ``aot_eager`` (+ AOTAutograd's joint graph and partition)."""

    inductor = "inductor"
    aot_eager = "aot_eager"
    eager = "eager"


class DDPImpl(Choice):
    """``parallel.ddp_impl``: what wraps the model under pure data parallelism."""

    replicate = "replicate"
    fully_shard = "fully_shard"


class Dtype(Choice):
    """``precision.*_dtype`` and ``checkpoint.export_dtype``: torch dtype names."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Float8Recipe(Choice):
    """``precision.float8``: float8 training of the linear layers through torchao, by the
    scaling its recipe names (torchao's ``Float8LinearRecipeName``), or none (no float8).

    tensorwise: one scale per tensor (cuBLAS tensorwise kernel; float8 FSDP all-gather and
    torchao's float8 TP styles); rowwise: one scale per row, every operand e4m3, scales rounded
    to powers of two; rowwise_with_gw_hp: rowwise, with the weight gradient's matmul kept in
    high precision."""

    none = "none"
    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"


class DataKind(Choice):
    """``data.kind``: synthetic tokens, a byte-level text file, or a dataset and tokenizer
    of Hugging Face's libraries (``hf``)."""

    synthetic = "synthetic"
    text = "text"
    hf = "hf"


class Logger(Choice):
    """``logger.name``: where rank 0's figures go besides metrics.jsonl."""

    wandb = "wandb"
    none = "none"


class WandbMode(Choice):
    """``logger.mode``."""

    offline = "offline"
    online = "online"
    disabled = "disabled"


class Device(Choice):
    """``device``: auto picks CUDA when a GPU is visible, else CPU."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class FaultKind(Choice):
    """``fault.kind``: how an injected fault fails."""

    exception = "exception"
    sigkill = "sigkill"
    sigterm = "sigterm"
    nan = "nan"
    hang = "hang"
    abort = "abort"


class FaultPhase(Choice):
    """``fault.phase``: at a step's start or while its checkpoint is written."""

    step = "step"
    save = "save"


class OnNan(Choice):
    """``trainer.on_nan``: what a non-finite step does."""

    stop = "stop"
    skip = "skip"


class AccumReduce(Choice):
    """``trainer.accum_reduce``: when gradients are reduced across micro-batches of a step.

    every: FSDP/HSDP reduce-scatter each micro-batch's gradients (they stay sharded: the
    memory saving users expect from accumulation); HSDP's replicate all-reduce and DDP's
    all-reduce still run once, after the last micro-batch. last: sync is off until the last
    micro-batch, so each rank holds unsharded gradients across micro-batches (less traffic,
    more memory)."""

    every = "every"
    last = "last"


class ExchangeOrder(Choice):
    """``parallel.ep_order``: the order the token exchange by node runs its chunks through its
    stages (``distributed/exchange_overlap.schedule``). breadth_first: each stage on every
    chunk before the next stage (the relays' work on chunk i+1 is issued before chunk i's
    experts; the sums go back over the NICs after the last chunk's experts). per_chunk: chunk
    i+1's relay right after chunk i's experts and chunk i's sums sent as soon as its outputs
    are back, so the NIC stage of one chunk runs beside the experts of the next. Which is
    faster depends on the links: per_chunk where the NICs dominate, breadth_first where the
    NVLink stage is about as long (docs/moe.md). The flat exchange runs both alike."""

    breadth_first = "breadth_first"
    per_chunk = "per_chunk"


# ``parallel.pp_schedule``: the order in which pipeline stages run micro-batches
# (``torch.distributed.pipelining``'s schedules).
# gpipe: every forward, then every backward (holds all micro-batches' activations).
# 1f1b: one forward, one backward in turn after a warm-up (holds at most pp of them).
# interleaved_1f1b: 1F1B over ``parallel.pp_stages_per_rank`` > 1 stages per rank (rank r
# holds stages r, r + pp, ...): a smaller bubble for more stage-to-stage sends.
# interleaved_zb: interleaved, each backward split into its input-gradient and weight-gradient
# halves so that weight gradients fill the bubble (zero-bubble).
# Built with Enum's functional API because "1f1b" is not a Python identifier and OmegaConf
# looks members up by name (a name equal to its value keeps ``parallel.pp_schedule=1f1b``).
PPSchedule = Choice(
    "PPSchedule",
    [(v, v) for v in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb")],
    module=__name__,
)
# The schedules that run several stages per rank (``parallel.pp_stages_per_rank`` > 1).
INTERLEAVED_SCHEDULES = frozenset({PPSchedule["interleaved_1f1b"], PPSchedule["interleaved_zb"]})


class LauncherName(Choice):
    """``launcher.name``: this node's elastic launcher, or SLURM through submitit."""

    local = "local"
    slurm = "slurm"
    slurm_local = "slurm_local"

    @property
    def submitit(self) -> bool:
        """True for the launchers that run jobs through hydra-submitit-launcher."""
        return self is not LauncherName.local


class DPMode(Choice):
    """Which data-parallel wrapper a job's degrees call for (``ParallelDims.dp_mode``)."""

    none = "none"
    ddp = "ddp"
    fsdp = "fsdp"
    hsdp = "hsdp"


class StartSource(Choice):
    """Where a job's state comes from (``checkpoint.start.Start``): a checkpoint (full state),
    a Hugging Face folder (weights only) or fresh weights."""

    checkpoint = "checkpoint"
    hf = "hf"
    fresh = "fresh"


class RunStatus(Choice):
    """How a job ended (``summary.json``'s ``status``), in the order reports list them; a job
    dir without summary.json is ``unfinished`` (``report.runs.Job``), never written."""

    completed = "completed"
    interrupted = "interrupted"
    failed = "failed"
    skipped = "skipped"
    unfinished = "unfinished"

    @property
    def rank(self) -> int:
        """The position reports sort jobs by: completed first, unfinished last."""
        return list(RunStatus).index(self)


class Resume(Choice):
    """``checkpoint.resume``: continue from the job's own newest checkpoint, or never."""

    auto = "auto"
    never = "never"
