"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The root schema ``RunConfig`` is the first entry of ``conf/config.yaml``'s defaults list, so
every YAML choice is merged into a typed node: a wrong type or an unknown key fails at
composition with the key's name, and a choice field (an Enum of ``choices.py``) fails with
the allowed values listed. Cross-field checks that need no world size live in
``checks.validate_config``; checks on degrees live in ``parallel_dims.ParallelDims``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hsdp_runner.core.choices import (
    AC,
    AccumReduce,
    CompileBackend,
    DataKind,
    DDPImpl,
    Device,
    Dtype,
    ExchangeOrder,
    Float8Recipe,
    LauncherName,
    Logger,
    OnNan,
    PPSchedule,
    Resume,
    WandbMode,
)

# Fault injection's schema lives with fault injection (core/faults.py), which sits below config
# so that the trainer and the checkpointer can fail on purpose without importing config.
from hsdp_runner.core.faults import FaultConfig

# The model group's base schema: the fields every family shares. Each family extends it with a
# dataclass of its own (models/base.py), stored by register_schemas as model/<family>_schema;
# a conf/model/*.yaml names its family's schema first in its defaults list, so the node is typed
# by the family's dataclass (Hydra's pattern for a group of schemas that extend one base).
from hsdp_runner.models.base import ModelConfig, family_schemas


@dataclass
class ParallelConfig:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    # Expert parallel (a model with experts): each MoE block's experts shared out over ep of the
    # dp_shard x cp x tp ranks of a replica (it borrows ranks; the world size is the other
    # degrees' product). distributed/expert_parallel.py, docs/moe.md.
    ep: int = 1
    # ep > 1: each rank's tokens are exchanged in this many chunks, each chunk's all-to-alls
    # running while the experts compute another's (distributed/exchange_overlap.py); 1: one
    # exchange, waited for. None: 2, or 1 with compiled blocks.
    ep_chunks: Optional[int] = None
    # The order the exchange by node (an ep group across nodes) runs its chunks through its
    # stages (core/choices.ExchangeOrder). None: breadth_first in a job; the planner times
    # both and names the faster in its row (parallel=auto runs it).
    ep_order: Optional[ExchangeOrder] = None
    sequence_parallel: bool = True
    # Sequence parallel saves each block's gathered attention and dense feed-forward input as
    # the rank's shard and all-gathers it again in backward, as Megatron does
    # (distributed/sp_saves.py): tp - 1 shards less a block, one more all-gather. No effect
    # without TP and sequence parallel or under parallel.ac=full/selective.
    sp_save_shard: bool = False
    # tp > 1: the output layer leaves the logits sharded over the vocabulary and the loss is
    # computed on them (torch's loss_parallel), instead of all-gathering them on every rank.
    loss_parallel: bool = True
    reshard_after_forward: bool = True
    ac: AC = AC.none
    compile: bool = False
    compile_backend: CompileBackend = CompileBackend.inductor
    ddp_impl: DDPImpl = DDPImpl.replicate
    allow_tp_across_nodes: bool = False
    allow_cp_across_nodes: bool = False
    # Pipeline parallel (pp > 1; distributed/pipeline.py): the schedule, the micro-batches each
    # step's local batch is cut into (None: 2 x pp, resolved by ParallelDims) and the stages
    # each rank holds (> 1 only for the interleaved schedules); blocks the first and the last
    # stage get fewer than an even split, for the embedding and the output layer they also run.
    pp_schedule: PPSchedule = PPSchedule["1f1b"]
    pp_microbatches: Optional[int] = None
    pp_stages_per_rank: int = 1
    pp_first_stage_less_blocks: int = 0
    pp_last_stage_less_blocks: int = 0
    # parallel=auto: one process plans the degrees left at -1 for every rank (runtime/auto_job.py).
    auto: bool = False


