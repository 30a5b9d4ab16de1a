"""The register's Lightning (Trainer) part: the private names of ``lightning.pytorch`` the package uses, each behind a
helper of ours, with the version it was checked on.

Lightning 2.6.6 has no public way to reach these: the fit loop's data fetcher and combined loader (fault tolerance
moves a rejoining group's data to the live group's place through them), the epoch loop's step counter of the loggers
and its per-batch SIGTERM broadcast, the optimizer a ``LightningOptimizer`` wraps, the module's ``_device_mesh`` that
Lightning's own ``ModelParallelStrategy`` sets, the batch hooks its epoch loop runs, the loader behind
``load_from_checkpoint``, ``ModelCheckpoint``'s save path (a save of the current step on demand). Each entry of
:data:`PRIVATE_USES` is looked up by the canary in tests/compat/test_private_api.py, which fails naming the entry when
upstream moves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_par.compat.register import PrivateName

__all__ = [
    "PRIVATE_USES",
    "RICH_AVAILABLE",
    "SubprocessScriptLauncher",
    "batches_that_stepped",
    "before_batch_transfer",
    "checkpoint_loader",
    "data_fetcher",
    "restart_training_fetch",
    "combined_loader",
    "save_model_checkpoint",
    "is_dataloader_iter_fetcher",
    "plain_optimizer",
    "plugin_compute_dtype",
    "set_batches_that_stepped",
    "set_checkpoint_loader",
    "set_module_device_mesh",
    "sigterm_broadcast",
    "set_sigterm_broadcast",
    "summary_max_depth",
]

_CHECKED = "lightning 2.6.6"
_FIT_LOOP = "lightning.pytorch.loops.fit_loop._FitLoop"
_EPOCH_LOOP = "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop"
_MODEL_CHECKPOINT = "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint"
_STEP_CHECKPOINT_OVERRIDE = "an override in lightning_par.fault.step_checkpoint.StepCheckpoint"


def __getattr__(name: str) -> Any:
    """The two names taken from Lightning as they are, imported on first use (this module imports no Lightning, so
    the helpers below serve code that must not load the Trainer): ``RICH_AVAILABLE`` (truthy when ``rich`` is
    installed as Lightning's progress bar needs it; a lazy requirement check) and ``SubprocessScriptLauncher`` (the
    Trainer's launcher that re-runs the script per rank)."""
    if name == "RICH_AVAILABLE":
        from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

        return _RICH_AVAILABLE
    if name == "SubprocessScriptLauncher":
        from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

        return _SubprocessScriptLauncher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plain_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a ``LightningOptimizer`` wraps (``optimizer`` itself when it wraps none)."""
    return getattr(optimizer, "_optimizer", optimizer)


def data_fetcher(trainer: Any) -> Any:
    """The training data fetcher of the Trainer's fit loop (``fit_loop._data_fetcher``; ``None`` before ``fit``)."""
    return trainer.fit_loop._data_fetcher


def combined_loader(trainer: Any) -> Any:
    """The training ``CombinedLoader`` of the Trainer's fit loop (``fit_loop._combined_loader``)."""
    return trainer.fit_loop._combined_loader


def restart_training_fetch(trainer: Any, passed: int | None = None) -> Any:
    """Start the Trainer's training data over: a new iterator of every loader behind the fit loop's data fetcher (the
    order of the epoch the samplers are set to; the fetcher's counters reset), and with ``passed`` the fetcher told
    that the epoch's first ``passed`` batches are fetched already (the loaders skip them themselves). Lightning 2.6.6
    has no public way to start an epoch's data at a batch other than 0 mid-fit; its epoch loop fetches from this
    fetcher (:func:`data_fetcher`), whose ``fetched``/``done`` counters it reads. Returns the fetcher."""
    fetcher = data_fetcher(trainer)
    iter(fetcher)
    if passed is not None:
        fetcher.fetched = passed
        fetcher.done = fetcher.length is not None and fetcher.fetched >= fetcher.length
    return fetcher


def save_model_checkpoint(callback: Any, trainer: Any) -> bool:
    """Save the current step through a ``ModelCheckpoint``'s own path, as its ``on_train_batch_end`` does when a save
    is due: unless ``ModelCheckpoint._should_skip_saving_checkpoint`` (not fitting, sanity check, this step saved
    already), its ``_monitor_candidates``, then ``_save_topk_checkpoint`` and ``_save_last_checkpoint`` with them.
    Lightning 2.6.6 has no public "save now" on the callback. Every rank must call it (a sharded save is collective).

    Returns:
        Whether a save ran (``False``: skipped).
    """
    if callback._should_skip_saving_checkpoint(trainer):
        return False
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)
    return True


def is_dataloader_iter_fetcher(fetcher: Any) -> bool:
    """Whether ``fetcher`` is the one Lightning uses for a ``training_step`` that takes ``dataloader_iter``."""
    from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

    return isinstance(fetcher, _DataLoaderIterDataFetcher)


def batches_that_stepped(trainer: Any) -> int:
    """The loggers' step axis: the epoch loop's count of batches that stepped (``_batches_that_stepped``)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_batches_that_stepped(trainer: Any, value: int) -> None:
    """Set :func:`batches_that_stepped` (no public setter in Lightning 2.6.6)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = value


def sigterm_broadcast(trainer: Any) -> Callable[[], None] | None:
    """The epoch loop's per-batch broadcast of the SIGTERM flag (``_broadcast_sigterm_tensor``), or ``None``."""
    return getattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", None)


