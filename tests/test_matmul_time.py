"""The planner's matmul time (planner/matmul_time.py) and the matmuls it prices
(planner/matmul_shapes.py): tiles, waves and the memory roofline on hand-computed cases, the
shapes' FLOPs equal to the runner's count, and expert matmuls that shrink run less efficiently."""

import pytest
from clusters import fake_cluster

from hsdp_runner import plan
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.planner import kernel_rates, matmul_shapes, matmul_time, precision_cost
from hsdp_runner.planner.cluster import resolve
from hsdp_runner.planner.matmul_time import Gemm
from hsdp_runner.planner.step_time import step_flops
from hsdp_runner.train.metrics import lookup_sm_count

# Round figures: 1,000 TFLOP/s x 0.5, 3,000 GB/s; an H100's 132 SMs and 128 x 128 x 64 tiles.
# The tiles run at sm90's measured GEMM efficiency x compute_efficiency: 0.5 in all.
H100 = fake_cluster(
    device="NVIDIA H100 80GB HBM3",
    peak_tflops=1000.0,
    compute_efficiency=0.5 / kernel_rates.gemm_efficiency("sm90"),
    memory_gbps=3000.0,
)
DEVICE = matmul_time.device_of(H100, dtype_bytes=2)
WAVE_8192 = 132 * 2 * 128 * 128 * 8192 / 500e12  # one wave of tiles 8,192 deep: 70.9 us


def test_the_device_facts_name_sms_and_architecture():
    assert lookup_sm_count("NVIDIA H100 80GB HBM3") == (132, "sm90")
    assert lookup_sm_count("NVIDIA A100-SXM4-40GB") == (108, "sm80")
    assert lookup_sm_count("NVIDIA H200") == (132, "sm90")
    assert lookup_sm_count("cpu") is None and lookup_sm_count("NVIDIA H200 NVL") is None
    assert (DEVICE.sms, DEVICE.tile) == (132, (128, 128, 64))


def test_a_one_row_gemm_is_memory_bound():
    """(1, 4096, 4096): 32 output tiles, each padded from 1 row to 128. The library splits K
    to spread them over the SMs, and then reading the 4096 x 4096 weight is what takes time:
    (4096 + 4096 x 4096 + 4096) x 2 bytes at 3 TB/s = 11.2 us, far below peak."""
    gemm = Gemm(1, 4096, 4096)
    weight_read = (4096 + 4096 * 4096 + 4096) * 2 / 3000e9
    assert matmul_time.memory_seconds(gemm, DEVICE) == pytest.approx(weight_read)
    assert matmul_time.seconds(gemm, DEVICE) == pytest.approx(weight_read, rel=1e-2)
    assert matmul_time.compute_seconds(gemm, DEVICE) > 3 * weight_read  # unsplit: a padded wave
    assert matmul_time.efficiency(gemm, DEVICE) < 0.01


def test_133_tiles_on_132_sms_take_two_waves():
    """7 x 19 = 133 output tiles take two waves, 12 x 11 = 132 one; one row past a tile edge
    adds a whole row of tiles (13 x 11 = 143: two waves)."""
    full, one_over = Gemm(12 * 128, 11 * 128, 8192), Gemm(7 * 128, 19 * 128, 8192)
    assert matmul_time.tile_count(one_over, DEVICE.tile) == 133
    assert (matmul_time.waves(full, DEVICE), matmul_time.waves(one_over, DEVICE)) == (1, 2)
    assert matmul_time.waves(Gemm(12 * 128 + 1, 11 * 128, 8192), DEVICE) == 2
    assert matmul_time.compute_seconds(full, DEVICE) == pytest.approx(WAVE_8192)
    assert matmul_time.compute_seconds(one_over, DEVICE) == pytest.approx(2 * WAVE_8192)
    # The full wave runs at the large-GEMM rate; split-K trims the second wave, not to one.
    assert matmul_time.efficiency(full, DEVICE) == pytest.approx(0.5)
    assert WAVE_8192 * 133 / 132 < matmul_time.seconds(one_over, DEVICE) < 2 * WAVE_8192


