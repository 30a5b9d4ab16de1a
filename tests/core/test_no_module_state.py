"""No hidden mutable state at module level in ``lightning_par/``, read from the source with ``ast``.

Per-step values (the cp sequence shard, a packed block's document ids, the auxiliary-loss factor) travel in step
variables scoped to the step (:mod:`lightning_par.step_context`), never in a module's list, dict or ``global``. This
test lists every module-level binding of a mutable object (a dict, list or set display or comprehension, a call of
``dict``/``list``/``set``/``defaultdict``/``OrderedDict``/``deque``/``Counter``/``bytearray``/a weak container, or an
assignment through a ``global`` statement in a function) and fails on one that is not in the allow-lists below:

* :data:`CONSTANTS`: tables filled once at import and never changed after (registries of names, presets, schemas).
  The test also checks that no code of the package mutates them (item assignment or deletion, augmented assignment,
  a mutating method such as ``append``/``update``/``clear``, through the name or ``module.NAME``), so a constant
  that starts being written fails here too.
* :data:`PROCESS_STATE`: the few pieces of state that belong to the process, not to a step (caches of generated
  classes, lazily imported classes, a bound port, the orphan watchdog thread), each with the reason it stays.

``__all__`` lists are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_par"

MUTABLE_CALLS = frozenset({
    "dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "bytearray",
    "WeakKeyDictionary", "WeakValueDictionary", "WeakSet",
})
MUTATING_METHODS = frozenset({
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add", "discard",
    "appendleft", "extendleft", "sort", "reverse", "__setitem__", "__delitem__",
})

_REGISTRY = "a registry of names filled at import, read only after"
_PRESETS = "a table of presets or defaults, read only"
_BENCH = "a benchmark's settings or layouts, read only"
_SCHEMA = "a table of schema classes or option names, read only"
_MAP = "a lookup table (name -> value), read only"

#: ``module:NAME`` -> why it is a constant (never mutated after import; checked below).
CONSTANTS: dict[str, str] = {
    "lightning_par.axis_registry:PHASES": _MAP,
    "lightning_par.benchmarks.activation_checkpointing:_FULL": _BENCH,
    "lightning_par.benchmarks.activation_checkpointing:_QUICK": _BENCH,
    "lightning_par.benchmarks.activation_checkpointing:LAYOUTS": _BENCH,
    "lightning_par.benchmarks.checkpoint:_QUICK": _BENCH,
    "lightning_par.benchmarks.checkpoint:_FULL": _BENCH,
    "lightning_par.benchmarks.common:GPT_SHAPES": _PRESETS,
    "lightning_par.benchmarks.compile:LAYOUTS": _BENCH,
    "lightning_par.benchmarks.gpu_check:MOE_GPU": _BENCH,
    "lightning_par.benchmarks.gpu_check:MOE_DRY": _BENCH,
    "lightning_par.hf.lora:LORA_DEFAULTS": _PRESETS,
    "lightning_par.benchmarks.compile:_FULL": _BENCH,
    "lightning_par.benchmarks.compile:_QUICK": _BENCH,
    "lightning_par.benchmarks.context_parallel:_FULL": _BENCH,
    "lightning_par.benchmarks.context_parallel:_QUICK": _BENCH,
    "lightning_par.benchmarks.context_parallel:LAYOUTS": _BENCH,
    "lightning_par.benchmarks.context_parallel:GPU_CHECK_LAYOUTS": _BENCH,
    "lightning_par.benchmarks.context_parallel:TARGETS": _BENCH,
    "lightning_par.benchmarks.ddp:_QUICK": _BENCH,
    "lightning_par.benchmarks.ddp:_FULL": _BENCH,
    "lightning_par.benchmarks.expert_parallel:_FULL": _BENCH,
    "lightning_par.benchmarks.expert_parallel:_QUICK": _BENCH,
    "lightning_par.benchmarks.expert_parallel:LAYOUTS": _BENCH,
    "lightning_par.benchmarks.float8:_FULL": _BENCH,
    "lightning_par.benchmarks.float8:_QUICK": _BENCH,
    "lightning_par.benchmarks.gpu_check:LLAMA_1B": _PRESETS,
    "lightning_par.benchmarks.gpu_check:LLAMA_TINY": _PRESETS,
    "lightning_par.benchmarks.gpu_check:LAYOUTS": _BENCH,
    "lightning_par.benchmarks.moe:_FULL": _BENCH,
    "lightning_par.benchmarks.moe:_QUICK": _BENCH,
    "lightning_par.benchmarks.muon:_QUICK": _BENCH,
    "lightning_par.benchmarks.muon:_FULL": _BENCH,
    "lightning_par.benchmarks.single_gpu:PRESETS": _PRESETS,
    "lightning_par.benchmarks.tensor_parallel:_FULL": _BENCH,
    "lightning_par.benchmarks.tensor_parallel:_QUICK": _BENCH,
    "lightning_par.benchmarks.zero:_QUICK": _BENCH,
    "lightning_par.benchmarks.zero:_FULL": _BENCH,
    "lightning_par.benchmarks.zero:_FORMULA_STAGE": _MAP,
    "lightning_par.compat:PRIVATE_NAMES": _MAP,
    "lightning_par.config.loggers:_LOGGER_PACKAGES": _MAP,
    "lightning_par.config.schema:LOGGER_SCHEMAS": _SCHEMA,
    "lightning_par.config.schema:STRATEGY_SCHEMAS": _SCHEMA,
    "lightning_par.config.trainer:_RECIPE_OWNED_ARGS": _MAP,
    "lightning_par.context_parallel.attention:CP_ATTENTION_METHODS": _REGISTRY,
    "lightning_par.contract:_ADAPTER_MODULES": _REGISTRY,
    "lightning_par.data.datasets:_SUFFIXES": _MAP,
    "lightning_par.data.fingerprint:_NAMES": _MAP,
    "lightning_par.data_parallel.comm_volume:_CHARGES": _MAP,
    "lightning_par.data_parallel.compression:CAST_DTYPES": _MAP,
    "lightning_par.data_parallel.options:DTYPE_NAMES": _MAP,
    "lightning_par.data_parallel.options:ZERO_GROUP_DEFAULTS": _PRESETS,
    "lightning_par.fault.process:_STATES": _MAP,
    "lightning_par.hf.experts:_LAYOUT_FLAGS": _MAP,
    "lightning_par.hf.tensor_parallel:HF_STYLES": _REGISTRY,
    "lightning_par.hf.tensor_parallel:_EXPERT_PARAM_STYLES": _MAP,
    "lightning_par.hf.tensor_parallel:_FAMILY_PLANS": _PRESETS,
    "lightning_par.models.gpt:GPT_PRESETS": _PRESETS,
    "lightning_par.models.gpt_tp_plan:GPT_TP_PLAN": _PRESETS,
    "lightning_par.parallel_dims:SIZE_FIELDS": _MAP,
    "lightning_par.parallel_dims:AXIS_OF_SIZE": _MAP,
    "lightning_par.parallel_dims:DERIVED_MESHES": _MAP,
    "lightning_par.parallelize:PLAIN_GROUPS": _SCHEMA,
    "lightning_par.parallelize:NESTED_GROUPS": _SCHEMA,
    "lightning_par.parallelize:OPTION_GROUPS": _SCHEMA,
    "lightning_par.pipeline_parallel.options:SCHEDULES": _REGISTRY,
    "lightning_par.planner.devices:DEVICE_PRESETS": _PRESETS,
    "lightning_par.planner.overrides:STRATEGY_FIELDS": _MAP,
    "lightning_par.planner.precision:PRECISIONS": _PRESETS,
    "lightning_par.planner.precision:LIGHTNING_PRECISIONS": _MAP,
    "lightning_par.planner.report:_SIZE_HEADERS": _MAP,
    "lightning_par.planner.report:_COMM_COLUMNS": _MAP,
    "lightning_par.planner.report:COLUMNS": _MAP,
    "lightning_par.planner.report:OPTIONAL_COLUMNS": _MAP,
    "lightning_par.planner.run_config:_DP_MODE_OF": _MAP,
    "lightning_par.precision:MIXED_PRECISIONS": _MAP,
    "lightning_par.profiling.draw:COLORS": _MAP,
    "lightning_par.profiling.trace:ANNOTATIONS": _MAP,
    "lightning_par.profiling.trace:_PIPELINE_KINDS": _MAP,
    "lightning_par.tensor_parallel.comm_volume:_SENT": _MAP,
    "lightning_par.tensor_parallel.plan:_ACCEPTS": _REGISTRY,
    "lightning_par.tensor_parallel.plan:_SUBTREE_STYLES": _REGISTRY,
}

#: ``module:NAME`` -> why this state belongs to the process and stays (not per-step; each a candidate to remove).
PROCESS_STATE: dict[str, str] = {
    "lightning_par.activation_checkpointing:_CLASSES":
        "cache of the generated Checkpointed<Class> subclasses: a pure function of the class, so one class per class",
    "lightning_par.compile:_FORWARDS":
        "cache of torch.compile'd forwards per (class, options): dynamo's own caches are per function object",
    "lightning_par.compile:_CLASSES": "cache of the generated Compiled<Class> subclasses (as _CLASSES above)",
    "lightning_par.hf.experts:_CLASSES":
        "cache of the generated contract-speaking expert subclasses (hf/experts.py is being changed by the MoE work)",
    "lightning_par.hf.pipeline:_CHECKED":
        "weak cache of a network's checked pipeline plan: keyed by the network, gone with it",
    "lightning_par.config.loggers:_WARNED": "the logger packages already warned about: one warning per process",
    "lightning_par.contract:_ADAPTERS":
        "the network adapters registered by register_adapter (a plug-in registry; hf registers at import)",
    "lightning_par.context_parallel.attention:COMM_BYTES_SENT":
        "instrumentation: bytes the cp attention sent, reset and read by the cp benchmark around a measurement",
    "lightning_par.fault.orphan:_guard": "the orphan watchdog thread of this process (one per process)",
    "lightning_par.fault.process_group_exit:FAILED":
        "set when the run failed, read by the atexit handler that then skips destroy_process_group",
    "lightning_par.launcher:_bound_store": "the TCPStore this process bound to a port for its job (one per process)",
    "lightning_par.parallel_dims:_MESHES":
        "the DeviceMesh built for the current world, reused by every ParallelDims of the process (torch builds a "
        "mesh's groups collectively: building it twice costs new process groups)",
    "lightning_par.parallel_dims:_RETIRED": "meshes of an earlier world kept alive until the process ends",
    "lightning_par.sweep:_EXTRA_COLUMNS": "columns registered by register_column for the sweep report (a registry)",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        return name in MUTABLE_CALLS
    return False


def module_state(tree: ast.Module) -> dict[str, int]:
    """``name -> line`` of the module-level bindings of mutable objects and of the names functions assign through a
    ``global`` statement."""
    found: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if _is_mutable(value):
            for target in targets:
                if isinstance(target, ast.Name) and target.id != "__all__":
                    found.setdefault(target.id, node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            for name in node.names:
                found.setdefault(name, node.lineno)
    return found


def find_state() -> dict[str, int]:
    """``module:NAME -> line`` over the package."""
    out = {}
    for module, path in _modules().items():
        for name, line in module_state(ast.parse(path.read_text(), str(path))).items():
            out[f"{module}:{name}"] = line
    return out


def _mutated_names(tree: ast.AST) -> set[str]:
    """Names (``NAME`` or the attribute of ``module.NAME``) that code mutates in place."""

    def name_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return node.attr
        return None

    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Subscript) and (name := name_of(target.value)):
                out.add(name)
            elif isinstance(node, ast.AugAssign) and (name := name_of(target)):
                out.add(name)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATING_METHODS and (name := name_of(node.func.value))):
            out.add(name)
    return out


def test_the_scan_finds_mutable_state() -> None:
    tree = ast.parse(
        "X = {}\nY: list[int] = []\nZ = set()\nW = (1, 2)\nV = frozenset()\n__all__ = ['X']\n"
        "def f():\n    global G\n    G = 1\n"
    )
    assert module_state(tree) == {"X": 1, "Y": 2, "Z": 3, "G": 8}
    assert _mutated_names(ast.parse("A[1] = 2\nm.B.append(3)\nC.get(1)\ndel D[0]\nE += 1\n")) == {"A", "B", "D", "E"}


def test_no_new_mutable_module_state() -> None:
    found = find_state()
    allowed = CONSTANTS.keys() | PROCESS_STATE.keys()
    new = {k: v for k, v in found.items() if k not in allowed}
    assert not new, (
        f"mutable module-level state {new} (module:NAME -> line): pass per-step values in a step variable "
        f"(lightning_par/step_context.py) or as arguments; a true constant goes in CONSTANTS, with its reason"
    )
    stale = sorted(allowed - found.keys())
    assert not stale, f"allow-listed names that are gone (remove them from the lists): {stale}"


def test_the_constants_are_never_mutated() -> None:
    mutated: set[str] = set()
    for path in _modules().values():
        mutated |= _mutated_names(ast.parse(path.read_text(), str(path)))
    written = sorted(k for k in CONSTANTS if k.split(":")[1] in mutated)
    assert not written, f"these constants are mutated by package code (move them to PROCESS_STATE or stop): {written}"


def test_step_values_are_scoped() -> None:
    """The three per-step values of the issue: set for a block, gone after it (also after an error)."""
    import pytest
    import torch

    from lightning_par import aux_loss
    from lightning_par.context_parallel import sequence
    from lightning_par.data import doc_mask

    shard = sequence.SequenceShard(None, torch.arange(4), 2)
    with sequence.sequence_shard(shard):
        assert sequence.active_sequence_shard() is shard
        with aux_loss.aux_loss_scaled(0.25):
            assert aux_loss.aux_loss_scale() == 0.25
        assert aux_loss.aux_loss_scale() == 1.0
    assert sequence.active_sequence_shard() is None
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="inside"), doc_mask.document_attention(ids):
        assert doc_mask.active_documents() is ids
        raise RuntimeError("inside")
    assert doc_mask.active_documents() is None
