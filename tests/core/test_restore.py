"""``ModuleSnapshot`` (no processes): what parallelize() changes in place is reverted, what others changed since is
kept, tied parameters stay tied, and the parameters of modules a pipeline cut left off this rank are released."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_par.activation_checkpointing import checkpoint_module
from lightning_par.parallelize import OWNER_ATTR, _Owner, parallel_model_of
from lightning_par.restore import ModuleSnapshot


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)) * self.scale)


def _hooks(m: nn.Module) -> int:
    return sum(len(getattr(m, h)) for h in ("_forward_hooks", "_forward_pre_hooks", "_state_dict_pre_hooks"))


def test_restore_reverts_the_engines_changes_and_keeps_the_users() -> None:
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    snapshot = ModuleSnapshot(net)
    # What engines do in place: swap a class, register hooks, replace parameters, set attributes, replace a child.
    checkpoint_module(net.body)
    net.body[0].register_forward_pre_hook(lambda m, a: None)
    net.body[0].weight = nn.Parameter(torch.zeros(2, 4))  # a "shard"
    net.body[1].forward = lambda x: x  # type: ignore[method-assign]
    net.engine_flag = True
    original_head = net.head
    net.head = nn.Identity()
    snapshot.seal()
    # After parallelize(): the user's own hook and attribute stay; a lazily registered engine hook goes.
    net.body[0].register_forward_hook(lambda m, a, o: None)
    net.user_flag = 1
    from torch.distributed.fsdp import _fully_shard  # noqa: F401 - an engine package's function as the lazy hook

    engine_hook = torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup._register_state_dict_hooks
    net.embed.register_state_dict_pre_hook(lambda *a, **k: engine_hook)  # a lambda of this file: the user's
    net.embed._state_dict_pre_hooks[999] = engine_hook  # defined in torch.distributed: an engine's

    trained = {n: p.detach() + 1.0 for n, p in plain.named_parameters()}
    snapshot.restore(trained, {"scale": torch.full((4,), 2.0)})

    assert type(net.body) is nn.Sequential and net.head is original_head
    assert "forward" not in net.body[1].__dict__ and not hasattr(net, "engine_flag") and net.user_flag == 1
    assert len(net.body[0]._forward_pre_hooks) == 0 and len(net.body[0]._forward_hooks) == 1
    assert list(net.embed._state_dict_pre_hooks.values())[0] is not engine_hook
    assert len(net.embed._state_dict_pre_hooks) == 1
    assert net.head.weight is net.embed.weight  # still tied
    for name, p in net.named_parameters():
        assert type(p) is nn.Parameter and p.requires_grad
        torch.testing.assert_close(p, trained[name], rtol=0, atol=0)
    torch.testing.assert_close(net.scale, torch.full((4,), 2.0))
    assert [n for n, _ in net.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_seal_releases_parameters_of_modules_cut_off() -> None:
    net = Net()
    snapshot = ModuleSnapshot(net)
    layer = net.body[0]
    net.body = nn.Sequential(nn.Identity(), net.body[1])  # a "pipeline cut" drops body.0
    snapshot.seal()
    assert layer.weight is None and layer.bias is None
    values = {n: torch.zeros_like(p) for n, p in Net().named_parameters()}
    snapshot.restore(values, {})
    assert net.body[0] is layer and torch.count_nonzero(layer.weight) == 0


def test_restore_needs_seal_and_every_value() -> None:
    net = Net()
    snapshot = ModuleSnapshot(net)
    with pytest.raises(RuntimeError, match="seal"):
        snapshot.restore({}, {})
    snapshot.seal()
    with pytest.raises(KeyError, match="embed.weight"):
        snapshot.restore({}, {})


def test_owner_record_is_not_copied() -> None:
    net = Net()
    net.__dict__[OWNER_ATTR] = _Owner(object())  # type: ignore[arg-type]
    assert parallel_model_of(net) is not None
    assert parallel_model_of(copy.deepcopy(net)) is None
    assert parallel_model_of(pickle.loads(pickle.dumps(net))) is None


def test_a_tree_parallelised_by_other_code_is_refused_at_restore() -> None:
    net = Net()
    snapshot = ModuleSnapshot(net)
    snapshot.foreign = "body.0.weight"  # what a DTensor parameter at recording time sets
    snapshot.seal()
    with pytest.raises(ValueError, match=r"'body.0.weight' already was a DTensor.*Build a new module"):
        snapshot.restore({}, {})
