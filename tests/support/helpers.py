"""Shared test machinery: run Lightning fits on several gloo ranks and a one-process reference on the same data.

Parity is judged on the *global* batch: with ``dp`` replicas each taking ``micro_batch`` samples, step ``k`` of the
reference sees samples ``[k * micro_batch * dp, (k + 1) * micro_batch * dp)``, exactly the union of what the
replicas see with a non-shuffling ``DistributedSampler``. The global loss of a step is the mean of the replicas'
losses (equal shard sizes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_par.launcher import run_distributed
from lightning_par.parallel_dims import ParallelDims

TIMEOUT_S = float(os.environ.get("LP_TEST_TIMEOUT_S", "240"))


class LossRecorder(L.Callback):
    """Keeps the loss returned by every training step (before accumulation scaling), on this rank."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # Lightning returns the loss divided by the accumulation factor; undo it.
        self.losses.append(float(loss.detach()) * trainer.accumulate_grad_batches)


class TokenDataset(Dataset):
    """``n`` fixed random windows ``(x, y)`` of ``seq`` byte tokens, ``y`` shifted by one. Deterministic."""

    def __init__(self, n: int = 64, seq: int = 16, vocab: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full, unsharded parameters of ``module`` on CPU (DTensors gathered), keyed by their original names."""
    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().cpu().clone()
    return out


#: Trainer settings every distributed test shares: no logger, checkpoint callback, progress bar, model summary or
#: sanity check, and no injected sampler (tests shard the data over the dp axis themselves).
QUIET_TRAINER = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
    num_sanity_val_steps=0,
)


def quiet_trainer(strategy: Any, world: int, **kwargs: Any) -> L.Trainer:
    """A Trainer on ``world`` CPU devices under ``strategy`` with :data:`QUIET_TRAINER` plus ``kwargs``."""
    return L.Trainer(devices=world, strategy=strategy, **{**QUIET_TRAINER, **kwargs})


def fit_worker(
    make_strategy: Callable[[], Any],
    make_module: Callable[[], L.LightningModule],
    dataset: Dataset,
    micro_batch: int,
    steps: int,
    trainer_kwargs: dict | None = None,
    state_fn: Callable[[L.LightningModule, Any], dict] | None = None,
) -> dict:
    """Body of one rank: fit ``make_module()`` under ``make_strategy()`` for ``steps`` optimizer steps."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    strategy = make_strategy()
    dims: ParallelDims = strategy.resolve_parallel_dims(world)
    sampler = DistributedSampler(dataset, num_replicas=dims.dp_size, rank=dims.coordinates(rank)["dp"], shuffle=False)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    recorder = LossRecorder()
    module = make_module()
    trainer = quiet_trainer(
        strategy, world, max_steps=steps, limit_val_batches=0, callbacks=[recorder], **(trainer_kwargs or {})
    )
    trainer.fit(module, loader)
    state = (state_fn or (lambda m, s: full_state_dict(m)))(module, strategy)
    extras = strategy.summary_extras() if hasattr(strategy, "summary_extras") else {}
    return {"rank": rank, "dp_rank": dims.coordinates(rank)["dp"], "losses": recorder.losses, "state": state, "extras": extras}


def run_fit(world_size: int, *args: Any, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Run :func:`fit_worker` on ``world_size`` ranks (see its arguments)."""
    return run_distributed(fit_worker, world_size, args, timeout_s=timeout_s)


def reference_fit(
    make_module: Callable[[], L.LightningModule],
    dataset: Dataset,
    global_batch: int,
    steps: int,
    accumulate: int = 1,
    clip_norm: float | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain torch: ``steps`` optimizer steps on global batches of ``global_batch`` samples.

    With ``accumulate > 1`` each optimizer step takes ``accumulate`` consecutive global batches, each loss scaled by
    ``1/accumulate`` (what Lightning does). Returns the per-micro-step losses (unscaled) and the final parameters.
    """
    torch.manual_seed(0)
    module = make_module()
    opt_cfg = module.configure_optimizers()
    opt = opt_cfg["optimizer"] if isinstance(opt_cfg, dict) else (opt_cfg[0] if isinstance(opt_cfg, (list, tuple)) else opt_cfg)
    sched = opt_cfg.get("lr_scheduler") if isinstance(opt_cfg, dict) else None
    if isinstance(sched, dict):
        sched = sched["scheduler"]
    loader = iter(DataLoader(dataset, batch_size=global_batch, shuffle=False, drop_last=True))
    losses = []
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = next(loader)
            loss = module.training_step((x, y), 0)
            losses.append(float(loss.detach()))
            (loss / accumulate).backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip_norm)
        opt.step()
        update_expert_biases(module)
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def update_expert_biases(module: Any) -> None:
    """After an optimizer step of a one-process reference: each MoE layer's auxiliary-loss-free bias update (what the
    strategies do after every optimizer step; a no-op for layers without a bias)."""
    for m in module.modules():
        if callable(getattr(m, "update_expert_bias", None)):
            m.update_expert_bias()


def global_losses(results: list[dict]) -> list[float]:
    """Per-step loss of the global batch: the mean over dp replicas (one representative rank per replica)."""
    by_dp: dict[int, list[float]] = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r["losses"])
    per_replica = list(by_dp.values())
    return [sum(v[i] for v in per_replica) / len(per_replica) for i in range(len(per_replica[0]))]


