"""A resume continues the same run: the hyper-parameters a checkpoint was written with are compared with the new
ones before any tensor is loaded, and a change that would silently alter the model, its optimization or the data it
sees is refused, naming each field (old -> new).

What a resume compares (``meta.pt``'s ``hyper_parameters`` and ``datamodule_hyper_parameters``, the LightningModule's
and the LightningDataModule's ``save_hyperparameters()``; nested dicts by dotted name, e.g. ``config.n_head``):

* the model's hyper-parameters, all of them (its architecture, ``learning_rate``, ``weight_decay``, ``betas``,
  warm-up, ...): **refused** if changed. The restored optimizer and LR scheduler keep the checkpoint's values (their
  state holds them), so a new value would be ignored or half-applied: to change one, start a new run from the weights
  (``load_model_weights`` / ``load_from_checkpoint``). Except :data:`APPLIED_MODULE_FIELDS` (``max_steps``): a run
  resumed to train longer; the schedule is recomputed for the new length from the restored step;
* the data module's: ``path``, ``block_size``, ``seed``, ``tokenizer``, ``synthetic*`` (another sample stream: the
  saved position would point elsewhere) **refused**, except a ``tokenizer`` path whose files are the checkpoint's
  (same contents: applied); :data:`APPLIED_DATA_FIELDS` (workers, validation batches, cache
  directory) applied; ``batch_size`` **refused** while the checkpoint is inside an epoch (Lightning's loops count the
  epoch in batches: a new size would replay or skip samples), applied from an epoch boundary. The same holds for the
  number of data-parallel replicas (:class:`~lightning_par.data.ResumableDataLoader` saves both with its position),
  except that a position saved in the epoch's global order (``consumed``: the loader's re-splitting sampler,
  :mod:`lightning_par.data.sampler`) resumes inside an epoch with another ``batch_size`` and number of replicas when
  their product, the global batch, is the same (``dp_size`` 2 -> 4 with half the ``batch_size``): applied.

* the data's fingerprint (:mod:`lightning_par.data.fingerprint`, in the data module's state): the tokenizer files'
  contents, the token cache's key, the packing settings: **refused** if changed (a tokenizer edited in place gives
  another token stream under the same ``data.tokenizer``).

A field that only one side has (a hyper-parameter added by a newer version, a checkpoint of an older one) is not
compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["APPLIED_DATA_FIELDS", "APPLIED_MODULE_FIELDS", "check_resume", "resume_changes"]

#: Model hyper-parameters a resume may change (applied): the schedule's length, for a run resumed to train longer.
APPLIED_MODULE_FIELDS = frozenset({"max_steps"})
#: Data hyper-parameters a resume may change (applied): they do not change which samples come in which order.
APPLIED_DATA_FIELDS = frozenset({"num_workers", "val_batches", "cache_dir"})
#: Data hyper-parameters a resume may change only from an epoch boundary (the saved position counts batches).
EPOCH_BOUNDARY_DATA_FIELDS = frozenset({"batch_size"})


def _plain(value: Any) -> Any:
    """OmegaConf containers, tuples and mappings as plain dicts/lists, for comparison."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _changed(saved: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """``(dotted field, old, new)`` for every field both sides have, whose values differ."""
    if not isinstance(saved, Mapping) or not isinstance(new, Mapping):
        return []
    old, now = _flat(_plain(saved)), _flat(_plain(new))
    return [(k, old[k], now[k]) for k in old if k in now and old[k] != now[k]]


def data_position(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The training DataLoader's saved position (:class:`~lightning_par.data.ResumableDataLoader`'s state) in a
    checkpoint's ``meta.pt``, or ``None``."""
    try:
        states = meta["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    except (KeyError, TypeError):
        return None
    return states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else None


def resume_changes(
    meta: Mapping[str, Any],
    module_hparams: Mapping[str, Any] | None,
    datamodule_hparams: Mapping[str, Any] | None = None,
    replicas: int | None = None,
    data_fingerprint: Mapping[str, Any] | None = None,
) -> tuple[list[str], list[str]]:
    """What differs between a checkpoint's hyper-parameters and the new run's (see the module docstring).

    Args:
        meta: the checkpoint's ``meta.pt`` contents.
        module_hparams: the new LightningModule's ``hparams``.
        datamodule_hparams: the new LightningDataModule's ``hparams`` (``None``: not compared).
        replicas: the new run's number of data-parallel replicas (``None``: not compared).
        data_fingerprint: the new data module's fingerprint (:mod:`lightning_par.data.fingerprint`), compared with
            the one in the checkpoint's data module state (``None``: not compared). When both have one, a
            ``tokenizer`` path that changed with the same files is applied.

    Returns:
        ``(refused, applied)``: each a list of ``"<where> <field>: <old> -> <new>"`` lines.
    """
    from lightning_par.data.fingerprint import fingerprint_changes

    saved_fingerprint = _saved_fingerprint(meta)
    refused_data = fingerprint_changes(saved_fingerprint, data_fingerprint)
    same_tokenizer = (saved_fingerprint is not None and data_fingerprint is not None
                      and "tokenizer" in saved_fingerprint and "tokenizer" in data_fingerprint
                      and saved_fingerprint["tokenizer"] == data_fingerprint["tokenizer"])
    refused: list[str] = []
    applied: list[str] = []
    for field, old, new in _changed(meta.get("hyper_parameters"), module_hparams):
        (applied if field in APPLIED_MODULE_FIELDS else refused).append(f"model {field}: {old!r} -> {new!r}")
    position = data_position(meta) or {}
    inside_epoch = int(position.get("batches") or 0) > 0
    saved_replicas = position.get("replicas")
    # A position in the global order (a re-splitting sampler's ``consumed``) resumes with another batch size and
    # replica count when the global batch is the same (see the module docstring).
    same_global = _same_global_batch(position, datamodule_hparams, replicas)
    for field, old, new in _changed(meta.get("datamodule_hyper_parameters"), datamodule_hparams):
        line = f"data {field}: {old!r} -> {new!r}"
        if field == "tokenizer" and same_tokenizer:
            applied.append(line + " (the same tokenizer files)")
        elif field in APPLIED_DATA_FIELDS or (field in EPOCH_BOUNDARY_DATA_FIELDS
                                              and (not inside_epoch or same_global)):
            applied.append(line)
        else:
            refused.append(line + (f" (the checkpoint is {position['batches']} batches into an epoch"
                                   f"{_global_hint(position)})" if field in EPOCH_BOUNDARY_DATA_FIELDS else ""))
    if inside_epoch and replicas is not None and saved_replicas is not None and int(saved_replicas) != replicas:
        line = f"data-parallel replicas (dp_size): {saved_replicas} -> {replicas}"
        if same_global:
            applied.append(line + " (the rest of the epoch re-split over the new replicas)")
        else:
            refused.append(line + f" (the checkpoint is {position['batches']} batches into an epoch"
                                  f"{_global_hint(position)})")
    return refused + refused_data, applied


def _saved_fingerprint(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The data fingerprint a checkpoint holds: in its data module's state (Lightning saves ``state_dict()`` under the
    class's name), or ``None``."""
    for value in meta.values():
        if isinstance(value, Mapping) and isinstance(value.get("fingerprint"), Mapping):
            return value["fingerprint"]
    return None


def _global_hint(position: Mapping[str, Any]) -> str:
    if position.get("consumed") is None or not position.get("batch_size") or not position.get("replicas"):
        return ""
    total = int(position["batch_size"]) * int(position["replicas"])
    return (f"; it may resume with another dp_size if batch_size * dp_size stays {position['batch_size']} * "
            f"{position['replicas']} = {total}")


def _same_global_batch(position: Mapping[str, Any], datamodule_hparams: Mapping[str, Any] | None,
                       replicas: int | None) -> bool:
    """Whether a position saved in the global order (``consumed``) resumes with the same global batch."""
    if position.get("consumed") is None or not position.get("batch_size") or not position.get("replicas"):
        return False
    if "batch_size" not in (datamodule_hparams or {}):
        # a loader the check cannot see (no data module): the loader compares the global batch when it loads
        return True
    batch = datamodule_hparams["batch_size"]  # type: ignore[index]
    now_replicas = replicas if replicas is not None else position["replicas"]
    return int(batch) * int(now_replicas) == int(position["batch_size"]) * int(position["replicas"])


def check_resume(
    path: str | Path,
    meta: Mapping[str, Any],
    module_hparams: Mapping[str, Any] | None,
    datamodule_hparams: Mapping[str, Any] | None = None,
    replicas: int | None = None,
    data_fingerprint: Mapping[str, Any] | None = None,
) -> list[str]:
    """Refuse resuming from the checkpoint at ``path`` with other hyper-parameters or other data (see the module
    docstring and :func:`resume_changes`).

    Returns:
        The changes that are applied (for a log line).

    Raises:
        ValueError: a refused change; the message names every refused field with its old and new value.
    """
    refused, applied = resume_changes(meta, module_hparams, datamodule_hparams, replicas, data_fingerprint)
    if refused:
        raise ValueError(
            f"checkpoint {str(path)!r} cannot be resumed with these settings: {'; '.join(refused)}. A resume continues "
            f"the same run: set these back to the checkpoint's values (the first value of each). To train with the new "
            f"values, start a new run from the checkpoint's weights instead (lightning_par.checkpoint.load_model_weights "
            f"or load_from_checkpoint); a new batch size or data-parallel size is accepted from an epoch boundary."
        )
    return applied
