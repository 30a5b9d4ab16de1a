"""lightning_par.compat on the installed torch: every wrapped private name resolves and every helper does its job."""

from collections.abc import Generator

import pytest
import torch

from lightning_par import compat


@pytest.fixture
def world_of_one() -> Generator[None, None, None]:
    """A one-rank gloo process group (in this process), destroyed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2.13.0+cpu", (2, 13)), ("2.10.0a0+git1234abc", (2, 10)), ("2.15.1", (2, 15)), ("3.0", (3, 0))],
)
def test_version_parse(text: str, expected: tuple[int, int]) -> None:
    assert compat._version(text) == expected


def test_torch_version_is_the_installed_one() -> None:
    major, minor = compat.TORCH_VERSION
    assert torch.__version__.startswith(f"{major}.{minor}.")
    assert (2, 10) <= compat.TORCH_VERSION < (2, 16)


@pytest.mark.parametrize("name", sorted(compat.PRIVATE_NAMES))
def test_every_private_name_resolves(name: str) -> None:
    assert compat._private(name) is not None


def test_every_export_exists() -> None:
    for name in compat.__all__:
        assert getattr(compat, name) is not None, name


def test_missing_private_name_says_which_and_where(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(compat.PRIVATE_NAMES, "_no_such_name", ("torch", "torch.no_such_module"))
    with pytest.raises(RuntimeError, match=r"no _no_such_name in torch, torch.no_such_module"):
        compat._private("_no_such_name")


def test_local_tensor_of_a_plain_tensor_is_the_tensor() -> None:
    t = torch.zeros(3)
    assert compat.local_tensor(t) is t


def test_is_view() -> None:
    base = torch.zeros(4, 2)
    assert not compat.is_view(base)
    assert compat.is_view(base[1:]) and compat.is_view(base.view(-1))


def test_reexports_are_torch_classes() -> None:
    assert hasattr(compat.TorchDispatchMode, "__torch_dispatch__")
    assert compat.tree_leaves(([1, (2,)], {"a": 3})) == [1, 2, 3]
    assert isinstance(compat.HigherOrderOperator, type)
    assert compat.FUNCTIONAL_COLLECTIVES.all_reduce is not None


def test_op_name() -> None:
    assert compat.op_name(torch.ops.aten.add.Tensor) == "add"

    class NoOpname:
        def __str__(self) -> str:
            return "c10d.allreduce_.default"

    assert compat.op_name(NoOpname()) == "allreduce_"


def test_profiler_enabled() -> None:
    assert compat.profiler_enabled() is False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert compat.profiler_enabled() is True


def test_stage_to_rank_mapping() -> None:
    assert compat.stage_to_rank_mapping(2, 4, "loop") == {0: 0, 1: 1, 2: 0, 3: 1}
    assert compat.stage_to_rank_mapping(2, 4, "v") == {0: 0, 1: 1, 2: 1, 3: 0}


def test_pipeline_stage_meta_of_an_unbuilt_stage_is_none() -> None:
    assert compat.pipeline_stage_meta(object()) is None


def test_grad_scaler_helpers() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    assert compat.grad_scaler_init_kwargs(scaler) == {"device": "cpu", "init_scale": 128.0}
    assert compat.grad_scaler_init_kwargs(object()) == {"device": "cuda", "init_scale": 2.0**16}
    replicator = compat.multi_device_replicator(torch.ones(1))
    assert compat.replicated_tensors(replicator) == {}
    copy = replicator.get(torch.device("cpu"))
    assert compat.replicated_tensors(replicator) == {torch.device("cpu"): copy}


def test_dtensor_and_mesh_helpers(world_of_one: None) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    dt = distribute_tensor(torch.arange(8.0), mesh["tp"], [Shard(0)])
    local = compat.local_tensor(dt)
    assert type(local) is torch.Tensor and local.data_ptr() == dt.to_local().data_ptr()
    assert compat.dtensor_spec(dt).placements == dt.placements and compat.dtensor_spec(dt).mesh == dt.device_mesh

    placement = compat.strided_shard(0, 2)
    assert type(placement).__name__ == "_StridedShard" and (placement.dim, placement.split_factor) == (0, 2)

    assert compat.concatenate_meshes([mesh["dp"], mesh["tp"]]).mesh_dim_names == ("dp", "tp")
    assert compat.flatten_mesh(mesh, "dp_tp").size() == 1
    assert mesh["dp_tp"].size() == 1

    world = dist.group.WORLD
    assert compat.resolve_process_group(world.group_name).size() == 1
    store = compat.default_store()
    store.set("compat", "1")
    assert store.get("compat") == b"1"


def test_grouped_mm_runs_on_cpu_both_forms() -> None:
    """The CPU grouped form of the experts (lightning_par.expert_parallel.grouped) rests on these two calls."""
    assert compat.grouped_mm_runs_on_cpu()
    x, w, dy = torch.randn(5, 4), torch.randn(2, 4, 8), torch.randn(5, 8)
    offs = torch.tensor([2, 5], dtype=torch.int32)
    torch.testing.assert_close(compat.grouped_mm(x, w, offs), torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))
    per_group = torch.stack([x[:2].t() @ dy[:2], x[2:].t() @ dy[2:]])  # (2, 4, 8)
    torch.testing.assert_close(compat.grouped_mm(x.t(), dy, offs), per_group)


def test_the_helpers_moved_into_the_register_resolve() -> None:
    """The canaries of the names the package used outside the register until issue 46 (each a one-line look-up)."""
    ref = compat.muon_reference()
    assert callable(ref.zeropower) and ref.ns_steps > 0 and len({ref.a, ref.b, ref.c}) == 3
    assert compat.serialization_get_layout()("torch.strided") is torch.strided
    assert compat.dcp_storage_info_class().__name__ == "_StorageInfo"
    assert "aot_eager" in compat.dynamo_backends(exclude_tags=())
    assert isinstance(compat.dynamo_counters()["stats"]["unique_graphs"], int)
    assert hasattr(compat.dynamo_config(), "recompile_limit")
    assert isinstance(compat.privateuse1_backend_name(), str)
    assert isinstance(compat.current_function_mode_stack(), list)
    leaves, spec = compat.tree_flatten({"a": torch.ones(1), "b": [torch.zeros(2)]})
    assert len(leaves) == 2 and compat.tree_unflatten(leaves, spec)["b"][0].shape == (2,)
    assert compat.tree_map_only(torch.Tensor, lambda t: t + 1, [torch.zeros(1)])[0].item() == 1.0


def test_module_copy_has_tables_of_its_own() -> None:
    """The canary of :func:`lightning_par.compat.module_copy`: filling the copy leaves the original as it was (a torch
    that renamed ``nn.Module``'s tables would make the copy share them, and the original would change)."""
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net.register_buffer("b", torch.zeros(1))
    shell = compat.module_copy(net)
    shell.add_module("extra", torch.nn.ReLU())
    assert [n for n, _ in net.named_children()] == ["0"] and [n for n, _ in shell.named_children()] == ["extra"]
    assert shell.b is net.b and type(shell) is torch.nn.Sequential
    linear = torch.nn.Linear(2, 2)
    pruned = compat.module_copy(linear, parameters=False)
    pruned.register_parameter("weight", linear.weight)
    pruned.register_buffer("scale", torch.ones(1))
    assert [n for n, _ in pruned.named_parameters()] == ["weight"] and pruned.weight is linear.weight
    assert [n for n, _ in linear.named_parameters()] == ["weight", "bias"] and not list(linear.buffers())


def test_parameter_and_buffer_tables_are_the_modules_own() -> None:
    """The canary of :func:`lightning_par.compat.parameter_table` / :func:`~lightning_par.compat.buffer_table`
    (what lightning_par.restore records and edits in place): the live tables, ``None`` entries kept."""
    linear = torch.nn.Linear(2, 3, bias=False)
    linear.register_buffer("scale", torch.ones(1))
    table = compat.parameter_table(linear)
    assert table is linear.__dict__[compat.PARAMETER_TABLE]
    assert list(table.items()) == [("weight", linear.weight), ("bias", None)]
    weight = table["weight"]
    table["weight"] = None  # edits the module: the parameter is gone from it, its name stays
    assert list(linear.named_parameters()) == [] and list(table) == ["weight", "bias"]
    table["weight"] = weight
    assert [n for n, _ in linear.named_parameters()] == ["weight"] and linear.weight is weight
    buffers = compat.buffer_table(linear)
    assert list(buffers) == ["scale"] and buffers["scale"] is linear.scale
    buffers["scale"] = torch.zeros(1)
    assert linear.scale.item() == 0.0


def test_parallel_style_hooks_are_the_styles_own(world_of_one: None) -> None:
    """The canary of :func:`lightning_par.compat.parallel_style_hooks`: with them, ``distribute_module`` does what the
    style's own ``_apply`` does (the same output, placements and local-ness) for torch's column- and row-wise styles."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1,))
    x = torch.randn(2, 4)
    for style, weight_placement in ((ColwiseParallel(), Shard(0)), (RowwiseParallel(), Shard(1))):
        torch.manual_seed(0)
        theirs = parallelize_module(torch.nn.Linear(4, 4, bias=False), mesh, style)
        torch.manual_seed(0)
        ours = torch.nn.Linear(4, 4, bias=False)

        def partition(name: str, module: torch.nn.Module, mesh_: object, p: object = weight_placement) -> None:
            module.register_parameter(
                "weight", torch.nn.Parameter(distribute_tensor(module.weight.detach(), mesh_, [p]))
            )

        in_fn, out_fn = compat.parallel_style_hooks(style)
        assert in_fn.func.__name__ == "_prepare_input_fn" and out_fn.func.__name__ == "_prepare_output_fn"
        distribute_module(ours, mesh, partition, in_fn, out_fn)
        expected, got = theirs(x), ours(x)
        assert type(got) is type(expected) and not isinstance(got, DTensor)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert ours.weight.placements == theirs.weight.placements
    assert compat.parallel_style_hooks(ColwiseParallel(output_layouts=Replicate(), use_local_output=False))[1].args == (
        (Replicate(),), False
    )
    with pytest.raises(RuntimeError, match="has no _prepare_input_fn"):
        compat.parallel_style_hooks(object())
