"""safetensors export and import: transformers gives our logits; training starts from an export."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY, cli_env, cli_server, read_job, run_forked
from omegaconf import OmegaConf

from hsdp_runner.checkpoint import hf
from hsdp_runner.export import load_full_weights
from hsdp_runner.models.llama import Llama


def _transformers():
    """transformers, imported on first use: only the tests that load an export need it."""
    return pytest.importorskip("transformers")


def _our_model(checkpoint):
    weights, manifest = load_full_weights(checkpoint)
    cfg = OmegaConf.create(manifest["model"])
    model = Llama(cfg)
    model.load_state_dict(weights)
    return model.eval(), cfg


def _hf_logits(folder, tokens):
    model = _transformers().LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


def test_hf_names_and_rope_order_round_trip_exactly():
    cfg = OmegaConf.create(
        {
            "dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "vocab_size": 256,
            "ffn_hidden_dim": 192,
            "seq_len": 32,
            "norm_eps": 1e-5,
            "rope_theta": 1e4,
            "init_std": 0.02,
        }
    )
    state = {k: torch.randn(v.shape) for k, v in Llama(cfg).state_dict().items()}
    exported = hf.to_hf(state, cfg, torch.float32)
    assert "model.layers.1.self_attn.k_proj.weight" in exported and "lm_head.weight" in exported
    assert not torch.equal(
        exported["model.layers.0.self_attn.q_proj.weight"], state["layers.0.attention.wq.weight"]
    )
    back = hf.from_hf(exported, cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_export_loads_in_transformers_with_the_same_logits(trained_checkpoint):
    model, cfg = _our_model(trained_checkpoint / "checkpoints" / "step-2")
    tokens = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours = model(tokens)
    theirs = _hf_logits(trained_checkpoint / "hf", tokens)
    assert (
        json.loads((trained_checkpoint / "hf" / "config.json").read_text())["torch_dtype"]
        == "float32"
    )
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_export_cli_splits_into_shards_with_an_index_above_the_size_limit(
    trained_checkpoint, tmp_path
):
    out = tmp_path / "bf16"
    # The checkpoints folder stands for its newest complete checkpoint (step-2).
    argv = [
        str(trained_checkpoint / "checkpoints"),
        str(out),
        "--dtype",
        "bfloat16",
        "--max-shard-gib",
        "0.0002",
    ]
    result = cli_server().run(argv, cli_env(), REPO, 120, tmp_path, module="hsdp_runner.export")
    assert result.returncode == 0, result.stderr
    index = json.loads((out / hf.INDEX_FILE).read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert not (out / hf.SINGLE_FILE).exists()
    transformers = _transformers()
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    fp32 = transformers.LlamaForCausalLM.from_pretrained(trained_checkpoint / "hf")
    for (name, p16), (_, p32) in zip(model.named_parameters(), fp32.named_parameters()):
        assert torch.equal(p16, p32.to(torch.bfloat16)), name


def test_training_starts_from_a_safetensors_folder_under_tp(trained_checkpoint, job_dir):
    """init_from_hf under TP: the first loss is the exported weights' loss on batch 0 (the job's
    ranks forked without torch's elastic launch: conftest's ``run_forked``)."""
    from hsdp_runner.train.data import TokenBatches

    result = run_forked(
        job_dir,
        *TINY,
        "parallel=tp",
        "trainer.steps=1",
        f"checkpoint.init_from_hf={trained_checkpoint / 'hf'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records, summary = read_job(job_dir)
    assert summary["loaded_from"] == str(trained_checkpoint / "hf") and summary["start_step"] == 0

    model, cfg = _our_model(trained_checkpoint / "checkpoints" / "step-2")
    batches = TokenBatches(
        OmegaConf.create({"kind": "synthetic", "path": None}),
        cfg.vocab_size,
        cfg.seq_len,
        8,
        dp_rank=0,
        dp_size=1,
        seed=0,
    )
    inputs, targets = batches.local_batch(0)
    with torch.no_grad():
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5)
