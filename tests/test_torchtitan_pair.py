"""benchmarks/torchtitan_pair.py and benchmarks/torchtitan_job.py without torchtitan or a GPU:
the torchtitan flavor has the runner's shape and parameter count, torchtitan's metrics are read
from its per-step file and, without it, from its console lines, the runner's job is a valid
runner configuration, and without a GPU the benchmark says so and exits 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hsdp_runner.config.compose import compose
from hsdp_runner.runtime import prelaunch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import torchtitan_job  # noqa: E402  (benchmarks/torchtitan_job.py)
import torchtitan_pair  # noqa: E402  (benchmarks/torchtitan_pair.py)

SHAPE = SimpleNamespace(
    **{k: v for k, v in torchtitan_pair.SHAPE.items()}, layers=16, metrics_jsonl="m.jsonl"
)

# torchtitan 0.2.2's console lines (components/metrics.py, train.py) with colours off.
TITAN_LOG = """\
[titan] 2026-11-27 16:54:00,641 - root - INFO - Model llama3_pair pair size: 1,498,482,688 total parameters
[titan] 2026-11-27 16:54:01,066 - root - INFO - Peak FLOPS used for computing MFU: 9.890e+14
[titan] 2026-11-27 16:54:01,910 - root - INFO - step:  1  loss: 12.07245  grad_norm:  1.4513  memory: 30.00GiB(37.50%)  tps: 1,101  tflops: 9.05  mfu: 0.92%
[titan] 2026-11-27 16:54:03,424 - root - INFO - step:  2  loss: 11.06645  grad_norm:  1.4495  memory: 31.50GiB(39.38%)  tps: 30,085  tflops: 247.10  mfu: 24.98%
[titan] 2026-11-27 16:54:04,595 - root - INFO - step:  3  loss: 10.03419  grad_norm:  1.4481  memory: 31.50GiB(39.38%)  tps: 30,109  tflops: 247.30  mfu: 25.00%
[titan] 2026-11-27 16:54:05,199 - root - INFO - step:  4  loss:  9.08146  grad_norm:  1.4508  memory: 31.25GiB(39.06%)  tps: 30,212  tflops: 248.14  mfu: 25.09%
"""


def test_torchtitan_flavor_has_the_runners_ffn_width_and_parameter_count():
    kwargs = torchtitan_job.flavor_kwargs(SHAPE)
    assert (kwargs["ffn_dim_multiplier"], kwargs["multiple_of"]) == (1.5, 256)  # Llama 3.2 1B
    width = torchtitan_job.titan_ffn_hidden(2048, 1.5, 256)
    assert width == torchtitan_pair.SHAPE["ffn_hidden"] == 8192
    # torchtitan's llama3 at this flavor: embedding, 16 x (wq wk wv wo w1 w2 w3, 2 norms), norm,
    # output (counted on the meta device with torchtitan 0.2.2).
    assert torchtitan_pair.runner_params(16, 2048) == 1_498_482_688


def test_torchtitan_console_lines_give_medians_after_warmup(tmp_path):
    figures = torchtitan_pair.titan_figures(tmp_path, TITAN_LOG, warmup=1)
    assert figures["tps"] == 30109.0 and figures["tflops"] == 247.3
    assert abs(figures["mfu"] - 0.25) < 1e-12
    assert figures["mem_peak_gib"] is None and figures["mem_reserved_gib"] == 31.5
    assert figures["params"] == 1_498_482_688 and figures["peak_tflops"] == 989.0
    assert figures["steps_logged"] == 4 and figures["final_loss"] == 9.08146


def test_torchtitan_metrics_file_wins_over_console_lines(tmp_path):
    records = [
        {"throughput(tps)": 100.0 * s, "tflops": 1.0 * s, "mfu(%)": 10.0 * s}
        | {"loss_metrics/global_avg_loss": 5.0 - s, "memory/max_active(GiB)": 20.0 + s}
        | {"memory/max_reserved(GiB)": 30.0 - s, "step": s}
        for s in range(1, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = torchtitan_pair.titan_figures(tmp_path, TITAN_LOG, warmup=2)
    assert (figures["tps"], figures["tflops"], figures["mfu"]) == (400.0, 4.0, 0.4)
    assert (figures["mem_peak_gib"], figures["mem_reserved_gib"]) == (25.0, 29.0)
    assert figures["params"] == 1_498_482_688  # still from the console


@pytest.mark.parametrize("profile", [False, True])
def test_both_tools_get_the_same_job(tmp_path, profile):
    args = torchtitan_pair.parse_args(["--steps", "20"] + (["--profile"] if profile else []))
    runner = torchtitan_pair.runner_command(args, True, tmp_path / "job")
    assert "device=cuda" in runner  # validated here on this machine's CPU
    overrides = [a if a != "device=cuda" else "device=cpu" for a in runner[4:]]
    dims = prelaunch.validate(compose(overrides), tmp_path)
    assert dims.world_size == 1
    titan = torchtitan_pair.titan_command(args, True, tmp_path / "titan")
    ours, theirs = titan[titan.index("--") - 9 : titan.index("--")], titan[titan.index("--") + 1 :]
    parsed, rest = torchtitan_job.parse([*ours, "--", *theirs])
    assert (parsed.layers, parsed.ffn_hidden, parsed.vocab, parsed.mp) == (16, 8192, 128256, "fsdp")
    for flag in ("selective_ac_option=op", "compile.enable", "local_batch_size=4", "seq_len=2048"):
        assert any(a.endswith(flag) for a in rest), flag
    assert "parallel.ac=selective" in runner and "parallel.compile=true" in runner
    # With --profile both trace step 18: the runner's window, torchtitan's profile_freq
    # (it traces each multiple of it).
    assert ("profile.start_step=18" in runner) == profile == ("--profiling.profile_freq=18" in rest)


@pytest.mark.multiprocess  # two short Python processes
def test_a_failed_job_is_recorded_not_raised(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    result = torchtitan_pair.run_job("torchtitan", cmd, {}, tmp_path, 30, lambda log: {})
    assert result["error"].startswith("exit 3") and "boom" in result["error"]
    slow = [sys.executable, "-c", "import time; time.sleep(5)"]
    result = torchtitan_pair.run_job("torchtitan", slow, {}, tmp_path, 0.5, lambda log: {})
    assert "timed out" in result["error"]


def test_without_a_gpu_it_says_so_exits_0_and_writes_why(monkeypatch, capsys, tmp_path):
    import hsdp_runner.distributed.hardware as hardware

    monkeypatch.setattr(hardware, "cuda_available", lambda: False)
    out = tmp_path / "pair.json"
    assert torchtitan_pair.main(["--out", str(out)]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == []


def test_trace_kernels_sums_a_steps_kernels_by_kind(tmp_path):
    """Two GEMMs, a flash kernel, a Triton kernel and a copy over a 10 ms span with 4 ms of
    kernels: summed by kind, 60% idle, the top kernel first; CPU events left out."""
    import trace_kernels

    events = [
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 2000, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "ts": 4000, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_mul_0", "ts": 6000, "dur": 500},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 9500, "dur": 500},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99999},
    ]
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    found = trace_kernels.compare_traces({"a": path})["a"]
    assert found["kinds"] == {
        "gemm": [2.0, 2],
        "attention": [1.0, 1],
        "triton": [0.5, 1],
        "copy/fill": [0.5, 1],
    }
    assert found["span_ms"] == 10.0 and abs(found["idle_share"] - 0.6) < 1e-12
    assert found["top"][0] == ["sm90_xmma_gemm_bf16", 2.0, 2]
