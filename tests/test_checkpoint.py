"""Checkpoints: exact resume, crash safety of a save, resharding across layouts, for Llama, for
GPT-2 (the family added through the model seam) and for the MoE family across ep degrees. Each job runs through the runner's job
path (validation, ``run_job``, ``run_worker``), its ranks forked without torch's elastic
launch (conftest's ``run_forked``); a SIGKILLed rank ends the job as under the launcher."""

from pathlib import Path

import pytest
import torch
from conftest import METERS_OFF, TINY, read_job, run_forked
from omegaconf import OmegaConf

from hsdp_runner.checkpoint import hf
from hsdp_runner.checkpoint.checkpointer import expected_shapes, own_param_groups
from hsdp_runner.export import load_full_weights
from hsdp_runner.models.base import model_spec

pytestmark = pytest.mark.multiprocess

SAVE = ["checkpoint.enable=true"]


def _loss_at(records: list[dict], step: int) -> float:
    return next(r["loss"] for r in records if r["step"] == step)


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory):
    """A 20-step fsdp job saving at steps 10 and 20, SIGKILLed on rank 1 while step 20 is being
    saved (after all its steps ran), then the same command again, which resumes from step 10.

    Returns (job dir, step records and checkpoint folder listing after the killed run).
    """
    out = tmp_path_factory.mktemp("resume")
    job = [
        *TINY,
        "parallel=fsdp",
        "parallel.dp_shard=2",
        "trainer.steps=20",
        *SAVE,
        "checkpoint.interval=10",
        "checkpoint.keep_last=1",
    ]
    killed = run_forked(
        out, *job, "fault.rank=1", "fault.step=20", "fault.phase=save", "fault.kind=sigkill"
    )
    assert killed.returncode == 1 and "rank 1 failed" in killed.stderr, killed.stderr[-3000:]
    straight, _ = read_job(out)
    listing = sorted(p.name for p in (out / "checkpoints").iterdir())
    resumed = run_forked(out, *job)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out, straight, listing


def test_resume_is_bit_exact(killed_then_resumed):
    """Steps 11-20 trained again from the step-10 checkpoint equal the uninterrupted ones."""
    out, straight, _ = killed_then_resumed
    assert [r["step"] for r in straight] == list(range(1, 21))
    records, summary = read_job(out)
    assert summary["start_step"] == 10 and summary["loaded_from"].endswith("step-10")
    assert [r["step"] for r in records] == list(range(1, 21))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in records] == [r[key] for r in straight], key


def test_kill_mid_save_leaves_previous_checkpoint_loadable(killed_then_resumed):
    out, _, listing = killed_then_resumed
    # The interrupted save stays a .partial folder; step 10 was not pruned (keep_last=1)
    # because step 20 never became complete.
    assert listing == ["step-10", "step-20.partial"]
    # The resumed job loaded step 10, completed step 20, then pruned step 10 and the leftover.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-20"]
    assert read_job(out)[1]["last_checkpoint"].endswith("step-20")


