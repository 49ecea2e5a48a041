"""Precision, activation checkpointing, accumulation and data options train end to end.

The presets themselves are trained by the parity run (tests/test_parity.py). Options that
apply to the same layout share one job: each must train for the job to train."""

import pytest
from conftest import TINY, read_job, run_cli

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "parallel=fsdp_tp",
            "precision=bf16_pure",
            "parallel.ac=selective",
            "parallel.reshard_after_forward=false",
        ],
        ["parallel=single", "precision=bf16"],
        ["parallel=hsdp", "parallel.ac=full", "trainer.grad_accum_steps=2"],
        ["parallel=tp", "parallel.sequence_parallel=false", "data=text"],
    ],
    ids=lambda o: ",".join(o),
)
def test_precision_ac_and_accumulation_options_train(overrides, job_dir):
    result = run_cli(job_dir, *TINY, *overrides, "trainer.steps=4")
    assert result.returncode == 0, result.stderr[-3000:]
    # torch's warning about the root returning a view (TP's local logits) is answered in
    # parallelize.apply_data_parallel, not shown to every user of TP.
    assert "returned a view tensor" not in result.stderr
    records, summary = read_job(job_dir)
    assert summary["status"] == "completed"
    assert records[-1]["loss"] < records[0]["loss"]
