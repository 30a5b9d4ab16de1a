"""``torch.compile`` per block, as an option of every strategy (``strategy.compile.*``).

Each block the model contract names (:func:`lightning_par.contract.checkpoint_modules` with ``"full"``: the reference
GPT's ``blocks.<i>``, a Hugging Face model's decoder layers, else the pipeline layers of an ``nn.Sequential`` /
``nn.ModuleList``) gets its ``forward`` compiled on its own, in one place of :func:`lightning_par.parallelize.
parallelize`'s order: after the pipeline cut, tensor and context parallelism and activation checkpointing, before the
dp mode (torchtitan's ``apply_compile`` sits at the same place). So

* the graph of a block holds its tensor-parallel styles' DTensor arithmetic and its recomputation, which are inside
  the block;
* the dp mode's machinery stays outside every graph: FSDP2's unshard/reshard hooks and the bucketed reducer's
  gradient hooks are module and parameter hooks, and only ``forward`` is compiled here (the class of the block is
  swapped for a subclass whose ``forward`` runs the compiled function; ``nn.Module.__call__`` still runs the hooks
  eagerly around it);
* parameter names do not change (no ``_orig_mod``): checkpoints, plans and ZeRO state are the same compiled or not.

One compiled function per block class (and options) serves every block of that class: dynamo lifts the parameters as
graph inputs, so blocks of one class share a graph instead of compiling one each.

:class:`CompileStats` reads dynamo's counters for the run's summary: frames compiled, graphs, graph breaks (with their
reasons) and recompilations after the second training step, which should be 0 (a recompile in steady state means a
guard fails every step: a shape or a Python value changing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_par import contract
from lightning_par.activation_checkpointing import _Checkpointed, is_checkpointed, modules_at
from lightning_par.axis_registry import Axis, Build
from lightning_par.validation import check_bool, check_choice

__all__ = [
    "COMPILE",
    "COMPILE_MODES",
    "CompileOptions",
    "CompileStats",
    "compile_blocks",
    "compile_module",
    "is_block_compiled",
    "refuse_fullgraph",
]

#: Valid ``compile.mode`` values (``torch.compile``'s modes; ``None`` is inductor's default).
COMPILE_MODES: tuple[str | None, ...] = (None, "default", "reduce-overhead", "max-autotune",
                                         "max-autotune-no-cudagraphs")
#: Modes that capture CUDA graphs: refused (see :meth:`CompileOptions.__post_init__`).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


#: Backends torch always registers (``torch/_dynamo/backends``): accepted without listing the registry, whose first
#: listing imports every backend module (0.37 CPU-s measured on the 2-core machine, paid by every rank that builds a
#: strategy, compile on or off). ``tests/core/test_compile_option.py`` checks each is in the registry.
BUILTIN_BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager")


def _backends(every: bool = True) -> list[str]:
    from lightning_par.compat import dynamo_backends

    if every:
        return sorted(dynamo_backends(exclude_tags=()))
    return sorted({*dynamo_backends(), "aot_eager", "eager"})  # the two debug backends a user checks with


@dataclass(frozen=True)
class CompileOptions:
    """``strategy.compile``: ``torch.compile`` of every block, after tp/cp and activation checkpointing and before the
    dp mode.

    Attributes:
        enabled: compile the blocks.
        backend: a dynamo backend (``torch._dynamo.list_backends()``): ``"inductor"`` (generated kernels; on CPU it
            compiles C++), ``"aot_eager"`` (dynamo and AOTAutograd, eager kernels: a cheap check that the graphs are
            right), ``"eager"``.
        mode: ``None`` (the backend's default), ``"default"`` or ``"max-autotune-no-cudagraphs"`` (inductor only).
            The CUDA-graph modes ``"reduce-overhead"`` and ``"max-autotune"`` are refused.
        fullgraph: fail at the first graph break instead of splitting the block's graph (refused by an axis that runs
            a collective inside a block that dynamo cannot trace: see :func:`refuse_fullgraph`).

    Raises:
        ValueError: naming the field, the value and what would be valid.
    """

    enabled: bool = False
    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False

    def __post_init__(self) -> None:
        check_bool("compile.enabled", self.enabled)
        check_bool("compile.fullgraph", self.fullgraph)
        if not isinstance(self.backend, str) or (self.backend not in BUILTIN_BACKENDS
                                                 and self.backend not in _backends()):
            raise ValueError(
                f"compile.backend={self.backend!r} is not valid: expected one of {_backends(every=False)} (torch."
                f"_dynamo.list_backends()), e.g. 'inductor' or 'aot_eager'."
            )
        check_choice("compile.mode", self.mode, COMPILE_MODES)
        if self.mode in _CUDA_GRAPH_MODES:
            raise ValueError(
                f"compile.mode={self.mode!r} is not valid here: it captures CUDA graphs, whose inputs must keep their "
                f"addresses from step to step, while FSDP2 (zero3) allocates the unsharded parameters anew at every "
                f"all-gather and a pipeline schedule passes fresh micro-batch buffers. Use mode="
                f"'max-autotune-no-cudagraphs' (autotuned kernels without CUDA graphs), 'default' or None."
            )
        if self.mode not in (None, "default") and self.backend != "inductor":
            raise ValueError(
                f"compile.mode={self.mode!r} is not valid with compile.backend={self.backend!r}: modes are inductor's. "
                f"Use backend='inductor' or mode=None."
            )

    def torch_compile_kwargs(self) -> dict[str, Any]:
        """The keywords of ``torch.compile``."""
        out: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph}
        if self.mode is not None:
            out["mode"] = self.mode
        return out


# ---------------------------------------------------------------------------------------------------- compile a block
#: (block class, options) -> the compiled ``forward`` of that class, shared by its instances.
_FORWARDS: dict[tuple[type, CompileOptions], Any] = {}
_CLASSES: dict[type, type] = {}


class _CompiledForward:
    """Mixin of the swapped-in classes: ``forward`` runs the class's compiled forward (the hooks stay outside)."""

    _lp_compile_options: CompileOptions
    #: the class whose ``forward`` is compiled (set on each ``Compiled<Class>``; FSDP2 may subclass it again): the
    #: block's own class, under activation checkpointing's ``Checkpointed<Class>``
    _lp_base: type
    #: the block was checkpointed (activation_checkpointing="full"): recompute it around the compiled forward
    _lp_recompute: bool

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the module's own signature
        base = self._lp_base
        key = (base, self._lp_compile_options)
        compiled = _FORWARDS.get(key)
        if compiled is None:
            compiled = torch.compile(base.forward, **self._lp_compile_options.torch_compile_kwargs())
            _FORWARDS[key] = compiled
        if self._lp_recompute and torch.is_grad_enabled():
            # A checkpointed block: the recomputation runs eagerly around the compiled forward, so its graph holds
            # no checkpoint (under tensor parallelism, torch 2.13's AOTAutograd fails to save a DTensor's mesh
            # through a checkpoint inside a graph: "expected all tensors_saved_with_vc_check to be Tensors").
            return checkpoint(compiled, self, *args, use_reentrant=False, **kwargs)
        return compiled(self, *args, **kwargs)


