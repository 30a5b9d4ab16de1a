"""The main job: train a model under a lightning_par strategy, configured by Hydra (the reference GPT by default).

    python recipes/train.py                                  # small GPT, stdlib corpus, 2 CPU processes, ddp_overlap
    python recipes/train.py parallel=dp4 model=tiny trainer=smoke
    python recipes/train.py -m parallel=dp1,dp2              # a sweep: one multi-process world per job
    python recipes/train.py model=custom model._target_=my_pkg.MyModule +model.hidden=512

Outputs go to the Hydra run directory: Lightning logs (CSV, TensorBoard), checkpoints, train.log and summary.json.
Installed without this repository, the same job is ``python -m lightning_par.train``.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import lightning_par  # noqa: F401  (registers the strategies)
from lightning_par.config.schema import register_configs
from lightning_par.train import run_recipe

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return run_recipe(cfg)


if __name__ == "__main__":
    main()