def set_sigterm_broadcast(trainer: Any, broadcast: Callable[[], None]) -> None:
    """Replace :func:`sigterm_broadcast` on this Trainer's epoch loop (an instance attribute)."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = broadcast


def before_batch_transfer(module: Any, batch: Any, dataloader_idx: int) -> Any:
    """What Lightning's epoch loop runs on a fetched batch before ``batch_to_device``: the module's (and its
    datamodule's) ``on_before_batch_transfer`` (``LightningModule._on_before_batch_transfer``)."""
    return module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """Make ``mesh`` the module's ``device_mesh`` (read-only property over ``_device_mesh``), as Lightning's
    ``ModelParallelStrategy`` does before ``configure_model``."""
    module._device_mesh = mesh


def checkpoint_loader() -> Callable[..., Any]:
    """The function ``LightningModule.load_from_checkpoint`` reads a checkpoint with
    (``lightning.pytorch.core.module._load_from_checkpoint``)."""
    import lightning.pytorch.core.module as core_module

    return core_module._load_from_checkpoint


def set_checkpoint_loader(loader: Callable[..., Any]) -> None:
    """Replace :func:`checkpoint_loader` (``load_from_checkpoint`` looks it up in its module at each call)."""
    import lightning.pytorch.core.module as core_module

    core_module._load_from_checkpoint = loader


def plugin_compute_dtype(plugin: Any) -> Any:
    """The dtype matmuls run in under a precision plugin (Lightning's throughput monitor's own mapping)."""
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    return _plugin_to_compute_dtype(plugin)


PRIVATE_USES: tuple[PrivateName, ...] = (
    PrivateName("lightning", "lightning.pytorch.core.optimizer.LightningOptimizer", "_optimizer", "instance",
                _CHECKED, "plain_optimizer"),
    PrivateName("lightning", _FIT_LOOP, "_data_fetcher", "instance", _CHECKED, "data_fetcher"),
    PrivateName("lightning", _FIT_LOOP, "_combined_loader", "instance", _CHECKED, "combined_loader"),
    PrivateName("lightning", "lightning.pytorch.loops.fetchers", "_DataLoaderIterDataFetcher", "attribute", _CHECKED,
                "is_dataloader_iter_fetcher"),
    PrivateName("lightning", _EPOCH_LOOP, "_batches_that_stepped", "instance", _CHECKED,
                "batches_that_stepped, set_batches_that_stepped"),
    PrivateName("lightning", _EPOCH_LOOP, "_broadcast_sigterm_tensor", "attribute", _CHECKED,
                "sigterm_broadcast, set_sigterm_broadcast"),
    PrivateName("lightning", "lightning.pytorch.core.module.LightningModule", "_on_before_batch_transfer",
                "attribute", _CHECKED, "before_batch_transfer"),
    PrivateName("lightning", "lightning.pytorch.core.module.LightningModule", "_device_mesh", "instance", _CHECKED,
                "set_module_device_mesh"),
    PrivateName("lightning", "lightning.pytorch.core.module", "_load_from_checkpoint", "attribute", _CHECKED,
                "checkpoint_loader, set_checkpoint_loader (lightning_par.checkpoint.loading)"),
    PrivateName("lightning", "lightning.pytorch.callbacks.throughput_monitor", "_plugin_to_compute_dtype",
                "attribute", _CHECKED, "plugin_compute_dtype"),
    PrivateName("lightning", "lightning.pytorch.callbacks.progress.rich_progress", "_RICH_AVAILABLE", "attribute",
                _CHECKED, "RICH_AVAILABLE"),
    PrivateName("lightning", "lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher",
                "attribute", _CHECKED, "SubprocessScriptLauncher"),
    PrivateName("lightning", "lightning.pytorch.trainer.trainer.Trainer", "_signal_connector", "instance", _CHECKED,
                "lightning_par.compat.disable_lightning_signal_handlers"),
    PrivateName("lightning", "lightning.pytorch.callbacks.model_summary.ModelSummary", "_max_depth", "instance",
                _CHECKED, "summary_max_depth"),
    *(PrivateName("lightning", _MODEL_CHECKPOINT, name, "attribute", _CHECKED, "save_model_checkpoint")
      for name in ("_should_skip_saving_checkpoint", "_monitor_candidates", "_save_topk_checkpoint",
                   "_save_last_checkpoint")),
    # Overridden, not called (an override only works at the definition): the canary says when upstream renames them,
    # which would otherwise leave StepCheckpoint's background save and late last.ckpt link silently unused.
    # Overridden by subclasses of ours (tests/compat/test_private_api.py finds every such override and requires its entry)
    PrivateName("lightning", "lightning.pytorch.strategies.strategy.Strategy", "_configure_launcher", "attribute",
                _CHECKED, "an override in lightning_par.strategies.base.MeshStrategy"),
    PrivateName("lightning", "lightning.pytorch.callbacks.progress.rich_progress.RichProgressBar",
                "_get_train_description", "attribute", _CHECKED,
                "an override in lightning_par.callbacks.progress.StepProgressBar"),
    *(PrivateName("lightning", _MODEL_CHECKPOINT, name, "attribute", _CHECKED, _STEP_CHECKPOINT_OVERRIDE)
      for name in ("_save_checkpoint", "_link_checkpoint")),
)


def summary_max_depth(callback: Any) -> int:
    """The ``max_depth`` a ``ModelSummary`` callback was built with."""
    return callback._max_depth