@dataclass
class PrecisionConfig:
    name: str = MISSING
    param_dtype: Dtype = Dtype.float32
    reduce_dtype: Dtype = Dtype.float32
    master_dtype: Dtype = Dtype.float32
    # Float8 training of the linear layers (distributed/float8.py); none: no float8.
    float8: Float8Recipe = Float8Recipe.none
    # FSDP/HSDP gather float8 weights (tensorwise only) instead of param_dtype ones.
    float8_all_gather: bool = False
    # With float8: the routed experts' grouped matmuls too (torchao's float8 rowwise grouped
    # matmul). Off by default: measured 5.2x slower than bf16 on an H200 (docs/precision.md).
    float8_experts: bool = False


@dataclass
class OptimConfig:
    """AdamW's settings and the LR schedule (conf/optim/adamw.yaml). AdamW is the one
    optimizer: the trainer skips a non-finite step on the device through fused AdamW's
    ``found_inf``, and the planner's memory model counts its two moments."""

    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass
class DataConfig:
    """The training data (conf/data/*.yaml). ``kind=hf`` reads the keys below ``path``
    (hsdp_runner/train/hf_*.py, docs/data.md); synthetic and text data ignore them."""

    kind: DataKind = DataKind.synthetic
    path: Optional[str] = None
    tokenizer: Optional[str] = None
    text_field: str = "text"
    split: str = "train"
    val_split: Optional[str] = None
    val_fraction: float = 0.01
    streaming: bool = False
    shuffle_buffer: int = 64
    workers: int = 0
    prefetch: int = 2
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    cache_dir: Optional[str] = None


@dataclass
class LoggerConfig:
    name: Logger = Logger.none
    project: str = "hsdp_runner"
    entity: Optional[str] = None
    mode: WandbMode = WandbMode.offline
    group: Optional[str] = None


@dataclass
class LauncherConfig:
    name: LauncherName = LauncherName.local
    nnodes: int = 1
    nproc_per_node: Optional[int] = None
    timeout_s: int = 300
    # SLURM only (launcher=slurm / slurm_local); conf/launcher/slurm.yaml feeds them to
    # hydra-submitit-launcher.
    gpus_per_node: Optional[int] = None
    timeout_min: int = 60
    partition: Optional[str] = None
    account: Optional[str] = None
    # Stop signals (hsdp_runner/runtime/signals.py): the time-limit signal SLURM sends
    # signal_delay_s before --time (besides TERM, INT and USR2), and how many times a job it
    # stopped is requeued (submitit's max_num_timeout).
    signal: Optional[str] = None
    signal_delay_s: int = 120
    requeue: int = 0
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None


@dataclass
class TrainerConfig:
    steps: int = 20
    seed: int = 0
    global_batch_size: int = 8
    grad_accum_steps: int = 1
    accum_reduce: AccumReduce = AccumReduce.every
    log_every: int = 1
    eval_batches: int = 0
    # Validation during training: every val_every steps (0: never), val_batches held-out batches.
    val_every: int = 0
    val_batches: int = 2
    freeze: list = field(default_factory=list)
    on_nan: OnNan = OnNan.stop
    # The loss in chunks of tokens, each recomputed in backward (train/loss.py), where the
    # rank's logits (whole, or its vocabulary slice under loss parallel) exceed
    # loss.CHUNK_ELEMENTS: less memory for a large vocabulary.
    chunked_loss: bool = False
    # The cross-entropy in fp32 (an fp32 copy of the logits); false: in the logits' own dtype,
    # half the loss's memory at bf16's rounding of the log-probabilities (train/loss.py).
    loss_fp32: bool = True


@dataclass
class MetricsConfig:
    warmup_steps: int = 2
    peak_tflops: Optional[float] = None
    comm_step: Optional[int] = 1
    # Steps over which the peak of tensor memory is measured (hsdp_runner/train/tensor_memory.py):
    # the window ends when step N is reported, after step N+1's forward and backward, so 1
    # covers the first optimizer step and a step that holds the optimizer state. On CPU it
    # runs torch.profiler, which slows those steps (warmup_steps leaves them out); 0 = off.
    memory_steps: int = 1


