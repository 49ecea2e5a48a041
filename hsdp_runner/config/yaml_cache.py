"""Parsed config files, kept per process: ``load(path)`` parses a YAML file once for each
content it has had, and hands every caller its own copy.

Hydra reads and parses every file of the defaults tree again at each composition (its own
cache, ``CachingConfigRepository``, lives for one composition), and this runner composes many
times in one process: a sweep composes each job twice (the pre-launch check and the job), the
planner and ``parity`` compose a config per layout, and the tests a few hundred. Parsing
and building the files' configs is a quarter of a composition here (112 -> 86 ms with this
cache for conf/ and Hydra's own configs; a copy costs a seventh of a parse). Hydra has no
setting for this; its extension point is a config source plugin
(``hydra_plugins/hsdp_runner_config_cache``), which reads through this module.
"""

from __future__ import annotations

import copy
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

# (resolved path, file bytes) -> the parsed config. Keyed by content, not a modification
# time, so a file rewritten within one clock tick is parsed again.
_parsed: dict[tuple[str, bytes], DictConfig | ListConfig] = {}


def load(path: str | Path) -> DictConfig | ListConfig:
    """The config in the YAML file ``path``, as ``OmegaConf.load`` returns it, parsed once per
    content and process; a copy the caller may change. Raises OSError as ``open`` does."""
    path = Path(path)
    text = path.read_bytes()
    key = (str(path), text)
    if key not in _parsed:
        _parsed[key] = OmegaConf.load(path)
    return copy.deepcopy(_parsed[key])
