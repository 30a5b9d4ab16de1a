"""The main job: train the reference GPT under a lightning_par strategy, configured by Hydra.

    python recipes/train.py                                  # small GPT, stdlib corpus, 2 CPU processes, ddp_overlap
    python recipes/train.py parallel=dp4 model=tiny trainer=smoke
    python recipes/train.py -m parallel=dp1,dp2              # a sweep: one multi-process world per job

Outputs go to the Hydra run directory: Lightning logs (CSV, TensorBoard), checkpoints and summary.json.
"""

from __future__ import annotations

import json

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import lightning_par  # noqa: F401  (registers the strategies)
from lightning_par.config.schema import register_configs
from lightning_par.train import launch_job

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    summary = launch_job(cfg, HydraConfig.get().runtime.output_dir)
    if summary is None:
        return None
    keys = ("strategy", "world_size", "dp_size", "tp_size", "pp_size", "steps", "initial_train_loss",
            "final_train_loss", "final_val_loss", "tokens_per_s")
    print(json.dumps({k: summary.get(k) for k in keys}, indent=2))
    return summary.get("final_val_loss")


if __name__ == "__main__":
    main()
