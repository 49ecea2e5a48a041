"""Hydra composition: every group option composes, typos and wrong types fail naming the key."""

from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from hsdp_runner.compose import CONF_DIR as CONF
from hsdp_runner.compose import compose
from hsdp_runner.config import ConfigError
from hsdp_runner.config_checks import validate_batch, validate_config

GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in CONF.iterdir() if g.is_dir()}


def test_every_group_has_its_options():
    assert GROUPS["parallel"] == sorted(["single", "ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "hsdp_tp"])
    assert {"llama3_debug", "llama3_1b", "llama3_8b", "llama3_70b"} <= set(GROUPS["model"])
    assert GROUPS["precision"] == ["bf16", "bf16_pure", "fp32"]
    assert set(GROUPS["data"]) == {"synthetic", "text"}
    assert set(GROUPS["logger"]) == {"wandb", "none"}


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_each_group_option_composes_and_validates(group, option):
    # A job has no cluster by default (only the planner's conf/plan.yaml picks one): append it.
    cfg = compose([f"{'+' if group == 'cluster' else ''}{group}={option}"])
    validate_config(cfg)
    if group == "model":
        assert cfg.model.name == option


def test_presets_hold_their_degrees():
    expected = {"single": (1, 1, 1), "ddp": (2, 1, 1), "fsdp": (1, 4, 1), "hsdp": (2, 2, 1),
                "tp": (1, 1, 2), "fsdp_tp": (1, 2, 2), "hsdp_tp": (2, 2, 2)}
    for name, degrees in expected.items():
        p = compose([f"parallel={name}"]).parallel
        assert (p.dp_replicate, p.dp_shard, p.tp) == degrees, name


def test_default_job_is_small_hsdp_on_debug_model():
    cfg = compose([])
    assert (cfg.parallel.dp_replicate, cfg.parallel.dp_shard) == (2, 2)
    assert cfg.model.name == "llama3_debug" and cfg.model.dim == 256 and cfg.model.n_layers == 6
    assert cfg.precision.name == "fp32" and cfg.logger.mode == "offline"


def test_unknown_key_fails_at_composition_naming_it():
    with pytest.raises(ConfigCompositionException) as err:
        compose(["parallel.tpp=2"])
    assert "tpp" in str(err.value) or "tpp" in str(err.value.__cause__)


def test_wrong_type_fails_at_composition_naming_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        compose(["parallel.tp=two"])
    text = f"{err.value} {err.value.__cause__}"
    assert "tp" in text and "two" in text


@pytest.mark.parametrize("override, words", [
    ("parallel.ac=sometimes", "parallel.ac='sometimes'"),
    ("precision.param_dtype=float8", "precision.param_dtype"),
    ("trainer.steps=0", "trainer.steps=0"),
    ("data.kind=images", "data.kind"),
    ("logger.mode=cloud", "logger.mode"),
    ("metrics.peak_tflops=-1", "metrics.peak_tflops"),
    ("model.n_heads=5", "model.dim=256 is not divisible by model.n_heads=5"),
])
def test_validation_errors_name_key_and_value(override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(".", r"\.")):
        validate_config(compose([override]))


def test_batch_must_split_over_dp_and_accumulation():
    cfg = compose(["trainer.global_batch_size=6", "trainer.grad_accum_steps=1"])
    with pytest.raises(ConfigError, match=r"trainer.global_batch_size=6 is not divisible .* 4"):
        validate_batch(cfg, dp_size=4)
    assert validate_batch(compose(["trainer.global_batch_size=16", "trainer.grad_accum_steps=2"]), 4) == 2
