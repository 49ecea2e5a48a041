"""The GPT-2 family, added through the model seam: its presets compose with every layout, its
schema rejects typos, its counts match the built model, its Hugging Face export computes what
``transformers.GPT2LMHeadModel`` computes. (Parity: test_parity.py; resharding: test_checkpoint.py.)"""

import math

import pytest
import torch
from hydra.errors import ConfigCompositionException
from test_config import GROUPS, compose

from hsdp_runner.checkpoint import hf
from hsdp_runner.config.checks import validate_config
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.parallel_dims import DIM_NAMES, ParallelDims
from hsdp_runner.models.base import build_meta_model, model_spec

TINY = "model=gpt2_tiny"


# parallel=auto has no degrees until it plans (tests/test_auto.py covers it).
@pytest.mark.parametrize("layout", [name for name in GROUPS["parallel"] if name != "auto"])
def test_gpt2_tiny_composes_and_validates_with_every_parallel_preset(layout):
    cfg = compose([TINY, f"parallel={layout}"])
    validate_config(to_run_config(cfg))
    p = cfg.parallel
    dims = ParallelDims.from_config(p, cfg.model, math.prod(p[name] for name in DIM_NAMES))
    assert dims.world_size >= 1 and type(model_spec(cfg.model)).__name__ == "GPT2Config"


@pytest.mark.parametrize(
    "override", ["model.n_kv_heads=2", "model.rope_theta=1.0", "model.norm_eps=tiny"]
)
def test_gpt2_schema_rejects_llama_keys_and_wrong_types_at_composition(override):
    with pytest.raises(ConfigCompositionException):
        compose([TINY, override])


def test_tp_must_divide_the_gpt2_heads():
    cfg = compose([TINY, "parallel=tp", "parallel.tp=3"])
    with pytest.raises(ConfigError, match="parallel.tp=3 does not divide model.n_heads=4"):
        ParallelDims.from_config(cfg.parallel, cfg.model, 3)


def test_gpt2_small_is_124m_parameters_plus_its_untied_output_layer():
    spec = model_spec(compose(["model=gpt2_small"]).model)
    built = sum(p.numel() for p in build_meta_model(spec).parameters())
    assert spec.count_params()["total"] == built == 124_439_808 + 50257 * 768
    d, layers = 768, 12
    matmul = layers * 12 * d * d + 50257 * d
    assert spec.flops_per_token() == 6 * matmul + 12 * layers * d * 1024


def _random_tiny():
    """gpt2_tiny with every parameter (biases and norms included) random, in eval mode."""
    spec = model_spec(compose([TINY]).model)
    model = spec.build()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return spec, model.eval()


def test_hf_mapping_round_trips_exactly():
    spec, model = _random_tiny()
    state = model.state_dict()
    exported = hf.to_hf(state, spec, torch.float32)
    assert exported["transformer.h.1.attn.c_attn.weight"].shape == (64, 3 * 64)  # Conv1D (in, out)
    back = hf.from_hf(exported, spec)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_export_loads_in_transformers_gpt2_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    spec, model = _random_tiny()
    folder = tmp_path / "hf"
    hf.write_folder(
        hf.to_hf(model.state_dict(), spec, torch.float32),
        hf.hf_config(spec, torch.float32),
        folder,
        2**30,
    )
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).eval()
    assert not theirs.config.tie_word_embeddings
    # no special-token ids outside the vocabulary (transformers' GPT-2 default is 50256)
    assert theirs.config.bos_token_id is None and theirs.config.eos_token_id is None
    tokens = torch.randint(
        0, spec.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    # And back: the folder reads into our names with the weights unchanged.
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    read = hf.read_folder(folder, spec, shapes)
    assert all(torch.equal(read[k], v) for k, v in model.state_dict().items())


def test_a_llama_folder_is_refused_for_a_gpt2_model(tmp_path):
    llama = model_spec(compose(["model=llama3_tiny"]).model)
    state = {k: torch.zeros(v.shape) for k, v in build_meta_model(llama).state_dict().items()}
    hf.write_folder(
        hf.to_hf(state, llama, torch.float32),
        hf.hf_config(llama, torch.float32),
        tmp_path / "llama",
        2**30,
    )
    spec = model_spec(compose([TINY]).model)
    with pytest.raises(hf.HFFormatError, match="model_type='llama'.*'gpt2'"):
        hf.check_folder(tmp_path / "llama", spec, {})


def test_initial_weights_are_a_function_of_seed_and_name():
    spec = model_spec(compose([TINY]).model)
    a, b = spec.build(), spec.build()
    a.init_weights(3)
    b.init_weights(3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    params = dict(a.named_parameters())
    assert torch.equal(params["h.0.ln_1.weight"], torch.ones(64))
    assert torch.equal(params["h.0.attn.q_proj.bias"], torch.zeros(64))
    # The residual projections are scaled down by depth, as GPT-2 does.
    assert params["h.0.mlp.c_proj.weight"].std() < 0.7 * params["h.0.mlp.c_fc.weight"].std()


@pytest.mark.parametrize(
    "model, no_decay",
    [
        (
            "llama3_tiny",
            {
                "tok_embeddings.weight",
                "norm.weight",
                "layers.0.attention_norm.weight",
                "layers.0.ffn_norm.weight",
            },
        ),
        (
            TINY.removeprefix("model="),
            {
                "wte.weight",
                "wpe.weight",
                "ln_f.weight",
                "ln_f.bias",
                "h.0.ln_1.weight",
                "h.0.attn.q_proj.bias",
                "h.0.mlp.c_proj.bias",
            },
        ),
    ],
)
def test_the_model_spec_keeps_embeddings_norms_and_biases_out_of_weight_decay(model, no_decay):
    from hsdp_runner.train.optimizer import build_optimizer

    cfg = to_run_config(compose([f"model={model}"]))
    spec = model_spec(cfg.model)
    with torch.device("cpu"):
        built = spec.build()
    names = {id(p): n for n, p in built.named_parameters()}
    decay, zero = build_optimizer([built], cfg.optim, spec.no_weight_decay).param_groups
    assert decay["weight_decay"] == cfg.optim.weight_decay > 0 and zero["weight_decay"] == 0
    decayed = {names[id(p)] for p in decay["params"]}
    assert no_decay <= {names[id(p)] for p in zero["params"]} and not no_decay & decayed
    # Only matmul weights are decayed: 2-D, and no embedding table.
    assert decayed and all(built.get_parameter(n).ndim == 2 for n in decayed)
    assert not any(n.startswith(("tok_embeddings", "wte", "wpe")) for n in decayed)
