"""The measured kernel rates the planner prices GPUs with (planner/kernel_rates.py), derived
again from the measurement files they cite, and how they price a step: a large GEMM at the
measured GEMM efficiency, attention at the share its tokens reached, every launch's idle on
top of the kernels."""

import json
import statistics
from pathlib import Path

import pytest
import torch
from clusters import fake_cluster

from hsdp_runner import plan
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.planner import attention_time, kernel_rates, matmul_time, precision_cost, traffic
from hsdp_runner.planner.matmul_time import Gemm
from hsdp_runner.planner.step_time import step_flops

REPO = Path(__file__).resolve().parents[1]
KERNELS = json.loads((REPO / kernel_rates.KERNELS_FILE).read_text())
H200_PEAK = 989.5e12
H100 = fake_cluster(device="NVIDIA H100 80GB HBM3", peak_tflops=989.5, compute_efficiency=1.0)


def test_gemm_efficiency_is_the_median_of_the_measured_large_gemms():
    """Per measured GEMM: the tile and wave model's time at full peak over the measured time;
    the median over those whose output dims are both >= 2,048."""
    device = matmul_time.MatmulDevice(H200_PEAK, None, 1.0, 4.8e12, 2, 132, (128, 128, 64))
    shares = [
        matmul_time.seconds(Gemm(r["m"], r["n"], r["k"]), device) / (r["ms"] / 1e3)
        for r in KERNELS["matmul"]
        if min(r["m"], r["n"]) >= 2048
    ]
    assert len(shares) == 20
    assert kernel_rates.gemm_efficiency("sm90") == pytest.approx(
        statistics.median(shares), abs=5e-4
    )


def test_attention_table_is_the_measured_one():
    for row in KERNELS["attention"]:
        share = kernel_rates.attention_share("sm90", row["causal"], row["tokens"])
        assert share == pytest.approx(row["share_of_peak"], abs=5e-4)


def test_launch_cost_is_the_profiled_idle_time_per_launch():
    """The runner's eager step unprofiled (tokens over tokens/s) less its kernels' busy time,
    over its launches."""
    profile = json.loads((REPO / kernel_rates.PROFILE_FILE).read_text())
    row, kernels = profile["rows"][0]["runner"], profile["kernels"][0]["runner"]["kinds"]
    settings = profile["settings"]
    step = settings["batch"] * settings["seq_len"] / row["tps"]
    busy = sum(ms for ms, _ in kernels.values()) / 1e3
    launches = sum(count for _, count in kernels.values())
    assert kernel_rates.launch_seconds("sm90") == pytest.approx((step - busy) / launches, rel=5e-3)


def test_an_a100_inherits_the_h200_measurement():
    assert kernel_rates.gemm_efficiency("sm80") == kernel_rates.gemm_efficiency("sm90")
    with pytest.raises(KeyError, match="sm70"):
        kernel_rates.gemm_efficiency("sm70")


def test_a_large_gemm_is_priced_at_the_measured_efficiency_and_a_thin_one_below():
    device = matmul_time.device_of(H100, dtype_bytes=2)
    measured = kernel_rates.gemm_efficiency("sm90")
    # 64 x 112 tiles fill 54.3 of 55 waves: within 2% of the tiles' rate.
    assert matmul_time.efficiency(Gemm(8192, 14336, 4096), device) == pytest.approx(
        measured, rel=0.02
    )
    assert matmul_time.efficiency(Gemm(64, 4096, 4096), device) < 0.5 * measured


def test_attention_at_8k_tokens_runs_six_times_the_rate_of_1k():
    flops = 1e15
    short = attention_time.seconds(flops, H100, seq_len=1024, cp=1)
    long = attention_time.seconds(flops, H100, seq_len=8192, cp=1)
    assert short / long == pytest.approx(0.916 / 0.142, rel=1e-3)
    assert long == pytest.approx(flops / (H200_PEAK * 0.916), rel=1e-3)


def test_a_context_parallel_chunk_mixes_the_causal_and_full_shares():
    """cp 8 over 65,536 tokens: chunks of 8,192, 1/8 of the count causal (0.916), the rest
    full chunks of which the mask skips half (2 x 0.512 at the count)."""
    share = attention_time.counted_share("sm90", 65536, 8)
    assert share == pytest.approx(1 / (1 / 8 / 0.916 + 7 / 8 / 1.024), rel=1e-3)


def test_a_cpu_prices_attention_at_its_peak_times_the_efficiency():
    cpu = fake_cluster(device="cpu", peak_tflops=1.0, compute_efficiency=0.5)
    assert attention_time.seconds(1e12, cpu, seq_len=1024, cp=1) == pytest.approx(2.0)


def test_launches_count_every_eager_op_and_each_fused_run():
    """x @ w, then (y + 1) * 2: eager three kernels (the matmul, the add, the multiply),
    compiled two (the matmul; the add and multiply fused)."""
    x, w, y = (torch.ones(8, 8, device="meta") for _ in range(3))
    trace = traffic._Trace()
    with trace:
        x @ w
        (y + 1) * 2
    assert traffic._launches(trace, compiled=False)["forward"] == 3
    assert traffic._launches(trace, compiled=True)["forward"] == 2


@pytest.mark.parametrize(
    "model, batch, launch_bound",
    [("llama3_debug", 8, True), ("llama3_8b", 8, False)],
)
def test_every_step_pays_its_launches_idle_on_top_of_its_kernels(model, batch, launch_bound):
    """On 8 H100s, llama3_debug's kernels are microseconds long and Llama 3 8B's milliseconds:
    in both the launch part is the trace's launches at the measured idle per launch, added to
    the kernels' parts (the profile that measured it had kernels outlasting their launches,
    and a floor under the step would have priced it at zero there); the small step is mostly
    launches, the large one mostly kernels."""
    cfg = to_run_config(plan.compose([f"model={model}", f"trainer.global_batch_size={batch}"]))
    dims = ParallelDims(dp_replicate=1, dp_shard=8, cp=1, tp=1, world_size=8, ranks_per_node=8)
    cluster = fake_cluster(device="NVIDIA H100 80GB HBM3", gpus_per_node=8, nodes=1)
    hw = step_flops(cfg.model, cfg.trainer, cfg.parallel.ac, 8)[1]
    parts = precision_cost.compute_seconds(cfg, dims, cluster, hw)
    launches = precision_cost.launch_seconds(cfg, cluster)
    assert launches / kernel_rates.launch_seconds("sm90") > 50 * cfg.model.n_layers
    assert parts["launch"] == pytest.approx(launches)
    kernels = sum(v for k, v in parts.items() if k != "launch")
    assert (launches > kernels) is launch_bound
    assert launches > 0 and kernels > 0