def is_block_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s forward was compiled by :func:`compile_module`."""
    return isinstance(module, _CompiledForward)


def compile_module(module: nn.Module, options: CompileOptions) -> nn.Module:
    """Compile ``module``'s ``forward`` in place (idempotent): its class becomes a cached subclass
    ``Compiled<Class>`` whose ``forward`` calls ``torch.compile(<Class>.forward, ...)`` (compiled lazily, at the first
    call); parameters, buffers, hooks and names are untouched, and the module's hooks run outside the graph.

    Returns:
        ``module``.
    """
    if is_block_compiled(module):
        return module
    cls = type(module)
    recompute = is_checkpointed(module)
    sub = _CLASSES.get(cls)
    if sub is None:
        base = next(c for c in cls.__mro__ if not issubclass(c, _Checkpointed)) if recompute else cls
        sub = type(f"Compiled{cls.__name__}", (_CompiledForward, cls),
                   {"__module__": cls.__module__, "_lp_base": base, "_lp_recompute": recompute})
        _CLASSES[cls] = sub
    module.__class__ = sub
    module._lp_compile_options = options  # type: ignore[attr-defined]
    return module


def compile_blocks(network: nn.Module, paths: Sequence[str], options: CompileOptions,
                   skip_absent: bool = False) -> list[str]:
    """Compile the modules of ``network`` at ``paths`` (:func:`compile_module`).

    Args:
        network: the network, or under pipelining the holder of this rank's stages.
        paths: module paths relative to ``network``.
        options: how to compile.
        skip_absent: skip paths through parts another pipeline stage holds.

    Returns:
        The paths compiled on this rank.

    Raises:
        ValueError: a path that names no module (unless ``skip_absent``).
    """
    found = modules_at(network, paths, skip_absent, "compile: block path")
    for module in found.values():
        compile_module(module, options)
    return list(found)


# ---------------------------------------------------------------------------------------------------- dynamo's counters
class CompileStats:
    """Dynamo's counters over a run (they are process-wide: the run's figures are differences from its start).

    ``mark_step()`` after each training step; :meth:`summary` gives frames compiled, graphs, graph breaks (with the
    first reasons) and the recompilations after the second step.
    """

    def __init__(self) -> None:
        self._start = self._read()
        self._after_warmup: dict[str, Any] | None = None
        self.steps = 0
        #: graphs compiled by evaluation steps (no gradient: a graph of their own, once), apart from
        #: training's, since the second training step
        self.eval_compiled = 0

    def eval_step(self, module: Any, batch: Any, run: Any) -> Any:
        """A step wrapper (``Build.step_wrappers``): what a step without gradients (validation, test, predict)
        compiles is counted apart, so that the steady state of training is judged on training steps alone."""
        if torch.is_grad_enabled() or self._after_warmup is None:
            return run(batch)
        before = self._read()
        try:
            return run(batch)
        finally:
            after = self._read()
            self.eval_compiled += after["graphs"] - before["graphs"]

    @staticmethod
    def _read() -> dict[str, Any]:
        from lightning_par.compat import dynamo_counters

        counters = dynamo_counters()
        return {
            "frames": int(counters["frames"]["ok"]),
            "attempts": int(counters["frames"]["total"]),
            "graphs": int(counters["stats"]["unique_graphs"]),
            "breaks": dict(counters["graph_break"]),
        }

    def mark_step(self) -> None:
        """Called after each training step: the counters after the second one are the steady state's baseline."""
        self.steps += 1
        if self.steps == 2:
            self._after_warmup = self._read()

    def summary(self) -> dict[str, Any]:
        now = self._read()
        breaks = {k: v - self._start["breaks"].get(k, 0) for k, v in now["breaks"].items()}
        breaks = {k: v for k, v in breaks.items() if v > 0}
        out: dict[str, Any] = {
            "compile_frames": now["frames"] - self._start["frames"],
            "compile_graphs": now["graphs"] - self._start["graphs"],
            "compile_graph_breaks": sum(breaks.values()),
            "compile_graph_break_reasons": [k[:200] for k in sorted(breaks, key=breaks.get, reverse=True)[:5]],
            # frames dynamo gave up on (e.g. its recompile limit reached): they run eagerly
            "compile_frames_not_compiled": (now["attempts"] - self._start["attempts"]) - (now["frames"]
                                                                                            - self._start["frames"]),
            # graphs compiled by training steps since the second one (an evaluation's own graph is counted apart;
            # dynamo's frame count also moves for frames it looks at without making a graph)
            "compile_recompiles_after_step_2": (
                None if self._after_warmup is None
                else now["graphs"] - self._after_warmup["graphs"] - self.eval_compiled
            ),
            "compile_eval_compiles_after_step_2": self.eval_compiled,
        }
        return out


