"""The one bootstrap for composing the config: where ``conf/`` is, the schema registration, the
resolvers, and ``compose`` for callers outside ``@hydra.main`` (parity, the planner, tests).

``app`` (the Hydra application), ``parity``, ``plan`` and the tests all start here, so a new
resolver or schema is added once.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hsdp_runner.config.checks import check_plain_config
from hsdp_runner.config.schema import RunConfig, register_schemas
from hsdp_runner.models.base import family_schema, model_fields

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def default_run_dir() -> str:
    """Output dir of a single run: time-stamped, or one name shared by all torchrun ranks.

    Every torchrun rank composes the config itself, so a clock-based name could differ between
    ranks; they share the rendezvous id (or, without one, their agent's pid and start time).
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or "RANK" not in os.environ:
        return datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")
    if run_id in ("", "none"):
        run_id = f"{os.uname().nodename}-{os.getppid()}-{_process_start(os.getppid())}"
    return f"outputs/torchrun/{run_id}"


def _process_start(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def bootstrap() -> None:
    """Register the typed schemas and the ``hsdp_run_dir`` resolver (idempotent)."""
    register_schemas()
    if not OmegaConf.has_resolver("hsdp_run_dir"):
        OmegaConf.register_new_resolver("hsdp_run_dir", default_run_dir)


def compose(overrides: list[str], config_name: str = "config") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with ``overrides`` (Hydra's compose API) and return
    the typed config; raises Hydra's ConfigCompositionException on a bad override."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    bootstrap()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)


def to_run_config(cfg: DictConfig | dict) -> RunConfig:
    """The typed config: the schema dataclasses (``RunConfig``, the model as its family's
    dataclass), built once where a config arrives (the launcher, which sends it to its workers
    typed; a torchrun or SLURM rank; a pre-submit check).

    Takes a composed DictConfig or its plain resolved container (a checkpoint's or a run's copy);
    ``hydra`` (present in a sweep job's config) is dropped. Raises ConfigError naming the key
    for a choice outside its Enum or a key the schema does not know (added with ``+``).
    """
    # Section by section: a sweep job's ``hydra`` node holds interpolations that resolve only
    # inside Hydra's own job context.
    plain = {
        key: OmegaConf.to_container(cfg[key], resolve=True)
        if OmegaConf.is_config(cfg[key])
        else copy.deepcopy(cfg[key])
        for key in cfg
        if key != "hydra"
    }
    check_plain_config(plain)
    model = model_fields(plain.pop("model"))
    node = OmegaConf.merge(schema_node(RunConfig), plain)
    node.model = OmegaConf.merge(schema_node(family_schema(model)), model)
    return OmegaConf.to_object(node)


@functools.cache
def schema_node(schema: type) -> DictConfig:
    """OmegaConf's config of the dataclass ``schema`` with its defaults, built once a process
    (two thirds of a ``to_run_config``). Never changed: ``OmegaConf.merge`` copies its first
    argument before merging into it."""
    return OmegaConf.structured(schema)


def plain_config(cfg: RunConfig) -> dict:
    """The typed config as plain data (choices as their strings): what W&B's run config and
    JSON files hold."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
