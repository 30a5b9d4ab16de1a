"""Hugging Face safetensors weights into a model of any layout, each rank reading only the block it holds.

A ``save_pretrained`` directory holds ``model.safetensors`` or shards listed by ``model.safetensors.index.json``
(``{"weight_map": {hf_name: file}}``). For every tensor of a model state (plain tensors or DTensors of their global
shape, keyed ``<prefix><hf_name>``), :func:`fill_from_safetensors` asks the file for this rank's block only
(``safetensors.safe_open(...).get_slice(name)[rows, cols]``: a memory map, so the other blocks are never read) and
copies it into the local shard. Weights that the model ties (``lm_head.weight`` to ``embed_tokens.weight`` under
``tie_word_embeddings``), which ``save_pretrained`` writes once, are read under the name that is in the files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.compat import local_chunk, local_tensor

__all__ = ["INDEX_NAME", "TRUST_REMOTE_CODE_ENV", "WEIGHTS_NAME", "fill_from_safetensors", "load_hf_weights",
           "tied_aliases", "trust_remote_code", "weight_files"]

#: The single-file weights of a ``save_pretrained`` directory.
WEIGHTS_NAME = "model.safetensors"
#: The index of a sharded ``save_pretrained`` directory.
INDEX_NAME = "model.safetensors.index.json"


#: The opt-in to the Python files a model, config or tokenizer directory names (``auto_map``): ``1`` lets
#: transformers import them. An environment variable, never a config field: a checkpoint's hyper-parameters reach the
#: loaders, and a checkpoint is data, never code.
TRUST_REMOTE_CODE_ENV = "LIGHTNING_PAR_TRUST_REMOTE_CODE"


def trust_remote_code() -> bool:
    """The ``trust_remote_code`` every loader of the project passes to transformers: ``False`` unless
    ``$LIGHTNING_PAR_TRUST_REMOTE_CODE=1``. Always a bool: transformers never asks on stdin ("Do you wish to run the
    custom code? [y/N]"), so no answer there can import a file.

    Raises:
        ValueError: the variable holds another value than ``0``/``1`` (or empty).
    """
    value = os.environ.get(TRUST_REMOTE_CODE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{TRUST_REMOTE_CODE_ENV}={value!r} is not valid: expected '1' (transformers imports the Python files a "
            f"model, config or tokenizer directory names: only for directories you trust) or '0'/unset (never)."
        )
    return value == "1"


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Which safetensors file of ``directory`` holds each tensor, by Hugging Face name.

    Raises:
        ValueError: ``directory`` has neither ``model.safetensors.index.json`` nor ``model.safetensors`` (e.g. only
            ``pytorch_model.bin``), or its index is unreadable.
    """
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"model.pretrained={str(directory)!r} has an unreadable {INDEX_NAME} ({err}).") from None
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS_NAME
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ValueError(
        f"model.pretrained={str(directory)!r} is not valid: it has no {WEIGHTS_NAME} and no {INDEX_NAME}. Expected a "
        f"directory written by save_pretrained(..., safe_serialization=True) (or by python -m lightning_par.hf "
        f"export); .bin weights are not read."
    )