@dataclass
class ProfileConfig:
    """torch.profiler trace of a step window (see hsdp_runner/train/profiling.py)."""

    enable: bool = False
    start_step: int = 3
    steps: int = 2
    all_ranks: bool = False


@dataclass
class CheckpointConfig:
    """Checkpoint saving, resuming, Hugging Face import/export (see hsdp_runner/checkpoint/checkpointer.py)."""

    enable: bool = False
    interval: Optional[int] = None
    dir: Optional[str] = None
    resume: Resume = Resume.auto
    load_path: Optional[str] = None
    keep_last: Optional[int] = None
    init_from_hf: Optional[str] = None
    export_at_end: bool = False
    export_dir: Optional[str] = None
    export_dtype: Dtype = Dtype.bfloat16
    export_max_shard_gib: float = 5.0
    rank0_wait_s: float = 3600.0


@dataclass
class ClusterConfig:
    """A machine the planner predicts for (conf/cluster/*.yaml; see hsdp_runner/planner/cluster.py)."""

    name: str = MISSING
    device: str = MISSING
    gpus_per_node: int = MISSING
    nodes: int = 1
    device_memory_gib: Optional[float] = None
    peak_tflops: Optional[float] = None
    # Dense FP8 TFLOP/s of one device for precision=float8 (null: the peak table for `device`).
    float8_peak_tflops: Optional[float] = None
    compute_efficiency: float = MISSING
    nvlink_gbps: Optional[float] = None  # null: measured (cluster.measure=true)
    nvlink_efficiency: Optional[float] = None  # null only when measured
    nics_per_node: Optional[int] = None  # null: no inter-node link of its own
    nic_gbit: Optional[float] = None
    nic_efficiency: Optional[float] = None
    # Replaced by the datasheet figures above; set, resolving the cluster names the new keys.
    intra_node_gbps: Optional[float] = None
    inter_node_gbps: Optional[float] = None
    intra_node_latency_us: float = MISSING
    inter_node_latency_us: float = MISSING
    overlap: Optional[float] = 1.0  # null: measured (cluster.measure=true)
    memory_reserve_gib: float = 0.0
    memory_gbps: Optional[float] = None  # device memory bandwidth, GB/s; null: measured
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
    cp_degrees: Optional[list] = None  # null: every cp the sequence and the node allow
    # Pipeline degrees priced beside the pp = 1 layouts (planner/pipeline.py); [1]: none;
    # null: 1 and the powers of two dividing the nodes and the blocks (default_pp_degrees).
    pp_degrees: Optional[list] = None
    # Expert-parallel degrees of a model with experts (planner/degrees.py); null: the powers of
    # two dividing the experts and the ranks ep may borrow (dp_shard x cp x tp); [1]: none.
    ep_degrees: Optional[list] = None
    # The busiest ep rank's routed token copies over the mean (>= 1; 1.0 = uniform routing):
    # scales its experts' activations, matmuls and received all-to-all rows. A job's logged
    # moe/load_max_over_mean (per expert) bounds it from above.
    expert_imbalance: float = 1.0


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
    device: Device = Device.auto


def register_schemas() -> None:
    """Store ``RunConfig`` as ``run_schema`` so ``conf/config.yaml`` can extend it, and each
    model family's schema as ``model/<family>_schema`` for its ``conf/model/*.yaml``. Once a
    process: storing converts every dataclass to a config again, a sixth of a composition."""
    store = ConfigStore.instance()
    if "run_schema.yaml" in store.repo:  # stored last, below
        return
    for name, schema in family_schemas().items():
        store.store(group="model", name=name, node=schema)
    store.store(name="run_schema", node=RunConfig)
