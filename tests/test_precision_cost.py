"""The planner's compute price (planner/precision_cost.py): matmuls by their shapes, float8
ones at the FP8 peak, attention at peak, the work between matmuls at memory bandwidth, eager or
compiled, from a meta trace."""

import pytest
import torch
from clusters import fake_cluster

from hsdp_runner import plan
from hsdp_runner.core.choices import AC
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.models import norm_rope
from hsdp_runner.models.base import model_spec
from hsdp_runner.models.norm_rope import RMSNormFunction
from hsdp_runner.planner import matmul_shapes, precision_cost, traffic
from hsdp_runner.planner.step_time import step_flops, step_time

H100 = dict(gpus_per_node=8, nodes=1, peak_tflops=1000.0, float8_peak_tflops=2000.0)
FSDP8 = ParallelDims(dp_replicate=1, dp_shard=8, cp=1, tp=1, world_size=8, ranks_per_node=8)


def _cfg(*overrides):
    return plan.compose(["model=llama3_debug", "trainer.global_batch_size=8", *overrides])


def test_kernel_boundaries_decide_what_moves():
    """(x + y) * 2 on 1,000 fp32 elements: eager, two kernels (read x, y; write s; read s;
    write out: 5 x 4 kB); compiled, one (read x, y; write out: 3 x 4 kB)."""
    x, y = (torch.ones(1000, device="meta") for _ in range(2))
    trace = traffic._Trace()
    with trace:
        (x + y) * 2
    assert traffic._moved(trace, compiled=False)["forward"] == 5 * 4000
    assert traffic._moved(trace, compiled=True)["forward"] == 3 * 4000


