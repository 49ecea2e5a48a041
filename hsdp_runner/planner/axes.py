"""What a plan varies and the options it is made with: ``plan.axes`` values applied to the
composed config, and the ``plan.*`` options checked before anything is planned.

An axis is a dotted key of the job config with several values (``plan.axes.parallel.ac=none,
full``): each combination is applied to the composed config as an override would be
(``axis_configs``), then converted once to the typed ``RunConfig`` the planning reads. The
degrees are never an axis: they are always enumerated (``planner.degrees``).
"""

from __future__ import annotations

import functools
import itertools
from enum import Enum

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hsdp_runner.config.checks import validate_config
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.config.schema import PlanConfig, RunConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.expert_parallel import compile_refusal
from hsdp_runner.models.base import routed_experts
from hsdp_runner.planner.degrees import PLANNED_DIMS, check_ep_degrees


def check_plan_options(plan: PlanConfig, model=None) -> None:
    """Raise ConfigError for ``plan.*`` options the planner cannot work with (for ``model``, the
    job's model config, where given: expert-parallel degrees for a model without experts)."""
    layers = list(plan.layers_measured)
    if len(set(layers)) < 2 or min(layers) < 1:
        raise ConfigError(
            f"plan.layers_measured={layers} needs two different block counts >= 1 "
            "to extrapolate per block, e.g. plan.layers_measured=[1,2]"
        )
    if plan.top_k < 1:
        raise ConfigError(f"plan.top_k={plan.top_k} must be >= 1")
    if plan.expert_imbalance < 1:
        raise ConfigError(
            f"plan.expert_imbalance={plan.expert_imbalance} must be >= 1: the busiest ep "
            "rank's routed tokens over the mean (1.0 = uniform routing)"
        )
    if model is not None:
        check_ep_degrees(plan.ep_degrees, routed_experts(model))


def check_axis_keys(cfg: DictConfig, axes: dict) -> None:
    """Raise ConfigError for an axis key that is not a key of the job config, or a degree."""
    for key in axes:
        if (
            key.split(".")[0] in ("cluster", "plan")
            or OmegaConf.select(cfg, key, default="<absent>") == "<absent>"
        ):
            raise ConfigError(
                f"plan.axes.{key}: {key} is not a key of the job config; "
                "axes take dotted keys such as plan.axes.parallel.ac=none,selective"
            )
        if key.split(".")[-1] in PLANNED_DIMS:
            raise ConfigError(f"plan.axes.{key}: the degrees are always enumerated; drop it")


def axis_configs(cfg: DictConfig, axes: dict[str, list]) -> list[tuple[dict, RunConfig]]:
    """One (axis values, typed config) per combination of the axes; each config validated.

    A value that is a string is typed as YAML types it (``true`` -> bool, ``2`` -> int);
    ``plan.check_axes`` hands over values already typed by composing them as overrides.
    """
    check_axis_keys(cfg, axes)
    out = []
    for values in itertools.product(*axes.values()) if axes else [()]:
        variant = cfg.copy()
        chosen = dict(zip(axes, values))
        for key, value in chosen.items():
            if isinstance(value, str):
                value = OmegaConf.create({"v": value}).v  # YAML typing: true -> bool, 2 -> int
            try:
                OmegaConf.update(variant, key, value, merge=False)
            except OmegaConfBaseException as err:
                raise ConfigError(f"plan.axes.{key}={value}: {str(err).splitlines()[0]}") from None
        typed = to_run_config(variant)  # the one conversion of this candidate
        validate_config(typed)
        # What a job refuses before its workers start, whatever its degrees, is not planned.
        refusal = compile_refusal(typed.parallel, typed.precision, typed.model)
        if refusal:
            raise ConfigError(refusal)
        out.append((chosen, typed))
    return out


def plain_value(value):
    """A config value as YAML and JSON write it: a choice (an Enum) as its string."""
    return value.value if isinstance(value, Enum) else value


def typed_value(cfg: RunConfig, dotted: str):
    """The typed config's value at a dotted key (an axis, e.g. ``parallel.ac``)."""
    return functools.reduce(getattr, dotted.split("."), cfg)
