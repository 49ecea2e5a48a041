"""A config source that parses each YAML file of hsdp_runner's config once a process
(``hsdp_runner.config.yaml_cache``), and the search-path plugin that puts it in place of
Hydra's file source for the runner's own ``conf/`` (a ``--config-dir``, such as ``sweeps/``,
joins the search path after the plugins ran and is read by Hydra's file source; its one file
is the sweep's primary config, parsed again per job).

Hydra finds config sources and search-path plugins only in the ``hydra_plugins`` package and
lets none replace the ``file`` and ``pkg`` schemes, hence schemes of their own
(``hsdp-yaml``, ``hsdp-pkg``) and the search path rewritten to them. Other Hydra applications
are left alone: the rewrite applies only where ``conf/`` of this checkout is on the search
path.
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra._internal.core_plugins import file_config_source, importlib_resources_config_source
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin

SCHEME = "hsdp-yaml"
PACKAGE_SCHEME = "hsdp-pkg"
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def _parsed_once(source: ConfigSource, path: str | Path) -> ConfigResult:
    """What Hydra's sources return for the config file at ``path``: its header (the first 512
    characters' ``# @package`` lines) and its config, from ``yaml_cache.load``."""
    from hsdp_runner.config import yaml_cache

    with open(path, encoding="utf-8") as f:
        header = ConfigSource._get_header_dict(f.read(512))
    return ConfigResult(
        config=yaml_cache.load(path),
        path=f"{source.scheme()}://{source.path}",
        provider=source.provider,
        header=header,
    )


class ParsedOnceConfigSource(file_config_source.FileConfigSource):
    """Hydra's file source (listing, groups, headers) whose configs come from
    ``yaml_cache.load``."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def load_config(self, config_path: str) -> ConfigResult:
        full_path = os.path.realpath(
            os.path.join(self.path, self._normalize_file_name(config_path))
        )
        if not os.path.exists(full_path):
            raise ConfigLoadError(f"Config not found : {full_path}")
        return _parsed_once(self, full_path)


class ParsedOncePackageSource(importlib_resources_config_source.ImportlibResourcesConfigSource):
    """Hydra's package source (its own ``pkg://hydra.conf``: the hydra node's defaults, read at
    every composition) whose configs come from ``yaml_cache.load`` where the package is a
    folder, as installed; from a zip, as Hydra reads them."""

    @staticmethod
    def scheme() -> str:
        return PACKAGE_SCHEME

    def load_config(self, config_path: str) -> ConfigResult:
        from importlib import resources

        res = resources.files(self.path).joinpath(self._normalize_file_name(config_path))
        if not isinstance(res, Path):
            return super().load_config(config_path)
        if not res.is_file():
            raise ConfigLoadError(f"Config not found : {self._normalize_file_name(config_path)}")
        return _parsed_once(self, res)


class ParsedOnceSearchPath(SearchPathPlugin):
    """Where this checkout's ``conf/`` is on the search path, every ``file://`` entry reads
    through ``ParsedOnceConfigSource`` and every ``pkg://`` one through
    ``ParsedOncePackageSource`` instead."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        elements = search_path.get_path()
        if not any(_file_dir(e.path) == str(CONF_DIR) for e in elements):
            return
        for element in elements:
            if (directory := _file_dir(element.path)) is not None:
                element.path = f"{SCHEME}://{directory}"
            elif element.path.startswith("pkg://"):
                element.path = f"{PACKAGE_SCHEME}://{element.path[len('pkg://') :]}"


def _file_dir(path: str) -> str | None:
    """The directory of a search-path entry Hydra reads with its file source (``file://<dir>``,
    or a bare directory, as ``initialize_config_dir`` adds it); None for any other scheme."""
    if path.startswith("file://"):
        return path[len("file://") :]
    return None if "://" in path else path
