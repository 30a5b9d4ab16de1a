"""The model contract: how a user's LightningModule tells the strategies how it parallelises.

Generic code (``pipeline_parallel/``, ``tensor_parallel/``, ``data_parallel/``, ``strategies/``) knows no model; it asks
these functions, which read what the model provides and fall back to what a plain ``nn.Sequential`` /
``nn.ModuleList`` implies. Everything is optional except what the chosen technique needs:

==========================  ==========================================================================================
the network                 ``lightning_module.<module_attr>`` (``module_attr="model"`` by default); without that
                            attribute and with ``pp_size == 1``, the LightningModule itself.
tensor parallelism          a plan ``{module path relative to the network: style}`` from the strategy's ``plan=``,
                            else ``network.tp_plan()``, else ``lightning_module.tp_plan()``. Optional
                            ``network.check_tensor_parallel(tp_size, sequence_parallel[, plan=])`` raises
                            ``ValueError`` for shapes the plan cannot split (e.g. heads not divisible by ``tp_size``).
pipeline stages             ``network.pipeline_layers() -> list[str]``: names of the children between which a stage
                            boundary may fall, in execution order; ``network.pipeline_stage(layers, first=, last=)
                            -> nn.Module``: a module that runs only those layers (plus what comes before the first
                            layer when ``first``, after the last when ``last``), sharing the network's parameters.
                            Fallback: the children of an ``nn.Sequential`` / ``nn.ModuleList``.
pipeline loss               ``lightning_module.pipeline_loss(outputs, targets)`` or ``lightning_module.loss_fn(outputs,
                            targets)`` -> the mean loss of one micro-batch (a scalar). Under pipelining the
                            LightningModule's ``training_step`` does not make the loss: the schedule runs forward and
                            backward itself, micro-batch by micro-batch; ``training_step`` runs on the last stage on
                            each micro-batch's outputs (no gradient) for what it logs.
pipeline output             optional ``network.pipeline_output(outputs)``: the last stage's outputs as ``network(...)``
                            returns them (default: as they are; a Hugging Face model: an output object with
                            ``.logits``). Under pipelining the LightningModule's ``validation_step`` / ``test_step``
                            run on every rank, their one call of the network returning the last stage's outputs.
pipeline batch              ``lightning_module.pipeline_batch(batch) -> (inputs, targets)``; by default a batch is
                            ``(inputs, targets)``. ``inputs`` is a tensor or a tuple of tensors (the first stage's
                            positional arguments), split along dim 0; ``targets`` any structure of tensors split along
                            dim 0. Stages may pass a tuple of tensors to the next stage.
profiling sample            for ``split="time"``: ``lightning_module.example_input_array`` or
                            ``network.example_input()``.
activation checkpointing    ``network.checkpoint_modules(mode) -> list[str]``: paths (relative to the network) of the
                            modules to checkpoint for ``mode`` ``"full"`` (every block) or ``"selective"`` (the
                            attention of every block). Fallback for ``"full"``: the pipeline layers (the children of
                            an ``nn.Sequential`` / ``nn.ModuleList``, or ``pipeline_layers()``); ``"selective"``
                            needs the method (only the model knows which part is attention).
context parallelism         attention through ``torch.nn.functional.scaled_dot_product_attention`` (no ``attn_mask``,
                            ``dropout_p=0``; causal or full); ``network.forward(..., position_ids=)`` taking the global
                            positions of the tokens a rank holds. Batches arrive with every tensor's sequence dim
                            (dim 1) split and ``position_ids`` ``(seq_local,)`` appended (a tuple batch) or added under
                            that key (a dict batch); under pipelining ``pipeline_batch`` maps them into the first
                            stage's inputs. For ``method="all_to_all"``: ``network.attention_heads()``. Optional
                            ``network.context_parallel_attention()``: a context each cp step runs in (e.g. to turn
                            off a mask the model would build from the positions).
expert parallelism          ``network.expert_modules() -> list[str]``: paths (relative to the network) of the experts
                            of every mixture-of-experts layer. An experts module is called as ``experts(x, counts)``
                            with ``x`` ``(tokens, d)`` sorted by expert and ``counts`` ``(experts held,)`` int64; it
                            returns ``(tokens, d)`` in the order of ``x``; every parameter has the expert index on
                            dim 0 (``num_experts`` rows), and forward reads each through ``w.to_local()`` when ``w`` is
                            a DTensor (the ep ranks hold ``Shard(0)`` pieces). The router, the sorting and the
                            weighted combination stay in the layer (:class:`lightning_par.models.moe.MoE` is one).
                            Per-sequence statistics (load balance, capacity) read
                            :func:`lightning_par.context_parallel.sequence.active_sequence_shard` under cp; auxiliary
                            losses go through :func:`lightning_par.aux_loss.attach_aux_loss`.
label masks                 integer targets of ``-100`` count for nothing (:func:`batch_counted_tokens`): with a
                            token-mean loss the dp replicas, cp pieces and pp micro-batches are weighed by their
                            share of the counted tokens, as one process averages. A LightningModule whose loss is no
                            token mean sets ``token_mean_loss = False`` (every part then weighs the same).
==========================  ==========================================================================================
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "network_method",
    "register_adapter",
    "attention_heads",
    "batch_counted_tokens",
    "batch_counted_tokens_tensor",
    "checkpoint_modules",
    "counted_tokens",
    "counted_tokens_tensor",
    "expert_modules",
    "find_network",
    "pipeline_batch",
    "pipeline_layers",
    "pipeline_loss",
    "pipeline_output",
    "pipeline_sample",
    "pipeline_stage",
    "check_tensor_parallel",
    "tp_plan",
]


#: Adapters for model families whose classes we cannot add methods to: ``(matches(network) -> bool, adapter)``. An
#: adapter provides any of the contract's network methods as functions taking the network first
#: (``adapter.pipeline_layers(network)``); a method the network defines itself wins.
_ADAPTERS: list[tuple[Callable[[nn.Module], bool], Any]] = []
#: Where a family's adapter lives, by the prefix of its classes' module: imported (and so registered) on first sight,
#: so that generic code imports no model library.
_ADAPTER_MODULES = {"transformers.": "lightning_par.hf.adapter", "peft.": "lightning_par.hf.lora"}


def register_adapter(matches: Callable[[nn.Module], bool], adapter: Any) -> None:
    """Register ``adapter`` for the networks ``matches`` accepts (see :data:`_ADAPTERS`)."""
    _ADAPTERS.append((matches, adapter))


def _adapter(network: nn.Module) -> Any:
    import importlib

    family = type(network).__module__
    for prefix, module_name in _ADAPTER_MODULES.items():
        if family.startswith(prefix):
            importlib.import_module(module_name)
    for matches, adapter in _ADAPTERS:
        if matches(network):
            return adapter
    return None


def network_method(network: nn.Module, name: str) -> Callable[..., Any] | None:
    """``network.<name>`` if the network defines it as a method, else its adapter's ``<name>`` bound to it, else
    None: how an axis's folder reads what the contract asks of a network for that axis."""
    method = getattr(network, name, None)
    if callable(method):
        return method
    adapter = _adapter(network)
    function = getattr(adapter, name, None) if adapter is not None else None
    if callable(function):
        return lambda *args, **kwargs: function(network, *args, **kwargs)
    return None


