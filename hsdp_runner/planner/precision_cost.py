"""The compute part of a step's time, split by what limits each part: the matmuls by their
shapes (float8 ones at the float8 peak), attention at its measured rate, the work between
matmuls at memory bandwidth, and the device's idle at each kernel launch; eager or compiled.

``planner.step_time`` once priced every hardware FLOP at ``peak x compute_efficiency``, one
efficiency standing in for everything a step does on the device. Here (``compute_seconds``):

- **Matmuls.** Every GEMM a rank runs in the step (``matmul_shapes.step_gemms``: each linear's
  forward and two backward GEMMs at its TP-local shape, the experts' grouped GEMMs, what AC
  recomputes) is priced from its shape (``matmul_time``: output tiles in waves over the SMs
  at peak x the architecture's measured GEMM efficiency (``kernel_rates``) x
  ``cluster.compute_efficiency``, or its bytes at memory bandwidth when those take
  longer). The linears ``precision.float8`` converts (``float8``'s module filter: not the
  output layer, not a layer with a dim that is not a multiple of 16) run at the device's
  float8 peak (``Cluster.float8_peak_tflops``: ``cluster.float8_peak_tflops`` or the datasheet
  table, dense FP8) x the same efficiency (assumed, float8 kernels reach the same fraction of
  their peak as bf16 ones); the rest, the routed experts' grouped GEMMs included, at the
  compute dtype's peak.
- **Attention** (flash: QK^T and AV, forward, backward and full AC's recompute): the FLOPs of
  the runner's count (``step_time.step_flops``: every query against every key, as torchtitan
  and MFU count them) that are not the linears', at the compute dtype's peak x the share
  of it the architecture's kernel was measured to reach at that count, by the tokens of a
  sequence (causal) or of a context-parallel chunk (``attention_time``) x
  ``cluster.compute_efficiency``: the count, not the causal kernel's half of it, because the
  measured share is taken at the count.
- **Memory-bound work** (norms, activations, RoPE, residual adds, the loss, and under float8
  torchao's amax and casts) at ``cluster.memory_gbps``. Its bytes come from the model's own
  code, traced eager or compiled (``planner/traffic.py``): Inductor's fusion is assumed never
  to span a matmul, a reduction's output is written once, the kernels run at the full
  datasheet bandwidth; outside the blocks nothing is compiled (``parallel.compile``: each
  block through Inductor; the debugging backends of ``parallel.compile_backend`` are priced
  eager).
  Activation checkpointing (full or selective: both recompute every element-wise op)
  runs the blocks' forward bytes once more; ``moe`` reruns the MoE blocks' feed-forward alone,
  which the trace itself runs as the job does (its backward's bytes hold it). With TP the bytes of a rank's tokens split over
  the tp ranks (sequence parallel shards the norms and residual stream, TP the heads and FFN).
- **Launches** (``launch_seconds``): the same traces count the kernels a micro-batch launches
  (``traffic._launches``: every matmul and attention call, and every element-wise op eager or every
  fused run compiled), each at the architecture's measured idle per launch
  (``kernel_rates.launch_seconds``: the runner's profiled eager step, its unprofiled step less
  its kernels' busy time, over its launches), added to the kernels' time (part 'launch').
  Added, not a floor under the step: that profile shows the idle as a share of the step
  (31%) on a step whose kernels outlast its launches, which a floor (the host running ahead,
  idle only where the launches outlast the work) prices at zero; a floor left that idle to
  ``cluster.compute_efficiency``, which then slowed every kernel of every job by it, large
  and small (benchmarks/planner_gpu_heldout.py: the held-out H200 jobs 14.7% median |error|
  with the floor, 6.4% added; docs/planner.md). The trace does not see FSDP's copies, the
  optimizer's and clipping's foreach kernels or autograd's accumulation: the count is a lower
  bound (a profiled H200 step launched 3,286 kernels where its trace counts about 1,550).
"""

from __future__ import annotations

from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.choices import AC, CompileBackend
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.expert_parallel import exchange_chunks
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.models.base import build_meta_model, moe_layers
from hsdp_runner.models.params import torch_dtype
from hsdp_runner.planner import attention_time, kernel_rates, matmul_shapes, matmul_time
from hsdp_runner.planner.cluster import Cluster
from hsdp_runner.planner.traffic import traffic
from hsdp_runner.train.metrics import lookup_sm_count


def float8_peak_tflops(cfg: RunConfig, cluster: Cluster) -> float:
    """Dense float8 TFLOP/s of one device (``Cluster.float8_peak_tflops``: the config's
    ``cluster.float8_peak_tflops`` or the datasheet table); ConfigError naming the key when
    the cluster has none."""
    if not cluster.float8_peak_tflops:
        raise ConfigError(
            f"precision.float8={cfg.precision.float8} on cluster.device={cluster.device!r}: no "
            "float8 peak in metrics.PEAK_TFLOPS (a device without float8 tensor cores?); set "
            "cluster.float8_peak_tflops=<dense FP8 TFLOP/s> or plan precision=bf16"
        )
    return cluster.float8_peak_tflops


