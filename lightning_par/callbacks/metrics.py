"""Throughput, MFU and memory of a (data/tensor/pipeline) parallel training run, measured per optimizer step.

Token counts are global: the ranks of one data-parallel replica (its tensor- and pipeline-parallel ranks) see the
same batch, so one optimizer step consumes ``x.numel() * dp_size`` tokens per micro-batch. MFU follows the PaLM paper
(Chowdhery et al. 2022, appendix B): achieved model FLOP/s over the peak FLOP/s of all devices.

Peak memory of a step is measured on one optimizer step (by default the second, after the optimizer state exists),
with every strategy: on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the step's
start; on CPU by :class:`~lightning_par.memory.StepMemoryTracker`, which counts tensor storages (the model state alive
at the start, then every storage an operator creates, until it is freed). It is split into the model state
(parameters, gradients, optimizer state) and the rest (activations, communication buffers, temporaries).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.utilities import rank_zero_warn

from lightning_par.memory import (
    StepMemoryTracker,
    model_state_bytes,
    model_state_tensors,
    param_split_bytes,
    peak_memory_bytes,
)

__all__ = ["ParallelMetricsCallback", "log_comm_stats", "log_host_number", "parallel_sizes", "persistent_comm_buffers"]

#: optimizer steps during which the model-state bytes are measured (see ``on_before_optimizer_step``).
_STATE_MEASURE_STEPS = 3
_CPU_MFU_NOTE = "not meaningful on CPU: no peak FLOP/s for this device"


def parallel_sizes(trainer: L.Trainer) -> dict[str, int]:
    """``{"dp_size", "tp_size", "pp_size", "world_size"}`` of the run, and every other size that is not 1
    (``dp_replicate_size`` under HSDP, ...).

    Read from ``trainer.strategy.parallel_dims`` (a :class:`lightning_par.parallel_dims.ParallelDims`) when the
    strategy has one; otherwise every rank is a data-parallel replica: ``dp_size = trainer.world_size``,
    ``tp_size = pp_size = 1``.
    """
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if dims is None:
        return {"dp_size": trainer.world_size, "tp_size": 1, "pp_size": 1, "world_size": trainer.world_size}
    return {"tp_size": dims.tp_size, "pp_size": dims.pp_size, **dims.sizes(), "world_size": dims.world_size}


def _batch_tokens(batch: Any) -> int | None:
    """Tokens in this rank's micro-batch: ``numel`` of the input tensor, or ``None`` if there is none to find.

    Accepts a tensor, an ``(x, y, ...)`` tuple/list (``x`` is used), or a mapping with ``input_ids`` or ``x``.
    """
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0].numel()
    if isinstance(batch, Mapping):
        for key in ("input_ids", "x"):
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key].numel()
    return None


def _flops_per_token(pl_module: L.LightningModule) -> float | None:
    """Training FLOPs per token of the whole model, from ``pl_module.model.config.flops_per_token()`` or a
    ``flops_per_token`` attribute/method of ``pl_module``; ``None`` when neither exists."""
    config = getattr(getattr(pl_module, "model", None), "config", None)
    value = getattr(config, "flops_per_token", None)
    if value is None:
        value = getattr(pl_module, "flops_per_token", None)
    if callable(value):
        value = value()
    return float(value) if value is not None else None


def _compute_dtype(trainer: L.Trainer) -> torch.dtype:
    """The dtype matmuls run in under the trainer's precision plugin (float32 when it cannot be determined)."""
    try:  # Lightning's own mapping, private (the register): fall back to float32 if it moves
        from lightning_par.compat.lightning import plugin_compute_dtype

        return plugin_compute_dtype(trainer.precision_plugin)
    except Exception:
        return torch.float32


