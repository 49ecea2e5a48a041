"""Bad checkpoint input: one clear error each, naming the path and the problem; nothing overwritten."""

import os
import pickle
import random
import shutil

import pytest
import torch
from conftest import TINY, run_cli
from test_config import compose

from hsdp_runner import export
from hsdp_runner.checkpoint import checkpointer
from hsdp_runner.checkpoint import start as checkpoint
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.core.errors import ConfigError


def _validate(tmp_path, *overrides):
    cfg = to_run_config(compose([*TINY, *overrides]))
    return checkpoint.validate(cfg.checkpoint, cfg.model, cfg.trainer.steps, tmp_path / "job")


@pytest.fixture
def step2(trained_checkpoint, tmp_path):
    """A private copy of the trained job's step-2 checkpoint, free to damage."""
    return shutil.copytree(
        trained_checkpoint / "checkpoints" / "step-2", tmp_path / "ckpts" / "step-2"
    )


def test_checkpoint_of_another_model_shape_exits_2_before_any_worker(step2, job_dir):
    result = run_cli(job_dir, *TINY, "model.dim=128", f"checkpoint.load_path={step2}", timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"checkpoint {step2} holds another model shape" in result.stderr
    assert "model.dim=64 there, 128 here" in result.stderr
    assert not (job_dir / "logs").exists()


def test_truncated_checkpoint_is_refused_naming_the_file(step2, tmp_path):
    shard = step2 / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(
        checkpoint.CheckpointError,
        match=f"checkpoint {step2} is truncated: "
        r"__0_0.distcp holds 1000 bytes",
    ):
        _validate(tmp_path, f"checkpoint.load_path={step2}")


def test_corrupt_checkpoint_metadata_is_refused(step2, tmp_path):
    (step2 / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint {step2} is damaged"):
        _validate(tmp_path, f"checkpoint.load_path={step2}")


def test_corrupt_shard_data_fails_export_naming_the_checkpoint(step2, tmp_path, capsys):
    shard = step2 / "__0_0.distcp"
    shard.write_bytes(b"\0" * shard.stat().st_size)
    assert export.main([str(step2), str(tmp_path / "out")]) == 2
    assert f"checkpoint {step2} could not be read" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_interrupted_save_is_never_loaded(step2, tmp_path):
    partial = step2.rename(step2.with_name("step-2.partial"))
    (partial / checkpoint.MANIFEST).unlink()
    with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint {partial} is incomplete"):
        _validate(tmp_path, f"checkpoint.load_path={partial}")
    # Auto-resume ignores it: the job starts fresh.
    assert _validate(tmp_path, f"checkpoint.dir={partial.parent}").source == "fresh"


@pytest.mark.parametrize("key", ["checkpoint.load_path", "checkpoint.init_from_hf"])
def test_missing_path_is_refused_naming_key_and_path(key, tmp_path):
    with pytest.raises(
        checkpoint.CheckpointError, match=f"{key}={tmp_path}/nowhere does not exist"
    ):
        _validate(tmp_path, f"{key}={tmp_path}/nowhere")


def test_hf_folder_of_another_model_is_refused(trained_checkpoint, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"was written for another model: model.n_layers=3 but "
        "config.json implies 2",
    ):
        _validate(
            tmp_path, "model.n_layers=3", f"checkpoint.init_from_hf={trained_checkpoint / 'hf'}"
        )


def test_export_never_overwrites_a_folder_with_files(trained_checkpoint, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert export.main([str(trained_checkpoint / "checkpoints"), str(taken)]) == 2
    assert f"export folder {taken} already exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    with pytest.raises(ConfigError, match=f"checkpoint.export_dir {taken} already exists"):
        _validate(tmp_path, "checkpoint.export_at_end=true", f"checkpoint.export_dir={taken}")


def test_saving_beside_existing_checkpoints_without_resuming_is_refused(
    trained_checkpoint, tmp_path
):
    ckpts = trained_checkpoint / "checkpoints"
    with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint.dir={ckpts} already holds"):
        _validate(
            tmp_path, "checkpoint.enable=true", "checkpoint.resume=never", f"checkpoint.dir={ckpts}"
        )


def test_resuming_a_finished_run_is_refused(trained_checkpoint, tmp_path):
    with pytest.raises(
        checkpoint.CheckpointError,
        match="is at step 2, nothing is left to train with trainer.steps=2",
    ):
        _validate(
            tmp_path, "trainer.steps=2", f"checkpoint.dir={trained_checkpoint / 'checkpoints'}"
        )


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_rng_states_round_trip_and_are_read_without_running_pickled_code(tmp_path):
    cpu = torch.device("cpu")
    blob = checkpointer.rng_state(cpu)
    expected = (random.random(), torch.rand(4))
    assert checkpointer.set_rng_state(blob, cpu)
    again = (random.random(), torch.rand(4))
    assert again[0] == expected[0] and torch.equal(again[1], expected[1])
    # A pickle (an older checkpoint's form, or a crafted one) is not unpickled: nothing runs,
    # nothing is restored.
    marker = tmp_path / "ran"
    assert not checkpointer.set_rng_state(pickle.dumps(_RunsCode(str(marker))), cpu)
    assert not marker.exists()