def refuse_fullgraph(options: Any, what: str, why: str) -> None:
    """For an axis whose work inside a block runs eagerly between two graphs (a process-group call dynamo does not
    trace): refuse ``compile.fullgraph=True``.

    Args:
        options: the :class:`~lightning_par.parallelize.ParallelOptions`.
        what: the axis's setting (``"ep_size=2"``).
        why: what it runs inside each block.

    Raises:
        ValueError: ``compile.enabled`` and ``compile.fullgraph``, naming ``what`` and ``why``.
    """
    if options.compile.enabled and options.compile.fullgraph:
        raise ValueError(
            f"compile.fullgraph=True is not valid with {what}: {why}, which dynamo does not trace (a graph break "
            f"there). Use compile.fullgraph=False (the breaks are counted in the run's summary)."
        )


# ------------------------------------------------------------------------------------------------- the registry entry
def _block_paths(network: nn.Module) -> list[str]:
    try:
        return contract.checkpoint_modules(network, "full")
    except ValueError:
        raise ValueError(
            f"compile.enabled=True is not valid for a network of type {type(network).__name__}: it compiles every "
            f"block on its own, and the network names none. Keep the network at .model as an nn.Sequential/"
            f"nn.ModuleList of blocks, or define {type(network).__name__}.checkpoint_modules(mode) -> [paths of the "
            f"blocks] (see lightning_par.contract)."
        ) from None