def test_grouped_gemm_waves_count_every_group_tiles():
    """16 experts of (256, 768, 2048): 16 x 2 x 6 = 192 tiles in one launch, two waves."""
    grouped = Gemm(256, 768, 2048, groups=16)
    assert matmul_time.tile_count(grouped, DEVICE.tile) == 192
    assert matmul_time.waves(grouped, DEVICE) == 2
    assert matmul_time.best_split(grouped, DEVICE) == 1


def test_a_cpu_has_no_waves_only_the_roofline():
    cpu = matmul_time.device_of(fake_cluster(device="cpu", peak_tflops=1.0), dtype_bytes=4)
    assert cpu.sms is None
    big, thin = Gemm(1024, 1024, 1024), Gemm(1, 1024, 1024)
    assert matmul_time.seconds(big, cpu) == pytest.approx(2 * 1024**3 / 0.5e12)
    thin_bytes = (1024 + 1024 * 1024 + 1024) * 4
    assert matmul_time.seconds(thin, cpu) == pytest.approx(thin_bytes / 1000e9)


def _run(model: str, *overrides: str):
    return to_run_config(
        plan.compose([f"model={model}", "trainer.global_batch_size=8", *overrides])
    )


def _dims(tp: int = 1, ep: int = 1) -> ParallelDims:
    return ParallelDims(
        dp_replicate=1, dp_shard=8 // tp, tp=tp, world_size=8, ranks_per_node=8, ep=ep, moe=ep > 1
    )


def _attention_forward_per_token(model) -> float:
    """QK^T and AV, 4 x layers x heads x head width x seq_len (the runner's count)."""
    head = getattr(model, "head_dim", None) or model.dim // model.n_heads
    return 4.0 * model.n_layers * model.n_heads * head * model.seq_len


@pytest.mark.parametrize(
    "model,tp,ep",
    [
        ("llama3_8b", 1, 1),
        ("llama3_8b", 2, 1),
        ("gpt2_small", 1, 1),
        ("gpt2_small", 2, 1),
        ("qwen3_30b_a3b", 1, 1),
        ("qwen3_30b_a3b", 2, 2),
        ("moe_tiny", 1, 2),
        ("moe_tiny", 2, 1),
    ],
)
def test_the_shapes_sum_to_the_runners_flops(model, tp, ep):
    """The GEMMs' FLOPs plus attention equal flops_per_token x tokens (plus recompute) per
    rank: no linear lost or counted twice under TP, expert parallel or AC."""
    experts = model.startswith(("qwen3", "moe"))
    for ac in ("none", "full", "selective", *(["moe", "moe_act"] if experts else [])):
        cfg = _run(model, f"parallel.ac={ac}")
        linear = sum(g.flops for g in matmul_shapes.step_gemms(cfg, _dims(tp, ep)))
        tokens = cfg.trainer.global_batch_size * cfg.model.seq_len / 8
        passes = 4 if ac == "full" else 3  # forward, backward (x2), full AC's forward again
        attention = _attention_forward_per_token(cfg.model) * tokens * passes
        _, hardware = step_flops(cfg.model, cfg.trainer, cfg.parallel.ac, 8)
        assert linear + attention == pytest.approx(hardware, rel=1e-12), ac


def test_a_linear_runs_forward_input_grad_and_weight_grad_at_its_tp_shape():
    """llama3_8b at tp 2, 8 x 8,192 tokens over dp 4: a rank's micro-batch is 16,384 rows.
    wq (4096 -> 4096) is column-parallel: 2,048 outputs a rank; wo row-parallel: 2,048 inputs;
    the output layer (4096 -> 128,256) column-parallel: 64,128 outputs. Backward: the input's
    gradient (rows, in, out) and the weight's (out, in, rows)."""
    gemms = matmul_shapes.step_gemms(_run("llama3_8b"), _dims(tp=2))
    shapes = {(g.m, g.n, g.k) for g in gemms if g.part == "matmul"}
    rows = 8 * 8192 / 4
    assert {(rows, 2048, 4096), (rows, 4096, 2048), (2048, 4096, rows)} <= shapes  # wq
    assert {(rows, 4096, 2048), (rows, 2048, 4096), (4096, 2048, rows)} <= shapes  # wo
    assert {(rows, 64128, 4096), (rows, 4096, 64128), (64128, 4096, rows)} <= shapes  # output
    assert (4096, 64128, rows) not in shapes


