"""Test machinery for ZeRO: many fits in one process-group launch, with byte and communication probes.

A *case* is a plain dict (picklable under fork and spawn)::

    {"name": str, "stage": 0..3 (0 = ddp_overlap), "options": {...strategy options}, "steps": int,
     "micro_batch": int, "accumulate": int, "clip": float | None, "module": "gpt" | "gpt-warmup" | "mlp",
     "save_at": (step, path) | None, "resume": path | None, "validate": path | None}

:func:`cases_worker` runs every case of a list on this rank, one ``Trainer.fit`` (or ``validate``) after another in
the same process group, and returns one result dict per case.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_par.data_parallel.comm_volume import CommVolumeCallback
from lightning_par.data_parallel.zero_memory import zero_state_bytes
from lightning_par.launcher import run_distributed
from lightning_par.models import GPTConfig, GPTLightningModule
from tests.support.helpers import TIMEOUT_S, LossRecorder, TokenDataset, quiet_trainer

CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0)


def make_gpt(warmup_steps: int = 0) -> GPTLightningModule:
    torch.manual_seed(0)
    return GPTLightningModule(GPTConfig(**CONFIG), learning_rate=3e-3, adam_eps=1e-6, warmup_steps=warmup_steps)


def make_gpt_warmup() -> GPTLightningModule:
    """The GPT with a learning rate that changes every step (linear warm-up over 8 steps), so a resumed run must
    restore the optimizer's param-group hyper-parameters and the LR scheduler, not only the tensors."""
    return make_gpt(warmup_steps=8)


class TokenMLP(L.LightningModule):
    """Not a GPT: an embedding, a 37-wide hidden layer (37 rows: uneven chunks at dp 2 and 4, so padding is
    exercised), a LayerNorm and a 3-element gain held by the LightningModule itself (3 rows < dp 4: an empty chunk;
    a root FSDP2 unit whose parameters are used in ``training_step``, not in ``forward``), and a frozen parameter
    that the optimizer holds but never steps. SGD with momentum, returned as a list."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 24)
        self.hidden = nn.Linear(24, 37)
        self.norm = nn.LayerNorm(37)
        self.out = nn.Linear(37, 256)
        self.gain = nn.Parameter(torch.tensor([1.0, 0.5, 0.25]))
        self.frozen_bias = nn.Parameter(torch.linspace(-1, 1, 256), requires_grad=False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.norm(F.gelu(self.hidden(self.embed(x))))
        logits = self.out(h) * self.gain.sum() + self.frozen_bias
        return F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3)]


def make_mlp() -> TokenMLP:
    torch.manual_seed(0)
    return TokenMLP()


class TokenMLPAdamW(TokenMLP):
    """:class:`TokenMLP` with AdamW (decoupled weight decay) instead of SGD."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6, weight_decay=1e-2)


def make_mlp_adamw() -> TokenMLPAdamW:
    torch.manual_seed(0)
    return TokenMLPAdamW()


MODULES = {"gpt": make_gpt, "gpt-warmup": make_gpt_warmup, "mlp": make_mlp, "mlp-adamw": make_mlp_adamw}


class StateBytesProbe(L.Callback):
    """Maximum over the run of :func:`zero_state_bytes` at every optimizer step (and at the end)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def _measure(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for key, value in zero_state_bytes(pl_module, trainer.optimizers).items():
            self.bytes[key] = max(self.bytes.get(key, 0), value)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._measure(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._measure(trainer, pl_module)


class SaveAtStep(L.Callback):
    """``trainer.save_checkpoint(path)`` once ``step`` optimizer steps are done (as ``ModelCheckpoint`` saves, from
    ``on_train_batch_end``), and keep the full parameters of that moment."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and self.state is None:
            trainer.save_checkpoint(self.path)
            self.state = trainer.strategy.full_state_dict()


def make_strategy(stage: int, options: dict[str, Any]) -> Any:
    from lightning_par.strategies import DDPOverlapStrategy
    from lightning_par.strategies.zero import ZeroStrategy

    if stage == 0:
        return DDPOverlapStrategy(timeout_s=60, **{"gradient_as_bucket_view": True, **options})
    return ZeroStrategy(stage=stage, timeout_s=60, **options)


def _loader(dataset: Dataset, micro_batch: int, dp_size: int, dp_rank: int) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)


