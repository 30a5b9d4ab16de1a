"""The learning-rate scaling rule (Goyal et al. 2017) and its callback, without processes."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from lightning_par.callbacks import LRScalingCallback
from lightning_par.callbacks.lr_scaling import SCALE_KEY
from lightning_par.lr_scaling import check_lr_scaling, lr_scale_factor, warmup_multiplier, warmup_steps


@pytest.mark.parametrize(("rule", "factor"), [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_factor_of_each_rule(rule, factor):
    assert lr_scale_factor(rule, global_batch=64, reference_batch=16) == factor


def test_a_dp_sweep_keeps_the_per_sample_warmup():
    """dp 1, 2, 4 with the same warm-up in samples: the multiplier is the same function of samples seen."""
    warmup_samples, micro = 96, 8
    for dp in (1, 2, 4):
        batch = micro * dp
        steps = warmup_steps(warmup_samples, batch)
        assert steps == math.ceil(96 / batch)
        for step in range(steps + 2):
            seen = (step + 1) * batch
            assert warmup_multiplier(step, steps) == pytest.approx(min(1.0, seen / warmup_samples))
    assert warmup_multiplier(0, 0) == 1.0 and warmup_multiplier(5, 3) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rule": "cubic"}, r"lr_scaling.rule='cubic' is not valid: expected one of \['none', 'linear', 'sqrt'\]"),
     ({"reference_batch": 0}, "lr_scaling.reference_batch=0 is not valid"),
     ({"reference_batch": True}, "lr_scaling.reference_batch=True is not valid"),
     ({"warmup_samples": -1}, "lr_scaling.warmup_samples=-1 is not valid")],
)
def test_bad_options_name_the_field(kwargs, match):
    options = {"rule": "linear", "reference_batch": None, "warmup_samples": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        check_lr_scaling(**options, prefix="lr_scaling.")
    with pytest.raises(ValueError, match=match.replace("lr_scaling.", "")):
        LRScalingCallback(**options)


def _trainer(world: int, accumulate: int, step_lr: bool = True):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.01}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)  # halves the rate every step
    trainer = SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)],
                              accumulate_grad_batches=accumulate, world_size=world, global_step=0,
                              strategy=SimpleNamespace())
    module = SimpleNamespace(logged={}, log=lambda name, value, **kw: module.logged.__setitem__(name, value))
    return trainer, module, optimizer, scheduler


def test_callback_scales_every_group_warms_up_and_leaves_the_scheduler_in_charge():
    trainer, module, optimizer, scheduler = _trainer(world=2, accumulate=2)
    callback = LRScalingCallback("linear", reference_batch=4, warmup_samples=48)
    batch = (torch.zeros(6, 2), torch.zeros(6))  # global batch 6 * 2 replicas * 2 accumulated = 24: k = 6
    during, after = [], []
    for step in range(4):
        trainer.global_step = step
        for micro in range(2):
            callback.on_train_batch_start(trainer, module, batch, 2 * step + micro)
        if step == 0:  # after the callback's own hooks: sees the rate the step uses
            optimizer.register_step_pre_hook(lambda o, a, k: during.append([g["lr"] for g in o.param_groups]))
        optimizer.step(lambda: callback.on_before_optimizer_step(trainer, module, optimizer))  # as Lightning
        after.append([g["lr"] for g in optimizer.param_groups])  # restored before the scheduler steps
        scheduler.step()
    assert callback.global_batch == 24 and callback.factor == 6.0 and callback.num_warmup_steps == 2
    scheduled = [[base * 6 * 0.5 ** s for base in (0.1, 0.01)] for s in range(4)]
    expected = [[lr * min(1.0, (s + 1) / 2) for lr in scheduled[s]] for s in range(4)]
    torch.testing.assert_close(torch.tensor(during), torch.tensor(expected))
    torch.testing.assert_close(torch.tensor(after), torch.tensor(scheduled))
    assert module.logged["lr_effective"] == pytest.approx(expected[-1][0]) and module.logged["global_batch"] == 24
    extras = callback.summary_extras()
    assert extras["lr_after_warmup"] == pytest.approx(expected[1]) and extras["lr_last"] == pytest.approx(expected[3])
    assert extras["lr_reference_batch"] == 4 and extras["micro_batch"] == 6
    callback.teardown(trainer, module, "fit")
    assert not callback._handles


def test_a_resumed_optimizer_is_not_scaled_twice_and_reference_defaults_to_one_replica():
    trainer, module, optimizer, scheduler = _trainer(world=4, accumulate=1)
    for group in optimizer.param_groups:  # as restored from a checkpoint of a scaled run
        group["lr"] *= 4.0
        group[SCALE_KEY] = 4.0
    scheduler.base_lrs = [b * 4.0 for b in scheduler.base_lrs]
    callback = LRScalingCallback("linear")  # reference: one replica's micro-batch, so k = dp_size = 4
    callback.on_train_batch_start(trainer, module, {"x": torch.zeros(3, 2)}, 0)
    assert callback.factor == 4.0
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.4, 0.04])
    assert scheduler.base_lrs == pytest.approx([0.4, 0.04])


def test_a_batch_without_tensors_is_refused():
    trainer, module, *_ = _trainer(world=1, accumulate=1)
    with pytest.raises(ValueError, match="cannot count the samples of a batch of type str"):
        LRScalingCallback("sqrt").on_train_batch_start(trainer, module, "text", 0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [(["lr_scaling.rule=quadratic"], "lr_scaling.rule='quadratic' is not valid"),
     (["lr_scaling.warmup_samples=-4"], "lr_scaling.warmup_samples=-4 is not valid"),
     (["lr_scaling.warmup_samples=64"], r"both would warm the learning rate up. Set model.warmup_steps=0"),
     (["profile=true", "profile_steps=0"], "profile_steps=0 is not valid")],
)
def test_the_recipe_refuses_bad_scaling_and_profiling_options_before_any_process(overrides, match):
    from lightning_par.train import validate_run

    cfg = _composer()(["model=tiny", *overrides])
    with pytest.raises(ValueError, match=match):
        validate_run(cfg)
    # the per-sample warm-up alone is fine
    validate_run(_composer()(["model=tiny", "model.warmup_steps=0", "lr_scaling.rule=sqrt",
                              "lr_scaling.warmup_samples=64"]))


@functools.cache
def _composer():
    """``hydra.compose`` of conf/config.yaml with ``model=tiny`` composed once for the module (tests/support/compose.py;
    imported here so that collecting the module imports no Hydra)."""
    from lightning_par.config.schema import register_configs
    from tests.config.test_compose import CONF
    from tests.support.compose import Composer

    register_configs()
    return Composer(CONF)