def test_a_norm_is_priced_as_torchs_fused_kernels_on_a_gpu():
    """RMSNorm over 64 bf16 channels of 16 rows, traced as a GPU runs it: forward one fused
    kernel (read x 2,048 B; write the normalised value 2,048 B and the fp32 rstd 64 B) and the
    weight's multiply (read both, 2,048 + 128 B; write the output 2,048 B); backward one
    kernel (read the gradient, x, rstd, weight; write both gradients). Op by op the forward
    alone is six kernels; afterwards the trace's stand-ins are gone."""
    x = torch.ones(16, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with traffic._kernels_of("cuda") as trace:
        out = RMSNormFunction.apply(x, weight, 1e-6)
        trace.phase = "backward"
        torch.autograd.grad(out, (x, weight), torch.ones_like(out))
    moved = traffic._moved(trace, compiled=False)
    assert moved["forward"] == 2048 + 2048 + 64 + 2048 + 128 + 2048
    # ones_like writes the seed gradient (a free op: not counted); the kernel reads it, x,
    # rstd and weight and writes grad x and grad weight.
    assert moved["backward"] == 2048 + 2048 + 64 + 128 + 2048 + 128
    assert norm_rope.FUSED_NORM_DEVICES == {"cuda"}
    assert norm_rope.fused_rms_norm is not traffic._one_kernel_rms_norm
    # A CPU job runs the norm op by op (no fused kernels there): priced so.
    x.grad = None
    with traffic._kernels_of("cpu") as trace:
        RMSNormFunction.apply(x, weight, 1e-6)
    assert traffic._moved(trace, compiled=False)["forward"] > 3 * moved["forward"]


def test_traced_bytes_are_linear_in_tokens():
    """The two-token-count fit predicts a third count exactly (activations grow with tokens,
    weight casts with forwards)."""
    cfg = _cfg("precision=float8")
    fields = traffic.model_fields(cfg.model)
    fields["seq_len"] = 1
    key = traffic.json.dumps(fields, sort_keys=True, default=str)
    fit = traffic._traffic(key, "tensorwise", True)
    one, two = (traffic._trace_model(key, "tensorwise", n, 48, True) for n in (1, 2))
    per_block_forward = two["forward"] - one["forward"]
    assert fit.bytes("block_forward", 48) == pytest.approx(
        per_block_forward * cfg.model.n_layers, rel=1e-9
    )


def _hw(cfg) -> float:
    return step_flops(cfg.model, cfg.trainer, cfg.parallel.ac, 8)[1]


def test_compile_cuts_the_memory_bound_time_and_not_the_matmuls():
    cluster = fake_cluster(**H100)
    hw = _hw(_cfg("precision=bf16"))
    eager = precision_cost.compute_seconds(_cfg("precision=bf16"), FSDP8, cluster, hw)
    compiled = precision_cost.compute_seconds(
        _cfg("precision=bf16", "parallel.compile=true"), FSDP8, cluster, hw
    )
    for part in ("matmul", "attention"):
        assert compiled[part] == eager[part] > 0, part
    assert 0 < compiled["memory"] < eager["memory"]
    # The debugging backends fuse nothing: priced as eager.
    for backend in ("aot_eager", "eager"):
        unfused_run = precision_cost.compute_seconds(
            _cfg("precision=bf16", "parallel.compile=true", f"parallel.compile_backend={backend}"),
            FSDP8,
            cluster,
            hw,
        )
        assert unfused_run == eager, backend
    # In the blocks (compiled); the embedding, final norm and loss stay eager in both.
    cfg = _cfg("precision=bf16")
    fused, unfused = (traffic.traffic(cfg.model, cfg.precision, c) for c in (True, False))
    # (Eager, the norms already run as torch's fused kernels and RoPE as two kernels a
    # direction, ``common._rotate``: compile saves the rest, about 40% of a block's bytes at
    # llama3_debug's width; seen 0.59 forward and 0.63 backward, 0.47 and 0.53 when RoPE was
    # nine kernels op by op.)
    for part in ("block_forward", "block_backward"):
        assert 0 < fused.bytes(part, 1024) < 0.65 * unfused.bytes(part, 1024), part
    assert fused.rest == unfused.rest


def test_attention_is_priced_at_the_full_count_on_a_gpu_and_a_cpu():
    """Attention's time is the full-square count the runner's FLOPs hold (every query against
    every key) at peak x efficiency, on a GPU as on a CPU: a GPU's causal kernel computes about
    half of them at a lower efficiency than a GEMM, and the full count at a GEMM's efficiency
    stands for both until attention's own efficiency is measured (the module docstring)."""
    cfg = _cfg("precision=bf16", "model.seq_len=32768")
    hw = _hw(cfg)
    gpu = precision_cost.compute_seconds(cfg, FSDP8, fake_cluster(**H100), hw)
    cpu = precision_cost.compute_seconds(cfg, FSDP8, fake_cluster(**H100, device="cpu"), hw)
    counted = hw - sum(g.flops for g in matmul_shapes.step_gemms(cfg, FSDP8))
    assert counted > 0.5 * hw  # long sequences: attention is most of the count
    full = counted / (1000e12 * 0.5)  # peak 1,000 TFLOP/s x efficiency 0.5
    assert gpu["attention"] == pytest.approx(full) and cpu["attention"] == pytest.approx(full)


def test_float8_runs_the_block_linears_at_the_float8_peak():
    """llama3_debug: every block linear is aligned, so all their FLOPs (forward, backward and
    selective AC's recompute) move to the float8 peak; attention and the output layer stay.
    Memory bandwidth out of the way (no SM figure: FLOPs at peak x efficiency)."""
    cluster = fake_cluster(**{**H100, "memory_gbps": 1e9})
    for ac in ("none", "selective"):
        bf16 = _cfg("precision=bf16", "parallel.compile=true", f"parallel.ac={ac}")
        f8 = _cfg("precision=float8", "parallel.compile=true", f"parallel.ac={ac}")
        spec, tokens = model_spec(f8.model), 8 * f8.model.seq_len / 8  # a rank's tokens
        block_weights = spec.count_params()["matmul"] - spec.vocab_size * spec.dim
        recompute = spec.selective_recompute_flops_per_token() if ac == "selective" else 0.0
        f8_flops = (6 * block_weights + recompute) * tokens
        parts = precision_cost.compute_seconds(f8, FSDP8, cluster, _hw(bf16))
        assert parts["float8_matmul"] == pytest.approx(f8_flops / (2000e12 * 0.5))
        output_layer = 6 * spec.vocab_size * spec.dim * tokens
        assert parts["matmul"] == pytest.approx(output_layer / (1000e12 * 0.5))
        bf16_parts = precision_cost.compute_seconds(bf16, FSDP8, cluster, _hw(bf16))
        assert parts["attention"] == pytest.approx(bf16_parts["attention"])
        assert parts["attention"] > 0


def test_float8_pays_at_8b_width_but_not_at_256():
    """Its casts cost memory traffic per token and per weight, its matmuls save FLOPs: at
    Llama 8B's width float8 shortens the compute, at llama3_debug's (256) it lengthens it."""
    cluster = fake_cluster(**{**H100, "memory_gbps": 3350.0})

    def compute(*overrides):
        cfg = plan.compose(["trainer.global_batch_size=64", "parallel.compile=true", *overrides])
        return step_time(cfg, FSDP8, cluster)["compute_s"]

    big = ["model=llama3_8b", "model.n_layers=2", "model.seq_len=2048"]
    assert compute(*big, "precision=float8") < compute(*big, "precision=bf16")
    small = ["model=llama3_debug"]
    assert compute(*small, "precision=float8") > compute(*small, "precision=bf16")


def test_float8_on_a_device_without_a_float8_peak_names_the_key():
    cluster = fake_cluster(**{**H100, "float8_peak_tflops": None, "device": "NVIDIA A100"})
    with pytest.raises(ConfigError, match="cluster.float8_peak_tflops"):
        precision_cost.compute_seconds(_cfg("precision=float8"), FSDP8, cluster, 1e12)


def test_grouped_expert_matmuls_move_no_bytes_between_matmuls():
    """The experts' grouped matmuls (``torch._grouped_mm``) are priced as FLOPs
    (``expert_matmul``), so the work between matmuls must not count their operands: moe_tiny's
    MoE block (the second block: the first is dense) would otherwise read its experts' weights
    (3 x 8 experts x 32 x 64 in bf16) in every forward and twice in every backward."""
    cfg = plan.compose(["model=moe_tiny", "precision=bf16"])
    moved = traffic.traffic(cfg.model, cfg.precision, compiled=False)
    experts = 3 * cfg.model.n_experts * cfg.model.expert_ffn_dim * cfg.model.dim * 2
    per_forward = moved.block_forward[1] / cfg.model.n_layers
    per_backward = moved.block_backward[1] / cfg.model.n_layers
    assert per_forward < experts / 10 and per_backward < experts / 10, (per_forward, experts)


@pytest.mark.parametrize("dense", [0, 1, 2, 3])
def test_traffic_of_a_model_with_dense_and_moe_blocks_counts_each_kind(dense):
    """A model of 4 blocks, the first ``dense`` of them dense and the rest MoE: the per-block
    traffic fitted from short traces (blocks + the rest, at two token counts) equals what the
    whole model's own trace moves at a third count, whichever kind its first blocks are."""
    cfg = plan.compose(["model=moe_tiny", "model.n_layers=4", f"model.n_dense_layers={dense}"])
    moved = traffic.traffic(cfg.model, cfg.precision, compiled=False)
    fields = traffic.model_fields(cfg.model)
    key = traffic.json.dumps({**fields, "seq_len": 1}, sort_keys=True, default=str)
    whole = traffic._trace_model(key, "none", 4, 48, False)
    fitted = sum(moved.bytes(part, 48) for part in ("block_forward", "block_backward", "rest"))
    assert fitted == pytest.approx(sum(whole.values()), rel=1e-6)


@pytest.mark.parametrize("ac", [AC.moe, AC.moe_act])
def test_the_moe_recompute_is_traced_as_backwards_work_of_each_moe_block(ac):
    """``parallel.ac=moe`` reruns each MoE block's norm and MoE layer in backward, as the job's
    build does, and ``moe_act`` its experts' activation: the traced forward is unchanged,
    backward grows by the same bytes and launches for each MoE block and by none for a dense
    one (4 blocks, 3 or 0 of them dense), and by less than a whole block's forward (attention
    is not run again). moe_act's activation is three kernels (the SiLU, the product, the
    weight in place), each reading and writing (rows, hidden) rows."""
    growth = {}
    for dense in (3, 0):
        cfg = plan.compose(["model=moe_tiny", "model.n_layers=4", f"model.n_dense_layers={dense}"])
        kept, rerun = (
            traffic.traffic(cfg.model, cfg.precision, False, "cuda", 1, a) for a in (AC.none, ac)
        )
        assert rerun.block_forward == kept.block_forward
        growth[4 - dense] = (
            rerun.bytes("block_backward", 48) - kept.bytes("block_backward", 48),
            rerun.launches["block_backward"] - kept.launches["block_backward"],
            kept.bytes("block_forward", 48) / cfg.model.n_layers,
        )
    one, four = growth[1], growth[4]
    assert four[0] == pytest.approx(4 * one[0], rel=1e-6) and four[1] == 4 * one[1] > 0
    assert 0 < four[0] / 4 < four[2]
    if ac is AC.moe_act:
        assert one[1] == 3


def test_the_loss_in_the_logits_dtype_is_traced_as_the_job_runs_it():
    """``trainer.loss_fp32=false``: the trace's loss runs on the bf16 logits, as the job's:
    the blocks move what they moved, the rest 28 bytes less per token and logit (the fp32 copy
    and its gradient's cast back, 6 + 6; the log-softmax's and its backward's reads and writes
    at 2 bytes instead of 4, 4 + 6; the NLL's read and its gradient's write, 2 + 2)."""
    cfg = plan.compose(["model=llama3_tiny", "precision=bf16"])
    fp32, in_bf16 = (
        traffic.traffic(cfg.model, cfg.precision, False, "cuda", 1, AC.none, loss_fp32)
        for loss_fp32 in (True, False)
    )
    assert (in_bf16.block_forward, in_bf16.block_backward) == (
        fp32.block_forward,
        fp32.block_backward,
    )
    per_logit = (fp32.rest[0] - in_bf16.rest[0]) / cfg.model.vocab_size
    assert 27.5 < per_logit < 28.5, per_logit