def assert_params_close(actual: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Parameters agree within ``rtol`` plus ``atol`` absolute (for entries near zero).

    Adam divides by ``sqrt(v) + eps``, which amplifies fp32 rounding in near-zero gradient entries: in ONE process,
    4 AdamW steps on the tiny GPT with the global-batch gradient vs the mean of two half-batch gradients (identical
    up to rounding) end with parameters 6.3e-5 apart at eps=1e-8 and 2.0e-6 apart at eps=1e-6
    (``tests/core/test_parity_tolerance.py`` measures it). So parity runs use ``adam_eps=1e-6`` and ``atol=1e-5``:
    1/300 of one step at lr 3e-3, while a missing or unaveraged all-reduce moves parameters by about a step.
    """
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------------- matrices run in one launch
def ci_params(names: Any, ci: Any) -> list[Any]:
    """``names`` as ``pytest.param`` values for ``parametrize``, those outside ``ci`` marked ``slow``: CI (``make
    test``, ``-m "not slow"``) runs the ``ci`` cells, ``make test-slow`` the rest. A cell named in ``ci`` that is not
    in ``names`` is an error (a renamed case must not silently leave CI)."""
    import pytest

    names, ci = list(names), set(ci)
    unknown = ci - set(names)
    if unknown:
        raise ValueError(f"ci cells {sorted(unknown)} are not cases of this matrix: {names}")
    return [pytest.param(n, marks=() if n in ci else pytest.mark.slow) for n in names]


def running(request: Any, argname: str = "name", test: str | None = None) -> set[Any]:
    """The values of parameter ``argname`` of this module's tests (of test function ``test`` only, if given) that
    this session runs (after ``-m``/``-k`` deselection): a module fixture that launches every case of a matrix in one
    world launches only these, so a cell marked ``slow`` costs CI nothing."""
    return {
        item.callspec.params[argname]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and argname in item.callspec.params
        and (test is None or getattr(item, "originalname", None) == test)
    }


# ----------------------------------------------------------------------------------- one forked child
def in_a_forked_child(body: Callable[[], Any], timeout_s: float = 60.0) -> tuple[int, float, str]:
    """Run ``body`` in a child forked from this process; its exit status (``body`` returning is 0, an uncaught
    exception 1, ``os._exit(n)`` n, a signal -N), how long it took (seconds) and what it wrote to stderr.

    A fork, not a fresh interpreter: the child already has torch and lightning imported (a fresh interpreter spends
    about 5 s importing them). The child calls ``gc.freeze()`` first, as the launcher's ranks do, so its garbage
    collection never destroys an object (a process group) whose threads only this process has, and it runs no
    OpenMP region. Killed with SIGKILL after ``timeout_s`` (status -9)."""
    import gc
    import select
    import signal
    import sys
    import time
    import traceback

    read_fd, write_fd = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            gc.freeze()
            os.dup2(write_fd, 2)
            os.close(read_fd)
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # not pytest's capture
            body()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_fd)
    chunks, deadline = [], started + timeout_s
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while True:  # until the child's stderr closes (it exited) or the deadline
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([pipe], [], [], left)
            if ready:
                data = pipe.read(65536)
                if not data:
                    break
                chunks.append(data)
    _, status = os.waitpid(pid, 0)
    took = time.monotonic() - started
    code = os.waitstatus_to_exitcode(status)
    return code, took, b"".join(chunks).decode(errors="replace")
