"""Hydra's ``compose`` for tests that compose one base many times with different values (issue 47).

A Hydra compose of ``conf/config.yaml`` costs about 0.2 s of CPU: building the defaults list, reading every YAML file
of it and merging them. ``tests/config/test_bad_inputs.py`` alone composed 98 times, almost always the same defaults
with one value changed. ``Composer`` splits the overrides the way Hydra does (``ConfigLoaderImpl`` /
``defaults_list.Overrides``): overrides that choose a config group (``model=hf``, ``strategy=zero3``, ``+x/y=z``,
anything with a package, sweeps and ``hydra.*`` keys) go through ``hydra.compose`` as they are, once per distinct
selection; overrides of config values (``trainer.max_steps=0``, ``+model.config.x=true``, ``~key``) are then applied
to a deep copy of that composed config by Hydra's own step, ``ConfigLoaderImpl._apply_overrides_to_config``, which is
exactly what ``compose`` does after merging the defaults (in the same order, on the same struct-mode config, which
then also holds the ``hydra`` node that ``compose`` deletes; errors come out as the same
``ConfigCompositionException``). The result equals ``hydra.compose(config_name, overrides)``
(``tests/config/test_bad_inputs.py::test_the_cached_compose_equals_hydra_compose`` checks it on one row of each kind).

A ``Composer`` caches per instance (make one per test module: a test that registers another structured config
afterwards gets a fresh one), returns a deep copy on every call (no test sees another's mutation), and works
inside Hydra's initialisation for ``config_dir`` or outside any (it then initialises Hydra for a base compose only).
A test whose point is the compose path itself calls ``hydra.compose``.
"""

from __future__ import annotations

import copy
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig


def _group_paths(config_dir: Path) -> frozenset[str]:
    """Every config group path of the two sources Hydra searches besides its own ``hydra/`` groups: the directories
    under ``config_dir`` and the groups of the ``ConfigStore`` (what ``ConfigRepository.group_exists`` asks them)."""
    paths = {p.relative_to(config_dir).as_posix() for p in config_dir.rglob("*") if p.is_dir()}

    def walk(node: dict, prefix: str) -> None:
        for name, child in node.items():
            if isinstance(child, dict):
                paths.add(prefix + name)
                walk(child, prefix + name + "/")

    walk(ConfigStore.instance().repo, "")
    return frozenset(paths)


class Composer:
    """``Composer(config_dir)(overrides)`` == ``hydra.compose("config", overrides)`` under ``config_dir``, with the
    group part composed once per distinct selection.

    ``config_dir``: the primary config directory (where Hydra is already initialised, it must be this one, else
    ``RuntimeError``). ``overrides``: Hydra override strings. Returns a fresh ``DictConfig`` (struct mode, no
    ``hydra`` node). Raises what ``hydra.compose`` raises (``ConfigCompositionException``,
    ``MissingConfigException``)."""

    def __init__(self, config_dir: Path | str, config_name: str = "config") -> None:
        self.config_dir = str(Path(config_dir).resolve())
        self.config_name = config_name
        self._bases: dict[tuple[str, ...], DictConfig] = {}
        self._parser = OverridesParser.create()
        self._groups: frozenset[str] | None = None  # at the first call, after the schemas are registered

    def _check_initialised(self) -> bool:
        """False where Hydra is not initialised (the base compose then initialises it for ``config_dir``)."""
        gh = GlobalHydra.instance()
        if not gh.is_initialized():
            return False
        mains = [s.path for s in gh.config_loader().get_sources() if s.provider == "main"]
        if mains != [self.config_dir]:
            raise RuntimeError(f"Hydra is initialised with {mains}, not {self.config_dir}")
        return True

    def _is_value_override(self, override) -> bool:
        """True where Hydra's ``defaults_list.Overrides`` puts the override in ``config_overrides``."""
        key = override.key_or_group
        if override.package is not None or override.is_sweep_override() or key.split(".")[0] == "hydra":
            return False
        return key not in self._groups

    def __call__(self, overrides: list[str] | tuple[str, ...]) -> DictConfig:
        initialised = self._check_initialised()
        if self._groups is None:  # Hydra's own look-up (get_group_options) copies its repository: ~0.1 s a key
            self._groups = _group_paths(Path(self.config_dir))
        overrides = list(overrides)
        parsed = self._parser.parse_overrides(overrides=overrides)
        is_value = [self._is_value_override(p) for p in parsed]
        group = tuple(o for o, v in zip(overrides, is_value) if not v)
        values = [p for p, v in zip(parsed, is_value) if v]
        if group not in self._bases:
            if initialised:
                self._bases[group] = compose(config_name=self.config_name, overrides=list(group))
            else:
                with initialize_config_dir(config_dir=self.config_dir, version_base=None):
                    self._bases[group] = compose(config_name=self.config_name, overrides=list(group))
        cfg = copy.deepcopy(self._bases[group])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg
