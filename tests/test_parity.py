"""`hsdp_runner.parity`: every layout trains the same model as a single process.

One parity run (all presets, 20 steps, fp32, tiny model) is shared by the tests below; they
also check that each preset trained (loss down, metrics, logs) through the real launch path.
"""

import subprocess
import sys

import pytest

from conftest import REPO, TINY, cli_env, read_job, run_cli

pytestmark = pytest.mark.multiprocess

WORLD = {"single": 1, "ddp": 2, "fsdp": 4, "hsdp": 4, "tp": 2, "fsdp_tp": 4, "hsdp_tp": 8}
METRIC_KEYS = {"step", "loss", "grad_norm", "step_time_s", "tps_per_device", "tps_global",
               "tflops", "mfu", "mem_peak_gib"}
STEPS = 20


def run_parity(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "hsdp_runner.parity", *args], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=timeout)


def rel_diffs(a, b, key="loss"):
    return [abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b)]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    result = run_parity("--steps", str(STEPS), "--out", str(out), "model=llama3_tiny")
    return out, result


def test_every_layout_matches_single_process_within_1e5(parity):
    out, result = parity
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (out / "parity.md").read_text()
    for layout in WORLD:
        assert f"| {layout} | {WORLD[layout]} |" in table and table.count("PASS") == len(WORLD)
    base, _ = read_job(out / "single")
    for layout in WORLD:
        records, summary = read_job(out / layout)
        assert len(records) == STEPS
        assert max(rel_diffs(records, base)) <= 1e-5, layout
        assert max(rel_diffs(records, base, "grad_norm")) <= 1e-5, layout
        assert abs(summary["eval_loss"] - read_job(out / "single")[1]["eval_loss"]) <= 1e-5 * summary["eval_loss"]


@pytest.mark.parametrize("layout", list(WORLD))
def test_preset_trained_through_the_launch_path(parity, layout):
    out, _ = parity
    records, summary = read_job(out / layout)
    assert METRIC_KEYS <= set(records[0])
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert summary["status"] == "completed" and summary["world_size"] == WORLD[layout]
    assert summary["mesh_dim_names"] == ["dp_replicate", "dp_shard", "tp"]
    assert summary["median_tps_global"] > 0 and summary["steady_steps"] == STEPS - 2
    assert len(list((out / layout / "logs").glob("rank*.log"))) == WORLD[layout]


def test_fsdp_and_hsdp_are_identical_at_step_one(parity):
    out, _ = parity
    fsdp, _ = read_job(out / "fsdp")
    hsdp, _ = read_job(out / "hsdp")
    assert fsdp[0]["loss"] == hsdp[0]["loss"]
    assert fsdp[0]["grad_norm"] == pytest.approx(hsdp[0]["grad_norm"], rel=1e-6)


def test_ddp_replicate_equals_hsdp_with_shard_size_one(parity, job_dir):
    out, _ = parity
    result = run_cli(job_dir, *TINY, "parallel=ddp", "parallel.ddp_impl=fully_shard",
                     f"trainer.steps={STEPS}")
    assert result.returncode == 0, result.stderr[-3000:]
    replicate, _ = read_job(out / "ddp")
    hsdp_n1, summary = read_job(job_dir)
    assert summary["dp_mode"] == "ddp"
    assert max(rel_diffs(hsdp_n1, replicate)) <= 1e-6
    assert max(rel_diffs(hsdp_n1, replicate, "grad_norm")) <= 1e-6


def test_bf16_stays_within_2e2_of_fp32(parity, job_dir):
    out, _ = parity
    result = run_cli(job_dir, *TINY, "parallel=hsdp", "precision=bf16", f"trainer.steps={STEPS}")
    assert result.returncode == 0, result.stderr[-3000:]
    bf16, _ = read_job(job_dir)
    fp32, _ = read_job(out / "single")
    assert max(rel_diffs(bf16, fp32)) <= 2e-2
    assert max(rel_diffs(bf16, fp32)) > 0  # bf16 really ran in bf16


@pytest.mark.parametrize("args, words", [
    (["--rtol", "-1"], "--rtol=-1.0 must be a positive number"),
    (["--rtol", "tight"], "--rtol='tight' is not a number"),
    (["--layouts", "fsdp,zero3"], "unknown layout(s) zero3"),
    (["--layouts", "fsdp", "launcher.nproc_per_node=3"], "world size is 3"),
])
def test_bad_parity_input_is_one_clear_error_before_launch(args, words, tmp_path):
    result = run_parity(*args, "--out", str(tmp_path / "p"), "model=llama3_tiny", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert words in result.stderr
    assert not (tmp_path / "p" / "single" / "logs").exists()
