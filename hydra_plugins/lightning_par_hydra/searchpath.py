"""Put lightning_par's config groups on the search path of lightning_par's own Hydra entry point.

``python -m lightning_par.train`` has no config directory of its own (``config_path=None``): this plugin appends the
repository's ``conf/`` directory, shipped in the wheel as the package ``lightning_par.conf``. From a source checkout
(the repository on ``PYTHONPATH``, or an editable install) the ``conf/`` directory beside the ``lightning_par`` package
is used instead, so edits to it take effect without reinstalling.

Hydra loads search-path plugins for every app, so the plugin acts only when the running program is a lightning_par
module: appended to any app, our groups (``model``, ``strategy``, ...) would turn that app's own keys of the same names
into group selections (``strategy=zero3`` would no longer set a plain value). Your own app opts in with
``hydra: {searchpath: [pkg://lightning_par.conf]}`` in its primary config.
"""

import importlib.util
import sys
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

__all__ = ["LightningParSearchPathPlugin", "conf_search_path", "running_lightning_par"]

#: Provider name of the entry in Hydra's search path (``--info searchpath`` shows it).
PROVIDER = "lightning_par"


def conf_search_path() -> str | None:
    """Hydra search-path entry of lightning_par's configs: ``file://<checkout>/conf`` in a source checkout,
    ``pkg://lightning_par.conf`` in an installed package, ``None`` when lightning_par is not importable.

    Finds the package without importing it (importing lightning_par imports torch).
    """
    spec = importlib.util.find_spec("lightning_par")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    checkout = package.parent / "conf"
    if (checkout / "config.yaml").is_file():
        return f"file://{checkout}"
    if (package / "conf" / "config.yaml").is_file():
        return "pkg://lightning_par.conf"
    return None


def running_lightning_par() -> bool:
    """Whether the program is a lightning_par module run with ``python -m`` (``__main__.__spec__.name``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None) or ""
    return name == "lightning_par" or name.startswith("lightning_par.")


class LightningParSearchPathPlugin(SearchPathPlugin):
    """Appends lightning_par's configs to the search path of lightning_par's own entry point (lowest priority)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        path = conf_search_path() if running_lightning_par() else None
        if path is not None:
            search_path.append(provider=PROVIDER, path=path)