def tied_aliases(network: nn.Module) -> dict[str, str]:
    """``{alias: name}`` for every parameter that ``network`` shares under several names (tied weights), ``name``
    being the first one in registration order (the one ``save_pretrained`` keeps)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in network.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


@torch.no_grad()
def fill_from_safetensors(
    state: dict[str, Any],
    directory: str | Path,
    prefix: str = "model.",
    aliases: dict[str, str] | None = None,
    check_only: bool = False,
) -> int:
    """Copy this rank's block of every tensor of ``state`` from the safetensors files of ``directory``, in place.

    Args:
        state: ``{prefix + hf_name: tensor}``, plain tensors or DTensors of the global shape (a strategy's model
            state); entries without ``prefix`` are left alone.
        directory: a ``save_pretrained`` directory.
        prefix: what the state's keys put before the Hugging Face name (``"model."`` for ``HFCausalLM``).
        aliases: tied names, ``{alias: name}`` (:func:`tied_aliases`), read under ``name`` when the files lack them.
        check_only: only check that every tensor is in the files with its shape (safetensors headers; nothing read
            or copied): for a model on the ``meta`` device, before any process starts.

    Returns:
        The bytes read from the files (this rank's blocks).

    Raises:
        ValueError: a tensor is missing from the files or has another shape there (the message names it).
    """
    from safetensors import safe_open

    files = weight_files(directory)
    aliases = aliases or {}
    wanted: dict[Path, list[tuple[str, str, Tensor]]] = {}
    missing: list[str] = []
    copies: list[tuple[Tensor, Tensor]] = []
    seen: set[int] = set()
    for key, tensor in state.items():
        if not key.startswith(prefix) or not isinstance(tensor, Tensor) or id(tensor) in seen:
            continue  # another module's, or a tied weight met under its first name already
        seen.add(id(tensor))
        name = key[len(prefix):]
        source = name if name in files else aliases.get(name)
        if source is None or source not in files:
            missing.append(name)
        elif source != name and isinstance(state.get(prefix + source), Tensor):
            copies.append((state[prefix + source], tensor))  # a tied weight given twice: read once, copied
        else:
            wanted.setdefault(files[source], []).append((source, name, tensor))
    if missing:
        raise ValueError(
            f"model.pretrained={str(directory)!r} does not fit this model: its safetensors lack {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} ({len(missing)} tensors). Expected a directory saved from the same "
            f"architecture and config."
        )
    read = 0
    for file, entries in wanted.items():
        with safe_open(str(file), framework="pt") as f:
            for source, name, tensor in entries:
                piece = f.get_slice(source)
                shape = tuple(piece.get_shape())
                if shape != tuple(tensor.shape):
                    raise ValueError(
                        f"model.pretrained={str(directory)!r} does not fit this model: {source!r} has shape {shape} "
                        f"in {file.name} and {tuple(tensor.shape)} here."
                    )
                if check_only:
                    continue
                offsets, sizes = local_chunk(tensor)
                if any(s == 0 for s in sizes):
                    continue  # an empty shard (more ranks than rows)
                block = piece[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if sizes else piece[:]
                local = local_tensor(tensor)
                local.copy_(block.reshape(local.shape))
                read += block.numel() * block.element_size()
    for source_tensor, tensor in [] if check_only else copies:
        if local_chunk(source_tensor) != local_chunk(tensor):
            raise ValueError(f"tied weights are sharded differently ({local_chunk(source_tensor)} and "
                             f"{local_chunk(tensor)}); expected the same layout for both names.")
        local_tensor(tensor).copy_(local_tensor(source_tensor))
    return read


def load_hf_weights(
    directory: str | Path,
    module: nn.Module,
    parallel: Any = None,
    prefix: str = "model.",
    aliases: dict[str, str] | None = None,
) -> int:
    """Load a ``save_pretrained`` directory's weights into ``module`` (one process) or into this rank's part of a
    parallel model (each rank reads only its blocks; no collective).

    Args:
        directory: the ``save_pretrained`` directory.
        module: the LightningModule (or any module keyed ``prefix + hf_name``).
        parallel: the strategy's :class:`~lightning_par.parallelize.ParallelModel` when the module is parallelized
            (its engine's one-process state is filled, then loaded back); ``None`` for a plain module.
        prefix: see :func:`fill_from_safetensors`.
        aliases: see :func:`fill_from_safetensors`.

    Returns:
        The bytes this rank read.

    Raises:
        ValueError: see :func:`weight_files` and :func:`fill_from_safetensors`.
    """
    if parallel is None:
        state = module.state_dict(keep_vars=True)
        return fill_from_safetensors(state, directory, prefix, aliases)
    engine = parallel.engine
    state = engine.model_state_dict()
    parallel.to_one_process(state, [])
    read = fill_from_safetensors(state, directory, prefix, aliases)
    engine.load_model_state_dict(state)
    return read