def check_not_compiled(module: nn.Module, technique: str, why: str) -> None:
    """Refuse a LightningModule holding a ``torch.compile``'d module (``torch.compile`` in ``configure_model`` or
    ``__init__``, Lightning's documented pattern) under a technique that splits the model by its own structure: compile
    puts the compiled module behind ``._orig_mod``, so the plan's paths and the stage boundaries no longer name it, and
    a compiled graph would not see the split the technique makes afterwards. The data-parallel modes (``ddp``,
    ``zero1``-``zero3``) take a compiled network (measured at parity with ``backend="aot_eager"``).

    Args:
        module: the LightningModule.
        technique: what refuses (``"tensor parallelism (tp_size=2)"``).
        why: what it does with the module's structure.

    Raises:
        ValueError: naming the compiled module and what to do instead.
    """
    from lightning_par.compat import is_compiled_module

    compiled = [name or type(module).__name__ for name, m in module.named_modules() if is_compiled_module(m)]
    if compiled:
        raise ValueError(
            f"{type(module).__name__}.{compiled[0]} is a torch.compile'd module (torch.compile in configure_model or "
            f"__init__), which {technique} cannot run: it {why}, and torch.compile hides the module's own structure "
            f"behind '_orig_mod'. Remove torch.compile from the LightningModule and let the strategy compile every "
            f"block after it has parallelised the model: compile={{'enabled': True}} (strategy.compile.enabled=true "
            f"in a recipe; docs/compile.md). A data-parallel layout (ddp, zero1, zero2, zero3) also accepts a "
            f"compiled network."
        )


