"""The dry run against real gloo runs at N = 8, and "will it fit" refusing a layout before any process starts.

One launch of 8 gloo processes fits one optimizer step of each layout below (every dp mode; tp, pp, cp, HSDP, ep; the
reference GPT, its MoE variant and a user's network speaking the model contract) and
counts each rank's model-state storages at the step (``tests.support.zero.StateBytesProbe``); the dry run of the same
rank, on the meta device and a fake process group (:func:`lightning_par.planner.dry_run.dry_run`), must give the same
bytes within 1%. The analytic prediction is checked against the dry run at 8, 512 and 1024 ranks in
``tests/planner/test_planner_dry_run.py``.
"""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import lightning_par.train as train
from lightning_par.config.schema import register_configs
from lightning_par.planner.dry_run import RankState, dry_run, stage_ranks
from tests.config.test_compose import CONF
from tests.support.p3d import _strategy, make_model, run_plan, token_data

pytestmark = pytest.mark.e2e

register_configs()
WORLD, MICRO = 8, 2


def _fit(name: str, model: str = "gpt", **options) -> dict:
    return {"kind": "fit", "name": name, "model": model, "strategy": "parallel_3d", "options": options,
            "steps": 1, "micro_batch": MICRO, "bytes": True}


CASES = [
    _fit("ddp-tp2-dp4", dp_mode="ddp", tp_size=2),
    _fit("zero1-tp2-pp2-dp2", dp_mode="zero1", tp_size=2, pp_size=2, schedule="1f1b", num_microbatches=2),
    _fit("zero2-cp2-tp2-dp2", dp_mode="zero2", cp_size=2, tp_size=2),
    _fit("zero3-hsdp2x2-tp2", dp_mode="zero3", dp_replicate_size=2, dp_shard_size=2, tp_size=2),
    _fit("zero1-ep2-dp8", "moegpt", dp_mode="zero1", ep_size=2),
    # a user's network with its own tp plan and stages (the model contract), SGD with momentum
    _fit("zero1-tp2-pp2-user-mlp-sgd", "mlp-sgd", dp_mode="zero1", tp_size=2, pp_size=2, schedule="1f1b",
         num_microbatches=2),
]


@pytest.fixture(scope="module")
def measured() -> dict:
    # Dry runs first, in this process: the forked gloo ranks must not inherit anything of their fake worlds (DTensor's
    # sharding cache named the fake process groups: "Could not resolve the process group registered under ...").
    for case in CASES:
        _dry(case, 0)
    return run_plan(WORLD, CASES, token_data(MICRO * WORLD), token_data(8, seed=1), timeout_s=600)


_DRY: dict[tuple[str, int], RankState] = {}


def _dry(case: dict, rank: int) -> RankState:
    """The dry run of ``case`` on ``rank`` (computed once per module)."""
    if (case["name"], rank) not in _DRY:
        strategy = _strategy(case)
        dims = strategy.resolve_parallel_dims(WORLD)
        _DRY[case["name"], rank] = dry_run(lambda: make_model(case), dims, strategy.options, rank)
    return _DRY[case["name"], rank]


def _ranks(measured: dict, case: dict) -> list[dict]:
    """The runs of rank 0, the last rank and rank 0's peer on every pipeline stage (the others repeat them)."""
    dims = _strategy(case).resolve_parallel_dims(WORLD)
    wanted = {0, WORLD - 1, *stage_ranks(dims)}
    return [run for run in measured[case["name"]] if run["rank"] in wanted]


