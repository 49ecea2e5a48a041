"""The MoE family's Hugging Face export and import (Qwen3-MoE): ``transformers`` computes our
logits and the runner's eval loss from an export, an export reads back into the same weights,
and what Qwen3-MoE cannot express is refused with one line before anything is written."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import METERS_OFF, read_job, run_forked
from test_config import compose

from hsdp_runner import export
from hsdp_runner.checkpoint import hf
from hsdp_runner.checkpoint.start import MANIFEST, load_full_weights
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.models.base import model_spec
from hsdp_runner.train.data import EVAL_STEP_OFFSET, TokenBatches

# moe_tiny as Qwen3-MoE can hold it (no shared experts, no balancing bias), with heads
# narrower than dim / n_heads (config.json's head_dim).
QWEN3 = ["model=moe_tiny", "model.n_shared_experts=0", "model.bias_update_speed=0"]
QWEN3 += ["model.head_dim=8"]
JOB = [*QWEN3, "trainer.global_batch_size=8", "logger=none", *METERS_OFF, "parallel=single"]
EVAL_BATCHES = 2


def _transformers():
    """transformers, imported on first use: only the tests that load an export need it."""
    return pytest.importorskip("transformers")


def _spec(*overrides):
    return model_spec(compose([*QWEN3, *overrides]).model)


def _random_model():
    """The Qwen3-expressible moe_tiny with every parameter random (norms included: the QK-norm
    weights must follow wq/wk into HF's RoPE order), in eval mode."""
    spec = _spec()
    model = spec.build()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 1.0 if name.endswith("norm.weight") else 0.3
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return spec, model.eval()


def _load_hf(folder):
    """Qwen3MoeForCausalLM from ``folder`` in fp32, checking that every tensor was used."""
    model, info = _transformers().AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def test_qwen3_moe_names_and_rope_order_round_trip_exactly():
    spec, model = _random_model()
    state = model.state_dict()
    exported = hf.to_hf(state, spec, torch.float32)
    assert exported["model.layers.2.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert exported["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (64, 32)
    assert "model.layers.0.mlp.up_proj.weight" in exported  # the dense first layer
    assert not any("expert_bias" in name for name in exported)
    q_norm = "layers.1.attention.q_norm.weight"
    assert not torch.equal(
        exported[f"model.{q_norm.replace('attention', 'self_attn')}"], state[q_norm]
    )
    back = hf.from_hf(exported, spec)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_export_loads_in_transformers_qwen3_moe_with_the_same_logits(tmp_path):
    spec, model = _random_model()
    folder = tmp_path / "hf"
    hf.write_export(model.state_dict(), spec, torch.float32, folder, 1.0)
    config = json.loads((folder / hf.CONFIG_FILE).read_text())
    assert config["mlp_only_layers"] == [0] and config["head_dim"] == 8
    theirs = _load_hf(folder)
    tokens = torch.randint(
        0, spec.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


def _batches(cfg) -> TokenBatches:
    """The batches a single-rank job of ``cfg`` trains and evaluates on."""
    return TokenBatches(
        cfg.data,
        cfg.model.vocab_size,
        cfg.model.seq_len,
        cfg.trainer.global_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=cfg.trainer.seed,
    )


@pytest.fixture(scope="module")
def trained_moe(tmp_path_factory):
    """A finished single-rank job of the Qwen3-expressible moe_tiny: 2 steps, the eval loss of
    held-out batches, checkpoints and an fp32 export at the end."""
    out = tmp_path_factory.mktemp("trained_moe")
    result = run_forked(
        out,
        *JOB,
        "trainer.steps=2",
        f"trainer.eval_batches={EVAL_BATCHES}",
        "checkpoint.enable=true",
        "checkpoint.export_at_end=true",
        "checkpoint.export_dtype=float32",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def trained_moe_ep(tmp_path_factory):
    """The same job under expert parallel on two ranks (FSDP 2, ep 2): its export gathers
    expert weights sharded over ep and efsdp."""
    out = tmp_path_factory.mktemp("trained_moe_ep")
    result = run_forked(
        out,
        *JOB,
        "parallel=fsdp",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "trainer.steps=2",
        f"trainer.eval_batches={EVAL_BATCHES}",
        "checkpoint.export_at_end=true",
        "checkpoint.export_dtype=float32",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("job", ["trained_moe", "trained_moe_ep"])
def test_transformers_computes_the_runners_eval_loss_from_the_export(job, request):
    trained_moe = request.getfixturevalue(job)
    _, summary = read_job(trained_moe)
    assert (summary["layout"], summary["ep"]) == (("fsdp_ep", 2) if "ep" in job else ("single", 1))
    batches = _batches(compose(JOB))
    theirs = _load_hf(trained_moe / "hf")
    losses = []
    with torch.no_grad():
        for i in range(EVAL_BATCHES):
            inputs, targets = batches.local_batch(EVAL_STEP_OFFSET + i)
            logits = theirs(inputs).logits
            losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item())
    assert summary["eval_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)


def test_an_export_reads_back_into_the_checkpoint_weights(trained_moe, tmp_path, capsys):
    checkpoint = trained_moe / "checkpoints" / "step-2"
    folder = tmp_path / "hf"
    assert export.main([str(checkpoint), str(folder), "--dtype", "float32"]) == 0
    weights, manifest = load_full_weights(checkpoint)
    spec = model_spec(manifest["model"])
    read = hf.read_folder(folder, spec, {k: tuple(v.shape) for k, v in weights.items()})
    assert read.keys() == weights.keys()
    assert all(torch.equal(read[k], weights[k]) for k in weights)


def test_training_starts_from_the_export_with_its_weights(trained_moe, job_dir):
    """init_from_hf: the first loss is the exported weights' loss on batch 0 (every
    ``expert_bias`` zero, as trained)."""
    result = run_forked(
        job_dir, *JOB, "trainer.steps=1", f"checkpoint.init_from_hf={trained_moe / 'hf'}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records, summary = read_job(job_dir)
    assert summary["loaded_from"] == str(trained_moe / "hf") and summary["start_step"] == 0
    weights, manifest = load_full_weights(trained_moe / "checkpoints" / "step-2")
    model = model_spec(manifest["model"]).build()
    model.load_state_dict(weights)
    inputs, targets = _batches(compose(JOB)).local_batch(0)
    with torch.no_grad():
        loss = F.cross_entropy(model.eval()(inputs).flatten(0, 1), targets.flatten()).item()
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize(
    "key, value",
    [("score_func", "sigmoid"), ("route_scale", 2.5), ("bias_update_speed", 0.001)],
)
def test_the_export_cli_refuses_a_model_qwen3_moe_cannot_express(
    trained_moe, tmp_path, capsys, key, value
):
    """A checkpoint of such a model (the trained one, its manifest saying it was trained with
    ``model.<key>=<value>``: same tensors) exits 2 with one line naming the key."""
    checkpoint = tmp_path / "step-2"
    shutil.copytree(trained_moe / "checkpoints" / "step-2", checkpoint)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["model"][key] = value
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    assert export.main([str(checkpoint), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"model.{key}={value}" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.n_shared_experts=1", "n_shared_experts"),
        ("model.score_func=sigmoid", "score_func"),
        ("model.route_scale=2.5", "route_scale"),
        ("model.qk_norm=false", "qk_norm"),
        ("model.bias_update_speed=0.001", "bias_update_speed"),
    ],
)
def test_settings_qwen3_moe_cannot_express_are_refused_before_training(override, key):
    with pytest.raises(ConfigError, match=f"model.{key}="):
        hf.check_exportable(_spec(override))


def test_a_nonzero_balancing_bias_is_refused_at_export():
    spec, model = _random_model()
    state = dict(model.state_dict())
    state["layers.2.moe.router.expert_bias"] = torch.full((spec.n_experts,), 0.01)
    with pytest.raises(ConfigError, match="layers.2.moe.router.expert_bias is nonzero"):
        hf.to_hf(state, spec, torch.float32)


def test_export_at_end_with_a_balancing_bias_fails_before_any_step(job_dir):
    result = run_forked(
        job_dir, *JOB, "model.bias_update_speed=0.001", "checkpoint.export_at_end=true"
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "model.bias_update_speed=0.001" in result.stderr
    assert read_job(job_dir)[0] == []


def test_a_folder_whose_dense_layers_are_not_the_first_is_refused(tmp_path):
    spec, model = _random_model()
    folder = tmp_path / "hf"
    hf.write_export(model.state_dict(), spec, torch.float32, folder, 1.0)
    config = json.loads((folder / hf.CONFIG_FILE).read_text())
    config["decoder_sparse_step"] = 2  # layers 0 (mlp_only_layers) and 2 dense, 1 sparse
    (folder / hf.CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(hf.HFFormatError, match=r"makes layers \[0, 2\] dense"):
        hf.check_folder(folder, spec, {})


def test_a_model_qwen3_moe_cannot_express_cannot_start_from_a_qwen3_moe_folder(tmp_path):
    spec, model = _random_model()
    hf.write_export(model.state_dict(), spec, torch.float32, tmp_path / "hf", 1.0)
    with pytest.raises(ConfigError, match="model.n_shared_experts=1"):
        hf.check_folder(tmp_path / "hf", _spec("model.n_shared_experts=1"), {})