def find_network(module: nn.Module, module_attr: str | None, pipelined: bool) -> nn.Module:
    """The network the strategies parallelise (see the module docstring).

    Raises:
        ValueError: pipelining a LightningModule that has no network at ``module_attr``, or has parameters outside it
            (the schedule runs only the network, so they would never train).
    """
    network = getattr(module, module_attr, None) if module_attr else None
    if isinstance(network, nn.Module):
        if pipelined:
            inside = {id(p) for p in network.parameters()}
            outside = [n for n, p in module.named_parameters() if id(p) not in inside]
            if outside:
                raise ValueError(
                    f"{type(module).__name__} has parameters outside its network .{module_attr}: {outside[:5]}. Under "
                    f"pipelining only the network runs (micro-batch by micro-batch, stage by stage); move them into "
                    f".{module_attr} or use pp_size=1."
                )
        return network
    if pipelined:
        raise ValueError(
            f"module_attr={module_attr!r} is not valid for {type(module).__name__} under pipelining: expected the "
            f"LightningModule to keep its network at .{module_attr or 'model'} (an nn.Module: an nn.Sequential, an "
            f"nn.ModuleList, or a module with pipeline_layers()/pipeline_stage())."
        )
    return module


def tp_plan(module: nn.Module, network: nn.Module, explicit: Mapping[str, Any] | None) -> dict[str, Any]:
    """The tensor-parallel plan, relative to ``network``: ``explicit``, else ``network.tp_plan()``, else
    ``module.tp_plan()``.

    Raises:
        ValueError: none of the three exists.
    """
    if explicit is not None:
        return dict(explicit)
    for owner in (network, module):
        method = network_method(owner, "tp_plan")
        if method is not None:
            return dict(method())
    where = f"the network ({type(network).__name__}) or on " if network is not module else ""
    raise ValueError(
        f"tensor parallelism needs a plan for {type(module).__name__}: pass plan={{module path relative to the "
        f"network: style}} to the strategy (strategy.tensor_parallel.plan in the recipe), or define tp_plan() on "
        f"{where}{type(module).__name__}. Styles: colwise, rowwise, colwise_input, sequence_parallel, "
        f"position_embedding, replicate, vocab_embedding, vocab_head."
    )


def check_tensor_parallel(network: nn.Module, tp_size: int, sequence_parallel: bool,
                          plan: Mapping[str, Any] | None = None) -> None:
    """Call the network's own ``check_tensor_parallel(tp_size, sequence_parallel)`` if it has one (it raises
    ``ValueError`` for shapes its plan cannot split), with ``plan=`` (the plan the run uses) if it takes one."""
    method = network_method(network, "check_tensor_parallel")
    if not callable(method):
        return
    import inspect

    params = inspect.signature(method).parameters.values()
    if plan is not None and any(p.name == "plan" or p.kind is p.VAR_KEYWORD for p in params):
        method(tp_size, sequence_parallel, plan=plan)
    else:
        method(tp_size, sequence_parallel)


