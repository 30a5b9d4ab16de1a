"""Every module of the package imports: the first step of ``make test`` (CI's gate), so that a broken import anywhere in
``lightning_par/`` fails CI in seconds, before any slower tier runs. Modules are listed from the source tree
(``pkgutil.walk_packages``), so a new module is checked without anyone listing it."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import lightning_par

MODULES = sorted(m.name for m in pkgutil.walk_packages(lightning_par.__path__, "lightning_par.")
                 if not m.name.endswith(".__main__") and ".conf" not in m.name)


def test_the_package_has_its_modules():
    assert len(MODULES) > 100 and "lightning_par.parallel_dims" in MODULES, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    importlib.import_module(name)