def test_experts_run_one_grouped_gemm_over_the_local_experts():
    """qwen3_30b_a3b at ep 2 with the busiest rank 1.5x the mean: 64 local experts, each on
    8 x 4,096 / 8 x top_k 8 x 1.5 / 64 = 768 rows; only the experts' FLOPs grow. With the
    exchange in C chunks (``parallel.ep_chunks``; null: 2) each chunk's grouped GEMM runs on
    768 / C rows, C times: the same FLOPs."""
    balanced = matmul_shapes.step_gemms(_run("qwen3_30b_a3b"), _dims(ep=2))
    busy = matmul_shapes.step_gemms(_run("qwen3_30b_a3b", "plan.expert_imbalance=1.5"), _dims(ep=2))
    for chunks, rows in (("1", 768.0), ("null", 384.0), ("4", 192.0)):
        cfg = _run("qwen3_30b_a3b", "plan.expert_imbalance=1.5", f"parallel.ep_chunks={chunks}")
        gemms = matmul_shapes.step_gemms(cfg, _dims(ep=2))
        experts = [g for g in gemms if g.part == "expert_matmul"]
        assert {g.groups for g in experts} == {64}
        assert (rows, 768, 2048) in {(g.m, g.n, g.k) for g in experts}  # w1 forward
        assert (768, 2048, rows) in {(g.m, g.n, g.k) for g in experts}  # w1 weight gradient
        total = sum(g.flops for g in gemms if g.part == "expert_matmul")
        assert total == pytest.approx(sum(g.flops for g in busy if g.part == "expert_matmul"))

    def flops(gemms, part):
        return sum(g.flops for g in gemms if g.part == part)

    assert flops(busy, "expert_matmul") == pytest.approx(1.5 * flops(balanced, "expert_matmul"))
    assert flops(busy, "matmul") == flops(balanced, "matmul")


def test_smaller_grouped_expert_matmuls_run_at_lower_efficiency():
    """qwen3_30b_a3b on 8 H100s, 2,048 tokens a rank: without ep each of the 128 experts gets
    128 of the rank's 16,384 routed copies and reading all 128 experts' weights bounds the
    grouped matmuls; with ep 8 each of 16 local experts gets 1,024 rows and they run at the
    large-matmul rate."""
    cfg = _run("qwen3_30b_a3b", "model.seq_len=2048", "cluster=h100_sxm")
    cluster = resolve(cfg.cluster, "bfloat16")
    device = matmul_time.device_of(cluster, dtype_bytes=2)

    def expert_gemms(ep):
        return [g for g in matmul_shapes.step_gemms(cfg, _dims(ep=ep)) if g.part == "expert_matmul"]

    def expert_efficiency(ep):
        gemms = expert_gemms(ep)
        seconds = sum(matmul_time.seconds(g, device) for g in gemms)
        return sum(g.flops for g in gemms) / seconds / device.peak_flops

    def memory_bound(gemm):
        return matmul_time.memory_seconds(gemm, device) > matmul_time.compute_seconds(gemm, device)

    assert all(memory_bound(g) for g in expert_gemms(1))
    assert not any(memory_bound(g) for g in expert_gemms(8))
    small, large = expert_efficiency(1), expert_efficiency(8)
    assert large == pytest.approx(device.efficiency, rel=0.05)
    assert small < 0.95 * large


def test_compute_seconds_prices_the_experts_part_and_names_a_short_flop_count():
    cfg = _run("moe_tiny")
    dims = _dims(ep=2)
    _, hardware = step_flops(cfg.model, cfg.trainer, cfg.parallel.ac, 8)
    parts = precision_cost.compute_seconds(cfg, dims, H100, hardware)
    assert set(parts) == {"matmul", "expert_matmul", "attention", "memory", "launch"}
    assert all(parts[part] > 0 for part in ("matmul", "expert_matmul", "attention", "memory"))
    with pytest.raises(ValueError, match="step_flops"):
        precision_cost.compute_seconds(cfg, dims, H100, hardware / 2)
