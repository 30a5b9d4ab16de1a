"""Put lightning_par's config groups on every Hydra app's search path (after the app's own configs).

The configs are the repository's ``conf/`` directory, shipped in the wheel as the package ``lightning_par.conf``.
From a source checkout (the repository on ``PYTHONPATH``, or an editable install) the ``conf/`` directory beside the
``lightning_par`` package is used instead, so edits to it take effect without reinstalling.
"""

import importlib.util
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

__all__ = ["LightningParSearchPathPlugin", "conf_search_path"]

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


class LightningParSearchPathPlugin(SearchPathPlugin):
    """Appends lightning_par's configs to the search path: lowest priority, so an app's own groups win."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        path = conf_search_path()
        if path is not None:
            search_path.append(provider=PROVIDER, path=path)
