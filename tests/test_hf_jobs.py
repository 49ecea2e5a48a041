"""data=hf jobs through the runner (its ranks forked, conftest's ``run_forked``), on a corpus
and tokenizer made at test time: training with validation, a damaged file met mid-run that
stops the job with the file named and its checkpoints intact, the fixed rerun resuming to the
uninterrupted run's very losses, a resume under pipeline parallelism at another data-parallel
degree, the exported tokenizer."""

from __future__ import annotations

import json

import pytest
from conftest import TINY, read_job, run_forked
from hf_corpus import hf_overrides, make_corpus

from hsdp_runner.checkpoint.start import inspect

pytestmark = pytest.mark.multiprocess

STEPS = 6
PART_1 = 100  # training documents in the first file; the second holds the rest up to
VAL_FROM = 360  # the held-out documents (validation.jsonl) from here on


@pytest.fixture(scope="module")
def hf_jobs(tmp_path_factory):
    """Four launches over a folder of two training files and a validation file: the
    uninterrupted fsdp job (2 ranks, memory-mapped); the same job streamed with the second
    training file damaged, then again once it is fixed; a pipeline job (pp 2, dp 1) resuming
    the first one's step-4 checkpoint."""
    root = tmp_path_factory.mktemp("hf_jobs")
    corpus = make_corpus(root / "corpus")
    folder = root / "folder"  # splits by file name, as datasets infers them
    folder.mkdir()
    lines = corpus.jsonl.read_text().splitlines(keepends=True)
    (folder / "train-1.jsonl").write_text("".join(lines[:PART_1]))
    good = "".join(lines[PART_1:VAL_FROM])
    (folder / "train-2.jsonl").write_text(good)
    (folder / "validation.jsonl").write_text("".join(lines[VAL_FROM:]))
    job = [
        *TINY,
        "trainer.steps=6",
        *hf_overrides(corpus, folder),
        "data.val_split=validation",
        "trainer.val_every=2",
        "trainer.val_batches=1",
        "trainer.eval_batches=1",
        "checkpoint.enable=true",
        "checkpoint.interval=1",
    ]
    fsdp = ["parallel=fsdp", "parallel.dp_shard=2"]
    out = {name: root / name for name in ("straight", "damaged", "pipeline")}
    straight = run_forked(out["straight"], *job, *fsdp, "checkpoint.export_at_end=true")
    assert straight.returncode == 0, straight.stderr[-3000:]

    streamed = [*job, *fsdp, "data.streaming=true"]
    damaged = "".join(lines[PART_1 : PART_1 + 20]) + '{"text": "doc7 the\n' + good
    (folder / "train-2.jsonl").write_text(damaged)
    failed = run_forked(out["damaged"], *streamed)
    after_failure = (read_job(out["damaged"]), sorted((out["damaged"] / "checkpoints").iterdir()))
    (folder / "train-2.jsonl").write_text(good)  # fixed
    rerun = run_forked(out["damaged"], *streamed)
    assert rerun.returncode == 0, rerun.stderr[-3000:]

    step_4 = out["straight"] / "checkpoints" / "step-4"
    pipeline = run_forked(out["pipeline"], *job, "parallel=pp", f"checkpoint.load_path={step_4}")
    assert pipeline.returncode == 0, pipeline.stderr[-3000:]
    return out, corpus, failed, after_failure


def _by_step(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def test_a_job_trains_and_validates_on_a_jsonl_folder_with_a_tokenizer(hf_jobs):
    out, _, _, _ = hf_jobs
    records, summary = read_job(out["straight"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    val = _by_step(records, "val_loss")
    assert list(val) == [2, 4, 6] and val[6] < val[2]
    assert all(r["data_wait_s"] >= 0 for r in records)
    assert summary["val_loss"] == val[6]
    assert summary["eval_loss"] == val[6]  # the same held-out batch after the same step
    assert summary["max_data_wait_s"] >= summary["median_data_wait_s"] >= 0
    manifest = json.loads((out["straight"] / "checkpoints/step-4/checkpoint.json").read_text())
    assert manifest["data"]["position"] == {"samples": 4 * 8, "lanes": 8}


def test_a_damaged_file_stops_the_job_naming_it_and_its_checkpoints_stay_intact(hf_jobs):
    out, _, failed, ((records, summary), checkpoints) = hf_jobs
    assert failed.returncode == 1
    assert "train-2.jsonl cannot be read (" in failed.stderr, failed.stderr[-3000:]
    assert "train-2.jsonl cannot be read" in summary["error"] and summary["status"] == "failed"
    complete = [p for p in checkpoints if not p.name.endswith(".partial")]
    assert complete and len(complete) < STEPS and len(records) < STEPS
    for path in complete:
        inspect(path, None)  # complete and intact


def test_the_fixed_rerun_resumes_to_the_uninterrupted_runs_losses(hf_jobs):
    """Streamed and resumed from its last checkpoint, the job ends with exactly the losses,
    validation losses and gradient norms of the uninterrupted memory-mapped one."""
    out, _, _, _ = hf_jobs
    straight, _ = read_job(out["straight"])
    resumed, summary = read_job(out["damaged"])
    assert summary["start_step"] >= 1
    for key in ("loss", "grad_norm", "val_loss"):
        assert _by_step(resumed, key) == _by_step(straight, key), key


def test_a_pipeline_job_resumes_the_stream_at_another_dp_degree_and_validates(hf_jobs):
    """pp 2 x dp 1 from the fsdp (dp 2) step-4 checkpoint: steps 5 and 6 see the same batches
    (losses equal to float rounding) and validation under the pipeline equals fsdp's."""
    out, _, _, _ = hf_jobs
    straight, _ = read_job(out["straight"])
    piped, summary = read_job(out["pipeline"])
    assert summary["start_step"] == 4
    for key in ("loss", "val_loss"):
        theirs, ours = _by_step(straight, key), _by_step(piped, key)
        for step, value in ours.items():
            assert value == pytest.approx(theirs[step], rel=1e-5), (key, step)
    assert 6 in _by_step(piped, "val_loss")


def test_the_export_holds_the_jobs_tokenizer(hf_jobs):
    """data.tokenizer can name the exported folder: the same tokenizer, BOS and EOS."""
    from hsdp_runner.config.schema import DataConfig
    from hsdp_runner.train.hf_tokenizer import check_tokenizer

    out, corpus, _, _ = hf_jobs
    exported = check_tokenizer(DataConfig(tokenizer=str(out["straight"] / "hf")), 512)
    original = check_tokenizer(DataConfig(tokenizer=str(corpus.tokenizer)), 512)
    assert (exported.bos_id, exported.eos_id, exported.vocab_size) == (
        original.bos_id,
        original.eos_id,
        original.vocab_size,
    )
    assert (out["straight"] / "hf" / "tokenizer_config.json").is_file()


def test_a_resume_with_another_global_batch_is_refused_before_any_worker(
    hf_jobs, tmp_path, monkeypatch, capsys
):
    from hydra.core.global_hydra import GlobalHydra

    from hsdp_runner.runtime import app

    out, corpus, _, _ = hf_jobs
    step_4 = out["straight"] / "checkpoints" / "step-4"
    argv = [
        f"hydra.run.dir={tmp_path}",
        *TINY,
        *hf_overrides(corpus),
        f"checkpoint.load_path={step_4}",
    ]
    monkeypatch.setattr("sys.argv", ["hsdp_runner", *argv, "trainer.global_batch_size=16"])
    GlobalHydra.instance().clear()
    assert app.main() == 2
    err = capsys.readouterr().err
    assert "set trainer.global_batch_size=8 to continue its data=hf stream" in err, err
