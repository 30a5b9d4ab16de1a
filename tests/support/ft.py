"""Replica groups under the fault-tolerant replicate axis, each its own world, for the torchft tests.

A test starts torchft's lighthouse in its own process (``LighthouseServer(bind="[::]:0", ...)``), then each replica
group as its own OS process (``python -m tests.support.ft CONFIG.json``, a new session so that the test can SIGKILL or
SIGSTOP every rank of a group at once), which launches the group's ranks with the project's launcher
(:func:`lightning_par.launcher.run_distributed`, its own ``MASTER_PORT``: its own world).

Each rank appends one JSON line per training step to ``{dir}/progress_g{group}_r{rank}.jsonl`` (pid, Lightning's
global step, epoch and batch index, torchft's committed step, live groups; with ``record_data``, the dataset indices of
the step's batch) and, with ``dump``, saves its whole streamed state (module,
optimizer parameters, optimizer state: local tensors) after each step to ``{dir}/state_g{group}_r{rank}_s{step}.pt``,
keyed by the committed step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_par.data.resumable import ResumableDataLoader
from lightning_par.launcher import run_distributed
from lightning_par.strategies.base import MeshStrategy
from tests.support.forked_run import ForkedProcess, start_forked
from tests.support.helpers import LossRecorder, full_state_dict, quiet_trainer
from tests.support.user_models import ResidualMLP, make_mlp

REPO = Path(__file__).resolve().parents[2]


def regression_dataset(n: int = 256, seed: int = 0) -> TensorDataset:
    """``n`` fixed samples ``(x (8,), y (4,))`` for :class:`tests.support.user_models.ResidualMLP`."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


class ScheduledMLP(ResidualMLP):
    """:class:`ResidualMLP` with an lr decaying every optimizer step (``lr_0 / (1 + step / 10)``): its lr names the
    scheduler's step."""

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train_dataset(cfg: dict[str, Any]) -> TensorDataset:
    """The training data of ``cfg``: :func:`regression_dataset` of ``cfg["dataset_n"]`` samples (default 256)."""
    return regression_dataset(cfg.get("dataset_n", 256))


def make_module(cfg: dict[str, Any]) -> ResidualMLP:
    """The seeded MLP of ``cfg["optimizer"]``, with the lr schedule when ``cfg["scheduler"]``."""
    if not cfg.get("scheduler"):
        return make_mlp(cfg["optimizer"])
    torch.manual_seed(0)
    return ScheduledMLP(optimizer=cfg["optimizer"])


def _lr(trainer: L.Trainer) -> float:
    configs = trainer.lr_scheduler_configs
    return float(configs[0].scheduler.get_last_lr()[0]) if configs else float("nan")


