"""Move the tests from the process-kind layout (``tests/{unit,distributed,e2e,gpu,lightning}/``, helpers at ``tests/``
root) to the package's layout (``tests/<folder of lightning_par>/``, helpers in ``tests/support/``), with ``git mv`` so
that git's rename detection carries edits made meanwhile on other branches.

Re-runnable: ``python -m tests.support.relayout`` prints the plan; ``--apply`` does it. Files already moved are
skipped; a test file still in an old kind folder that :data:`MOVES` does not name gets a folder by :func:`guess`
(the ``lightning_par`` sub-package it imports most; its top-level modules -> ``core``; recipe runs -> ``recipes``),
printed so the reader can check it. Applying it:

1. ``git mv`` each file (a name taken in the target folder gets the old kind as a suffix: ``test_x_distributed.py``);
2. gives each moved test file the marker its old folder stood for (``distributed`` for ``distributed/`` and
   ``lightning/``, ``e2e`` for ``e2e/``, ``gpu`` for ``gpu/``), added to its module ``pytestmark`` unless present, so
   that the marker-selected stages of the Makefile select the same tests as the folder-selected ones did
   (``tests/support/check_stages.py`` proves it);
3. rewrites every reference in the repository's text files (imports ``tests.unit.test_x`` / ``tests.p3d_helpers``,
   paths ``tests/unit/test_x.py``), CHANGELOG.md excepted (its entries tell history).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("unit", "distributed", "e2e", "gpu", "lightning", "config")
#: The marker a file's old folder stood for (the Makefile selected those folders as a whole).
KIND_MARKER = {"distributed": "distributed", "lightning": "distributed", "e2e": "e2e", "gpu": "gpu"}

#: Helpers at tests/ root and the non-test modules of the kind folders -> tests/support/.
HELPERS = {
    "tests/compile_helpers.py": "tests/support/compile.py",
    "tests/device_rule.py": "tests/support/device_rule.py",
    "tests/doc_helpers.py": "tests/support/docs.py",
    "tests/fabric_helpers.py": "tests/support/fabric.py",
    "tests/float8_helpers.py": "tests/support/float8.py",
    "tests/ft_helpers.py": "tests/support/ft.py",
    "tests/helpers.py": "tests/support/helpers.py",
    "tests/hf_matrix_helpers.py": "tests/support/hf_matrix.py",
    "tests/label_helpers.py": "tests/support/labels.py",
    "tests/litgpt_helpers.py": "tests/support/litgpt.py",
    "tests/lora_helpers.py": "tests/support/lora.py",
    "tests/p3d_helpers.py": "tests/support/p3d.py",
    "tests/pp_helpers.py": "tests/support/pipeline.py",
    "tests/precision_helpers.py": "tests/support/precision.py",
    "tests/reparallel_helpers.py": "tests/support/reparallel.py",
    "tests/resume_helpers.py": "tests/support/resume.py",
    "tests/surface_helpers.py": "tests/support/surface.py",
    "tests/tp_helpers.py": "tests/support/tensor_parallel.py",
    "tests/user_models.py": "tests/support/user_models.py",
    "tests/zero_helpers.py": "tests/support/zero.py",
    "tests/e2e/_run.py": "tests/support/recipe_run.py",
    "tests/lightning/matrix.py": "tests/support/lightning_matrix.py",
    "tests/lightning/model.py": "tests/support/lightning_model.py",
}

#: old test file (without ``tests/`` and ``.py``) -> folder of tests/. The rule: the folder of ``lightning_par`` the
#: file tests; top-level modules of the package (parallelize, parallel_dims, steps, train, launcher, precision, ...) and
#: the package-wide guards -> ``core``; runs of a recipe that test the recipe itself -> ``recipes``.
MOVES = {
    # added on other branches while the move was made (merged after it)
    "unit/test_adding_an_optimizer": "optim", "distributed/test_demo_optimizer": "optim",
    "unit/test_callback_refusals": "callbacks", "unit/test_ft_hooks": "fault_tolerance",
    "unit/test_options_source": "config", "unit/test_runtime_layers": "runtime", "distributed/test_one_step": "runtime",
    "unit/test_architecture_doc": "core", "distributed/test_parallel_dims_once": "core",
    # unit
    "unit/test_activation_checkpointing": "core", "unit/test_adding_a_parallelism": "core", "unit/test_axes": "core",
    "unit/test_benchmark_report": "benchmarks", "unit/test_buffer_sync": "data_parallel",
    "unit/test_callbacks": "callbacks", "unit/test_checkpoint_damage": "checkpoint",
    "unit/test_checkpoint_safety": "checkpoint", "unit/test_checkpoint_verify": "checkpoint",
    "unit/test_comm_cost": "core", "unit/test_compat": "compat", "unit/test_compile_option": "core",
    "unit/test_compile_refusal": "core", "unit/test_context_parallel_checks": "context_parallel",
    "unit/test_counted_tokens": "core", "unit/test_cp_benchmark": "benchmarks", "unit/test_data": "data",
    "unit/test_data_fingerprint": "data", "unit/test_device_discipline": "core", "unit/test_docs": "core",
    "unit/test_documents_data": "data", "unit/test_ep_benchmark": "benchmarks", "unit/test_every_module_imports": "core",
    "unit/test_fabric_strategy": "fabric", "unit/test_fault_tolerance_options": "fault_tolerance",
    "unit/test_fault_units": "fault", "unit/test_float8": "core", "unit/test_ft_data_position": "fault_tolerance",
    "unit/test_ft_servers_bind": "fault_tolerance", "unit/test_gpt": "models", "unit/test_gpu_check": "benchmarks",
    "unit/test_hf_architectures": "hf", "unit/test_hf_checkpoint": "hf", "unit/test_hf_context_probe": "hf",
    "unit/test_hf_export_output": "hf", "unit/test_hf_matrix": "hf", "unit/test_hf_pipeline": "hf",
    "unit/test_hf_plans": "hf", "unit/test_host_syncs": "profiling", "unit/test_import_layers": "core",
    "unit/test_keyword_defaults": "core", "unit/test_lora_plan": "hf", "unit/test_lr_scaling": "core",
    "unit/test_memory": "core", "unit/test_mesh_reuse": "core", "unit/test_moe": "models",
    "unit/test_moe_grouped": "expert_parallel", "unit/test_muon": "optim", "unit/test_no_module_state": "core",
    "unit/test_parallel_3d_validation": "core", "unit/test_parallel_dims": "core", "unit/test_parity_tolerance": "core",
    "unit/test_pipeline_schedules": "pipeline_parallel", "unit/test_pipeline_split": "pipeline_parallel",
    "unit/test_planner": "planner", "unit/test_planner_axes": "planner", "unit/test_planner_calibration": "planner",
    "unit/test_planner_costs": "planner", "unit/test_planner_cp": "planner", "unit/test_planner_dry_run": "planner",
    "unit/test_planner_megatron": "planner", "unit/test_precision": "core", "unit/test_preemption_units": "fault",
    "unit/test_private_api": "compat", "unit/test_quiet": "core", "unit/test_restore": "core",
    "unit/test_resume": "fault", "unit/test_resume_changes": "checkpoint", "unit/test_run_lock": "fault",
    "unit/test_sweep_report": "core", "unit/test_timeline": "profiling", "unit/test_tokenizer": "data",
    "unit/test_tp_plan": "tensor_parallel", "unit/test_tp_regions": "tensor_parallel", "unit/test_train_launch": "core",
    "unit/test_trust_remote_code": "hf", "unit/test_zero_validation": "data_parallel",
    # distributed
    "distributed/test_async_checkpoint": "checkpoint", "distributed/test_buffers": "data_parallel",
    "distributed/test_clip_value": "core", "distributed/test_compile": "core", "distributed/test_compile_refusal": "core",
    "distributed/test_composition": "core", "distributed/test_context_parallel": "context_parallel",
    "distributed/test_cp_attention": "context_parallel", "distributed/test_ddp_overlap": "data_parallel",
    "distributed/test_device_rule": "core", "distributed/test_exact_resume": "data",
    "distributed/test_expert_parallel": "expert_parallel", "distributed/test_fabric": "fabric",
    "distributed/test_fabric_litgpt": "fabric", "distributed/test_fabric_pipeline": "fabric",
    "distributed/test_fault_tolerance": "fault_tolerance", "distributed/test_float8": "core",
    "distributed/test_hf_architectures": "hf", "distributed/test_hf_checkpoint": "hf", "distributed/test_hf_matrix": "hf",
    "distributed/test_hf_models": "hf", "distributed/test_hf_pipeline": "hf", "distributed/test_hf_tp_regions": "hf",
    "distributed/test_host_reads": "profiling", "distributed/test_hsdp": "data_parallel",
    "distributed/test_label_masks": "data", "distributed/test_local_heads": "tensor_parallel",
    "distributed/test_lora": "hf", "distributed/test_lr_scaling": "core", "distributed/test_mesh": "core",
    "distributed/test_muon": "optim", "distributed/test_nonfinite": "fault", "distributed/test_packed_documents": "data",
    "distributed/test_parallel_3d": "core", "distributed/test_pipeline": "pipeline_parallel",
    "distributed/test_planner_state": "planner", "distributed/test_reducer": "data_parallel",
    "distributed/test_reparallelize": "core", "distributed/test_store_bind": "core", "distributed/test_techniques": "core",
    "distributed/test_tensor_parallel": "tensor_parallel", "distributed/test_timeline": "profiling",
    "distributed/test_user_error_last": "core", "distributed/test_user_surface": "core",
    "distributed/test_zero": "data_parallel", "distributed/test_zero_checkpoint": "checkpoint",
    # e2e (the scripts a test finds with Path(__file__).with_name go with it)
    "e2e/test_checkpoint_faults": "checkpoint", "e2e/test_data_fingerprint_resume": "data",
    "e2e/test_documents_recipe": "recipes", "e2e/test_faults": "fault", "e2e/launcher_victim_script": "fault",
    "e2e/fault_models": "fault", "e2e/test_ft_recipe": "recipes", "e2e/test_hf_recipe": "recipes",
    "e2e/test_hydra_launcher": "recipes", "e2e/user_hydra_app": "recipes", "e2e/test_lora_recipe": "recipes",
    "e2e/test_main_job": "recipes", "e2e/test_outside_launcher": "fault", "e2e/test_packaged_config": "recipes",
    "e2e/test_plan_dry_run": "planner", "e2e/test_plan_recipe": "recipes", "e2e/test_preemption": "fault",
    "e2e/test_readme_examples": "recipes", "e2e/test_registry_names": "strategies",
    "e2e/registry_user_script": "strategies", "e2e/crash_user_script": "strategies",
    "e2e/test_resume_resplit": "recipes", "e2e/test_sweep": "recipes", "e2e/test_user_model": "recipes",
    "e2e/user_lm": "recipes",
    # gpu, lightning
    "gpu/test_cuda": "strategies", "gpu/test_host_syncs": "profiling", "lightning/test_matrix": "strategies",
}
#: Files whose new name is not the old one (besides the kind suffix a name clash adds).
RENAMES = {"lightning/test_matrix": "test_lightning_matrix"}
#: Files whose text keeps the old names: history, and the tables of the move itself.
KEEP = {"CHANGELOG.md", "tests/support/relayout.py", "tests/support/check_stages.py"}
#: The package's top-level modules are tested in tests/core/.
CORE = "core"


def guess(path: Path, root: Path = ROOT) -> str:
    """The folder for a test file :data:`MOVES` does not name: the ``lightning_par`` sub-package it names most."""
    text = path.read_text()
    counts: dict[str, int] = {}
    for name in re.findall(r"lightning_par\.([a-z_0-9]+)", text):
        folder = name if (root / "lightning_par" / name).is_dir() else CORE
        counts[folder] = counts.get(folder, 0) + 1
    if path.parent.name == "e2e" and not counts:
        return "recipes"
    return max(sorted(counts), key=counts.get) if counts else CORE


def plan(root: Path = ROOT) -> dict[str, str]:
    """Old repository-relative path -> new one, for every file of ``root`` still to move (moved files are absent)."""
    out: dict[str, str] = {}
    for old, new in HELPERS.items():
        if (root / old).exists():
            out[old] = new
    for path in sorted((root / "tests").glob("*.py")):  # a helper added at tests/ root since
        rel = path.relative_to(root).as_posix()
        if path.name not in {"conftest.py", "__init__.py"} and rel not in out:
            out[rel] = f"tests/support/{path.stem.removesuffix('_helpers')}.py"
            print(f"guessed (not in HELPERS): {rel} -> {out[rel]}", file=sys.stderr)
    taken = {p.relative_to(root).as_posix() for p in (root / "tests").rglob("*.py")}
    for kind in KINDS:
        if kind == "config":
            continue  # tests/config mirrors lightning_par/config already
        for path in sorted((root / "tests" / kind).glob("*.py")):
            rel = path.relative_to(root).as_posix()
            if path.name == "__init__.py" or rel in out:
                continue
            if path.name == "conftest.py":
                continue  # gpu/conftest.py: its fixture is now keyed on the marker (tests/conftest.py)
            key = f"{kind}/{path.stem}"
            folder = MOVES.get(key) or guess(path, root)
            name = RENAMES.get(key, path.stem)
            new = f"tests/{folder}/{name}.py"
            if new in taken or new in out.values():
                new = f"tests/{folder}/{name}_{kind}.py"
            out[rel] = new
            if key not in MOVES:
                print(f"guessed (not in MOVES): {rel} -> {new}", file=sys.stderr)
    return out


def module(path: str) -> str:
    return path[: -len(".py")].replace("/", ".")


def add_marker(path: Path, marker: str) -> bool:
    """Add ``pytest.mark.<marker>`` to the module's ``pytestmark`` (created after the imports when absent)."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            src = ast.get_source_segment(text, node.value)
            if re.search(rf"\bmark\.{marker}\b", src):
                return False
            items = src[1:-1].rstrip(", ") if isinstance(node.value, ast.List) else src
            new = f"pytestmark = [pytest.mark.{marker}, {items}]\n"
            lines[node.lineno - 1: node.end_lineno] = [new]
            path.write_text("".join(lines))
            return True
    if not any(isinstance(n, ast.Import) and any(a.name == "pytest" for a in n.names) for n in tree.body):
        raise SystemExit(f"{path}: no 'import pytest' to add the {marker} marker with; add it by hand")
    last = max(n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    lines[last:last] = ["\n", f"pytestmark = pytest.mark.{marker}\n"]
    path.write_text("".join(lines))
    return True


def rewrite_references(moves: dict[str, str]) -> list[str]:
    """Replace old paths and module names by the new ones in every tracked text file but CHANGELOG.md."""
    subs: dict[str, str] = {}
    for old, new in moves.items():
        subs[old] = new
        subs[module(old)] = module(new)
        head, _, name = module(old).rpartition(".")
        nhead, _, nname = module(new).rpartition(".")
        subs[f"from {head} import {name}"] = f"from {nhead} import {nname}"
    keys = sorted(subs, key=len, reverse=True)
    candidate = re.compile(r"(?<![\w./])(?:from tests import \w+|tests[./][\w./]*)")

    def replace(match: re.Match) -> str:  # the longest old name the candidate starts with, ending at a name boundary
        text = match.group(0)
        for key in keys:
            if text.startswith(key) and not text[len(key):len(key) + 1].isalnum() and text[len(key):][:1] != "_":
                return subs[key] + text[len(key):]
        return text
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    changed = []
    for rel in files.split("\0"):
        path = ROOT / rel
        if not rel or rel in KEEP or not path.is_file() or path.suffix not in {
                ".py", ".md", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".sh", ".txt", ""}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if "tests" not in text:
            continue
        new = candidate.sub(replace, text)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


def apply(moves: dict[str, str]) -> None:
    for old, new in moves.items():
        target = ROOT / new
        target.parent.mkdir(parents=True, exist_ok=True)
        init = target.parent / "__init__.py"
        if not init.exists():
            init.write_text("")
            subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
        subprocess.run(["git", "mv", old, new], cwd=ROOT, check=True)
        kind = Path(old).parent.name
        if kind in KIND_MARKER and Path(new).name.startswith("test_"):
            if add_marker(target, KIND_MARKER[kind]):
                print(f"marker {KIND_MARKER[kind]} added: {new}")
    # the whole table too: code added elsewhere since may still import a helper or test module by its old name
    for rel in rewrite_references({**full_map(), **moves}):
        print(f"references rewritten: {rel}")
    for kind in KINDS:
        folder = ROOT / "tests" / kind
        rest = [p for p in folder.glob("*") if p.name not in {"__init__.py", "__pycache__", "conftest.py"}]
        if kind != "config" and folder.is_dir() and not rest:
            for leftover in ("__init__.py", "conftest.py"):
                if (folder / leftover).exists():
                    subprocess.run(["git", "rm", "-q", str(folder / leftover)], cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apply", action="store_true", help="move (git mv), mark and rewrite; else print the plan")
    parser.add_argument("--map", action="store_true", help="print the whole old -> new map (moved files included)")
    args = parser.parse_args(argv)
    moves = plan()
    if args.map:
        for old, new in full_map().items():
            print(f"{old} -> {new}")
        return
    for old, new in moves.items():
        print(f"{old} -> {new}")
    if args.apply:
        apply(moves)


def full_map() -> dict[str, str]:
    """Old path -> new path for every file of the layout change, computed from the tables alone (used by
    ``check_stages.py`` to map node ids)."""
    out = dict(HELPERS)
    taken: set[str] = set()
    # unit first, so that the suffix goes to the process-starting twin, as plan() does on the original tree
    for key, folder in MOVES.items():
        kind, stem = key.split("/")
        name = RENAMES.get(key, stem)
        new = f"tests/{folder}/{name}.py"
        if new in taken:
            new = f"tests/{folder}/{name}_{kind}.py"
        taken.add(new)
        out[f"tests/{key}.py"] = new
    return out


if __name__ == "__main__":
    main()