def pipeline_layers(network: nn.Module) -> list[str]:
    """Names of the children a stage boundary may fall between, in execution order.

    Raises:
        ValueError: the network neither defines ``pipeline_layers()`` nor is an ``nn.Sequential``/``nn.ModuleList``.
    """
    method = network_method(network, "pipeline_layers")
    if callable(method):
        return list(method())
    if isinstance(network, (nn.Sequential, nn.ModuleList)):
        return [name for name, _ in network.named_children()]
    raise ValueError(
        f"a network of type {type(network).__name__} cannot be split into pipeline stages: expected an "
        f"nn.Sequential or nn.ModuleList of layers run in order, or a network that defines pipeline_layers() and "
        f"pipeline_stage(layers, first=, last=) (see lightning_par.contract)."
    )


def pipeline_stage(network: nn.Module, layers: Sequence[str], *, first: bool, last: bool) -> nn.Module:
    """A module running ``layers`` of ``network`` (see the module docstring); shares the network's parameters."""
    method = network_method(network, "pipeline_stage")
    if callable(method):
        return method(list(layers), first=first, last=last)
    pipeline_layers(network)  # raises for unsupported networks
    return nn.Sequential(OrderedDict((name, network.get_submodule(name)) for name in layers))


def pipeline_loss(module: nn.Module) -> Callable[[Any, Any], Tensor]:
    """``module.pipeline_loss`` or ``module.loss_fn``: ``(outputs of the last stage, targets) -> scalar loss``.

    Raises:
        ValueError: neither exists; the message says that ``training_step`` does not compute the loss under pipelining.
    """
    for name in ("pipeline_loss", "loss_fn"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    raise ValueError(
        f"pipelining needs {type(module).__name__}.loss_fn(outputs, targets) (or pipeline_loss) -> the mean loss of "
        f"one micro-batch: the schedule runs forward and backward itself, micro-batch by micro-batch, so the "
        f"LightningModule's training_step does not compute the loss under pipelining (pp_size > 1); it runs on the "
        f"last stage's outputs only for what it logs."
    )


def pipeline_output(network: nn.Module, outputs: Any) -> Any:
    """``outputs`` of the last pipeline stage as ``network(...)`` returns them: through the network's (or its
    adapter's) ``pipeline_output`` if defined, else as they are."""
    method = network_method(network, "pipeline_output")
    return method(outputs) if callable(method) else outputs


#: Targets equal to this count for nothing in a token-mean loss (``F.cross_entropy``'s default ``ignore_index``, and
#: Hugging Face labels).
IGNORE_INDEX = -100


def counted_tokens(targets: Any) -> float | None:
    """The number of elements of integer ``targets`` that are not :data:`IGNORE_INDEX` (the tokens a token-mean loss
    averages over); ``None`` when ``targets`` is not an integer tensor (a loss that is no token mean: every part of a
    batch then weighs the same)."""
    return float((targets != IGNORE_INDEX).sum()) if _integer(targets) else None


def _counted_targets(module: nn.Module, batch: Any) -> Tensor | None:
    """The integer targets of ``batch`` a token-mean loss counts (see :func:`batch_counted_tokens`), or ``None``."""
    if getattr(module, "token_mean_loss", True) is False:
        return None
    targets: Any = None
    if callable(getattr(module, "pipeline_batch", None)) or not isinstance(batch, Mapping):
        try:
            _, targets = pipeline_batch(module, batch)
        except (ValueError, TypeError, KeyError):  # e.g. (x, y, position_ids) without a pipeline_batch
            targets = batch[1] if isinstance(batch, (tuple, list)) and len(batch) >= 2 else None
    if not _integer(targets) and isinstance(batch, Mapping):
        targets = batch.get("labels")
    return targets if _integer(targets) else None


def _integer(targets: Any) -> bool:
    return isinstance(targets, Tensor) and not targets.is_floating_point() and not targets.is_complex()


def counted_tokens_tensor(targets: Any) -> Tensor | None:
    """:func:`counted_tokens` without a read to the host: a 0-dim float64 tensor on ``targets``'s device (``None``
    when ``targets`` is not an integer tensor)."""
    return (targets != IGNORE_INDEX).sum(dtype=torch.float64) if _integer(targets) else None


def batch_counted_tokens(module: nn.Module, batch: Any) -> float:
    """The number of target tokens of this rank's ``batch`` that count in a token-mean loss (not
    :data:`IGNORE_INDEX`), the weight of this rank's loss among the ranks holding other parts of the same batch (cp's
    pieces of the sequences, dp's other samples).

    The targets are ``module.pipeline_batch(batch)[1]`` when the module defines it, else a mapping batch's
    ``"labels"``, else ``batch[1]`` of a tuple batch (also of a longer one such as cp's ``(x, y, position_ids)``).
    ``1.0`` (every rank weighs the same) when there are no integer targets to count, or when the module sets
    ``token_mean_loss = False`` (its loss is no mean over the counted tokens: a sum, a per-sample mean).
    A read to the host (one device synchronisation on a GPU): the training step uses
    :func:`batch_counted_tokens_tensor`.

    Args:
        module: the LightningModule.
        batch: this rank's batch, as its step sees it.
    """
    counted = counted_tokens(_counted_targets(module, batch))
    return 1.0 if counted is None else counted


def batch_counted_tokens_tensor(module: nn.Module, batch: Any, device: torch.device) -> Tensor:
    """:func:`batch_counted_tokens` as a 0-dim float64 tensor on ``device``, with no read to the host (the value a
    collective then sums on the group's device: NCCL accepts only CUDA tensors).

    Args:
        module: the LightningModule.
        batch: this rank's batch, as its step sees it (its targets on ``device``, as Lightning moves them).
        device: where the count lives (the strategy's root device, or the loss's device).
    """
    targets = _counted_targets(module, batch)
    if targets is None:
        return torch.ones((), dtype=torch.float64, device=device)
    return (targets != IGNORE_INDEX).sum(dtype=torch.float64).to(device)


def pipeline_batch(module: nn.Module, batch: Any) -> tuple[tuple[Tensor, ...], Any]:
    """``(inputs as a tuple of tensors, targets)`` of a batch, through ``module.pipeline_batch`` if defined.

    Raises:
        ValueError: the batch (or what ``pipeline_batch`` returned) is not ``(inputs, targets)`` with ``inputs`` a
            tensor or a tuple of tensors.
    """
    method = getattr(module, "pipeline_batch", None)
    pair = method(batch) if callable(method) else batch
    if isinstance(pair, (tuple, list)) and len(pair) == 2:
        inputs, targets = pair
        if isinstance(inputs, Tensor):
            inputs = (inputs,)
        if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(t, Tensor) for t in inputs):
            return tuple(inputs), targets
    source = f"{type(module).__name__}.pipeline_batch(batch)" if callable(method) else "a batch"
    raise ValueError(
        f"{source} of type {type(pair).__name__} is not valid under pipelining: expected (inputs, targets), inputs a "
        f"tensor or a tuple of tensors split along dim 0 into micro-batches. Define "
        f"{type(module).__name__}.pipeline_batch(batch) -> (inputs, targets) to map another batch structure."
    )


