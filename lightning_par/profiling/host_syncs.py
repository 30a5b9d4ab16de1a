"""The register of the training step's host reads: the one source of ``docs/host-syncs.md``'s table and of the CUDA
test that counts them (``tests/profiling/test_host_syncs_gpu.py``).

A read of a device value to the host (``.item()``, ``float(t)``, ``.tolist()``, ``bool(t)``) and a blocking copy
between host and device (``torch.tensor(list, device="cuda")``, ``t.cpu()``) wait for every kernel queued before them.
Under ``torch.cuda.set_sync_debug_mode("warn")`` torch warns at each such synchronisation ("called a synchronizing
CUDA operation"); :func:`count_syncs` attributes each warning to the innermost frame of lightning_par's own code on
the stack when it was raised (a synchronisation inside torch or Lightning called from our code counts at our call;
one with no frame of ours, Lightning's own loop, counts as ``other``), as ``"<file>: <function>"``.

:data:`HOST_READS` lists every site of the package that may synchronise in a training step, with why, how often, and
:meth:`HostRead.per_step`: the most synchronisations the site makes in one training step of a layout of the GPU check
(:data:`lightning_par.benchmarks.gpu_check.LAYOUTS`: the tiny GPT or MoE GPT, fp32, no clipping, no asynchronous
save, no non-finite guard), on one rank (:class:`StepFacts`). The counts are read from the code (they count host reads
and blocking uploads) and from a CPU stand-in that warns at every read of a tensor that would live on the GPU
(``tests/device_rule.HostReads``, run on every layout by ``tests/profiling/test_host_reads.py``, which CI runs); not
yet measured on a GPU: the CUDA test fails on a site that synchronises more often than its count, or that is not
listed, and prints what it measured.

Run ``python -m lightning_par.profiling.host_syncs`` to print the Markdown table of ``docs/host-syncs.md``
(``tests/profiling/test_host_syncs.py`` checks that the docs hold exactly it).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["HOST_READS", "SYNC_MESSAGE", "HostRead", "StepFacts", "SyncRecorder", "check_counts", "count_syncs",
           "expected_syncs", "markdown_table", "package_site", "step_facts"]

#: what torch's warning says at each synchronisation under ``set_sync_debug_mode("warn")`` (torch 2.13)
SYNC_MESSAGE = "called a synchronizing CUDA operation"

PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StepFacts:
    """What decides a layout's host reads on one rank, in one training step of the GPU check.

    Attributes:
        pp: pipeline parallelism (``pp_size > 1``).
        last_stage: this rank holds the pipeline's last (loss) stage.
        microbatches: the pipeline's micro-batches per step.
        moe_layers: the model's MoE layers (on this rank).
        ep: expert parallelism (``ep_size > 1``).
        logged: the values ``training_step`` logs with ``self.log`` (the GPT's: ``train_loss``).
        cp: the context-parallel method (``"ring"``, ``"all_to_all"``), ``None`` without cp.
        attention_layers: the model's attention layers (the GPT of the check: 4).
    """

    pp: bool = False
    last_stage: bool = False
    microbatches: int = 1
    moe_layers: int = 0
    ep: bool = False
    logged: int = 1
    cp: str | None = None
    attention_layers: int = 4


@dataclass(frozen=True)
class HostRead:
    """One site of the package that synchronises with the device in a training step.

    Attributes:
        file: the file, relative to the package (``pipeline_parallel/steps.py``).
        functions: the functions the synchronisation happens in (the innermost of ours on the stack).
        what: what is read, and why it has to be.
        how_often: how often, in words (for the docs).
        per_step: the most synchronisations it makes in one training step of a GPU-check layout on one rank.
    """

    file: str
    functions: tuple[str, ...]
    what: str
    how_often: str
    per_step: Callable[[StepFacts], int]

    @property
    def sites(self) -> list[str]:
        """Its ``"<file>: <function>"`` keys, as :func:`count_syncs` names them."""
        return [f"{self.file}: {f}" for f in self.functions]


def _pp_last(f: StepFacts, n: int) -> int:
    return n if f.pp and f.last_stage else 0


#: Every site of the package that may synchronise in a training step (see the module docstring).
HOST_READS: tuple[HostRead, ...] = (
    HostRead("expert_parallel/dispatch.py", ("dispatch",),
             "the all-to-all's split sizes (sent, received) and the tokens per local expert, in one `.tolist()`: "
             "`all_to_all_single` takes its split sizes as Python integers",
             "once per MoE layer per forward, under ep", lambda f: f.moe_layers if f.ep else 0),
    HostRead("expert_parallel/grouped.py", ("expert_ffn",),
             "the tokens per expert (`counts.tolist()`) for the padded `bmm` and the loop forms; none under ep (the "
             "dispatch's read is handed over) and none for `grouped_mm` (CUDA bf16)",
             "once per MoE layer per forward, without ep", lambda f: 0 if f.ep else f.moe_layers),
    HostRead("expert_parallel/metrics.py", ("moe_step_metrics",),
             "every MoE layer's load imbalance, dropped tokens, auxiliary and z-loss, logged as floats: one "
             "`.tolist()` of them all", "once per step, with MoE layers", lambda f: 1 if f.moe_layers else 0),
    HostRead("pipeline_parallel/steps.py", ("_share_step",),
             "the stages' loss and step timings: the timings uploaded (`torch.tensor(..., device=)`), gathered over pp "
             "in one all-gather, read in one `.tolist()` (the bubble statistics are host numbers)",
             "twice per step under pp", lambda f: 2 if f.pp else 0),
    HostRead("pipeline_parallel/user_steps.py", ("_read_to_host",),
             "the micro-batches' logging weights and every value `training_step` logs, in one `.tolist()` (the "
             "logged means go to the other stages as Python objects)",
             "once per step on the last stage, under pp with `self.log` in `training_step`", lambda f: _pp_last(f, 1)),
    HostRead("pipeline_parallel/user_steps.py", ("share",),
             "the logged records sent to the other stages (`broadcast_object_list`: torch uploads the pickled bytes "
             "and their size, and reads them back on the receivers)", "once per step under pp (at most 4 copies)",
             lambda f: 4 if f.pp else 0),
    HostRead("pipeline_parallel/user_steps.py", ("replay",),
             "each value `training_step` logs with `sync_dist=True`, uploaded for `self.log` on every stage (it goes "
             "to a collective; the others are logged as CPU tensors)",
             "per such value per step, under pp", lambda f: 0),
    HostRead("context_parallel/attention.py", ("forward",),
             "ring attention: every cp rank's positions, in one `.tolist()`, from which the blocks' pieces (full, "
             "causal, masked, none) are decided on the host", "once per attention layer per forward, under cp ring",
             lambda f: f.attention_layers if f.cp == "ring" else 0),
    HostRead("context_parallel/attention.py", ("_strictly_increasing",),
             "all-to-all attention: whether the gathered positions, sorted, are strictly increasing (`bool(...)`): "
             "then the causal mask is the lower triangle", "once per attention layer per forward, under cp all_to_all",
             lambda f: f.attention_layers if f.cp == "all_to_all" else 0),
    HostRead("pipeline_parallel/clip.py", ("clip_grad_norm_across_ranks",),
             "the clipping coefficient, `float(...)`, so that one number scales plain and DTensor gradients alike",
             "once per optimizer step, with `gradient_clip_val`", lambda f: 0),
    HostRead("data_parallel/zero.py", ("clip_by_total_norm",),
             "the clipping coefficient, as above, under ZeRO", "once per optimizer step, with `gradient_clip_val`",
             lambda f: 0),
    HostRead("data_parallel/reducer.py", ("_arrival_order_of_rank0",),
             "rank 0's gradient arrival order (`.tolist()`), from which every rank builds the same buckets",
             "once per run, at the first backward (ddp_overlap)", lambda f: 0),
    HostRead("checkpoint/strategy_io.py", ("finish_pending_checkpoint",),
             "whether every rank's background save is done (an all-reduced flag, `.item()`)",
             "once per step while an asynchronous save is pending", lambda f: 0),
    HostRead("fault/nonfinite.py", ("on_before_backward", "on_before_optimizer_step"),
             "whether the loss and the gradients are finite (the decision to stop or skip is taken on the host)",
             "once per step and per optimizer step, with the non-finite guard", lambda f: 0),
    HostRead("fault/preemption.py", ("_agreed",),
             "whether any rank received the preemption signal (an all-reduced flag)",
             "once per step, with a preemption watch", lambda f: 0),
    HostRead("data/datasets.py", ("on_train_batch_end",),
             "the packing callback's counted tokens and padding fraction, logged as floats",
             "once per step, with the packed-document data module (`PackingMetricsCallback`)", lambda f: 0),
)


def step_facts(layout: tuple[int, str, str, dict[str, Any]], rank: int) -> StepFacts:
    """:class:`StepFacts` of ``rank`` in a layout of :data:`lightning_par.benchmarks.gpu_check.LAYOUTS`
    (``(ranks, model, strategy registry name, options)``; the model a 4-layer GPT, ``"moegpt"`` with an MoE layer
    every second block)."""
    _, model, _, options = layout
    pp = options.get("pp_size", 1)
    schedule = options.get("schedule", "1f1b")
    last = 0 if schedule in ("zbv_zero_bubble", "dualpipev") else pp - 1  # V-shaped schedules end on rank 0
    moe = 2 if model == "moegpt" else 0
    ep = options.get("ep_size", 1) > 1
    # the pp coordinate is the outermost mesh axis: with pp alone in the layout it is the rank
    return StepFacts(pp=pp > 1, last_stage=pp > 1 and rank == last, microbatches=options.get("num_microbatches", 1),
                     moe_layers=moe, ep=ep, cp=options.get("method", "ring") if options.get("cp_size", 1) > 1 else None)


def expected_syncs(facts: StepFacts) -> dict[str, int]:
    """``{"<file>: <function>": the most synchronisations in one step}`` for the sites with any, under ``facts``.
    A row with several functions allows its count in each of them."""
    out: dict[str, int] = {}
    for read in HOST_READS:
        n = read.per_step(facts)
        if n:
            for site in read.sites:
                out[site] = out.get(site, 0) + n
    return out


@lru_cache(maxsize=None)
def _functions(path: str) -> tuple[tuple[int, int, str], ...]:
    """``(first line, last line, name)`` of every function in the file at ``path``, innermost last."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return ()
    spans = [(n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return tuple(sorted(spans, key=lambda s: (s[0], -s[1])))


def package_site(filename: str, lineno: int, package: Path = PACKAGE) -> str | None:
    """``"<file relative to the package>: <innermost function holding the line>"`` for a file of ``package``, else
    ``None`` (``"<module>"`` outside any function)."""
    try:
        rel = Path(filename).resolve().relative_to(package)
    except ValueError:
        return None
    name = "<module>"
    for first, last, fn in _functions(str(Path(filename).resolve())):
        if first <= lineno <= last:
            name = fn  # sorted by first line: the last match is the innermost
    return f"{rel.as_posix()}: {name}"


def count_syncs(events: Iterable[tuple[str, list[tuple[str, int]]]], package: Path = PACKAGE) -> Counter[str]:
    """Count the synchronisation warnings of ``events`` by site.

    Args:
        events: ``(message, stack)`` per warning, ``stack`` the ``(filename, line)`` frames innermost first (what
            :class:`SyncRecorder` records); warnings whose message does not contain :data:`SYNC_MESSAGE` are skipped.
        package: the package root whose files are "ours".

    Returns:
        ``{"<file>: <function>": count}`` for the innermost frame of ``package`` on each stack, ``"other"`` for the
        warnings with none.
    """
    counts: Counter[str] = Counter()
    for message, stack in events:
        if SYNC_MESSAGE not in message:
            continue
        site = next((s for s in (package_site(f, n, package) for f, n in stack) if s is not None), "other")
        counts[site] += 1
    return counts


def check_counts(measured: Counter[str] | dict[str, int], expected: dict[str, int]) -> list[str]:
    """The package sites that synchronised more often than :data:`HOST_READS` allows (or are not in it); ``[]`` when
    every count is within its documented bound. ``"other"`` (Lightning's and torch's own) is not checked."""
    problems = []
    for site, n in sorted(measured.items()):
        if site == "other":
            continue
        allowed = expected.get(site, 0)
        if n > allowed:
            where = "not in HOST_READS" if site not in expected else f"HOST_READS allows {allowed}"
            problems.append(f"{site}: {n} synchronisations in the step ({where})")
    return problems


class SyncRecorder:
    """While active (``with SyncRecorder() as rec:``), CUDA's sync debug mode is ``"warn"`` and every warning is
    recorded in ``rec.events`` as ``(message, stack)`` with the stack when it was raised (innermost first), for
    :func:`count_syncs`.

    Args:
        cuda: switch CUDA's sync debug mode (``None``: when CUDA is available); ``False`` records the warnings only
            (how the unit test checks the recording on a CPU).
    """

    def __init__(self, cuda: bool | None = None) -> None:
        self.events: list[tuple[str, list[tuple[str, int]]]] = []
        self._saved: Any = None
        self._cuda = cuda

    def __enter__(self) -> SyncRecorder:
        import warnings

        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._saved = warnings.showwarning

        def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            frame, stack = sys._getframe(1), []
            while frame is not None:
                stack.append((frame.f_code.co_filename, frame.f_lineno))
                frame = frame.f_back
            self.events.append((str(message), [(filename, lineno), *stack]))

        warnings.showwarning = record
        if self._cuda is None:
            self._cuda = torch.cuda.is_available()
        if self._cuda:
            torch.cuda.synchronize()  # what was queued before does not count
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        import warnings

        import torch

        if self._cuda:
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._saved
        self._catch.__exit__(*exc)


def markdown_table() -> str:
    """The table of ``docs/host-syncs.md``: every row of :data:`HOST_READS`, with its count per step in the GPU
    check's layouts (ranks where it differs)."""
    from lightning_par.benchmarks.gpu_check import LAYOUTS

    lines = ["| where (file: function) | what and why | how often | at most, per step, in the GPU check |",
             "|---|---|---|---|"]
    for read in HOST_READS:
        cells = []
        for name, layout in LAYOUTS.items():
            per_rank = [read.per_step(step_facts(layout, r)) for r in range(layout[0])]
            if any(per_rank):
                cells.append(f"{name} {per_rank[0]}" if len(set(per_rank)) == 1 else
                             f"{name} {'/'.join(map(str, per_rank))}")
        where = f"`{read.file}: {', '.join(read.functions)}`"
        lines.append(f"| {where} | {read.what} | {read.how_often} | {'; '.join(cells) or '0'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