def run_case(case: dict[str, Any], dataset: Dataset, val_dataset: Dataset | None = None) -> dict[str, Any]:
    """Run one case on this rank (see the module docstring) and return its results."""
    from lightning_par.callbacks import ParallelMetricsCallback

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    strategy = make_strategy(case.get("stage", 3), case.get("options", {}))
    dims = strategy.resolve_parallel_dims(world)
    dp_rank = dims.coordinates(rank)["dp"]
    module = MODULES[case.get("module", "gpt")]()
    recorder, probe, metrics = LossRecorder(), StateBytesProbe(), ParallelMetricsCallback(warmup_steps=0)
    comm = CommVolumeCallback(step=1)
    saver = SaveAtStep(*case["save_at"]) if case.get("save_at") else None
    trainer_kwargs: dict[str, Any] = {"accumulate_grad_batches": case.get("accumulate", 1)}
    if case.get("clip") is not None:
        trainer_kwargs["gradient_clip_val"] = case["clip"]
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=case.get("steps", 1),
        limit_val_batches=0 if case.get("validate") is None else None,
        callbacks=[recorder, probe, metrics, comm] + ([saver] if saver else []),
        **trainer_kwargs,
    )
    out: dict[str, Any] = {"name": case.get("name"), "rank": rank, "dp_rank": dp_rank}
    if case.get("validate") is not None:
        assert val_dataset is not None
        val = trainer.validate(module, _loader(val_dataset, case["micro_batch"], dims.dp_size, dp_rank),
                               ckpt_path=case["validate"], verbose=False)
        out["val_loss"] = val[0]["val_loss"]
        return out
    loader = _loader(dataset, case["micro_batch"], dims.dp_size, dp_rank)
    trainer.fit(module, loader, ckpt_path=case.get("resume"))
    state = strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else {
        n: p.detach().clone() for n, p in module.named_parameters()
    }
    summary = metrics.summary()
    out.update(
        saved_state=saver.state if saver else None,
        losses=recorder.losses,
        state=state,
        bytes=probe.bytes,
        callback_bytes={k: summary[k] for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes")},
        step_memory={k: summary[k] for k in ("step_peak_bytes", "step_model_state_bytes", "step_other_bytes")},
        comm_bytes=comm.bytes_per_step,
        comm_by_op=comm.by_op,
        extras=strategy.summary_extras(),
        param_dtypes=sorted({str(p.dtype) for p in module.parameters()}),
        numel=sum(p.numel() for p in MODULES[case.get("module", "gpt")]().parameters()),
        num_tensors=len(list(module.parameters())),
    )
    return out


def cases_worker(cases: list[dict[str, Any]], dataset: Dataset, val_dataset: Dataset | None = None) -> list[dict]:
    """Body of one rank: every case in order, in one process group."""
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                                      "MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    results = []
    for case in cases:
        os.environ.update(env)  # Lightning's environment teardown removes WORLD_SIZE after each fit
        results.append(run_case(case, dataset, val_dataset))
    return results


def run_cases(world_size: int, cases: list[dict[str, Any]], dataset: Dataset, val_dataset: Dataset | None = None,
              timeout_s: float = TIMEOUT_S) -> dict[str, list[dict]]:
    """Run ``cases`` on ``world_size`` ranks; returns ``{case name: [result of rank 0, rank 1, ...]}``."""
    per_rank = run_distributed(cases_worker, world_size, (cases, dataset, val_dataset), timeout_s=timeout_s)
    return {case["name"]: [per_rank[r][i] for r in range(world_size)] for i, case in enumerate(cases)}


def token_dataset(n: int = 128) -> TokenDataset:
    return TokenDataset(n=n, seq=CONFIG["block_size"])


class TwoLayer(nn.Module):
    """A column-parallel ``up``, a row-parallel ``down`` and a LayerNorm left whole: plain and DTensor parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


def two_layer_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def two_layer_reference(steps: int, clip: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TwoLayer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    for step in range(steps):
        x, y = two_layer_batch(step)
        ((model(x) - y) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def tensor_parallel_worker(steps: int, clip: float) -> dict[int, dict[str, torch.Tensor]]:
    """dp 2 x tp 2: DTensor TP (colwise ``up``, rowwise ``down``) inside, then each ZeRO stage on the dp sub-mesh of
    the ``("pp", "dp", "tp")`` mesh; returns the full parameters after ``steps`` steps per stage. Stages 1 and 2 run
    each backward in two halves under ``defer_sync`` and reduce once with ``reduce_now``, as under pipelining."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_par.data_parallel.zero import apply_zero
    from lightning_par.data_parallel.zero_options import resolve_zero_options
    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.parallel_dims import ParallelDims

    init_process_group_from_env(timeout_s=60)
    dims = ParallelDims(dp_size=2, tp_size=2, world_size=4)
    dims.build_mesh()
    dp_rank = dims.coordinates(int(os.environ["RANK"]))["dp"]
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = TwoLayer()
        parallelize_module(model, dims.get_mesh("tp"), {"up": ColwiseParallel(), "down": RowwiseParallel()})
        options = resolve_zero_options(stage, bucket_cap_mb=None if stage == 3 else 1e-4)  # 1e-4 MiB: many buckets
        engine = apply_zero(model, dims.get_mesh("dp"), options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        engine.shard_optimizer(opt)
        for step in range(steps):
            x, y = two_layer_batch(step)
            x, y = x[dp_rank * 4 : dp_rank * 4 + 4], y[dp_rank * 4 : dp_rank * 4 + 4]
            if stage == 3:
                engine.pre_backward()
                ((model(x) - y) ** 2).mean().backward()
                engine.post_backward()
            else:  # backward in two pieces, reduced once at the end: what a pipeline schedule needs
                with engine.defer_sync():
                    for half in (slice(0, 2), slice(2, 4)):
                        (((model(x[half]) - y[half]) ** 2).mean() / 2).backward()
                engine.reduce_now()
            # The engine clips by the whole model's norm (ZeRO-1/2 optimizers step plain local shards).
            engine.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
            opt.step()
            opt.zero_grad()
        full = engine.full_state_dict()
        out[stage] = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in full.items()}
    return out


def grad_memory_worker() -> dict[str, Any]:
    """dp 2: the GPT under ZeRO-2 with small buckets and the reducer's gradient-memory probe, for one and for no
    bucket in flight; two steps each. Returns the peaks and the sizes to bound them with."""
    from lightning_par.data_parallel.zero import ZeroShardedDataParallel
    from lightning_par.data_parallel.zero_options import resolve_zero_options
    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.parallel_dims import ParallelDims

    init_process_group_from_env(timeout_s=60)
    dims = ParallelDims(dp_size=2, world_size=2)
    dims.build_mesh()
    data = token_dataset(8)
    x = torch.stack([data[i][0] for i in range(4)])
    y = torch.stack([data[i][1] for i in range(4)])
    out: dict[str, Any] = {"peaks": {}}
    for in_flight in (1, 0):
        torch.manual_seed(0)  # 4 blocks of width 64: many buckets, none dominating (unlike CONFIG's embeddings)
        module = GPTLightningModule(GPTConfig(**{**CONFIG, "n_layer": 4, "n_embd": 64}))
        engine = ZeroShardedDataParallel(module, dims.get_mesh("dp"), resolve_zero_options(2, bucket_cap_mb=0.05),
                                         max_buckets_in_flight=in_flight, measure_memory=True)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        engine.shard_optimizer(opt)
        for _ in range(2):
            engine.pre_backward()
            module.loss_fn(module(x), y).backward()
            engine.post_backward()
            opt.step()
            opt.zero_grad()
        summary = engine.summary()
        out["peaks"][in_flight] = summary["peak_grad_bytes"]
        out["bucket_bytes"] = summary["bucket_bytes"]
        out["num_buckets"] = summary["num_buckets"]
        out["shard_bytes"] = engine.reducer.grad_shard.numel() * 4
        out["largest_grad_bytes"] = max(p.numel() for p in module.parameters()) * 4
        out["full_grad_bytes"] = sum(p.numel() for p in module.parameters()) * 4
        engine.remove()
    return out


def overlap_gather_worker(steps: int = 3) -> dict[str, Any]:
    """dp 2: :class:`TokenMLP` (SGD with momentum; a parameter owned by the LightningModule itself) under ZeRO-1 and
    ZeRO-2 with and without ``overlap_param_gather``; returns the full parameters after ``steps`` steps and whether
    all-gathers were still pending when the next step began."""
    from lightning_par.data_parallel.zero import ZeroShardedDataParallel
    from lightning_par.data_parallel.zero_options import resolve_zero_options
    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.parallel_dims import ParallelDims

    init_process_group_from_env(timeout_s=60)
    dims = ParallelDims(dp_size=2, world_size=2)
    dims.build_mesh()
    rank = int(os.environ["RANK"])
    data = token_dataset(4 * 2 * steps)
    out: dict[str, Any] = {}
    for stage in (1, 2):
        for overlap in (False, True):
            module = make_mlp()
            options = resolve_zero_options(stage, bucket_cap_mb=0.005)
            engine = ZeroShardedDataParallel(module, dims.get_mesh("dp"), options, overlap_param_gather=overlap)
            (opt,) = module.configure_optimizers()
            engine.shard_optimizer(opt)
            pending = []
            for step in range(steps):
                start = (step * 2 + rank) * 4
                batch = tuple(torch.stack([data[i][k] for i in range(start, start + 4)]) for k in (0, 1))
                pending.append(engine.gather.pending)
                loss = module.training_step(batch, step)
                engine.pre_backward()
                loss.backward()
                engine.post_backward()
                opt.step()
                opt.zero_grad()
            out[f"z{stage}-overlap{int(overlap)}"] = {"state": engine.full_state_dict(), "pending": pending}
            engine.remove()
    return out