def pipeline_sample(module: nn.Module, network: nn.Module) -> tuple[Tensor, ...]:
    """One input batch to profile layers with (``split="time"``).

    Raises:
        ValueError: neither ``module.example_input_array`` nor ``network.example_input()`` gives one.
    """
    sample = getattr(module, "example_input_array", None)
    if sample is None and callable(getattr(network, "example_input", None)):
        sample = network.example_input()
    if isinstance(sample, Tensor):
        return (sample,)
    if isinstance(sample, (tuple, list)) and sample and all(isinstance(t, Tensor) for t in sample):
        return tuple(sample)
    raise ValueError(
        f"split='time' profiles the layers on a sample input: set {type(module).__name__}.example_input_array to one "
        f"input batch (or define example_input() on the network), or use split='params'."
    )


def checkpoint_modules(network: nn.Module, mode: str) -> list[str]:
    """Paths (relative to ``network``) of the modules activation checkpointing ``mode`` recomputes: the network's own
    ``checkpoint_modules(mode)``, else for ``"full"`` its pipeline layers (see the module docstring).

    Raises:
        ValueError: ``"selective"`` for a network without ``checkpoint_modules``, or ``"full"`` for one that has neither
            the method nor layers (an ``nn.Sequential``/``nn.ModuleList`` or ``pipeline_layers()``).
    """
    method = network_method(network, "checkpoint_modules")
    if callable(method):
        return list(method(mode))
    name = type(network).__name__
    if mode == "selective":
        raise ValueError(
            f"activation_checkpointing='selective' is not valid for a network of type {name}: it checkpoints the "
            f"attention of every block, which only the model can name. Define {name}.checkpoint_modules(mode) -> "
            f"[paths of the attention modules] (see lightning_par.contract), or use activation_checkpointing='full'."
        )
    try:
        return pipeline_layers(network)
    except ValueError as err:
        raise ValueError(
            f"activation_checkpointing={mode!r} is not valid for a network of type {name}: it checkpoints every block, "
            f"and the network names none. Keep the network at .model as an nn.Sequential/nn.ModuleList of blocks, or "
            f"define {name}.checkpoint_modules(mode) -> [paths of the blocks] (see lightning_par.contract)."
        ) from err


