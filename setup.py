"""Packaging beyond what pyproject.toml can say: the repository's top-level ``conf/`` ships inside the package as
``lightning_par.conf`` (found by the Hydra search-path plugin), and the ``hydra_plugins`` namespace package holds the
Hydra plugins. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["lightning_par", "lightning_par.*"]), "lightning_par.conf",
              "hydra_plugins.lightning_par_hydra"],
    package_dir={"lightning_par.conf": "conf"},
    package_data={"lightning_par.conf": ["*.yaml", "*/*.yaml"]},
)
