"""Every parallel preset trains end to end through the CLI and its loss goes down."""

import pytest

from conftest import TINY, read_job, run_cli

METRIC_KEYS = {"step", "loss", "grad_norm", "step_time_s", "tps_per_device", "tps_global",
               "tflops", "mfu", "mem_peak_gib"}
WORLD = {"single": 1, "ddp": 2, "fsdp": 4, "hsdp": 4, "tp": 2, "fsdp_tp": 4, "hsdp_tp": 8}

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("preset", list(WORLD))
def test_preset_trains_and_loss_goes_down(preset, job_dir):
    result = run_cli(job_dir, f"parallel={preset}", *TINY, "trainer.steps=8")
    assert result.returncode == 0, result.stderr[-3000:]
    records, summary = read_job(job_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert METRIC_KEYS <= set(records[0])
    assert records[-1]["loss"] < records[0]["loss"] - 0.05
    assert summary["status"] == "completed" and summary["world_size"] == WORLD[preset]
    assert summary["mesh_dim_names"] == ["dp_replicate", "dp_shard", "tp"]
    assert summary["median_tps_global"] > 0 and summary["steady_steps"] == 6
    assert summary["final_loss"] == records[-1]["loss"]
    assert len(list((job_dir / "logs").glob("rank*.log"))) == WORLD[preset]
    assert (job_dir / "config_resolved.yaml").exists()
    assert f"outputs in {job_dir}" in result.stdout


@pytest.mark.parametrize("overrides", [
    ["parallel=hsdp", "precision=bf16"],
    ["parallel=fsdp_tp", "precision=bf16_pure"],
    ["parallel=single", "precision=bf16"],
    ["parallel=hsdp", "parallel.ac=full", "trainer.grad_accum_steps=2"],
    ["parallel=fsdp_tp", "parallel.ac=selective", "parallel.reshard_after_forward=false"],
    ["parallel=tp", "parallel.sequence_parallel=false", "data=text"],
], ids=lambda o: ",".join(o))
def test_precision_ac_and_accumulation_options_train(overrides, job_dir):
    result = run_cli(job_dir, *TINY, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    records, summary = read_job(job_dir)
    assert summary["status"] == "completed"
    assert records[-1]["loss"] < records[0]["loss"]
