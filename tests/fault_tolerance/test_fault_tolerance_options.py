"""``strategy.fault_tolerance.*``: validated fields, refusals of what the fault-tolerant replicate axis does not
compose with (before any process starts), and a missing lighthouse named within ``connect_timeout_s``."""

from __future__ import annotations

import socket
import time

import pytest

from lightning_par.fault_tolerance import FaultToleranceOptions, check_lighthouse
from lightning_par.strategies.base import MeshStrategy
from tests.support.helpers import quiet_trainer
from tests.support.user_models import make_mlp
from tests.support.ft import regression_dataset

ON = dict(enabled=True, lighthouse="http://127.0.0.1:1")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(replica_group_id=2, num_replica_groups=2), "replica_group_id=2"),
        (dict(min_replicas=3, num_replica_groups=2), "min_replicas=3"),
        (dict(num_replica_groups=0), "num_replica_groups"),
        (dict(step_timeout_s=0), "step_timeout_s"),
        (dict(enabled="yes"), "enabled"),
        (dict(lighthouse="nohost"), "lighthouse='nohost'"),
    ],
)
def test_invalid_fields_are_named(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FaultToleranceOptions(**fields)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(pp_size=2), "pp_size=2 is not valid with fault_tolerance.*tensor parallelism \\(tp_size\\) run"),
        (dict(cp_size=2), "cp_size=2 is not valid with fault_tolerance"),
        (dict(dp_replicate_size=2), "dp_replicate_size=2 is not valid with fault_tolerance.*num_replica_groups"),
    ],
)
def test_what_does_not_compose_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MeshStrategy(fault_tolerance=ON, **kwargs)


def test_options_without_enabled_are_refused() -> None:
    given = r"\['lighthouse', 'min_replicas', 'num_replica_groups'\] are given but fault_tolerance.enabled=False"
    with pytest.raises(ValueError, match=given):
        MeshStrategy(fault_tolerance=dict(lighthouse="http://h:1", min_replicas=2, num_replica_groups=2))


def test_the_group_is_given_nested_only() -> None:
    """``enabled`` is a field of compile, float8 and fault_tolerance: flat, it would say nothing."""
    a = MeshStrategy(dp_mode="zero2", fault_tolerance=dict(enabled=True, lighthouse="http://h:1", num_replica_groups=3,
                                                           replica_group_id=2))
    assert a.options.fault_tolerance.replica_group_id == 2 and a.options.fault_tolerance.num_replica_groups == 3
    with pytest.raises(ValueError, match=r"lighthouse='http://h:1' is not a valid option"):
        MeshStrategy(dp_mode="zero2", lighthouse="http://h:1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_lighthouse_is_named_within_the_timeout() -> None:
    address = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    named = f"No torchft lighthouse answers at fault_tolerance.lighthouse='{address}'"
    with pytest.raises(ConnectionError, match=named):
        check_lighthouse(address, 1.0)
    assert time.monotonic() - t0 < 5.0


def test_fit_with_a_missing_lighthouse_fails_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    address = f"http://127.0.0.1:{_free_port()}"
    strategy = MeshStrategy(dp_mode="ddp", fault_tolerance=dict(enabled=True, lighthouse=address,
                                                                connect_timeout_s=1.0))
    trainer = quiet_trainer(strategy, 1, max_steps=1)
    loader = __import__("torch").utils.data.DataLoader(regression_dataset(16), batch_size=4)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="connect_timeout_s=1 s"):
        trainer.fit(make_mlp(), loader)
    assert time.monotonic() - t0 < 10.0
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_no_lighthouse_address_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=r"fault_tolerance.lighthouse=None and \$TORCHFT_LIGHTHOUSE is unset"):
        FaultToleranceOptions(enabled=True).lighthouse_address()


def test_every_further_axis_is_refused() -> None:
    """Sizes of the axes registered besides dp (cp, ep, the next one) are refused the same way."""
    from lightning_par.parallel_dims import ParallelDims

    for name in ParallelDims.size_names():
        if name in ("dp_size", "dp_shard_size", "tp_size", "pp_size", "dp_replicate_size"):
            continue
        with pytest.raises(ValueError, match=f"{name}=2 is not valid with fault_tolerance.enabled=True"):
            MeshStrategy(fault_tolerance=ON, **{name: 2})


def test_diloco_needs_ddp_inside_the_group() -> None:
    with pytest.raises(ValueError, match="diloco_sync_every=4 is not valid with dp_mode='zero2'.*dp_mode='ddp'"):
        MeshStrategy(dp_mode="zero2", fault_tolerance={**ON, "diloco_sync_every": 4})
    with pytest.raises(ValueError, match="diloco_sync_every=4 is not valid with tp_size=2.*tp_size=1"):
        MeshStrategy(dp_mode="ddp", tp_size=2, fault_tolerance={**ON, "diloco_sync_every": 4})
    with pytest.raises(ValueError, match="fault_tolerance.diloco_outer_momentum"):
        FaultToleranceOptions(diloco_outer_momentum=1.5)
