"""benchmarks/moe.py and benchmarks/moe_gpu.py at tiny sizes, in-process (no timing claimed):
the block's two paths compute the same thing, every job and GPU command they would run is a
valid runner configuration, and the GPU check without a GPU says so and exits 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hsdp_runner.config.compose import compose
from hsdp_runner.runtime import prelaunch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import moe as moe_bench  # noqa: E402  (benchmarks/moe.py)
import moe_gpu  # noqa: E402  (benchmarks/moe_gpu.py)


def test_block_times_the_grouped_and_the_loop_path_of_the_same_block():
    cfg = moe_bench.preset("moe_tiny")
    figures = moe_bench.block_figures(cfg, batch=1, repeats=1, warmup=0)
    assert figures["max_abs_diff"] < 1e-5  # the same weights, the same tokens
    assert figures["grouped_ms"] > 0 and figures["loop_ms"] > 0
    # 32 tokens x top 2 copies x 3 matmuls of 64 x 32, 2 FLOPs each, backward twice forward
    assert moe_bench.expert_flops(cfg, 32) == 3 * 32 * 2 * 3 * 2 * 64 * 32


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_each_ep_job_of_the_benchmark_is_a_valid_job_on_the_same_world(ep, tmp_path):
    cmd = moe_bench.job_command("moe_debug", ep, 4, 12, 8, tmp_path / "job")
    assert cmd[1:3] == ["-m", "hsdp_runner"]
    dims = prelaunch.validate(compose(cmd[4:]), tmp_path)
    assert (dims.world_size, dims.ep, dims.dp_shard) == (4, ep, 4)
    assert dims.layout == ("fsdp_ep" if ep > 1 else "fsdp")


def test_job_figures_are_medians_after_the_warmup(tmp_path):
    records = [
        {"step": s, "loss": 6.0 - s, "tps_global": 100.0 * s, "tps_per_device": 25.0 * s}
        | {"step_time_s": 1.0 / s, "moe/load_max_over_mean": 1.0 + s}
        for s in range(1, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = moe_bench.job_figures(tmp_path, warmup=2)
    assert figures == {
        "tps_global": 400.0,
        "tps_per_device": 100.0,
        "step_time_s": 0.25,
        "loss": 1.0,
        "load": 6.0,
    }


def test_gpu_check_without_a_gpu_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(moe_gpu, "cuda_available", lambda: False)
    assert moe_gpu.main([]) == 0
    assert "no CUDA GPU torch can use here" in capsys.readouterr().out


def test_gpu_check_counts_the_grouped_matmul_flops_of_its_routing():
    cfg = moe_bench.preset("moe_tiny")
    counts = moe_gpu.routed_counts(cfg, 16, "cpu")
    assert int(counts.sum()) == 16 * cfg.top_k and counts.max() <= 16
    figures = moe_gpu.matmul_figures(cfg, 16, 1, 0, device="cpu", dtype=torch.float32)
    assert set(figures) == {"grouped forward", "loop forward", "grouped fwd+bwd", "loop fwd+bwd"}
    for case, (tflops, seconds) in figures.items():
        flops = 16 * cfg.top_k * 3 * 2 * cfg.dim * cfg.expert_ffn_dim
        flops *= 3 if case.endswith("fwd+bwd") else 1
        assert tflops == pytest.approx(flops / seconds / 1e12), case


def test_gpu_step_job_is_a_valid_one_gpu_job(monkeypatch, tmp_path):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda including_emulation=True: True)
    args = SimpleNamespace(
        model="qwen3_30b_a3b", layers=2, seq_len=2048, steps=12, batch=4, step_warmup=4
    )
    cmd = moe_gpu.step_command(args, tmp_path / "job")
    dims = prelaunch.validate(compose(cmd[4:]), tmp_path)
    assert dims.world_size == 1 and "model.n_layers=2" in cmd


def test_gpu_check_float8_part_without_a_gpu_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(moe_gpu, "cuda_available", lambda: False)
    assert moe_gpu.main(["--part", "float8", "--steps", "8", "--step-warmup", "3"]) == 0
    assert "Nothing was measured" in capsys.readouterr().out


def test_gpu_float8_step_job_is_a_valid_one_gpu_job_on_hopper(monkeypatch, tmp_path):
    """The float8 part's float8 job passes the runner's checks on a 9.0 GPU (the experts'
    float8 grouped matmul included), and differs from the bf16 one in its precision only."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda device=None: (9, 0))
    args = SimpleNamespace(
        model="qwen3_30b_a3b", layers=2, seq_len=2048, steps=8, batch=4, step_warmup=3
    )
    cmd = moe_gpu.step_command(args, tmp_path / "job", "float8")
    assert prelaunch.validate(compose(cmd[4:]), tmp_path).world_size == 1
    bf16 = moe_gpu.step_command(args, tmp_path / "job")
    assert [a for a in cmd if a not in bf16] == [
        "precision=float8",
        "precision.float8_experts=true",
    ]