def _check(module: nn.Module, network: nn.Module, dims: Any, options: Any) -> None:
    opts: CompileOptions = options.compile
    if not opts.enabled:
        return
    from lightning_par.compat import is_compiled_module

    compiled = [name or type(module).__name__ for name, m in module.named_modules() if is_compiled_module(m)]
    if compiled:
        raise ValueError(
            f"compile.enabled=True is not valid with {type(module).__name__}.{compiled[0]}, a torch.compile'd module "
            f"(torch.compile in configure_model or __init__): the strategy compiles every block itself. Remove "
            f"torch.compile from the LightningModule."
        )
    if options.activation_checkpointing == "selective" and dims.tp_enabled:
        raise ValueError(
            f"compile.enabled=True is not valid with activation_checkpointing='selective' and tp_size={dims.tp_size}: "
            f"the attention's recomputation would sit inside the block's graph, and torch's AOTAutograd cannot save "
            f"a tensor-parallel (DTensor) activation through a checkpoint inside a graph (measured on torch 2.13: "
            f"'expected all tensors_saved_with_vc_check to be Tensors'). Use activation_checkpointing='full' (the "
            f"block is recomputed around its compiled forward) or 'none'."
        )
    paths = _block_paths(network)
    for path in paths:
        try:
            network.get_submodule(path)
        except AttributeError as err:
            raise ValueError(
                f"compile.enabled=True: block path {path!r} names no module of {type(network).__name__} ({err})."
            ) from err


def _read_paths(build: Build) -> None:
    """The blocks to compile, read from the whole network before any cut."""
    if build.options.compile.enabled:
        build.compile_paths = _block_paths(build.network)


def _compile(build: Build) -> None:
    """After tp/cp and activation checkpointing (the graph holds them), before the dp mode (its hooks stay outside)."""
    if not build.compile_paths:
        return
    build.compiled = compile_blocks(build.network, build.compile_paths, build.options.compile,
                                    skip_absent=build.dims.pp_enabled)
    # Blocks of one class share a compiled function; a block whose forward specialises on a per-layer Python value
    # (a layer index) costs one entry each. Room for every block, so that none falls back to eager at dynamo's
    # default limit (8) on a deep model.
    from lightning_par.compat import dynamo_config

    config = dynamo_config()
    config.recompile_limit = max(config.recompile_limit, len(build.compiled) + 8)
    stats = CompileStats()

    def step_log() -> dict[str, float]:
        stats.mark_step()
        return {}

    build.step_logs.append(step_log)
    build.step_wrappers.append(stats.eval_step)
    opts = build.options.compile
    build.summaries.append(lambda: {
        "compile_backend": opts.backend,
        "compile_mode": opts.mode,
        "compile_fullgraph": opts.fullgraph,
        "compiled_blocks": len(build.compiled),
        **stats.summary(),
    })


#: Per-block ``torch.compile``: a technique on no mesh axis, in the registry for its place in ``parallelize()``.
COMPILE = Axis(
    name="compile",
    option_groups=("compile",),
    check=_check,
    steps=(("read", _read_paths), ("compile", _compile)),
)