class ParallelMetricsCallback(L.Callback):
    """Measure tokens/s, MFU, step time and memory of this rank, and log them.

    A *step* is one optimizer step (all its gradient-accumulation micro-batches). Its wall time runs from
    ``on_train_batch_start`` of its first micro-batch to ``on_train_batch_end`` of its last one (measured with
    ``time.perf_counter``, after a ``torch.cuda.synchronize`` on CUDA). The first ``warmup_steps`` steps count towards
    ``tokens_seen`` but not towards the timing window.

    Logged from ``on_train_batch_end`` via ``pl_module.log`` (this rank's value, no ``sync_dist``), once the window
    has a step and every ``log_every_n_steps`` steps:

    * ``tokens_per_s``: median global tokens/s over the window (progress bar);
    * ``mfu``: model FLOPs utilisation in [0, 1], only when it is known (progress bar);
    * ``peak_mem_mb``: :func:`lightning_par.memory.peak_memory_bytes` in MiB (2**20 bytes);
    * ``step_peak_mb``: the peak tensor bytes of the measured step (see the module docstring), once measured.

    MFU = ``flops_per_token * tokens_per_s / (peak_flops_per_device * world_size)``, where ``flops_per_token`` is the
    whole model's training (forward + backward) FLOPs per token, read from ``pl_module.model.config.flops_per_token()``
    or ``pl_module.flops_per_token``. It is ``None`` (with a reason in ``summary()["mfu_note"]``) when either factor is
    unknown; on CPU there is no meaningful peak, so no figure is invented.

    Args:
        peak_flops_per_device: peak FLOP/s of one device at the training dtype. ``None`` looks it up with
            ``lightning.fabric.utilities.throughput.get_available_flops(device, dtype)`` (Lightning's table of
            vendor datasheet figures, dense, no sparsity) on accelerators; none on CPU.
        window: number of measured steps in the moving window.
        log_every_n_steps: log every this many optimizer steps; ``None`` logs at every step (the Trainer's own
            ``log_every_n_steps`` still throttles what reaches the logger).
        warmup_steps: leading steps left out of the timing window (compilation, allocator warm-up, ...).
        memory_step: the optimizer step (0-based) whose peak memory is measured; ``None`` measures none. On CPU the
            allocation tracker costs one Python call per operator during that step: leave it inside ``warmup_steps``
            so the timings do not see it (the default, step 1 of 2 warm-up steps).

    Raises:
        ValueError: ``window < 1``, ``warmup_steps < 0``, ``log_every_n_steps < 1``, ``memory_step < 0`` or
            ``peak_flops_per_device <= 0``.
    """

    def __init__(
        self,
        peak_flops_per_device: float | None = None,
        window: int = 20,
        log_every_n_steps: int | None = None,
        warmup_steps: int = 2,
        memory_step: int | None = 1,
    ) -> None:
        if peak_flops_per_device is not None and not peak_flops_per_device > 0:
            raise ValueError(f"peak_flops_per_device={peak_flops_per_device!r} is not valid: expected a float > 0.")
        if window < 1:
            raise ValueError(f"window={window!r} is not valid: expected an integer >= 1.")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} is not valid: expected None or >= 1.")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} is not valid: expected an integer >= 0.")
        if memory_step is not None and (isinstance(memory_step, bool) or not isinstance(memory_step, int)
                                        or memory_step < 0):
            raise ValueError(f"memory_step={memory_step!r} is not valid: expected None or an integer >= 0.")
        self.memory_step = memory_step
        self.peak_flops_per_device = peak_flops_per_device
        self.window = window
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self._reset()

    def _reset(self) -> None:
        self._times: deque[float] = deque(maxlen=self.window)  # seconds per measured step
        self._tokens: deque[int] = deque(maxlen=self.window)  # global tokens per measured step
        self._steps_done = 0
        self._tokens_seen = 0
        self._step_start: float | None = None
        self._step_tokens = 0
        self._last_global_step = 0
        self._device = torch.device("cpu")
        self._sizes = {"dp_size": 1, "tp_size": 1, "pp_size": 1, "world_size": 1}
        self._flops_per_token: float | None = None
        self._peak_flops: float | None = self.peak_flops_per_device
        self._mfu_note = "not measured yet"
        self._state_bytes: dict[str, int | None] = dict.fromkeys(
            ("param_bytes", "grad_bytes", "optimizer_state_bytes"), None
        )
        self._param_split: dict[str, int | None] = dict.fromkeys(("trainable_param_bytes", "frozen_param_bytes"))
        self._peak_mem: int | None = None
        self._warned_no_tokens = False
        self._tracker: StepMemoryTracker | None = None
        self._cuda_measuring = False
        self._step_peak: int | None = None

    # ------------------------------------------------------------------ hooks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        self._device = trainer.strategy.root_device
        self._sizes = parallel_sizes(trainer)
        self._last_global_step = trainer.global_step
        self._flops_per_token = _flops_per_token(pl_module)
        if self._peak_flops is None and self._device.type != "cpu":
            dtype = _compute_dtype(trainer)
            self._peak_flops = get_available_flops(self._device, dtype)
            peak_source = f"get_available_flops({self._device.type}, {dtype})"
        else:
            peak_source = "peak_flops_per_device argument"
        reasons = []
        if self._peak_flops is None:
            reasons.append(
                _CPU_MFU_NOTE
                if self._device.type == "cpu"
                else f"unknown: no peak FLOP/s for {self._device} (pass peak_flops_per_device)"
            )
        if self._flops_per_token is None:
            reasons.append("unknown: the module exposes no flops_per_token()")
        self._mfu_note = "; ".join(reasons) or (
            f"flops_per_token * tokens_per_s / (peak_flops_per_device * world_size); "
            f"peak {self._peak_flops:.4g} FLOP/s per device from {peak_source}"
        )
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step_start is None:
            if self._steps_done == self.memory_step and self._step_peak is None:
                self._start_memory(trainer, pl_module)
            self._step_start = time.perf_counter()

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Parameter, gradient and optimizer-state bytes do not change after the first steps (optimizer state exists
        # from the first step on): measure early, keep the hot path free of the walk over every tensor later.
        if self._steps_done < _STATE_MEASURE_STEPS:
            self._measure_state(pl_module, trainer.optimizers)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tokens = _batch_tokens(batch)
        if tokens is None and not self._warned_no_tokens:
            rank_zero_warn(f"ParallelMetricsCallback cannot count tokens in a batch of type {type(batch).__name__}.")
            self._warned_no_tokens = True
        self._step_tokens += (tokens or 0) * self._sizes["dp_size"]
        if trainer.global_step == self._last_global_step:
            return  # gradient accumulation: the optimizer has not stepped yet
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        elapsed = time.perf_counter() - (self._step_start if self._step_start is not None else time.perf_counter())
        self._last_global_step = trainer.global_step
        self._steps_done += 1
        self._tokens_seen += self._step_tokens
        if self._steps_done > self.warmup_steps and elapsed > 0:
            self._times.append(elapsed)
            self._tokens.append(self._step_tokens)
        self._step_start, self._step_tokens = None, 0
        self._stop_memory()
        self._peak_mem = self._read_peak_memory()

        if not self._times or (self.log_every_n_steps and trainer.global_step % self.log_every_n_steps):
            return
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("tokens_per_s", self._tokens_per_s(), prog_bar=True, **log)
        mfu = self._mfu()
        if mfu is not None:
            pl_module.log("mfu", mfu, prog_bar=True, **log)
        if self._peak_mem is not None:
            pl_module.log("peak_mem_mb", self._peak_mem / 2**20, **log)
        for key, value in self._state_bytes.items():
            if value is not None:  # param_mb, grad_mb, optimizer_state_mb of this rank (local shards)
                pl_module.log(key.replace("_bytes", "_mb"), value / 2**20, **log)
        if self._step_peak is not None:
            pl_module.log("step_peak_mb", self._step_peak / 2**20, **log)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_memory()
        self._measure_state(pl_module, trainer.optimizers)
        self._peak_mem = self._read_peak_memory()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_memory()

    # ------------------------------------------------------------------ step peak memory

    def _start_memory(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
            self._tracker = None
            self._cuda_measuring = True
            return
        tensors = model_state_tensors(pl_module, trainer.optimizers) + persistent_comm_buffers(trainer.strategy)
        self._tracker = StepMemoryTracker(tensors)
        self._tracker.__enter__()

    def _stop_memory(self) -> None:
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)
            self._step_peak = tracker.peak_bytes
        elif self._cuda_measuring:
            self._cuda_measuring = False
            torch.cuda.synchronize(self._device)
            self._step_peak = int(torch.cuda.max_memory_allocated(self._device))

    # ------------------------------------------------------------------ results

    def _measure_state(self, pl_module: L.LightningModule, optimizers: list[torch.optim.Optimizer]) -> None:
        """Keep the maximum of each model-state byte count seen (grads are gone after ``zero_grad``)."""
        for key, value in model_state_bytes(pl_module, optimizers).items():
            old = self._state_bytes[key]
            self._state_bytes[key] = value if old is None else max(old, value)
        self._param_split.update(param_split_bytes(pl_module))

    def _read_peak_memory(self) -> int | None:
        try:
            return peak_memory_bytes(self._device)
        except (ValueError, RuntimeError):
            return None

    def _tokens_per_s(self) -> float | None:
        if not self._times:
            return None
        return statistics.median(tok / sec for tok, sec in zip(self._tokens, self._times))

    def _mfu(self) -> float | None:
        tokens_per_s = self._tokens_per_s()
        if tokens_per_s is None or self._flops_per_token is None or self._peak_flops is None:
            return None
        return self._flops_per_token * tokens_per_s / (self._peak_flops * self._sizes["world_size"])

    def summary(self) -> dict[str, Any]:
        """This rank's measurements.

        Returns:
            A dict with

            * ``tokens_seen``: global tokens (all data-parallel replicas) consumed by all optimizer steps;
            * ``tokens_per_s``: median global tokens/s over the window of measured steps, ``None`` before any;
            * ``step_time_s``: median seconds per optimizer step over the window, ``None`` before any;
            * ``mfu``: float in [0, 1] or ``None``; ``mfu_note``: how it was computed or why it is unknown;
            * ``param_bytes``, ``grad_bytes``, ``optimizer_state_bytes``: maxima seen on this rank (``None`` if
              never measured), see :func:`lightning_par.memory.model_state_bytes`; ``trainable_param_bytes``,
              ``frozen_param_bytes``: this rank's parameter bytes split by ``requires_grad`` (a LoRA run's adapters
              and frozen base), see :func:`lightning_par.memory.param_split_bytes`;
            * ``peak_memory_bytes``: see :func:`lightning_par.memory.peak_memory_bytes` (``None`` if unsupported);
            * ``step_peak_bytes``: the most tensor bytes alive at once during optimizer step ``memory_step`` (see
              the module docstring; ``None`` if not measured), ``step_model_state_bytes``: parameters + gradients +
              optimizer state (the maxima above), and ``step_other_bytes``: the difference (activations,
              communication buffers, temporaries);
            * ``steps``, ``measured_steps``, ``flops_per_token``, ``peak_flops_per_device``.
        """
        known = [v for v in self._state_bytes.values() if v is not None]
        state = sum(known) if known else None
        return {
            "tokens_seen": self._tokens_seen,
            "tokens_per_s": self._tokens_per_s(),
            "step_time_s": statistics.median(self._times) if self._times else None,
            "mfu": self._mfu(),
            "mfu_note": self._mfu_note,
            **self._state_bytes,
            **self._param_split,
            "peak_memory_bytes": self._peak_mem,
            "step_peak_bytes": self._step_peak,
            "step_model_state_bytes": state,
            "step_other_bytes": None if self._step_peak is None or state is None else self._step_peak - state,
            "steps": self._steps_done,
            "measured_steps": len(self._times),
            "flops_per_token": self._flops_per_token,
            "peak_flops_per_device": self._peak_flops,
        }


def persistent_comm_buffers(strategy: Any) -> list[torch.Tensor]:
    """Communication buffers a strategy keeps across steps that no walk over the model state finds (the gradient
    reducer's buckets, ZeRO's all-gather send buffers), so that the step's peak counts them from the start."""
    out: list[torch.Tensor] = []
    parallel = getattr(strategy, "parallel", None)  # MeshStrategy: its ParallelModel
    for owner in (strategy, getattr(strategy, "engine", None), getattr(parallel, "engine", None)):
        reducer = getattr(owner, "reducer", None)
        for bucket in getattr(reducer, "buckets", None) or []:
            buffer = getattr(bucket, "buffer", None)
            if isinstance(buffer, torch.Tensor):
                out.append(buffer)
        buffers = getattr(getattr(owner, "gather", None), "buffers", None)  # ZeRO-1/2's parameter all-gather
        if callable(buffers):
            out.extend(buffers())
    return out


def log_host_number(pl_module: L.LightningModule, name: str, value: float, **kwargs: Any) -> None:
    """``pl_module.log(name, value, **kwargs)`` for a number computed on the host, without an upload to the device.

    Lightning 2.6's ``self.log`` turns a Python number into ``torch.tensor(value, device=self.device)``: on a GPU a
    blocking host-to-device copy, one synchronisation per logged number per step. A tensor keeps its device (the
    logged metric's state moves to it), so the number goes in as a 0-dim float32 CPU tensor and stays on the host
    (``docs/host-syncs.md``).

    Args:
        pl_module: the LightningModule.
        name: the metric's name.
        value: the number.
        kwargs: ``self.log``'s other arguments (``on_step``, ``prog_bar``, ...).
    """
    pl_module.log(name, torch.tensor(float(value), dtype=torch.float32), **kwargs)


def log_comm_stats(
    pl_module: L.LightningModule | None, stats: Any, name: str = "comm_exposed_ms", prog_bar: bool = False
) -> None:
    """Log one synchronised backward's exposed communication time as ``name`` (milliseconds), every
    ``trainer.log_every_n_steps`` optimizer steps (a ``self.log`` call costs about 0.25 ms of Python here: not on
    every step).

    ``comm_exposed_ms`` is the time the step waited for the gradient reduction after backward, i.e. the communication
    that overlap did not hide (:class:`~lightning_par.data_parallel.reducer.CommStats` ``exposed_s``). It replaces
    the old ``comm_overlap`` (share of the buckets' latency that elapsed before backward ended), which read as the
    share of time saved and was not: see ``lightning_par.benchmarks.ddp`` for the A/B measurement of what overlap
    hides.

    Args:
        pl_module: the LightningModule (nothing is logged without one attached to a trainer).
        stats: the backward's ``CommStats`` (``None``: nothing to log, e.g. an accumulation micro-batch).
        name: the metric's name (the strategies log ``parallel/comm_exposed_ms``).
        prog_bar: show it in the progress bar.
    """
    trainer = getattr(pl_module, "_trainer", None)
    if stats is None or trainer is None:
        return
    every = max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1))
    if trainer.global_step % every:
        return
    log_host_number(pl_module, name, stats.exposed_s * 1e3, on_step=True, on_epoch=False, prog_bar=prog_bar,
                    batch_size=1)