def attention_heads(network: nn.Module) -> int | None:
    """The number of attention heads, from ``network.attention_heads()`` (``None`` when the network does not say)."""
    method = network_method(network, "attention_heads")
    return int(method()) if callable(method) else None



def expert_modules(network: nn.Module) -> list[str]:
    """Paths (relative to ``network``) of its experts modules, from ``network.expert_modules()``, with their number of
    experts checked (see the module docstring).

    Raises:
        ValueError: the network does not define ``expert_modules()``, names none, or a path that is not a module, or an
            experts module whose parameters do not all have the same number of rows (experts) on dim 0.
    """
    method = network_method(network, "expert_modules")
    name = type(network).__name__
    paths = list(method()) if callable(method) else []
    if not paths:
        raise ValueError(
            f"expert parallelism (ep_size > 1) is not valid for a network of type {name}: it names no experts. Define "
            f"{name}.expert_modules() -> [paths of the experts modules of its mixture-of-experts layers] (see "
            f"lightning_par.contract), or use ep_size=1."
        )
    for path in paths:
        try:
            module = network.get_submodule(path)
        except AttributeError as err:
            raise ValueError(f"{name}.expert_modules() names {path!r}, which is not a submodule of it.") from err
        rows = {p.shape[0] if p.dim() else 0 for p in module.parameters()}
        if len(rows) != 1 or 0 in rows:
            raise ValueError(
                f"experts module {path!r} of {name} is not valid for expert parallelism: every parameter must have the "
                f"expert index on dim 0 (the same number of rows); got dim-0 sizes {sorted(rows)}."
            )
    return paths


def num_experts(network: nn.Module, path: str) -> int:
    """The number of experts of the experts module at ``path`` (dim 0 of its parameters)."""
    return next(network.get_submodule(path).parameters()).shape[0]
