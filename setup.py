"""Packaging beyond what pyproject.toml can say: the repository's top-level ``conf/`` ships inside the package as
``lightning_par.conf`` (one package per config group, found by the Hydra search-path plugin), and the
``hydra_plugins`` namespace package holds the Hydra plugins; the planner's published measurements
(``lightning_par/planner/data/calibration.json``) ship as package data of the data-only package
``lightning_par.planner.data`` (a folder without ``__init__.py``, named here so that setuptools includes it without
warning). Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup

conf = Path(__file__).resolve().parent / "conf"
conf_packages = ["lightning_par.conf", *(f"lightning_par.conf.{d.name}" for d in sorted(conf.iterdir()) if d.is_dir())]

setup(
    packages=[*find_packages(include=["lightning_par", "lightning_par.*"]), "lightning_par.planner.data",
              *conf_packages, "hydra_plugins.lightning_par_hydra"],
    package_dir={"lightning_par.conf": "conf"},
    package_data={**{name: ["*.yaml"] for name in conf_packages}, "lightning_par.planner.data": ["*.json"]},
)
