"""Tensor-parallel plans: a dict from module path to a style name, validated against a model before anything runs.

A plan is declarative and lives beside the model (see ``lightning_par/models/gpt_tp_plan.py``). Keys are dotted
module paths relative to the module the plan is applied to; a ``*`` segment matches every child (``"blocks.*.attn"``)
and ``""`` is that module itself.
Values are style names (below) or torch ``ParallelStyle`` objects, which are applied as given (and own the
parameters of their subtree, unless the object has ``covers_parameters = False``: a style that only adds hooks). A
style name means the same thing with and without sequence parallelism; :func:`resolve_style` picks the layouts for the
mode, so one plan serves both.

===================== ================================================================================================
name                  meaning (Megatron-LM, Shoeybi et al. 2019, §3; sequence parallelism, Korthikanti et al. 2022)
===================== ================================================================================================
``colwise``           ``nn.Linear`` split by output features (``ColwiseParallel``); input replicated, output local
                      ``(..., out / tp)``. The four linear styles also take a transposed linear layer (weight
                      ``(in, out)``: GPT-2's ``Conv1D``), split on the matching dim of its weight.
``rowwise``           ``nn.Linear`` split by input features (``RowwiseParallel``); partial outputs all-reduced, or
                      reduce-scattered over the sequence with sequence parallelism.
``colwise_gather``    ``nn.Linear`` split by output features whose output is gathered whole on every rank (Hugging
                      Face's ``colwise_gather_output`` inside a layer): what follows runs on replicated activations,
                      so a fused projection (q, k and v in one weight) or a norm over the whole hidden size stays right.
``rowwise_split``     ``nn.Linear`` split by input features whose input is replicated: each rank takes its slice of the
                      input (no communication), then as ``rowwise`` (Hugging Face's ``rowwise_split_input``).
``colwise_input``     on a module whose sub-layers are ``colwise`` (attention, MLP): one collective for the whole group
                      — Megatron's ``f`` (identity forward, all-reduce backward), or with sequence parallelism ``g``
                      (all-gather forward, reduce-scatter backward), on the module's first input, positional or by
                      keyword. Holds no parameters.
``sequence_parallel`` a per-token module on the residual stream (``LayerNorm``, ``RMSNorm``, ``Dropout``, a model
                      library's own norm class, a token-wise mixture of experts): runs on the sequence shard with
                      sequence parallelism, replicated otherwise. Parameters replicated (plain). The plan asserts that
                      the module is per-token; no type is checked.
``position_embedding`` an ``nn.Embedding`` of positions ``(seq, n_embd)``: replicated table; with sequence parallelism
                      its output is cut to this rank's positions.
``replicate``         any module that runs on replicated activations; parameters replicated, no communication.
``replicate_grad_sum`` a module inside a split region that runs on this rank's part (a per-head norm on the local
                      heads, Qwen3's ``q_norm``): parameters replicated (plain), gradients summed over the tp ranks.
``vocab_embedding``   the token ``nn.Embedding`` split over the vocabulary (padded to a multiple of ``tp_size``).
                      An ``nn.Embedding`` subclass keeps its own ``forward`` (Gemma's scaled embedding) around the
                      vocab-parallel lookup.
``vocab_embedding_full`` as ``vocab_embedding``, but its output is the whole sequence in both modes (all-reduced): for a
                      model whose own code between the embedding and the first layer uses the sequence length (a
                      Hugging Face model builds its attention masks there); a ``sequence_scatter`` then cuts it.
``sequence_scatter``  on the first module that runs on the residual stream (a model's first decoder layer): with
                      sequence parallelism its first input is cut to this rank's sequence shard (backward all-gathers
                      the gradient); without, nothing. Holds no parameters.
``sequence_gather``   on the last module that runs on sequence shards (a model's last decoder layer): with sequence
                      parallelism its output is all-gathered to the whole sequence, so what follows (a final norm,
                      planned ``replicate``; the model's own reshapes) runs on replicated activations; without, nothing.
``vocab_head_full``   as ``vocab_head``, its input the whole sequence in both modes (after a ``sequence_gather``).
``vocab_head``        the LM-head ``nn.Linear`` split over the vocabulary; logits stay a vocab-sharded DTensor so the
                      cross-entropy never gathers them.
===================== ================================================================================================

A module the plan leaves out runs on replicated activations as it is, its parameters replicated plain tensors (as in
torch's own Megatron plan, which lists only the split layers). Under sequence parallelism every parameter must be
owned by a planned module (or lie under a ``replicate``/``sequence_parallel``/``position_embedding`` one): a parameter
outside the plan would silently get the gradient of its sequence shard only. Split parameters become DTensors on the
tp mesh; replicated ones stay plain tensors
(:mod:`lightning_par.tensor_parallel.styles`), and those whose gradient is a partial sum over the tp ranks are summed
by :func:`~lightning_par.tensor_parallel.styles.sync_tp_partial_grads`. With both kinds in one model, norm clipping
must count each kind correctly (:func:`lightning_par.pipeline_parallel.clip.clip_grad_norm_across_ranks`) and a
``foreach`` optimizer step must run under ``torch.distributed.tensor.experimental.implicit_replication()`` (torch's
default on CPU is the per-tensor loop, which mixes them fine).
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_par.tensor_parallel.styles import (
    Colwise,
    ColwiseInput,
    PlainSequenceParallel,
    ReplicateParallel,
    Rowwise,
    SequenceGather,
    SequenceScatter,
    VocabParallelEmbedding,
    VocabParallelHead,
    transposed_linear_features,
)

__all__ = [
    "STYLE_NAMES",
    "Plan",
    "check_plan_styles",
    "expand_plan",
    "resolve_style",
    "uses_vocab_parallel_loss",
    "validate_plan",
]

#: A plan: module path (``*`` matches any child) -> style name or ``ParallelStyle``.
Plan = Mapping[str, "str | ParallelStyle"]

#: Style names a plan may use, in the order they are applied (``colwise_input`` first: its input hook must run
#: before the hooks of the column-parallel layers inside the module).
STYLE_NAMES: tuple[str, ...] = (
    "colwise_input",
    "colwise",
    "rowwise",
    "colwise_gather",
    "rowwise_split",
    "sequence_parallel",
    "position_embedding",
    "replicate",
    "replicate_grad_sum",
    "vocab_embedding",
    "vocab_embedding_full",
    "sequence_scatter",
    "sequence_gather",
    "vocab_head",
    "vocab_head_full",
)

_RMSNorm = getattr(nn, "RMSNorm", nn.LayerNorm)

#: Module types each style accepts (``None``: any module).
_ACCEPTS: dict[str, tuple[type[nn.Module], ...] | None] = {
    "colwise_input": None,
    "colwise": (nn.Linear,),
    "rowwise": (nn.Linear,),
    "colwise_gather": (nn.Linear,),
    "rowwise_split": (nn.Linear,),
    "vocab_embedding_full": (nn.Embedding,),
    "sequence_scatter": None,
    "sequence_gather": None,
    "vocab_head_full": (nn.Linear,),
    "sequence_parallel": None,  # the plan asserts the module is per-token (a library's own norm class qualifies)
    "position_embedding": (nn.Embedding,),
    "replicate": None,
    "replicate_grad_sum": None,
    "vocab_embedding": (nn.Embedding,),
    "vocab_head": (nn.Linear,),
}

#: Styles that turn the parameters of their whole subtree into DTensors (``colwise``/``rowwise``/vocab styles: the
#: module's own parameters; ``colwise_input``: none).
_SUBTREE_STYLES = {"sequence_parallel", "position_embedding", "replicate", "replicate_grad_sum"}


def resolve_style(style: str | ParallelStyle, sequence_parallel: bool) -> ParallelStyle:
    """The torch ``ParallelStyle`` for a style name in the given mode (a fresh object each call).

    Args:
        style: a name from :data:`STYLE_NAMES`, or a ``ParallelStyle`` (returned as is).
        sequence_parallel: whether activations between sub-blocks are sharded on the sequence dim (1).

    Raises:
        ValueError: an unknown style name.
    """
    if isinstance(style, ParallelStyle):
        return style
    seq = Shard(1) if sequence_parallel else Replicate()
    if style == "colwise":
        return Colwise()
    if style == "rowwise":
        return Rowwise(output_layouts=seq)
    if style == "colwise_gather":
        return Colwise(output_layouts=Replicate())
    if style == "rowwise_split":
        return Rowwise(input_layouts=Replicate(), output_layouts=seq)
    if style == "vocab_embedding_full":
        return VocabParallelEmbedding(sequence_parallel=False)
    if style == "sequence_scatter":
        return SequenceScatter(enabled=sequence_parallel)
    if style == "sequence_gather":
        return SequenceGather(enabled=sequence_parallel)
    if style == "vocab_head_full":
        return VocabParallelHead(sequence_parallel=False)
    if style == "colwise_input":
        return ColwiseInput(sequence_parallel=sequence_parallel)
    if style == "sequence_parallel":
        return PlainSequenceParallel() if sequence_parallel else ReplicateParallel()
    if style == "position_embedding":
        return ReplicateParallel(output_shard_dim=-2 if sequence_parallel else None)
    if style == "replicate":
        return ReplicateParallel()
    if style == "replicate_grad_sum":
        return ReplicateParallel(partial_grads=True)
    if style == "vocab_embedding":
        return VocabParallelEmbedding(sequence_parallel=sequence_parallel)
    if style == "vocab_head":
        return VocabParallelHead(sequence_parallel=sequence_parallel)
    raise ValueError(
        f"tensor-parallel style {style!r} is not valid: expected one of {list(STYLE_NAMES)} or a ParallelStyle."
    )


def check_plan_styles(plan: Any) -> dict[str, str | ParallelStyle]:
    """Check a plan's shape and style names without a model (usable in a strategy's constructor).

    Args:
        plan: a mapping (a dict, or an OmegaConf ``DictConfig``) from module path to style name or ``ParallelStyle``.

    Returns:
        The plan as a plain ``dict``, in its original order.

    Raises:
        ValueError: ``plan`` is not a non-empty mapping, a key is not a non-empty string, or a value is neither a
            known style name nor a ``ParallelStyle``; the message names the entry and the valid styles.
    """
    if not isinstance(plan, Mapping) and not hasattr(plan, "items"):
        raise ValueError(f"plan={plan!r} is not valid: expected a dict from module path to style name.")
    out = {}
    for path, style in plan.items():
        if not isinstance(path, str):
            raise ValueError(
                f"plan key {path!r} is not valid: expected a dotted module path such as 'blocks.*.attn' ('' is the "
                f"root module)."
            )
        if not isinstance(style, ParallelStyle) and style not in STYLE_NAMES:
            raise ValueError(
                f"plan[{path!r}]={style!r} is not a valid style: expected one of {list(STYLE_NAMES)} or a "
                f"ParallelStyle."
            )
        out[path] = style
    if not out:
        raise ValueError("plan={} is not valid: expected at least one module path -> style entry.")
    return out


def _match(root: nn.Module, path: str, skip_absent: bool) -> list[str]:
    """Exact module paths matching ``path`` (``*`` matches any child name at that level; ``""`` is ``root``)."""
    if path == "":
        return [""]
    found = [("", root)]
    for segment in path.split("."):
        nxt = []
        for prefix, module in found:
            if any(ch in segment for ch in "*?["):
                children = [(n, c) for n, c in module.named_children() if fnmatchcase(n, segment)]
            elif isinstance(child := getattr(module, segment, None), nn.Module):
                children = [(segment, child)]
            elif skip_absent:  # a part another pipeline stage holds (the plan was checked on the whole network)
                continue
            elif hasattr(module, segment) and child is None:
                raise ValueError(f"plan path {path!r} names module {prefix + segment!r}, which is None.")
            else:
                names = sorted(n for n, _ in module.named_children())
                where = f"module {prefix[:-1]!r}" if prefix else "the model"
                raise ValueError(
                    f"plan path {path!r} names a missing module: {where} has no child {segment!r} (children: {names})."
                )
            nxt.extend((f"{prefix}{n}.", c) for n, c in children)
        found = nxt
    if not found and not skip_absent:
        raise ValueError(f"plan path {path!r} matches no module.")
    return [p[:-1] for p, _ in found]


def expand_plan(root: nn.Module, plan: Plan, *, skip_absent: bool = False) -> dict[str, str | ParallelStyle]:
    """Resolve wildcards: exact module path -> style, in application order (``colwise_input`` first).

    Args:
        root: the module the plan's paths are relative to.
        plan: see :data:`Plan`.
        skip_absent: skip paths through a child that is missing or ``None`` and wildcards that match nothing: the
            parts of the network another pipeline stage holds. Check the plan against the whole network first
            (:func:`validate_plan` without ``skip_absent``), since a misspelt path is then skipped too.

    Raises:
        ValueError: a path names a missing module (the message lists the children that exist), two entries give one
            module different styles, or an unknown style.
    """
    plan = check_plan_styles(plan)
    expanded: dict[str, str | ParallelStyle] = {}
    for path, style in plan.items():
        for exact in _match(root, path, skip_absent):
            if exact in expanded and expanded[exact] is not style and expanded[exact] != style:
                raise ValueError(
                    f"plan gives module {exact!r} two styles: {expanded[exact]!r} and {style!r}; keep one."
                )
            expanded[exact] = style

    def order(item: tuple[str, str | ParallelStyle]) -> int:
        return STYLE_NAMES.index(item[1]) if isinstance(item[1], str) else len(STYLE_NAMES)

    return dict(sorted(expanded.items(), key=order))


def _covered_params(root: nn.Module, expanded: Mapping[str, str | ParallelStyle]) -> set[str]:
    covered: set[str] = set()
    for path, style in expanded.items():
        module = root.get_submodule(path)
        prefix = f"{path}." if path else ""
        hooks_only = style in ("colwise_input", "sequence_scatter", "sequence_gather")
        if hooks_only or not getattr(style, "covers_parameters", True):
            continue
        recurse = isinstance(style, ParallelStyle) or style in _SUBTREE_STYLES
        covered.update(prefix + n for n, _ in module.named_parameters(recurse=recurse))
    return covered


def validate_plan(
    root: nn.Module,
    plan: Plan,
    tp_size: int,
    sequence_parallel: bool,
    *,
    skip_absent: bool = False,
) -> dict[str, str | ParallelStyle]:
    """Check a plan against a model before any process group exists.

    Checks: every path names a module; every style name is known and fits its module's type; column-parallel
    ``out_features`` and row-parallel ``in_features`` are multiples of ``tp_size``; and, with ``sequence_parallel``,
    that every parameter is covered by the plan (see the module docstring) and the model is one sequence parallelism
    supports: a ``vocab_embedding`` scatters the sequence, every ``LayerNorm``/``RMSNorm`` is ``sequence_parallel``,
    and every ``colwise`` layer gets its input through a ``colwise_input`` on itself or an enclosing module (else it
    would treat a sequence shard as the whole sequence).

    Args:
        root: the module the paths are relative to.
        plan: see :data:`Plan`.
        tp_size: tensor-parallel size.
        sequence_parallel: whether sequence parallelism is on.
        skip_absent: see :func:`expand_plan`.

    Returns:
        The expanded plan (exact paths, application order).

    Raises:
        ValueError: the first failed check; the message names the module, the value and what would be valid.
    """
    expanded = expand_plan(root, plan, skip_absent=skip_absent)
    for path, style in expanded.items():
        if not isinstance(style, str):
            continue
        module = root.get_submodule(path)
        accepts = _ACCEPTS[style]
        transposed = transposed_linear_features(module)
        if transposed is not None and style in ("colwise", "rowwise", "colwise_gather", "rowwise_split"):
            in_features, out_features = transposed  # a transposed linear layer (GPT-2's Conv1D)
        elif accepts is not None and not isinstance(module, accepts):
            valid = [t.__name__ for t in dict.fromkeys(accepts)]
            raise ValueError(
                f"plan[{path!r}]={style!r} is not valid for a {type(module).__name__}: style {style!r} applies to "
                f"{valid}."
            )
        else:
            in_features, out_features = getattr(module, "in_features", 0), getattr(module, "out_features", 0)
        if style in ("colwise", "colwise_gather") and out_features % tp_size:
            raise ValueError(
                f"plan[{path!r}]={style!r} is not valid: out_features={out_features} is not divisible by "
                f"tp_size={tp_size}."
            )
        if style in ("rowwise", "rowwise_split") and in_features % tp_size:
            raise ValueError(
                f"plan[{path!r}]={style!r} is not valid: in_features={in_features} is not divisible by "
                f"tp_size={tp_size}."
            )
    if sequence_parallel:
        covered = _covered_params(root, expanded)
        missing = [n for n, _ in root.named_parameters() if n not in covered]
        if missing:
            raise ValueError(
                f"parameters {missing[:6]}{' ...' if len(missing) > 6 else ''} are not covered by the tensor-parallel "
                f"plan, which sequence_parallel=True needs: a module outside the plan would see only this rank's "
                f"positions and get a partial gradient. Add the module that owns each to the plan ('replicate' if it "
                f"runs on replicated activations, 'sequence_parallel' for a norm on the residual stream), or use "
                f"sequence_parallel=False."
            )
        _check_sequence_parallel(root, expanded, plan)
    return expanded


def _check_sequence_parallel(root: nn.Module, expanded: Mapping[str, str | ParallelStyle], plan: Plan) -> None:
    # The plan, not its expansion: a later pipeline stage has no embedding but gets sequence shards from the first.
    if "vocab_embedding" not in plan.values() and "sequence_scatter" not in plan.values():
        raise ValueError(
            "sequence_parallel=True is not supported for this model: its plan has no 'vocab_embedding' (or "
            "'sequence_scatter'), the layer that scatters activations over the sequence. Use sequence_parallel=False, "
            "or plan the token embedding as 'vocab_embedding'."
        )
    # 'replicate' is a norm's valid style only after a 'sequence_gather' (a final norm on the whole sequence).
    valid_norm = ("sequence_parallel", "replicate") if "sequence_gather" in plan.values() else ("sequence_parallel",)
    for name, module in root.named_modules():
        if isinstance(module, (nn.LayerNorm, _RMSNorm)) and expanded.get(name) not in valid_norm:
            raise ValueError(
                f"sequence_parallel=True is not supported for this model: norm {name!r} "
                f"({type(module).__name__}) is planned as {expanded.get(name)!r}, expected 'sequence_parallel' "
                f"(under sequence parallelism it sees only this rank's positions)."
            )
    gathers = [p for p, s in expanded.items() if s == "colwise_input"]
    for path, style in expanded.items():
        fed = any(path == g or path.startswith(g + ".") or g == "" for g in gathers)
        if style in ("colwise", "colwise_gather") and not fed:
            raise ValueError(
                f"sequence_parallel=True is not supported by this plan: plan[{path!r}]={style!r} has no "
                f"'colwise_input' on itself or an enclosing module, so it would take a sequence shard for the whole "
                f"sequence. Add 'colwise_input' on the module that feeds it (e.g. the attention or MLP block)."
            )


def uses_vocab_parallel_loss(plan: Plan) -> bool:
    """True if the plan has a ``vocab_head``: its logits are vocab-sharded DTensors that need the parallel loss."""
    return any(style in ("vocab_head", "vocab_head_full") or isinstance(style, VocabParallelHead)
               for style in plan.values())
