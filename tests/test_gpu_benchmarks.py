"""The GPU lease's scripts on this CPU: their no-GPU exits, and the held-out table read from a
lease's recorded results (benchmarks/results/h200_2026-11-27)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_kernels  # noqa: E402  (benchmarks/gpu_kernels.py)
import planner_gpu_heldout  # noqa: E402  (benchmarks/planner_gpu_heldout.py)

RESULTS = REPO / "benchmarks" / "results" / "h200_2026-11-27"


def test_held_out_table_of_the_h200_lease(capsys):
    """The six jobs' predictions as run against the H200's measurements, as docs/planner.md
    quotes them, the step-time median now over the five held out (28.4%; 26.7% over all six
    when the first was held out too), the fitted job's step marked, memory over all six
    (4.9%)."""
    rows = json.loads((RESULTS / "heldout.json").read_text())
    planner_gpu_heldout.predicted_table(rows)
    out = capsys.readouterr().out
    assert "step_time_s: median |error| 28.4% over 5 held-out jobs" in out
    assert "mem_gib: median |error| 4.9% over 6 held-out jobs" in out
    assert (
        "llama8b_8blocks_bf16_full      step_time_s predicted 1.741 measured 1.159 (+50.2%)" in out
    )
    assert (
        "llama1b_bf16_ac_none           step_time_s predicted 0.1931 measured 0.1652 (+16.9%) fitted"
        in out
    )


def test_every_held_out_job_has_its_plan_command_and_the_lease_script_parses():
    assert list(planner_gpu_heldout.JOBS)[0] == "llama1b_bf16_ac_none"  # a short lease keeps it
    for overrides in planner_gpu_heldout.JOBS.values():
        assert any(o.startswith("model=") for o in overrides)
        assert any(o.startswith("precision=") for o in overrides)
    lease = REPO / "benchmarks" / "gpu_lease.sh"
    assert subprocess.run(["bash", "-n", str(lease)]).returncode == 0


def test_kernel_benchmark_without_a_gpu_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(gpu_kernels, "cuda_available", lambda: False)
    assert gpu_kernels.main(["--part", "norm"]) == 0
    assert "no CUDA GPU torch can use" in capsys.readouterr().out


def test_matmul_prices_come_from_the_named_cluster_preset():
    """The matmul part prices each GEMM with the preset's device (H200: 132 SMs, its peak and
    efficiency), the same ``matmul_time`` the planner uses."""
    matmul_time, device = gpu_kernels._matmul_device("h200")
    assert device.sms == 132 and device.peak_flops == 989.5e12
    big = matmul_time.seconds(matmul_time.Gemm(m=8192, n=8192, k=8192), device)
    assert 2 * 8192**3 / big / device.peak_flops < device.efficiency + 1e-9


def test_a_llama_block_launches_75_kernels_a_step_as_cuda_runs_it():
    """benchmarks/block_ops.py's count of the runner's Llama block (forward / selective-AC
    recompute / backward, norms as torch's fused CUDA kernels): 24 / 18 / 33. More means a
    change added eager launches a GPU pays for (torchtitan 0.2.2's block: 20 / 15 / 33)."""
    import block_ops

    modules = block_ops.report({"runner": block_ops.runner_block})["runner"]["modules"]
    passes = [
        sum(row.get(part, 0) for row in modules.values())
        for part in ("forward", "recompute", "backward")
    ]
    assert passes == [24, 18, 33], modules
