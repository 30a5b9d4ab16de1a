"""NCCL's device rule without processes: (a) no torch tensor factory without ``device=`` in a function of the package
that calls a collective (the AST check of ``/work/shared/hooks/before-stop`` 4c, exceptions listed with their
reasons); (b) the dp token weighting under a ``meta:fake`` default group, whose backend map has no ``cpu`` entry: a
CPU tensor in its collectives raises ``No backend type associated with device type cpu`` as NCCL would, and a read
to the host (``float()``, ``.item()``) fails on ``meta``. The whole layouts run under the rule in
``tests/core/test_device_rule.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from tests.support.helpers import in_a_forked_child

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_par"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "send",
               "recv"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "as_tensor", "arange"}
#: folders whose collectives run on a CPU group on purpose
CPU_FOLDERS = {
    "planner": "planner/calibrate.py calibrates the CPU device itself, with its own gloo world",
    "benchmarks": "the benchmarks build their inputs on their own device; the GPU check runs them on CUDA",
}
#: path:function -> why a factory without device= there is no NCCL bug
EXCEPTIONS = {
    "expert_parallel/dispatch.py:dispatch": "the arange indexes the received tokens and feeds no collective; the "
                                            "file is rewritten with the once-per-layer split read (issue 49)",
}


def _offenders(root: Path = PACKAGE) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in CPU_FOLDERS:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
            if not any(c.func.attr in COLLECTIVES and isinstance(c.func.value, ast.Name)
                       and c.func.value.id in ("dist", "c10d", "funcol") for c in calls):
                continue
            for c in calls:
                if (c.func.attr in FACTORIES and isinstance(c.func.value, ast.Name) and c.func.value.id == "torch"
                        and not any(k.arg == "device" for k in c.keywords)
                        and "cpu group" not in lines[c.lineno - 1]
                        and f"{rel.as_posix()}:{fn.name}" not in EXCEPTIONS):
                    out.append(f"{rel.as_posix()}:{c.lineno} ({fn.name})")
    return out


def test_no_tensor_factory_without_device_feeds_a_collective():
    assert _offenders() == [], "build these tensors on the group's device (device=...), or mark a deliberate CPU group"


def test_the_ast_check_finds_a_host_tensor_in_a_collective(tmp_path):
    bad = tmp_path / "lightning_par" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import torch\nimport torch.distributed as dist\n\ndef f(g):\n    t = torch.tensor([1.0])\n"
                   "    dist.all_reduce(t, group=g)\n")
    assert _offenders(bad.parent) == ["bad.py:5 (f)"]


def _token_weight_on_meta() -> None:
    import torch.distributed as dist

    from lightning_par.compat import fake_store
    from lightning_par.data_parallel.token_mean import dp_token_mean_step

    dist.init_process_group("meta:fake", store=fake_store(), rank=0, world_size=4)
    try:
        group = dist.new_group([0, 1, 2, 3])
        x = torch.randn(2, 8, device="meta", requires_grad=True)
        y = torch.zeros(2, 8, dtype=torch.long, device="meta")
        loss = lambda batch: x.sum()  # noqa: E731 - a step returning a scalar loss with a gradient
        out = dp_token_mean_step(group)(torch.nn.Module(), (x, y), loss)
        assert out.device.type == "meta"
        cpu = torch.ones(1)
        try:
            dist.all_reduce(cpu, group=group)
        except RuntimeError as err:  # the group applies NCCL's rule: the check above could fail
            assert "No backend type associated with device type cpu" in str(err)
        else:
            raise AssertionError("a CPU tensor passed a group without a cpu backend")
    finally:
        dist.destroy_process_group()


def test_the_token_weight_keeps_to_the_device_under_a_group_without_cpu_backend():
    status, _, output = in_a_forked_child(_token_weight_on_meta, timeout_s=60)
    assert status == 0, output


def _fabric_token_means_on_meta() -> None:
    import types

    import torch.distributed as dist

    from lightning_par.compat import fake_store
    from lightning_par.fabric.strategy import MeshStrategy
    from lightning_par.runtime import step

    dist.init_process_group("meta:fake", store=fake_store(), rank=0, world_size=4)
    try:
        group = dist.new_group([0, 1, 2, 3])
        mesh = types.SimpleNamespace(size=lambda: 4, get_group=lambda: group)
        dims = types.SimpleNamespace(dp_size=4, group=lambda name: group, get_mesh=lambda name: mesh)
        # Fabric's strategy as token_mean and the runtime's global_mean (train_step's) see it: the dp group, the dp_cp mesh, the root device
        host = types.SimpleNamespace(parallel=types.SimpleNamespace(dims=dims, _batch_transforms=[]),
                                     root_device=torch.device("meta"))
        loss_sum = torch.randn((), device="meta", requires_grad=True)
        tokens = torch.ones((), device="meta")
        loss = MeshStrategy.token_mean(host, loss_sum, tokens)  # float(count) on meta raised here before issue 45
        assert loss.device.type == "meta" and loss.requires_grad
        mean = step.global_mean(host.parallel, loss_sum, tokens)
        assert mean.device.type == "meta" and mean.shape == ()
    finally:
        dist.destroy_process_group()


def test_fabric_token_means_read_nothing_to_the_host():
    """Fabric's ``token_mean_loss`` and ``train_step``'s global mean under a ``meta:fake`` group: the summed count stays
    a device tensor (a read to the host, ``float(count)``, fails on ``meta``: "Tensor.item() cannot be called on meta
    tensors", as it did before the count stayed on the device)."""
    status, _, output = in_a_forked_child(_fabric_token_means_on_meta, timeout_s=60)
    assert status == 0, output