def _compare(measured: dict, case: dict, keys: tuple[str, ...]) -> None:
    for run in _ranks(measured, case):
        state = _dry(case, run["rank"])
        got = run["bytes"]
        for key in keys:
            assert getattr(state, key) == pytest.approx(got[key], rel=0.01), (run["rank"], key, got, state)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_dry_run_param_and_optimizer_bytes_equal_a_real_gloo_run_at_8(measured, case):
    _compare(measured, case, ("param_bytes", "optimizer_state_bytes"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_dry_run_gradient_bytes_equal_a_real_gloo_run_at_8(measured, case):
    """The gloo probe counts storages: a gradient that is a view of an all-reduce bucket (``ddp``, ``zero1``) counts
    the whole bucket, once; a tensor-parallel (or expert) DTensor gradient is a tensor of its own besides its bucket
    slot. So ddp/zero1 with tp hold close to twice the gradients: what the dry run reads from the buckets it built
    too."""
    for run in _ranks(measured, case):
        state = _dry(case, run["rank"])
        held = state.grad_bytes - state.grad_view_bytes + state.viewed_bucket_bytes
        assert held == pytest.approx(run["bytes"]["grad_bytes"], rel=0.01), (run["rank"], run["bytes"], state)
    if case["options"]["dp_mode"] in ("ddp", "zero1") and case["options"].get("tp_size", 1) > 1:
        assert held > 1.9 * state.grad_bytes  # the tp gradients, twice


# ----------------------------------------------------------------------------------------------- will it fit
#: 16 blocks of width 4096 (3.2 B parameters) under ddp on 8 devices: about 77 GiB per device predicted.
TOO_BIG = ["model=gpt2", "model.n_embd=4096", "model.n_head=32", "model.n_layer=16", "data=synthetic",
           "trainer=smoke", "parallel=dp8", "data.batch_size=2"]


@pytest.fixture
def _hydra():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        yield


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was about to start: the layout was not refused before start-up")

    monkeypatch.setattr(train, "run_distributed", refuse)
    monkeypatch.setattr(train, "train_worker", refuse)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


def test_a_layout_that_cannot_fit_is_refused_before_start(_hydra, no_launch, tmp_path):
    cfg = compose(config_name="config", overrides=TOO_BIG + ["planner.device=a100-40gb"])
    with pytest.raises(ValueError) as info:
        train.launch_job(cfg, tmp_path / "run")
    message = str(info.value)
    assert re.search(r"dp8·tp1·pp1 ddp .* is predicted not to fit planner.device='a100-40gb': [\d.]+ GiB on the "
                     r"fullest rank .* > 38.00 GiB usable", message), message
    assert "Largest terms: optimizer state" in message
    nearest = re.search(r"nearest layout that fits is (.*?) \(([\d.]+) GiB\): (.*)\. \(planner", message)
    assert nearest is not None and float(nearest.group(2)) <= 38.0, message
    assert "strategy=" in nearest.group(3)
    assert not (tmp_path / "run" / ".heartbeat").exists()


def test_the_nearest_layout_passes_the_check_and_no_device_means_no_check(_hydra, no_launch, tmp_path):
    cfg = compose(config_name="config", overrides=TOO_BIG + ["planner.device=a100-40gb"])
    with pytest.raises(ValueError) as info:
        train.preflight(cfg, tmp_path)
    overrides = re.search(r"nearest layout that fits is .*?: (.*)\. \(planner", str(info.value)).group(1).split()
    fitting = compose(config_name="config", overrides=TOO_BIG + overrides + ["planner.device=a100-40gb"])
    assert train.preflight(fitting, tmp_path).dims.world_size == 8
    assert train.preflight(compose(config_name="config", overrides=TOO_BIG), tmp_path).dims.world_size == 8


def test_an_unknown_device_fails_when_the_config_is_composed(_hydra):
    with pytest.raises(ConfigCompositionException, match="planner.device=h100"):
        compose(config_name="config", overrides=["planner.device=h100"])


# ----------------------------------------------------------------------------------------------- recipes/plan.py
def _plan_recipe():
    """``recipes/plan.py`` as a module (its Hydra main is not run)."""
    import importlib.util

    from tests.recipes.test_plan_recipe import ROOT

    spec = importlib.util.spec_from_file_location("plan_recipe", ROOT / "recipes" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_recipe_dry_run_prints_each_stage_next_to_the_prediction(_hydra):
    """``--dry-run-rank=5`` at 1024 ranks (GPT-2, tp 4, pp 4, zero1): rank 5 and its peers on the 4 stages, each
    within 1% of the prediction, the worst stage named (what ``python recipes/plan.py --dry-run-rank=5 ...`` prints)."""
    recipe = _plan_recipe()
    argv = ["plan.py", "--dry-run-rank=5", "model=gpt2"]
    assert recipe._pop_dry_run_flags(argv) == (True, 5) and argv == ["plan.py", "model=gpt2"]
    assert recipe._pop_dry_run_flags(["plan.py", "--dry-run"]) == (True, 0)
    with pytest.raises(ValueError, match=r"--dry-run-rank='x' is not valid: expected an integer >= 0"):
        recipe._pop_dry_run_flags(["plan.py", "--dry-run-rank=x"])
    cfg = compose(config_name="plan", overrides=[
        "model=gpt2", "parallel.world_size=1024", "parallel.tp_size=4", "parallel.pp_size=4", "strategy=parallel_3d",
        "strategy.dp_mode=zero1", "strategy.pipeline.num_microbatches=4"])
    out = recipe.dry_run_report(cfg, 5)
    assert "fake process group of 1024 ranks, dp_mode=zero1" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(5, 0), (261, 1), (517, 2), (773, 3)]
    assert all(abs(float(r[-1]) - 1.0) <= 0.01 for r in rows), out  # dry run / predicted
    assert "worst rank over the pipeline stages: rank 5 (pp 0)" in out
    with pytest.raises(ValueError, match="rank=1024 is not valid"):
        recipe.dry_run_report(cfg, 1024)


def test_plan_prints_the_given_layouts_predicted_peak_memory(_hydra):
    recipe = _plan_recipe()
    cfg = compose(config_name="plan", overrides=["model=gpt2", "parallel=tp2_dp4", "strategy=tensor_parallel"])
    from omegaconf import OmegaConf

    line = recipe._peak_line(OmegaConf.to_container(cfg, resolve=True), "a100-40gb", 8)
    assert re.fullmatch(r"Predicted peak memory per rank of the given layout dp4·tp2·pp1 ddp m=1 b=\d+ ckpt=none on "
                        r"a100-40gb: [\d.]+ GiB on the fullest rank \(model state [\d.]+ GiB at most, activations "
                        r"[\d.]+ GiB\); fits: (True|False)", line), line


def test_the_fit_check_names_a_model_it_cannot_read():
    from lightning_par.planner.fit import check_fit

    run = {"model": {"_target_": "my_pkg.MyModule"}, "parallel": {"world_size": 2}, "strategy": {"name": "ddp_overlap"}}
    with pytest.raises(ValueError, match=r"planner.device='h100-80gb': the fit check cannot read this model .* Set "
                                         r"planner.device=null to start without the check"):
        check_fit(run, "h100-80gb")


def test_the_given_layout_line_only_for_a_layout_on_the_command_line():
    recipe = _plan_recipe()
    assert not recipe._layout_given(["model=gpt2", "parallel.world_size=64", "planner.device=h100-80gb"])
    for given in ("parallel=tp2_dp4", "parallel.tp_size=4", "strategy=zero3", "strategy.dp_mode=zero1",
                  "+strategy.pipeline.schedule=1f1b"):
        assert recipe._layout_given(["model=gpt2", given]), given
