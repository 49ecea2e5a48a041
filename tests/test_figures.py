"""One job's explainable figures: comm accounting in metrics.jsonl and summary.json, the memory
estimate and per-rank peaks, and a profiler trace of the chosen step window (the job's ranks
forked without torch's elastic launch: conftest's ``run_forked``)."""

import json

import pytest
from conftest import TINY, read_job, run_forked
from hydra.core.global_hydra import GlobalHydra

from hsdp_runner.runtime import app


@pytest.mark.multiprocess
def test_job_records_comm_memory_and_a_profiler_trace(job_dir):
    result = run_forked(
        job_dir,
        *TINY,
        "parallel=fsdp",
        "parallel.dp_shard=2",
        "trainer.steps=3",
        "metrics.comm_step=2",
        "profile.enable=true",
        "profile.start_step=2",
        "profile.steps=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records, summary = read_job(job_dir)
    # The counted step carries the breakdown; the others do not pay for counting.
    assert [("comm_ratio" in r) for r in records] == [False, True, False]
    assert records[1]["comm_measured"]["all_gather/dp_shard"]["calls"] == 5  # 3 fwd + 2 bwd
    assert summary["comm_step"] == 2
    assert summary["comm_ratio"] == pytest.approx(1.0, abs=0.01)
    assert summary["comm_bytes_measured"] == records[1]["comm_bytes_measured"] > 0
    assert set(summary["comm_analytic"]) <= set(summary["comm_measured"])
    # Memory: the state estimate (AdamW: 2 moments) and a peak for every rank.
    estimate = summary["mem_estimate_gib"]
    assert estimate["optimizer"] == pytest.approx(2 * estimate["grads"])
    assert estimate["total"] == pytest.approx(4 * estimate["params"])
    assert len(summary["mem_peak_gib_per_rank"]) == 2
    assert min(summary["mem_peak_gib_per_rank"]) > estimate["total"]
    assert summary["mem_peak_gib_max"] == max(summary["mem_peak_gib_per_rank"])
    log = (job_dir / "logs" / "rank0.log").read_text()
    assert "memory estimate per rank: params" in log and "communication per rank" in log
    # Rank 0 only wrote a Chrome trace of steps 2-3 (Perfetto / TensorBoard read it).
    traces = sorted(p.name for p in (job_dir / "profile").iterdir())
    assert traces == ["rank0_steps2-3.pt.trace.json"]
    trace = json.loads((job_dir / "profile" / traces[0]).read_text())
    assert any(
        "ProfilerStep" in e.get("name", "") or e.get("ph") == "X" for e in trace["traceEvents"]
    )


def test_profile_window_after_the_last_step_is_a_config_error(job_dir, monkeypatch, capsys):
    # In-process: ``python -m hsdp_runner`` exits with what app.main() returns.
    monkeypatch.setattr(
        "sys.argv",
        [
            "hsdp_runner",
            f"hydra.run.dir={job_dir}",
            *TINY,
            "parallel=single",
            "trainer.steps=3",
            "profile.enable=true",
            "profile.start_step=3",
            "profile.steps=2",
        ],
    )
    GlobalHydra.instance().clear()
    code = app.main()
    err = capsys.readouterr().err
    assert code == 2, err
    assert "profile.start_step=3" in err and "trainer.steps=3" in err