class Progress(L.Callback):
    """One JSON line per step; the state dump; stop when ``stop_file`` exists; ``sleep_s`` per step."""

    def __init__(self, cfg: dict[str, Any], rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.dir = Path(cfg["dir"])
        self.path = self.dir / f"progress_g{cfg['group']}_r{rank}.jsonl"
        # each sample's x is distinct: it names the sample's index in the dataset
        self.index = {x.numpy().tobytes(): i for i, (x, _) in enumerate(train_dataset(cfg))} if cfg.get(
            "record_data") else {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.cfg.get("record_data"):
            return
        sampler = trainer.train_dataloader.sampler  # the one Lightning injected (use_distributed_sampler=True)
        info = {"type": type(sampler).__name__, "num_replicas": getattr(sampler, "num_replicas", None),
                "rank": getattr(sampler, "rank", None), "shuffle": getattr(sampler, "shuffle", None),
                "seed": getattr(sampler, "seed", None), "drop_last": getattr(sampler, "drop_last", None),
                "batch_size": trainer.train_dataloader.batch_size, "num_training_batches": trainer.num_training_batches}
        (self.dir / f"sampler_g{self.cfg['group']}_r{self.rank}.json").write_text(json.dumps(info))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        ft = trainer.strategy.ft
        step = ft.manager.current_step()
        if self.cfg.get("dump"):
            tmp = self.dir / f".tmp_g{self.cfg['group']}_r{self.rank}.pt"
            torch.save(ft._state_dict(), tmp)
            key = trainer.global_step if self.cfg.get("dump_by") == "global_step" else step
            os.replace(tmp, self.dir / f"state_g{self.cfg['group']}_r{self.rank}_s{key}.pt")
        line = {"pid": os.getpid(), "t": time.time(), "global_step": trainer.global_step, "ft_step": step,
                "lr": _lr(trainer), "live": ft.live_replicas, "committed": ft.steps_committed,
                "recoveries": ft.recoveries,
                "recovery_s": ft.recovery_s, "epoch": trainer.current_epoch, "batch_idx": trainer.fit_loop.batch_idx,
                "data_moves": getattr(ft, "data_moves", None)}
        if self.cfg.get("record_data"):
            line["indices"] = [self.index[x.numpy().tobytes()] for x in batch[0]]
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        stop = self.cfg.get("stop_file")
        # every rank of the group decides the same (one rank stopping alone leaves its peers' quorum waiting)
        if stop and trainer.strategy.reduce_boolean_decision(os.path.exists(stop), all=False):
            trainer.should_stop = True
        if self.cfg.get("sleep_s"):
            time.sleep(self.cfg["sleep_s"])


def ft_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of replica group ``cfg["group"]``: fit the residual MLP for ``cfg["steps"]`` steps."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test can ask a stuck rank where it is
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    groups = cfg["groups"]
    ft = dict(enabled=True, lighthouse=cfg["lighthouse"], replica_group_id=cfg["group"], num_replica_groups=groups,
              min_replicas=cfg.get("min_replicas", groups), step_timeout_s=cfg.get("step_timeout_s", 20.0),
              quorum_timeout_s=cfg.get("quorum_timeout_s", 60.0), connect_timeout_s=cfg.get("connect_timeout_s", 10.0),
              **{k: cfg[k] for k in ("init_sync", "diloco_sync_every", "diloco_outer_lr", "diloco_outer_momentum")
                 if k in cfg})
    tp = cfg.get("tp", 1)
    dp = world // tp  # tp is the innermost mesh axis: dp rank = rank // tp
    strategy = MeshStrategy(dp_size=dp, tp_size=tp, dp_mode=cfg["dp_mode"], timeout_s=120.0, fault_tolerance=ft)
    dataset = train_dataset(cfg)
    extra: dict[str, Any] = {}
    if cfg.get("lightning_sampler"):  # Lightning injects its shuffling DistributedSampler over the strategy's dp ranks
        # "resumable": the recipe's loader, which a rejoining group moves through its own load_state_dict
        loader_cls = ResumableDataLoader if cfg.get("loader") == "resumable" else DataLoader
        if loader_cls is ResumableDataLoader:  # its move must not reach the fit loop's data fetcher (this process only)
            import lightning_par.compat.lightning as register

            def refused(*args: Any) -> Any:
                raise AssertionError("a loader moved by its state reached the fit loop's data fetcher")

            register.restart_training_fetch = register.combined_loader = refused
        loader = loader_cls(dataset, batch_size=cfg["micro_batch"], drop_last=True)
        extra["use_distributed_sampler"] = True
    else:
        sampler = DistributedSampler(dataset, num_replicas=dp * groups, rank=cfg["group"] * dp + rank // tp,
                                     shuffle=False)
        loader = DataLoader(dataset, batch_size=cfg["micro_batch"], sampler=sampler, drop_last=True)
    if cfg.get("accumulate"):
        extra["accumulate_grad_batches"] = cfg["accumulate"]
    recorder = LossRecorder()
    module = make_module(cfg)
    trainer = quiet_trainer(strategy, world, max_steps=cfg["steps"], limit_val_batches=0,
                            callbacks=[recorder, Progress(cfg, rank)], **extra)
    trainer.fit(module, loader)
    return {"rank": rank, "losses": recorder.losses, "state": full_state_dict(module),
            "summary": strategy.summary_extras()}


def hsdp_worker(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One rank of plain HSDP, one world without torchft: ``dp_replicate_size=cfg["groups"]`` x the groups' layout
    (``cfg["world"] // tp`` dp ranks, ``cfg["tp"]`` tp ranks), on the same global batches as the replica groups (dp rank
    ``d`` reads what dp rank ``d % dp`` of group ``d // dp`` reads), one fit per optimizer in ``cfg["optimizers"]``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp = cfg.get("tp", 1)
    out = {}
    for optimizer in cfg["optimizers"]:
        strategy = MeshStrategy(dp_replicate_size=cfg["groups"], dp_size=world // tp, tp_size=tp,
                                dp_mode=cfg["dp_mode"], timeout_s=120.0)
        dataset = regression_dataset()
        sampler = DistributedSampler(dataset, num_replicas=world // tp, rank=rank // tp, shuffle=False)
        loader = DataLoader(dataset, batch_size=cfg["micro_batch"], sampler=sampler, drop_last=True)
        recorder = LossRecorder()
        module = make_module({**cfg, "optimizer": optimizer})
        trainer = quiet_trainer(strategy, world, max_steps=cfg["steps"], limit_val_batches=0, callbacks=[recorder])
        trainer.fit(module, loader)
        out[optimizer] = {"rank": rank, "losses": recorder.losses, "state": full_state_dict(module)}
    return out


def start_group(cfg: dict[str, Any]) -> ForkedProcess:
    """Start replica group ``cfg["group"]`` (its ``cfg["world"]`` ranks) in a new session; results go to
    ``{dir}/result_g{group}.pt``, its output to ``{dir}/log_g{group}.txt`` (appended). A child forked from the test
    session's zygote (:mod:`tests.support.forked_run`: ``python -m tests.support.ft CFG`` without a fresh interpreter's
    ~5 CPU-s of imports, which were most of these tests' CPU); ``pid``, ``poll``, ``wait`` and ``os.killpg(pid, ...)``
    as with ``subprocess.Popen(start_new_session=True)``."""
    path = Path(cfg["dir"]) / f"cfg_g{cfg['group']}_{time.time_ns()}.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return start_forked([sys.executable, "-m", "tests.support.ft", str(path)], REPO, env,
                        log=Path(cfg["dir"]) / f"log_g{cfg['group']}.txt", new_session=True)


def progress(dir: str | Path, group: int, rank: int = 0) -> list[dict[str, Any]]:
    """The progress lines of one rank so far."""
    p = Path(dir) / f"progress_g{group}_r{rank}.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def group_plan(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """``cfg["plan"]`` (steps of :func:`tests.support.p3d.run_step`) for replica group ``cfg["group"]``: each step's
    strategy options gain this group's ``fault_tolerance`` (the lighthouse of ``cfg``, ``cfg["groups"]`` groups, all
    of them needed for a quorum), and ``{group}`` in its ``save``/``resume`` paths becomes the group's index (each
    group writes and resumes its own checkpoint)."""
    g = cfg["group"]
    ft = dict(enabled=True, lighthouse=cfg["lighthouse"], replica_group_id=g, num_replica_groups=cfg["groups"],
              min_replicas=cfg.get("min_replicas", cfg["groups"]), step_timeout_s=cfg.get("step_timeout_s", 20.0),
              quorum_timeout_s=cfg.get("quorum_timeout_s", 60.0))
    plan = []
    for step in cfg["plan"]:
        step = {**step, "options": {**step["options"], "fault_tolerance": ft}}
        for key in ("save", "resume"):
            if step.get(key):
                step[key] = step[key].format(group=g)
        plan.append(step)
    return plan


def main(path: str) -> None:
    cfg = json.loads(Path(path).read_text())
    if "plan" in cfg:  # steps of tests.support.p3d (the tiny GPT on tokens), optionally under tests.support.device_rule
        from tests.support.device_rule import rule_report
        from tests.support.p3d import plan_worker, token_data

        micro = cfg["plan"][0]["micro_batch"]
        args = (group_plan(cfg), token_data(micro * cfg["world"] * 2), token_data(micro * cfg["world"], seed=1),
                rule_report if cfg.get("device_rule") else None)
        results = run_distributed(plan_worker, cfg["world"], args, timeout_s=cfg.get("timeout_s", 240.0))
    else:
        results = run_distributed(ft_worker, cfg["world"], (cfg,), timeout_s=cfg.get("timeout_s", 240.0))
    torch.save(results, Path(cfg["dir"]) / f"result_g{cfg['group']}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
