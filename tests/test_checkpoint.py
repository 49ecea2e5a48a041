"""Checkpoints: exact resume, crash safety of a save, resharding across layouts (through the CLI)."""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY, read_job, run_cli

pytestmark = pytest.mark.multiprocess

SAVE = ["checkpoint.enable=true"]


def _losses(records: list[dict], steps) -> list[float]:
    by_step = {r["step"]: r["loss"] for r in records}
    return [by_step[s] for s in steps]


def test_resume_is_bit_exact(tmp_path):
    """20 steps straight vs 10 steps, interruption, resume: steps 11-20 agree bit for bit."""
    job = [*TINY, "parallel=fsdp", "parallel.dp_shard=2", "trainer.steps=20"]
    straight = run_cli(tmp_path / "straight", *job)
    assert straight.returncode == 0, straight.stderr[-3000:]
    interrupted = run_cli(tmp_path / "resumed", *job, *SAVE, "checkpoint.interval=10",
                          "fault.rank=0", "fault.step=11")
    assert interrupted.returncode == 1 and "injected fault" in interrupted.stderr
    resumed = run_cli(tmp_path / "resumed", *job, *SAVE, "checkpoint.interval=10")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, _ = read_job(tmp_path / "straight")
    records, summary = read_job(tmp_path / "resumed")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert summary["start_step"] == 10 and summary["loaded_from"].endswith("step-10")
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in records] == [r[key] for r in expected], key


def test_kill_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    """A rank SIGKILLed while step 6 is being saved: step 3 stays complete and is resumed."""
    job = [*TINY, "parallel=ddp", "trainer.steps=6", *SAVE, "checkpoint.interval=3",
           "checkpoint.keep_last=1"]
    killed = run_cli(tmp_path, *job, "fault.rank=1", "fault.step=6", "fault.phase=save",
                     "fault.kind=sigkill")
    assert killed.returncode == 1 and "rank 1 failed" in killed.stderr
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-3", "step-6.partial"]
    before, _ = read_job(tmp_path)
    assert [r["step"] for r in before] == list(range(1, 7))

    resumed = run_cli(tmp_path, *job)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records, summary = read_job(tmp_path)
    assert summary["start_step"] == 3
    assert [r["step"] for r in records] == list(range(1, 7))
    assert _losses(records, range(4, 7)) == _losses(before, range(4, 7))
    # The new checkpoint is complete, the interrupted one cleaned up, the old one pruned.
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-6"]


def test_checkpoint_reshards_hsdp_tp_to_fsdp_ddp_and_single(tmp_path):
    """hsdp_tp (8 ranks) -> fsdp (4) -> ddp (2) -> single: each next loss within 1e-5 rel."""
    from hsdp_runner import hf
    from hsdp_runner.checkpoint import expected_shapes
    from hsdp_runner.export import load_full_weights

    job = [*TINY, "trainer.steps=5", *SAVE]
    ref = run_cli(tmp_path / "hsdp_tp", *job, "parallel=hsdp_tp", "checkpoint.interval=2",
                  "checkpoint.export_at_end=true", "checkpoint.export_dtype=float32")
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference, _ = read_job(tmp_path / "hsdp_tp")

    source = tmp_path / "hsdp_tp" / "checkpoints" / "step-2"
    for layout, first in (("fsdp", 3), ("ddp", 4), ("single", 5)):
        result = run_cli(tmp_path / layout, *job, f"parallel={layout}", "checkpoint.interval=1",
                         f"checkpoint.load_path={source}")
        assert result.returncode == 0, (layout, result.stderr[-3000:])
        records, summary = read_job(tmp_path / layout)
        assert summary["start_step"] == first - 1 and records[0]["step"] == first
        assert records[0]["loss"] == pytest.approx(_losses(reference, [first])[0], rel=1e-5), layout
        source = tmp_path / layout / "checkpoints" / f"step-{first}"

    # Strided (FSDP-on-TP) shards round-trip exactly: DCP's reassembly of the step-5 checkpoint
    # equals the weights the 8 ranks gathered with full_tensor() for the export.
    weights, manifest = load_full_weights(tmp_path / "hsdp_tp" / "checkpoints" / "step-5")
    model_cfg = OmegaConf.create(manifest["model"])
    exported = hf.read_folder(tmp_path / "hsdp_tp" / "hf", model_cfg, expected_shapes(model_cfg))
    assert manifest["layout"]["mesh_shape"] == [2, 2, 2]
    for name, tensor in weights.items():
        assert torch.equal(tensor, exported[name]), name
