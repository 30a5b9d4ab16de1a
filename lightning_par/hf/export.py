"""A lightning_par checkpoint of an ``HFCausalLM`` out as a Hugging Face ``save_pretrained`` directory.

The checkpoint is a sharded DCP directory (:mod:`lightning_par.checkpoint.sharded`) of any strategy and layout, its
tensors keyed ``state_dict.model.<HF name>``. :func:`export_hf` writes ``config.json``, ``generation_config.json``
(when the model has one), ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``, one shard at a
time: for each output shard only its tensors are read from the checkpoint (``torch.distributed.checkpoint.load`` of
that subset, one process) and written, so memory holds one shard, never the whole model. Weights the model ties
(``lm_head.weight`` under ``tie_word_embeddings``) are written once, under the first name, as ``save_pretrained``
does.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_par.checkpoint.loading import load_in_one_process
from lightning_par.checkpoint.safe import load_metadata_file, safe_reader
from lightning_par.checkpoint.sharded import METADATA_FILENAME, verify_checkpoint
from lightning_par.data.tokenize import TOKENIZER_FILES
from lightning_par.hf.load import INDEX_NAME, tied_aliases, trust_remote_code

__all__ = ["DEFAULT_SHARD_BYTES", "export_hf", "export_lora", "hf_config_of"]

#: Largest output shard, in bytes, unless asked otherwise (a tensor larger than this gets a shard of its own).
DEFAULT_SHARD_BYTES = 2 * 1024**3


def hf_config_of(meta: dict[str, Any]) -> Any:
    """The ``transformers`` config of a checkpoint's model: the whole config ``HFCausalLM`` keeps in its checkpoints
    (``hf_config``), else rebuilt from its hyper-parameters (``model_type`` + ``config``, or ``pretrained``).

    Raises:
        ValueError: the checkpoint holds neither (it is not an ``HFCausalLM``'s).
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    saved = meta.get("hf_config")
    if saved is not None:
        return CONFIG_MAPPING[saved["model_type"]].from_dict(dict(saved))
    hp = dict(meta.get("hyper_parameters") or {})
    from lightning_par.hf.module import LOADER_OPTIONS

    options = sorted(set(dict(hp.get("config") or {})) & LOADER_OPTIONS)
    if options:
        raise ValueError(
            f"checkpoint is not valid for export: its hyper-parameters pass {options} to transformers (options that "
            f"load code or files; a checkpoint is data, never code)."
        )
    if hp.get("pretrained"):
        return AutoConfig.from_pretrained(hp["pretrained"], local_files_only=True,
                                          trust_remote_code=trust_remote_code(), **dict(hp.get("config") or {}))
    if hp.get("model_type"):
        return AutoConfig.for_model(hp["model_type"], **dict(hp.get("config") or {}))
    raise ValueError(
        "checkpoint is not valid for export: it holds no Hugging Face config (hf_config) and no HFCausalLM "
        "hyper-parameters (model_type or pretrained). Expected a checkpoint of lightning_par.hf.HFCausalLM."
    )


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of names whose bytes stay within ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def export_hf(
    checkpoint: str | Path,
    output: str | Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    prefix: str = "model.",
    tokenizer: str | Path | None = None,
) -> Path:
    """Write a ``save_pretrained``-compatible directory from a lightning_par checkpoint of an ``HFCausalLM``.

    One process, no process group; memory for one output shard at a time.
    Also a command: ``python -m lightning_par.hf export CHECKPOINT OUTPUT_DIR [--max-shard-bytes N]``.

    Args:
        checkpoint: the checkpoint directory (``*.ckpt``) of any lightning_par strategy.
        output: the directory to write; it must not exist or be an empty directory (not a symbolic link, not a mount
            point). The files are written into a staging directory beside it (``.<name>.exporting-<random>``), which
            is then renamed onto ``output``: a failure leaves ``output`` as it was and removes the staging copy.
        max_shard_bytes: largest safetensors shard, in bytes.
        prefix: the network's attribute in the LightningModule, with a dot (``HFCausalLM``: ``"model."``).
        tokenizer: a local tokenizer directory whose files (``tokenizer.json``, ``tokenizer_config.json``, ...) are
            copied into ``output``, so that ``AutoTokenizer.from_pretrained(output)`` works too.

    Returns:
        ``output``.

    Raises:
        FileNotFoundError, ValueError: a missing or damaged checkpoint (see
            :func:`lightning_par.checkpoint.verify_checkpoint`); ``max_shard_bytes`` not positive; ``output`` is a
            non-empty directory, a file, a symbolic link or a mount point (before anything is written); ``tokenizer``
            holds no tokenizer file; the checkpoint is not an ``HFCausalLM``'s or lacks a weight of its model.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from transformers import AutoModelForCausalLM

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} is not valid: expected a positive number of bytes.")
    path, output = Path(checkpoint), Path(output)
    _check_output(output)
    tokenizer_files = [] if tokenizer is None else [
        Path(tokenizer).expanduser() / f for f in TOKENIZER_FILES if (Path(tokenizer).expanduser() / f).is_file()
    ]
    if tokenizer is not None and not tokenizer_files:
        raise ValueError(f"tokenizer={str(tokenizer)!r} is not valid: it holds none of {list(TOKENIZER_FILES)}.")
    verify_checkpoint(path)
    meta = load_metadata_file(path / METADATA_FILENAME)  # data only (lightning_par.checkpoint.safe)
    config = hf_config_of(meta)
    with torch.device("meta"):  # names and ties only: no memory
        network = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code())
    tied = tied_aliases(network)
    names = [n for n in network.state_dict() if n not in tied]
    saved = safe_reader(path).read_metadata().state_dict_metadata
    sizes: dict[str, int] = {}
    specs: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for name in names:
        entry = saved.get(f"state_dict.{prefix}{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(
                f"checkpoint {str(path)!r} is not valid for export: it has no tensor {prefix}{name} of the "
                f"{config.model_type} model its config describes."
            )
        specs[name] = (entry.size, entry.properties.dtype)
        sizes[name] = entry.size.numel() * torch.empty((), dtype=entry.properties.dtype).element_size()
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.parent / f".{output.name}.exporting-{secrets.token_hex(4)}"
    staged.mkdir()  # beside the output (same file system: the move is a rename), ours alone
    try:
        _write(staged, path, config, meta, specs, sizes, max_shard_bytes, prefix, tokenizer_files)
        os.replace(staged, output)  # atomic; replaces an empty directory, never a non-empty one
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)  # the output is as it was, and no staging copy stays
        raise
    return output


def _check_output(output: Path) -> None:
    """Refuse, before anything is written, an output the export would not replace as a whole."""
    if output.is_symlink():
        raise ValueError(
            f"output={str(output)!r} is not valid: it is a symbolic link (to {os.readlink(output)!r}); the export "
            f"moves a finished directory into place and does not write through links. Give the directory itself, or "
            f"a path that does not exist."
        )
    if output.is_dir() and os.path.ismount(output):
        raise ValueError(
            f"output={str(output)!r} is not valid: it is a mount point, which a finished directory cannot be moved "
            f"onto. Give a new directory inside it (e.g. {str(output / 'model')!r})."
        )
    if output.exists() and not output.is_dir():
        raise ValueError(f"output={str(output)!r} is not valid: it exists and is not an empty directory (a file). "
                         f"Give a path that does not exist, or an empty directory.")
    if output.is_dir() and any(output.iterdir()):
        raise ValueError(f"output={str(output)!r} is not valid: it exists and is not an empty directory (it holds "
                         f"{sum(1 for _ in output.iterdir())} entries). Give a path that does not exist, or an empty "
                         f"directory.")


def _write(staged: Path, path: Path, config: Any, meta: dict[str, Any],
           specs: dict[str, tuple[torch.Size, torch.dtype]], sizes: dict[str, int], max_shard_bytes: int, prefix: str,
           tokenizer_files: list[Path]) -> None:
    """The export's files, written into ``staged``."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    shards = _plan_shards(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: torch.empty(specs[name][0], dtype=specs[name][1]) for name in shard}
        load_in_one_process({"state_dict": {prefix + n: t for n, t in tensors.items()}}, path)
        save_file(tensors, str(staged / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        del tensors
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (staged / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(staged)
    generation = meta.get("hf_generation_config")
    if generation is not None:
        GenerationConfig.from_dict(generation).save_pretrained(staged)
    for file in tokenizer_files:
        shutil.copyfile(file, staged / file.name)


def export_lora(checkpoint: str | Path, output: str | Path, merged: bool = False, base: str | Path | None = None,
                prefix: str = "model.") -> Path:
    """Write a LoRA run's adapter as a PEFT directory, or the model with the adapter merged as a Hugging Face one.

    One process, no process group; memory for the whole model. Also a command:
    ``python -m lightning_par.hf export CHECKPOINT OUTPUT_DIR --adapter`` (or ``--merged``).

    The model is rebuilt as the run built it (:class:`~lightning_par.hf.HFCausalLM` with its ``lora`` options: the
    base from ``base``, else the run's ``pretrained`` directory, else the checkpoint when it is whole), the
    checkpoint's tensors (of any layout) are read into it, then:

    * ``merged=False``: ``PeftModel.save_pretrained`` (``adapter_config.json``, ``adapter_model.safetensors``), which
      ``PeftModel.from_pretrained(base model, output)`` loads;
    * ``merged=True``: ``merge_and_unload()`` (each LoRA layer's weight becomes ``W + scaling * B @ A``, Hu et al.
      2021, §4.1) and ``save_pretrained``, which ``AutoModelForCausalLM.from_pretrained(output)`` loads.

    Args:
        checkpoint: the checkpoint directory (``*.ckpt``) of a run of ``HFCausalLM(lora=...)``.
        output: the directory to write; it must not exist or be empty (written beside it, then renamed onto it).
        merged: write the merged model instead of the adapter.
        base: a ``save_pretrained`` directory holding the base weights (default: the run's ``pretrained``).
        prefix: the network's attribute in the LightningModule, with a dot.

    Returns:
        ``output``.

    Raises:
        FileNotFoundError, ValueError: a missing or damaged checkpoint; one of a run without LoRA (export it without
            ``--adapter``/``--merged``); ``merged`` with no base to merge into (an adapter-only checkpoint of a
            ``model_type`` build without ``base``); ``output`` not empty (see :func:`export_hf`).
    """
    from lightning_par.hf.lora import apply_lora, lora_options

    path, output = Path(checkpoint), Path(output)
    _check_output(output)
    verify_checkpoint(path)
    meta = load_metadata_file(path / METADATA_FILENAME)
    hp = dict(meta.get("hyper_parameters") or {})
    lora = lora_options(hp.get("lora"))
    what = "--merged" if merged else "--adapter"
    if lora is None:
        raise ValueError(
            f"checkpoint {str(path)!r} is not valid for export {what}: its run trained no LoRA adapter (lora.r=0). "
            f"Export the whole model without --adapter/--merged."
        )
    config = hf_config_of(meta)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code())
    saved = safe_reader(path).read_metadata().state_dict_metadata
    base_dir = base if base is not None else hp.get("pretrained")
    whole = any(k.startswith(f"state_dict.{prefix}") and "lora_" not in k for k in saved)
    if base_dir is not None:
        from lightning_par.hf.load import fill_from_safetensors

        state = {f"{prefix}{k}": v for k, v in model.state_dict().items()}
        fill_from_safetensors(state, base_dir, prefix, tied_aliases(model))
    elif merged and not whole:
        raise ValueError(
            f"checkpoint {str(path)!r} holds the adapter only and its run built the base from model_type (random "
            f"weights), so there is no base to merge into: pass --base DIR (a save_pretrained directory of the base) "
            f"or export --adapter."
        )
    peft_model = apply_lora(model, lora)
    own = {f"{prefix}{k}": v for k, v in peft_model.state_dict().items()}
    wanted = {k: v for k, v in own.items() if f"state_dict.{k}" in saved}
    missing = [k for k, p in peft_model.named_parameters() if p.requires_grad and f"{prefix}{k}" not in wanted]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is not valid for export {what}: it lacks the adapter weights "
                         f"{missing[:3]} of the LoRA options it was trained with ({lora}).")
    tensors = {k: torch.empty_like(v) for k, v in wanted.items()}
    load_in_one_process({"state_dict": tensors}, path)
    with torch.no_grad():
        for name, value in tensors.items():
            own[name].copy_(value)
    if base_dir is not None:
        peft_model.peft_config["default"].base_model_name_or_path = str(base_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.parent / f".{output.name}.exporting-{secrets.token_hex(4)}"
    staged.mkdir()
    try:
        if merged:
            peft_model.merge_and_unload().save_pretrained(staged)
        else:
            peft_model.save_pretrained(staged)
        os.replace(staged, output)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return output
