"""The fault-tolerance component the Lightning strategy holds (:class:`lightning_par.fault_tolerance.hooks.
FaultToleranceHooks`), without processes: disabled, every hook hands its input back; enabled, the data is split over
every replica group's dp ranks. (What the hooks do in a run: tests/fault_tolerance/test_fault_tolerance.py.)"""

from __future__ import annotations

from lightning_par.fault_tolerance.hooks import FaultToleranceHooks
from lightning_par.parallelize import ParallelOptions
from lightning_par.strategies import MeshStrategy


def test_without_fault_tolerance_every_hook_hands_its_input_back():
    hooks = FaultToleranceHooks(ParallelOptions.build("ddp", None, "none"), {"dp_size": 2})
    assert hooks.sampler_kwargs(2, 1) == {"num_replicas": 2, "rank": 1}
    batch = object()
    assert hooks.batch_to_device(None, batch, 0) is batch
    assert hooks.training_step(None, 3, (3, "x"), {"k": 1}) == (3, (3, "x"), {"k": 1})
    assert hooks.optimizer_step(None, None, lambda: "loss", lambda closure: ("stepped", closure())) == ("stepped", "loss")
    hooks.setup_environment(), hooks.on_train_start(None), hooks.teardown()
    assert hooks.replicas is None and hooks.summary() == {}


def test_with_fault_tolerance_the_data_is_split_over_every_group():
    options = ParallelOptions.build("ddp", None, "none", fault_tolerance={
        "enabled": True, "num_replica_groups": 3, "replica_group_id": 2, "lighthouse": "http://127.0.0.1:1"})
    hooks = FaultToleranceHooks(options, {"dp_size": 2})
    assert hooks.sampler_kwargs(2, 1) == {"num_replicas": 6, "rank": 5}  # group 2's dp rank 1, after 2 groups of 2


def test_the_strategy_holds_the_component():
    strategy = MeshStrategy(dp_size=1)
    assert isinstance(strategy.fault_tolerance, FaultToleranceHooks) and strategy.ft is None
