"""The fault-tolerant job on one machine: a torchft lighthouse and N replica groups, each a recipe world of its own
(lightning_par.train_ft; docs/fault-tolerance.md).

    python recipes/train_ft.py strategy=zero2 parallel=dp2 model=tiny trainer=smoke \\
        strategy.fault_tolerance.enabled=true strategy.fault_tolerance.num_replica_groups=2

Outputs: <run_dir>/group<g>/ (each group's logs, checkpoints, summary.json), <run_dir>/group<g>.log and
<run_dir>/summary.json (every group's summary). Installed without this repository: python -m lightning_par.train_ft.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import lightning_par  # noqa: F401  (registers the strategies)
from lightning_par.config.schema import register_configs
from lightning_par.train_ft import run_ft_recipe

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_ft_recipe(cfg)


if __name__ == "__main__":
    main()