def compute_seconds(cfg: RunConfig, dims: ParallelDims, cluster: Cluster, hw_flops: float) -> dict:
    """Seconds of one step's device work on one rank, by part: 'matmul', 'float8_matmul' and
    'expert_matmul' (the linears in the compute dtype, those ``precision.float8`` converts, and
    the experts' grouped matmuls: each GEMM priced from its shape, ``matmul_shapes`` and
    ``matmul_time``), 'attention' (the FLOPs of ``hw_flops``, the rank's hardware FLOPs incl.
    recompute as ``step_time.step_flops`` counts them, that are not the linears' at balanced
    routing, at peak x ``cluster.compute_efficiency``) and 'memory' (the work between
    matmuls, float8 casts included). Returns {part: seconds}; the float8 parts only under
    float8, the experts' only for a model with experts."""
    gemms = matmul_shapes.step_gemms(cfg, dims)
    f8_peak = float8_peak_tflops(cfg, cluster) if any(g.float8 for g in gemms) else None
    width = torch_dtype(cfg.precision.param_dtype).itemsize
    parts = matmul_time.seconds_by_part(gemms, matmul_time.device_of(cluster, width, f8_peak))
    balanced = gemms
    if dims.ep > 1 and cfg.plan.expert_imbalance != 1.0:
        balanced = matmul_shapes.step_gemms(cfg, dims, imbalance=1.0)
    linear = sum(g.flops for g in balanced)
    if hw_flops < linear * (1 - 1e-9):
        raise ValueError(
            f"hw_flops={hw_flops:.6g} is below the FLOPs of the rank's linears ({linear:.6g}): "
            "pass step_time.step_flops' hardware count for this config and layout"
        )
    parts["attention"] = attention_time.seconds(
        max(hw_flops - linear, 0.0), cluster, cfg.model.seq_len, dims.cp
    )
    parts["memory"] = memory_seconds(cfg, dims, cluster)
    # Each launch leaves the device idle for the time measured per launch on the runner's own
    # profiled step, on top of its kernels (module docstring: why added, not a floor).
    chunks = exchange_chunks(cfg.parallel, dims)
    parts["launch"] = launch_seconds(cfg, cluster, chunks)
    return parts


def launch_seconds(cfg: RunConfig, cluster: Cluster, chunks: int = 1) -> float:
    """Seconds the launches of one rank's kernels take (``Traffic.launches``: the blocks'
    forward, AC's recompute of it, their backward and the rest, per micro-batch; the MoE
    layers' in the token exchange's ``chunks``) at its architecture's measured cost per
    launch (``kernel_rates.launch_seconds``); 0 on a device the SM table does not list (a
    CPU's ops are its own compute time)."""
    found = lookup_sm_count(cluster.device)
    if not found:
        return 0.0
    parallel = cfg.parallel
    fused = parallel.compile and CompileBackend(parallel.compile_backend) is CompileBackend.inductor
    ac = AC(parallel.ac)
    counts = traffic(
        cfg.model,
        cfg.precision,
        fused,
        cluster.device_type,
        chunks,
        ac,
        cfg.trainer.loss_fp32,
    ).launches
    recomputes = _block_recomputes(ac)
    per_micro = (
        counts["block_forward"] * (1 + recomputes) + counts["block_backward"] + counts["rest"]
    )
    return per_micro * cfg.trainer.grad_accum_steps * kernel_rates.launch_seconds(found[1])


def _block_recomputes(ac: AC) -> int:
    """Times AC runs the traced blocks' forward once more: 1 for full and selective, 0 for
    none, ``moe`` and ``moe_act``, whose recompute the trace holds as backward's."""
    return 1 if ac.wraps_blocks else 0


def memory_seconds(cfg: RunConfig, dims: ParallelDims, cluster: Cluster) -> float:
    """Seconds one rank's step spends on the work between matmuls (``traffic``: eager or
    compiled, float8 casts included, AC's recompute once more) at ``cluster.memory_gbps``."""
    trainer, parallel = cfg.trainer, cfg.parallel
    # Only inductor generates fused kernels; the debugging backends run the blocks' ops as eager.
    fused = parallel.compile and CompileBackend(parallel.compile_backend) is CompileBackend.inductor
    ac = AC(parallel.ac)
    t = traffic(
        cfg.model,
        cfg.precision,
        fused,
        cluster.device_type,
        exchange_chunks(parallel, dims),
        ac,
        trainer.loss_fp32,
    )
    # A micro-batch's tokens on one rank (each TP rank holds 1/tp of their activations).
    micro_tokens = trainer.global_batch_size * cfg.model.seq_len / dims.dp / dims.cp
    micro_tokens /= trainer.grad_accum_steps
    recomputes = _block_recomputes(ac)
    per_micro = (
        t.bytes("block_forward", micro_tokens) * (1 + recomputes)
        + t.bytes("block_backward", micro_tokens)
        + t.bytes("rest", micro_tokens)
    ) / dims.tp + expert_grad_sum_bytes(cfg, dims)
    return per_micro * trainer.grad_accum_steps / (cluster.memory_gbps * 1e9)


def expert_grad_sum_bytes(cfg: RunConfig, dims: ParallelDims) -> float:
    """Bytes one rank moves per micro-batch summing each routed expert weight's gradients over
    the token exchange's C chunks (``expert_parallel.exchange_chunks``; each chunk's grouped
    matmuls give the weight a gradient of its own): C - 1 sums of the rank's local experts'
    gradients in the compute dtype, two reads and a write each, per MoE layer. ``traffic``'s
    trace holds every expert (no ep) and leaves these sums out."""
    chunks = exchange_chunks(cfg.parallel, dims)
    if chunks == 1:
        return 0.0
    model = build_meta_model(cfg.model)
    weights = sum(
        w.numel() for layer in moe_layers(model) for w in layer.parameters() if w.dim() == 3
    )
    width = torch_dtype(cfg.precision.param_dtype).itemsize
    return 3 * (chunks - 1) * weights / dims.ep * width
