"""Hydra composition: every group option composes, typos and wrong types fail naming the key."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from hsdp_runner.config.checks import bad_choice_override, validate_batch, validate_config
from hsdp_runner.config.compose import CONF_DIR as CONF
from hsdp_runner.config.compose import compose, to_run_config
from hsdp_runner.core.choices import AC, DataKind
from hsdp_runner.core.errors import ConfigError

GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in CONF.iterdir() if g.is_dir()}


def test_every_group_has_its_options():
    assert GROUPS["parallel"] == sorted(
        [
            "single",
            "pp",
            "pp_fsdp",
            "pp_fsdp_tp",
            "pp_hsdp",
            "ddp",
            "fsdp",
            "hsdp",
            "tp",
            "fsdp_tp",
            "hsdp_tp",
            "cp",
            "fsdp_cp",
            "hsdp_cp_tp",
            "auto",
        ]
    )
    assert {"llama3_debug", "llama3_1b", "llama3_8b", "llama3_70b"} <= set(GROUPS["model"])
    assert GROUPS["precision"] == ["bf16", "bf16_pure", "float8", "float8_rowwise", "fp32"]
    assert set(GROUPS["data"]) == {"synthetic", "text", "hf"}
    assert set(GROUPS["logger"]) == {"wandb", "none"}


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_each_group_option_composes_and_validates(group, option):
    # A job's cluster is null unless chosen (parallel=auto plans for it; the planner's
    # conf/plan.yaml picks h100_sxm): cluster=<preset> chooses one, like any other group.
    cfg = compose([f"{group}={option}"])
    validate_config(to_run_config(cfg))
    if group == "model":
        assert cfg.model.name == option


def test_presets_hold_their_degrees():
    expected = {
        "single": (1, 1, 1, 1),
        "ddp": (2, 1, 1, 1),
        "fsdp": (1, 4, 1, 1),
        "hsdp": (2, 2, 1, 1),
        "tp": (1, 1, 1, 2),
        "fsdp_tp": (1, 2, 1, 2),
        "hsdp_tp": (2, 2, 1, 2),
        "cp": (1, 1, 2, 1),
        "fsdp_cp": (1, 2, 2, 1),
        "hsdp_cp_tp": (2, 1, 2, 2),
    }
    for name, degrees in expected.items():
        p = compose([f"parallel={name}"]).parallel
        assert (p.dp_replicate, p.dp_shard, p.cp, p.tp) == degrees, name
        assert not p.auto
    auto = compose(["parallel=auto"]).parallel
    assert (auto.dp_replicate, auto.dp_shard, auto.tp, auto.auto) == (-1, -1, -1, True)


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


@pytest.mark.parametrize(
    "override, allowed",
    [
        ("parallel.ac=sometimes", "[none, full, selective, moe, moe_act]"),
        ("parallel.ddp_impl=ddp", "[replicate, fully_shard]"),
        ("precision.param_dtype=float8", "[float32, bfloat16, float16]"),
        ("data.kind=images", "[synthetic, text, hf]"),
        ("logger.name=tensorboard", "[wandb, none]"),
        ("logger.mode=cloud", "[offline, online, disabled]"),
        ("trainer.on_nan=ignore", "[stop, skip]"),
        ("checkpoint.resume=always", "[auto, never]"),
        ("launcher.name=pbs", "[local, slurm, slurm_local]"),
    ],
)
def test_a_bad_choice_fails_at_composition_listing_the_allowed_values(override, allowed):
    key, value = override.split("=")
    with pytest.raises(ConfigCompositionException) as err:
        compose([override])
    text = f"{err.value} {err.value.__cause__}"
    assert f"Invalid value '{value}', expected one of {allowed}" in text
    assert f"full_key: {key}" in text


def test_choices_dispatch_as_enums_and_read_as_strings():
    cfg = compose(["parallel.ac=selective", "data=text"])
    assert cfg.parallel.ac is AC.selective and cfg.data.kind is DataKind.text
    assert cfg.parallel.ac == "selective" and f"{cfg.data.kind}" == "text"
    assert OmegaConf.to_yaml(cfg.parallel).count("ac: selective") == 1


def test_fault_kind_nan_composes_although_hydra_reads_it_as_a_float():
    cfg = compose(["fault.kind=nan"])
    assert cfg.fault.kind == "nan"
    validate_config(to_run_config(cfg))


def test_a_plain_dict_config_gets_the_same_choice_check():
    cfg = OmegaConf.to_container(compose([]), resolve=True, enum_to_str=True)
    cfg["fault"]["kind"] = "segfault"
    with pytest.raises(
        ConfigError,
        match="fault.kind='segfault' is not one of exception, sigkill, sigterm, nan, hang",
    ):
        validate_config(to_run_config(cfg))


def test_a_bad_choice_on_the_command_line_reads_as_one_line():
    assert bad_choice_override(["parallel=fsdp", "parallel.ac=full,sometimes"]) == (
        "parallel.ac='sometimes' is not one of none, full, selective, moe, moe_act; set parallel.ac to one "
        "of them"
    )
    assert bad_choice_override(["parallel.ac=full", "+logger.mode=online", "device=cpu"]) is None
    assert bad_choice_override(["parallel.ac=${oc.env:AC}"]) is None  # left to composition


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.steps=0", "trainer.steps=0"),
        ("metrics.peak_tflops=-1", "metrics.peak_tflops"),
        ("model.n_heads=5", "model.dim=256 is not divisible by model.n_heads=5"),
    ],
)
def test_validation_errors_name_key_and_value(override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(".", r"\.")):
        validate_config(to_run_config(compose([override])))


def test_batch_must_split_over_dp_and_accumulation():
    cfg = compose(["trainer.global_batch_size=6", "trainer.grad_accum_steps=1"])
    with pytest.raises(ConfigError, match=r"trainer.global_batch_size=6 is not divisible .* 4"):
        validate_batch(cfg.trainer, dp_size=4)
    cfg = compose(["trainer.global_batch_size=16", "trainer.grad_accum_steps=2"])
    assert validate_batch(cfg.trainer, 4) == 2


def test_a_config_file_is_parsed_once_per_content_and_every_caller_gets_its_own_copy(
    tmp_path, monkeypatch
):
    from hsdp_runner.config import yaml_cache

    path = tmp_path / "a.yaml"
    path.write_text("x: 1\ny: [1, 2]\n")
    parses = []
    load = OmegaConf.load
    monkeypatch.setattr(OmegaConf, "load", lambda p: parses.append(p) or load(p))
    first = yaml_cache.load(path)
    first.x = 5
    del first["y"]  # Hydra takes the defaults list out of the config it loaded
    assert yaml_cache.load(path) == {"x": 1, "y": [1, 2]} and len(parses) == 1
    path.write_text("x: 2\ny: [1, 2]\n")  # the same size, perhaps the same modification time
    assert yaml_cache.load(path).x == 2 and len(parses) == 2


def test_hydra_reads_conf_through_the_parse_once_source_and_composes_what_its_file_source_does(
    monkeypatch,
):
    """The search-path plugin puts ``hsdp-yaml`` and ``hsdp-pkg`` in place of Hydra's file and
    package sources where this checkout's conf/ is on the search path (only there), and the
    configs it composes equal those of Hydra's own sources."""
    from hydra import initialize_config_dir
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    def schemes():
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return [s.scheme() for s in GlobalHydra.instance().config_loader().get_sources()]

    cases = [
        ["model=moe_tiny", "parallel=hsdp", "parallel.ep=2"],
        ["parallel=fsdp_tp", "precision=float8", "trainer.steps=3"],
        ["model=gpt2_tiny", "parallel=pp_fsdp", "launcher=slurm"],
    ]
    assert schemes() == ["hsdp-pkg", "hsdp-yaml", "structured"]
    parsed_once = [OmegaConf.to_container(compose(c)) for c in cases]
    (plugin,) = [p for p in Plugins.instance().discover(SearchPathPlugin) if "hsdp" in p.__module__]
    other_app = ConfigSearchPathImpl()
    other_app.append("hydra", "pkg://hydra.conf")
    other_app.append("main", "file:///elsewhere/conf")
    plugin().manipulate_search_path(other_app)
    assert [e.path for e in other_app.get_path()] == ["pkg://hydra.conf", "file:///elsewhere/conf"]
    monkeypatch.setattr(plugin, "manipulate_search_path", lambda self, search_path: None)
    assert schemes() == ["pkg", "file", "structured"]
    assert [OmegaConf.to_container(compose(c)) for c in cases] == parsed_once
