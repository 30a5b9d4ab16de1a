"""One composition path for every strategy and a user's own model, and torch's six pipeline schedules, against one
process.

* A user's ``nn.Sequential`` (:class:`tests.support.user_models.ResidualMLP`, not the GPT) with its own TP plan, whose paths
  name its layers (``"1.fc1"``), trains under ``parallel_3d`` at dp2·tp2·pp2 with every dp mode (SGD with momentum,
  which unlike Adam moves twice as far on a gradient summed instead of averaged; and one AdamW run).
* Every schedule (gpipe, 1f1b, interleaved_1f1b, interleaved_zero_bubble, zbv_zero_bubble, dualpipev) trains the
  reference GPT (AdamW) and the user MLP (SGD) at pp 2 and pp 4; at dp2·pp2 with every dp mode; at dp2·tp2·pp2.
* A checkpoint saved under each strategy loads into every other strategy and layout, and into one process.

Parity: losses within ``rtol=1e-5`` of a one-process reference that sums the micro-batch gradients in the pipeline's
order (``reference_fit_microbatched``), gathered parameters within ``assert_params_close``. Each world size is one
launch.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.checkpoint import load_model_weights
from lightning_par.parallel_dims import MESH_AXES
from lightning_par.pipeline_parallel.options import SCHEDULES
from lightning_par.strategies import PipelineStrategy
from tests.support.helpers import assert_params_close, ci_params, global_losses, run_fit, running
from tests.support.p3d import make_gpt, run_plan, token_data
from tests.support.pipeline import RegressionDataset, one_thread, reference_fit_microbatched
from tests.support.user_models import DictDataset, TwoStreamModule, TwoStreamNet, make_mlp

pytestmark = pytest.mark.distributed

STEPS, MICRO = 2, 8
ZERO_BUBBLE = [s for s, spec in SCHEDULES.items() if spec.splits_backward]


def _factory(model: str):
    if model.startswith("gpt"):
        return lambda: make_gpt(int(model[3:] or 4))
    return lambda: make_mlp(optimizer=model.rsplit("-", 1)[1], depth=6 if "deep" in model else 3)


def _m(schedule: str, pp: int) -> int:
    """Micro-batches per batch: enough for every schedule (dualpipev: 2 * pp) and dividing MICRO."""
    return 2 * pp if schedule == "dualpipev" else (4 if pp == 2 else 8)


def _fit(name: str, model: str, options: dict, strategy: str = "parallel_3d") -> dict:
    return {"kind": "fit", "name": name, "model": model, "strategy": strategy, "options": options, "steps": STEPS,
            "micro_batch": MICRO}


def _dp_modes(schedule: str) -> list[tuple[str, dict]]:
    """Every dp mode valid with ``schedule`` (zero-bubble + resharding zero3 is refused: see PipelineOptions)."""
    zero3 = {"reshard_after_forward": False} if schedule in ZERO_BUBBLE else {}
    return [("ddp", {}), ("zero1", {}), ("zero2", {}), ("zero3", zero3)]


# ------------------------------------------------------------------------------------------------ cases
#: name: (model, options)
WORLD2 = {
    f"pp2-{s}-{model}": (model, dict(dp_size=1, pp_size=2, schedule=s, num_microbatches=_m(s, 2)))
    for s in SCHEDULES for model in ("gpt", "mlp-sgd")
}
WORLD4 = {
    **{f"pp4-{s}-{model}": (model, dict(dp_size=1, pp_size=4, schedule=s, num_microbatches=_m(s, 4)))
       for s in SCHEDULES for model in ("gpt8", "mlp-deep-sgd")},
    **{f"dp2pp2-{s}-{mode}": ("mlp-sgd", dict(dp_size=2, pp_size=2, schedule=s, num_microbatches=_m(s, 2),
                                               dp_mode=mode, **extra))
       for s in SCHEDULES for mode, extra in _dp_modes(s)},
}
WORLD8 = {
    # the user's nn.Sequential with its own tp plan (the model contract), every dp mode, 1F1B
    **{f"3d-user-{mode}-sgd": ("mlp-sgd", dict(dp_size=2, tp_size=2, pp_size=2, schedule="1f1b",
                                                num_microbatches=4, dp_mode=mode)) for mode in ("ddp", "zero1",
                                                                                                 "zero2", "zero3")},
    "3d-user-zero1-adamw": ("mlp-adamw", dict(dp_size=2, tp_size=2, pp_size=2, num_microbatches=4, dp_mode="zero1")),
    # every schedule at dp2·tp2·pp2
    **{f"3d-{s}-mlp": ("mlp-sgd", dict(dp_size=2, tp_size=2, pp_size=2, schedule=s, num_microbatches=_m(s, 2),
                                       dp_mode="zero2")) for s in SCHEDULES},
    **{f"3d-{s}-gpt": ("gpt", dict(dp_size=2, tp_size=2, pp_size=2, schedule=s, num_microbatches=_m(s, 2),
                                   dp_mode="ddp", sequence_parallel=True)) for s in SCHEDULES},
}


def _samples(cases: dict[str, tuple[str, dict]]) -> int:
    """Training samples of one launch (every case reads a prefix of the same data)."""
    return max(MICRO * o.get("dp_size", 1) for _, o in cases.values()) * STEPS


_S = list(SCHEDULES)
#: The cells CI runs (the rest are ``slow``): every schedule once per world with the models alternating, every dp mode
#: at dp2·pp2 (schedule i with dp mode i mod 4), at dp2·tp2·pp2 the user's model under ddp and zero3 (zero1 with
#: AdamW, zero2 in the schedule cells) and every schedule once (MLP on even, GPT on odd positions).
CI_WORLD2 = [f"pp2-{s}-{'gpt' if i % 2 == 0 else 'mlp-sgd'}" for i, s in enumerate(_S)]
CI_WORLD4 = [f"pp4-{s}-{'mlp-deep-sgd' if i % 2 == 0 else 'gpt8'}" for i, s in enumerate(_S)] + [
    f"dp2pp2-{s}-{_dp_modes(s)[i % 4][0]}" for i, s in enumerate(_S)
]
CI_WORLD8 = ["3d-user-ddp-sgd", "3d-user-zero3-sgd", "3d-user-zero1-adamw"] + [
    f"3d-{s}-{'mlp' if i % 2 == 0 else 'gpt'}" for i, s in enumerate(_S)
]


def _launch(request: pytest.FixtureRequest, world: int, cases: dict[str, tuple[str, dict]]) -> dict:
    """One launch of the cases this session runs (a ``slow`` cell deselected is not trained)."""
    wanted = running(request)
    plan = [_fit(name, model, options) for name, (model, options) in cases.items() if name in wanted]
    return run_plan(world, plan, token_data(_samples(cases)), token_data(16, seed=1), timeout_s=900)


@pytest.fixture(scope="module")
def world2(request: pytest.FixtureRequest) -> dict:
    return _launch(request, 2, WORLD2)


@pytest.fixture(scope="module")
def world4(request: pytest.FixtureRequest) -> dict:
    return _launch(request, 4, WORLD4)


@pytest.fixture(scope="module")
def world8(request: pytest.FixtureRequest) -> dict:
    return _launch(request, 8, WORLD8)


def _check(runs: list[dict], model: str, options: dict, samples: int) -> None:
    dp = options.get("dp_size", 1)
    dataset = token_data(samples) if model.startswith("gpt") else RegressionDataset(n=samples)
    with one_thread():
        ref_losses, ref_params = reference_fit_microbatched(
            _factory(model), dataset, MICRO, STEPS, options["num_microbatches"], dp
        )
    torch.testing.assert_close(torch.tensor(global_losses(runs)), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in runs:
        assert_params_close(r["state"], ref_params)


@pytest.mark.parametrize("name", ci_params(WORLD2, CI_WORLD2))
def test_every_schedule_at_pp2(world2, name):
    _check(world2[name], *WORLD2[name], _samples(WORLD2))


@pytest.mark.parametrize("name", ci_params(WORLD4, CI_WORLD4))
def test_every_schedule_at_pp4_and_every_dp_mode_at_dp2_pp2(world4, name):
    _check(world4[name], *WORLD4[name], _samples(WORLD4))


@pytest.mark.parametrize("name", ci_params(WORLD8, CI_WORLD8))
def test_user_model_and_every_schedule_at_dp2_tp2_pp2(world8, name):
    _check(world8[name], *WORLD8[name], _samples(WORLD8))


# ------------------------------------------------------------------------------------------------ checkpoints
#: name: (registry name, options) at world 4 — every strategy, each in another layout
CHECKPOINT_STRATEGIES = {
    "ddp_overlap": ("ddp_overlap", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "zero3": ("zero3", {}),
    "tensor_parallel": ("tensor_parallel", {"tp_size": 2}),
    "1f1b": ("1f1b", {"pp_size": 2, "num_microbatches": 2}),
    "parallel_3d": ("parallel_3d", {"tp_size": 2, "pp_size": 2, "dp_mode": "zero2", "num_microbatches": 2}),
}


def _next(saved: str) -> str:
    """The strategy after ``saved`` in CHECKPOINT_STRATEGIES (cyclic): CI loads each checkpoint into that one, so every
    strategy saves once and loads once, each in another layout; ``make test-slow`` loads each into every other."""
    names = list(CHECKPOINT_STRATEGIES)
    return names[(names.index(saved) + 1) % len(names)]


@pytest.fixture(scope="module")
def checkpoints(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, str]]:
    root = tmp_path_factory.mktemp("matrix")
    paths = {name: str(root / f"{name}.ckpt") for name in CHECKPOINT_STRATEGIES}
    every = running(request, "saved", "test_a_checkpoint_of_each_strategy_loads_into_every_other")
    plan = []
    for name, (registry, options) in CHECKPOINT_STRATEGIES.items():
        plan.append({"kind": "fit", "name": f"save-{name}", "model": "mlp-sgd", "strategy": registry,
                     "options": options, "steps": STEPS, "micro_batch": 4, "val": True, "save": paths[name]})
    for saved in CHECKPOINT_STRATEGIES:
        for name, (registry, options) in CHECKPOINT_STRATEGIES.items():
            if saved in every or name == _next(saved):
                plan.append({"kind": "validate", "name": f"{saved}->{name}", "model": "mlp-sgd", "strategy": registry,
                             "options": options, "micro_batch": 4, "ckpt": paths[saved]})
    return run_plan(4, plan, token_data(4 * 4 * STEPS), token_data(16, seed=1), timeout_s=900), paths


def _check_loads(checkpoints: tuple[dict, dict[str, str]], saved: str, into: list[str]) -> None:
    out, paths = checkpoints
    reference = out[f"save-{saved}"][0]["val_loss"]
    for name in into:
        losses = [r["val_loss"] for r in out[f"{saved}->{name}"]]
        assert losses == pytest.approx([reference] * len(losses), rel=1e-5), name
    module = make_mlp()
    with torch.no_grad():
        val = RegressionDataset(n=16, seed=1)
        x, y = val.x, val.y
        untrained = float(module.loss_fn(module.model(x), y))
        load_model_weights(paths[saved], module)
        one_process = float(module.loss_fn(module.model(x), y))
    assert one_process == pytest.approx(reference, rel=1e-5)
    assert abs(untrained - reference) > 1e-3  # the trained weights were really loaded


@pytest.mark.parametrize("saved", list(CHECKPOINT_STRATEGIES))
def test_a_checkpoint_of_each_strategy_loads_into_the_next_and_one_process(checkpoints, saved):
    _check_loads(checkpoints, saved, [_next(saved)])


@pytest.mark.slow
@pytest.mark.parametrize("saved", list(CHECKPOINT_STRATEGIES))
def test_a_checkpoint_of_each_strategy_loads_into_every_other(checkpoints, saved):
    _check_loads(checkpoints, saved, list(CHECKPOINT_STRATEGIES))


# ------------------------------------------------------------------------------------------------ the contract
def _two_stream() -> TwoStreamModule:
    torch.manual_seed(0)
    return TwoStreamModule()


@pytest.mark.parametrize("schedule", ["1f1b", "zbv_zero_bubble"])
def test_tuple_inputs_tuple_stage_outputs_dict_batches_and_pipeline_loss(schedule):
    """Two inputs to the first stage, a tuple between stages, dict batches mapped by ``pipeline_batch``, dict targets
    and ``pipeline_loss``: the same updates as one process on the global batch."""
    dataset, m = DictDataset(n=MICRO * STEPS), 4
    options = dict(pp_size=2, dp_size=1, schedule=schedule, num_microbatches=m)
    results = run_fit(2, lambda: PipelineStrategy(timeout_s=60, **options), _two_stream, dataset, MICRO, STEPS, None,
                      lambda module, strategy: strategy.full_state_dict())
    module = _two_stream()
    optimizer = module.configure_optimizers()
    losses = []
    with one_thread():
        for batch in torch.utils.data.DataLoader(dataset, batch_size=MICRO):
            inputs, targets = module.pipeline_batch(batch)
            step = []
            for i in range(m):
                sl = slice(i * MICRO // m, (i + 1) * MICRO // m)
                loss = module.pipeline_loss(module.model(*(t[sl] for t in inputs)), {"y": targets["y"][sl]})
                (loss / m).backward()
                step.append(float(loss))
            losses.append(sum(step) / m)
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(torch.tensor(global_losses(results)), torch.tensor(losses), rtol=1e-5, atol=0)
    for r in results:
        assert_params_close(r["state"], dict(module.named_parameters()))


# ------------------------------------------------------------------------------------------------ configure_model
class _BuiltInConfigureModel(TwoStreamModule):
    """Builds its network in ``configure_model``, where ``self.device_mesh`` is already the strategy's mesh (as with
    Lightning's ``ModelParallelStrategy``)."""

    def __init__(self) -> None:
        super().__init__(build=False)
        self.seen_axes: tuple[str, ...] | None = None

    def configure_model(self) -> None:
        self.seen_axes = tuple(self.device_mesh.mesh_dim_names)
        if not hasattr(self, "model"):
            torch.manual_seed(0)
            self.model = TwoStreamNet()


def test_device_mesh_is_set_before_configure_model():
    dataset = DictDataset(n=MICRO * STEPS)
    results = run_fit(2, lambda: PipelineStrategy(timeout_s=60, pp_size=2, schedule="1f1b", num_microbatches=4),
                      _BuiltInConfigureModel, dataset, MICRO, STEPS, None,
                      lambda module, strategy: {"axes": module.seen_axes, "trained": len(strategy.full_state_dict())})
    for r in results:
        assert r["state"]["axes"] == MESH_AXES and r["state"]["trained"] > 0
