"""Precision, activation checkpointing, accumulation and data options train end to end (each
job through the runner's job path, its ranks forked without torch's elastic launch: conftest.run_forked).

The presets themselves are trained by the parity run (tests/test_parity.py). Options that
apply to the same layout share one job: each must train for the job to train. The job with
gradient accumulation also checks the planner's memory for its config and layout against the
tensor peak every rank measured."""

import pytest
from clusters import fake_cluster
from conftest import TINY, rank_logs, read_job, run_forked

from hsdp_runner import plan
from hsdp_runner.planner.layouts import plan_layouts

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
        *(
            [
                "parallel=hsdp",
                "parallel.ac=full",
                "trainer.grad_accum_steps=2",
                f"trainer.accum_reduce={choice}",
            ]
            for choice in ("last", "every")
        ),
        ["parallel=tp", "parallel.sequence_parallel=false", "data=text"],
    ],
    ids=lambda o: ",".join(o),
)
def test_precision_ac_and_accumulation_options_train(overrides, job_dir):
    accumulating = "trainer.grad_accum_steps=2" in overrides
    meter = ["metrics.memory_steps=1"] if accumulating else []
    result = run_forked(job_dir, *TINY, *overrides, "trainer.steps=4", *meter)
    assert result.returncode == 0, result.stderr[-3000:] + rank_logs(job_dir)[-3000:]
    # torch's warning about the root returning a view (TP's local logits) is answered in
    # parallelize.apply_data_parallel, not shown to every user of TP (any rank's log).
    assert "returned a view tensor" not in rank_logs(job_dir)
    records, summary = read_job(job_dir)
    assert summary["status"] == "completed"
    assert records[-1]["loss"] < records[0]["loss"]
    if accumulating:
        _check_planned_memory(overrides, summary)


def _check_planned_memory(overrides: list[str], summary: dict) -> None:
    """The plan of the job's own config and layout (two micro-batches) predicts the measured
    tensor peak within 15%. Every rank runs the same program; the smallest rank's peak is it:
    gloo's threads free some collective buffers, at moments that vary by rank and run, and
    the meter sees only the main thread's frees, which added up to 28% to a rank's peak here
    (2,067 KiB on one rank, 2,644 on another; planned 2,063 under ``last``)."""
    degrees = {k: summary[k] for k in ("dp_replicate", "dp_shard", "cp", "tp")}
    cfg = plan.compose([*TINY, *overrides, "trainer.steps=4"])
    cluster = fake_cluster(nodes=1, gpus_per_node=summary["world_size"])  # no reserve: CPU
    row = plan_layouts(cfg, cluster, {}, degrees)[0]
    measured = min(summary["mem_tensor_peak_gib_per_rank"])
    assert abs(row["mem_gib"] / measured - 1) <= 0.15, (row["mem_gib"], measured)