def test_checkpoint_reshards_hsdp_tp_to_fsdp_cp_ddp_and_single(tmp_path):
    """hsdp_tp (8 ranks) -> fsdp_cp (4: sharded over dp_shard x cp) -> ddp (2) -> single: each
    next loss within 1e-5 rel; into context parallel and out of it again.

    Every job keeps trainer.steps=5 so the LR schedule is the reference's; each one's first
    loss is compared with the loss the 8-rank run had at that step.
    """
    job = [*TINY, "trainer.steps=5", *SAVE]
    ref = run_forked(
        tmp_path / "hsdp_tp",
        *job,
        "parallel=hsdp_tp",
        "checkpoint.interval=2",
        "checkpoint.export_at_end=true",
        "checkpoint.export_dtype=float32",
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference, _ = read_job(tmp_path / "hsdp_tp")

    source = tmp_path / "hsdp_tp" / "checkpoints" / "step-2"
    for layout, first in (("fsdp_cp", 3), ("ddp", 4), ("single", 5)):
        result = run_forked(
            tmp_path / layout,
            *job,
            f"parallel={layout}",
            f"checkpoint.interval={first}",
            f"checkpoint.load_path={source}",
        )
        assert result.returncode == 0, (layout, result.stderr[-3000:])
        records, summary = read_job(tmp_path / layout)
        assert summary["loaded_from"] == str(source) and summary["start_step"] == first - 1
        assert records[0]["step"] == first
        assert records[0]["loss"] == pytest.approx(_loss_at(reference, first), rel=1e-5), layout
        source = tmp_path / layout / "checkpoints" / f"step-{first}"

    # Strided (FSDP-on-TP) shards round-trip exactly: DCP's reassembly of the step-5 checkpoint
    # equals the weights the 8 ranks gathered with full_tensor() for the export.
    weights, manifest = load_full_weights(tmp_path / "hsdp_tp" / "checkpoints" / "step-5")
    model_cfg = OmegaConf.create(manifest["model"])
    exported = hf.read_folder(tmp_path / "hsdp_tp" / "hf", model_cfg, expected_shapes(model_cfg))
    assert manifest["layout"]["mesh_shape"] == [1, 2, 2, 1, 2]
    for name, tensor in weights.items():
        assert torch.equal(tensor, exported[name]), name


def test_gpt2_checkpoint_reshards_fsdp_tp_to_single_and_exports_for_transformers(tmp_path):
    """gpt2_tiny saved under fsdp_tp (4 ranks: strided FSDP-on-TP shards, the position table
    split by sequence parallel) continues in one process with the 4-rank run's losses; the
    4-rank run's HF export equals DCP's reassembly of its last checkpoint, and transformers'
    GPT2LMHeadModel computes our logits from it."""
    job = [
        "model=gpt2_tiny",
        "trainer.global_batch_size=8",
        "logger=none",
        "trainer.steps=4",
        *SAVE,
    ]
    _continues_in_one_process(
        tmp_path / "fsdp_tp",
        job,
        "parallel=fsdp_tp",
        "checkpoint.export_at_end=true",
        "checkpoint.export_dtype=float32",
    )

    weights, manifest = load_full_weights(tmp_path / "fsdp_tp" / "checkpoints" / "step-4")
    model_cfg = OmegaConf.create(manifest["model"])
    exported = hf.read_folder(tmp_path / "fsdp_tp" / "hf", model_cfg, expected_shapes(model_cfg))
    assert manifest["layout"]["mesh_shape"] == [1, 1, 2, 1, 2]
    for name, tensor in weights.items():
        assert torch.equal(tensor, exported[name]), name

    transformers = pytest.importorskip("transformers")
    ours = model_spec(model_cfg).build()
    ours.load_state_dict(weights)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path / "fsdp_tp" / "hf", dtype=torch.float32
    )
    tokens = torch.randint(
        0, model_cfg.vocab_size, (2, model_cfg.seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            theirs.eval()(tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5
        )


def test_a_rank_loads_its_own_optimizer_groups_with_the_saved_hyperparameters():
    """A checkpoint holds one rank's optimizer groups (DCP keeps one copy of a key every rank
    saves): another pipeline rank keeps its own parameter names, and its groups, empty or
    in another order, take the saved lr and betas of the group with their weight decay."""
    saved = [
        {"params": ["layers.0.w"], "weight_decay": 0.1, "lr": 2e-4, "betas": (0.9, 0.95)},
        {"params": ["layers.0.norm"], "weight_decay": 0.0, "lr": 2e-4, "betas": (0.9, 0.95)},
    ]
    own = [
        {"params": ["tok_embeddings.weight"], "weight_decay": 0.0, "lr": 0.0, "betas": (0, 0)},
        {"params": [], "weight_decay": 0.1, "lr": 0.0, "betas": (0, 0)},
    ]
    assert own_param_groups(own, saved) == [
        {
            "params": ["tok_embeddings.weight"],
            "weight_decay": 0.0,
            "lr": 2e-4,
            "betas": (0.9, 0.95),
        },
        {"params": [], "weight_decay": 0.1, "lr": 2e-4, "betas": (0.9, 0.95)},
    ]


def test_an_empty_optimizer_group_goes_last():
    """``trainer.freeze`` leaving no decayed weight (or a pipeline rank holding only GPT-2's
    embeddings): the empty group goes last, the one place torch 2.13's distributed state dict
    loads an empty group's hyperparameters into (first, a resumed fsdp job with
    ``trainer.freeze=[layers.*,output.*]`` failed with ``KeyError: 'betas'``)."""
    from hsdp_runner.config.schema import OptimConfig
    from hsdp_runner.train.optimizer import build_optimizer

    layer = torch.nn.Linear(2, 2)
    layer.weight.requires_grad_(False)
    optimizer = build_optimizer([layer], OptimConfig(), lambda name: name.endswith("bias"))
    assert [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups] == [
        (1, 0.0),
        (0, OptimConfig().weight_decay),
    ]


def test_pipeline_checkpoint_resumes_without_pp_and_back_and_exports(tmp_path):
    """A 2-stage pipeline job's step-2 checkpoint (each stage saved its own parameters, named
    as in the whole model) continues in one process with the pipeline's losses; that job's
    step-3 checkpoint continues under an interleaved pipeline (2 stages per rank, saved and
    loaded through one view of both chunks), whose step-4 checkpoint continues under a
    pipeline whose first rank holds the embedding alone (blocks 0 and 4: a checkpoint holds
    one rank's optimizer groups, and this rank's decayed group is empty); the pipeline's last
    checkpoint exports to a Hugging Face folder holding every parameter, through the CLI and
    at the job's end; a pipeline job starts from that folder (``init_from_hf``) as one
    process does."""
    from hsdp_runner import export

    job = [*TINY, "model.n_layers=4", "trainer.steps=5", *SAVE]
    interleaved = "pp:parallel.pp_schedule=interleaved_1f1b:parallel.pp_stages_per_rank=2"
    embedding_alone = "pp:parallel.pp_first_stage_less_blocks=4"
    at_end = ["checkpoint.export_at_end=true", "checkpoint.export_dtype=float32"]
    ref = run_forked(tmp_path / "pp", *job, "parallel=pp", "checkpoint.interval=2", *at_end)
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference, _ = read_job(tmp_path / "pp")
    source = tmp_path / "pp" / "checkpoints" / "step-2"
    legs = (("single", 3), (interleaved, 4), (embedding_alone, 5))
    for leg, (layout, first) in enumerate(legs):
        name, *extra = layout.split(":")
        result = run_forked(
            tmp_path / f"{leg}_{name}_resumed",
            *job,
            f"parallel={name}",
            *extra,
            f"checkpoint.interval={first}",
            f"checkpoint.load_path={source}",
        )
        assert result.returncode == 0, (layout, result.stderr[-3000:])
        records, summary = read_job(tmp_path / f"{leg}_{name}_resumed")
        assert summary["loaded_from"] == str(source) and records[0]["step"] == first
        for r in records:
            assert r["loss"] == pytest.approx(_loss_at(reference, r["step"]), rel=1e-5), layout
        source = tmp_path / f"{leg}_{name}_resumed" / "checkpoints" / f"step-{first}"

    last = tmp_path / "pp" / "checkpoints" / "step-5"
    assert export.main([str(last), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    weights, manifest = load_full_weights(last)
    model_cfg = OmegaConf.create(manifest["model"])
    exported = hf.read_folder(tmp_path / "hf", model_cfg, expected_shapes(model_cfg))
    assert manifest["layout"]["mesh_shape"] == [2, 1, 1, 1, 1]
    assert set(weights) == {name for name, _ in model_spec(model_cfg).build().named_parameters()}
    at_end = hf.read_folder(tmp_path / "pp" / "hf", model_cfg, expected_shapes(model_cfg))
    for name, tensor in weights.items():
        assert torch.equal(tensor, exported[name]) and torch.equal(tensor, at_end[name]), name

    # Rank 0 reads the folder and every stage keeps its own parameters of the broadcast.
    first_losses = {}
    for layout in ("single", "pp"):
        out = tmp_path / f"hf_{layout}"
        started = run_forked(
            out, *TINY, "model.n_layers=4", "trainer.steps=2", f"parallel={layout}",
            f"checkpoint.init_from_hf={tmp_path / 'hf'}",
        )  # fmt: skip
        assert started.returncode == 0, (layout, started.stderr[-3000:])
        records, summary = read_job(out)
        assert summary["loaded_from"] == str(tmp_path / "hf") and len(records) == 2
        first_losses[layout] = [r["loss"] for r in records]
    assert first_losses["pp"] == pytest.approx(first_losses["single"], rel=1e-5)


def test_moe_checkpoint_resumes_exactly_under_ep_and_reshards_across_ep_degrees(tmp_path):
    """moe_tiny saved under ep 4 (fsdp, dp_shard 4: each rank holds 2 of the 8 experts) resumes
    under ep 4 with the uninterrupted run's losses, bit for bit; then each job's checkpoint
    continues under another layout with the reference's losses (fp32, 1e-5 rel), along two
    chains from there: ep 2 x tp 2 (the experts sharded over the tp ranks, FSDP over
    dp_shard) -> ep 1 (fsdp 2) -> one process, and HSDP x ep 2 (dp_replicate 2 x dp_shard 2:
    the experts' shards replicated over dp_replicate) -> pp 2 x ep 2 (pp_fsdp: each stage
    holds one MoE block, its experts over the stage's two ranks) -> one process.

    A fast loss-free bias (``bias_update_speed``) makes the routing depend on the restored
    ``expert_bias`` buffer: each hop starts after an odd number of updates of +-speed, where
    it is not zero. Every checkpoint holds it, equal to the reference's at its step, and not
    the step's counts (``tokens_per_expert``).
    """
    job = ["model=moe_tiny", "model.bias_update_speed=0.05", "trainer.global_batch_size=8"]
    job += ["trainer.steps=8", "logger=none", *METERS_OFF, *SAVE]
    ref = run_forked(
        tmp_path / "ep4", *job, "parallel=fsdp", "parallel.ep=4", "checkpoint.interval=1"
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference, _ = read_job(tmp_path / "ep4")
    hops = (  # (name, layout, the job whose checkpoint of the step before `first` it loads, first)
        ("ep4_resumed", ["parallel=fsdp", "parallel.ep=4"], "ep4", 2),
        ("ep2_tp2", ["parallel=fsdp_tp", "parallel.ep=2"], "ep4_resumed", 4),
        ("ep1_fsdp2", ["parallel=fsdp", "parallel.dp_shard=2"], "ep2_tp2", 6),
        ("single", ["parallel=single"], "ep1_fsdp2", 8),
        ("hsdp_ep2", ["parallel=hsdp", "parallel.ep=2"], "ep4_resumed", 4),
        ("pp_ep2", ["parallel=pp_fsdp", "parallel.ep=2"], "hsdp_ep2", 6),
        ("single_after_pp", ["parallel=single"], "pp_ep2", 8),
    )
    for name, layout, loads, first in hops:
        source = tmp_path / loads / "checkpoints" / f"step-{first - 1}"
        biases = _expert_biases(source)
        assert len(biases) == 2 and all(b.count_nonzero() for b in biases.values()), source
        if loads != "ep4":  # saved by a hop: its bias as the reference's at that step
            reference_biases = _expert_biases(tmp_path / "ep4" / "checkpoints" / source.name)
            for key, bias in biases.items():
                assert torch.equal(bias, reference_biases[key]), (loads, key)
        result = run_forked(
            tmp_path / name,
            *job,
            *layout,
            f"checkpoint.interval={first + 1}",
            f"checkpoint.load_path={source}",
        )
        assert result.returncode == 0, (name, result.stderr[-3000:])
        records, summary = read_job(tmp_path / name)
        assert summary["loaded_from"] == str(source) and records[0]["step"] == first
        if name == "ep4_resumed":  # the same layout: every later step exactly as uninterrupted
            assert [r["loss"] for r in records] == [r["loss"] for r in reference[1:]]
        for r in records:  # the later steps check the optimizer state too
            assert r["loss"] == pytest.approx(_loss_at(reference, r["step"]), rel=1e-5), name


def test_experts_sharded_on_their_rows_save_and_resume_in_one_process(tmp_path):
    """moe_tiny with 2 experts at ep 2 over FSDP 4: a rank holds one expert and efsdp has two
    ranks, so FSDP shards the experts' weights on dim 1 (``param_sizes.expert_shard_dim``).
    Its step-2 checkpoint continues in one process with the saving job's own later losses."""
    job = ["model=moe_tiny", "model.n_experts=2", "model.top_k=1", "trainer.steps=4"]
    job += ["logger=none", *METERS_OFF, *SAVE]
    _continues_in_one_process(tmp_path / "ep2", job, "parallel=fsdp", "parallel.ep=2")


def _continues_in_one_process(saved: Path, job: list[str], *layout: str) -> None:
    """Train ``job`` (4 steps) under ``layout`` into ``saved`` with a checkpoint at step 2,
    continue that checkpoint in one process (``saved``'s sibling 'single'), and check its
    steps 3 and 4 against the saving job's losses (1e-5 relative)."""
    ref = run_forked(saved, *job, *layout, "checkpoint.interval=2")
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference, _ = read_job(saved)
    source = saved / "checkpoints" / "step-2"
    single = saved.parent / "single"
    result = run_forked(single, *job, "parallel=single", f"checkpoint.load_path={source}")
    assert result.returncode == 0, result.stderr[-3000:]
    records, summary = read_job(single)
    assert summary["loaded_from"] == str(source) and [r["step"] for r in records] == [3, 4]
    for r in records:
        assert r["loss"] == pytest.approx(_loss_at(reference, r["step"]), rel=1e-5), r["step"]


def _expert_biases(checkpoint) -> dict:
    """The ``expert_bias`` buffers a checkpoint holds, by name; checks that it holds no
    ``tokens_per_expert`` (not persistent: counts of one step)."""
    weights, _ = load_full_weights(checkpoint)
    assert not any(k.endswith("tokens_per_expert") for k in weights), checkpoint
    return {k: v for k, v in weights.items() if k.endswith("expert_bias")}
