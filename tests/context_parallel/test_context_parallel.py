"""Context parallelism against one process: the sequence split over cp ranks (causal load balancing), ring and
all-to-all attention, alone and with every dp mode, tensor parallelism and pipelining (1F1B).

Models: the reference GPT (AdamW) and a user's causal LM with post-norm layers, learned positions read from
``position_ids``, its own tensor-parallel plan and pipeline stages (:class:`tests.support.user_models.AttentionLM`, SGD with
momentum and AdamW). Each rank's loss is the
mean over the tokens it holds, every rank holds as many, so the global batch's loss is the mean over the (dp, cp)
ranks; it must match one process on the whole batch (``rtol=1e-5``), and the gathered parameters too.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.parallel_dims import ParallelDims
from tests.support.helpers import assert_params_close, reference_fit
from tests.support.p3d import make_gpt, run_plan, token_data
from tests.support.pipeline import reference_fit_microbatched
from tests.support.user_models import make_attention_lm

pytestmark = pytest.mark.distributed

STEPS, MICRO = 3, 2
METHODS = ("ring", "all_to_all")


def _fit(name: str, model: str, **options) -> dict:
    return {"kind": "fit", "name": name, "model": model, "strategy": "parallel_3d", "options": options,
            "steps": STEPS, "micro_batch": MICRO}


WORLD2 = {f"cp2-{model}-{m}": _fit(f"cp2-{model}-{m}", model, cp_size=2, method=m)
          for model in ("gpt", "attn-sgd", "attn-adamw") for m in METHODS}
BF16 = {f"cp2-bf16-{model}-{m}": {**_fit(f"cp2-bf16-{model}-{m}", model, cp_size=2, method=m),
                                  "precision": "bf16-mixed"} for model in ("gpt", "attn-sgd") for m in METHODS}
WORLD4 = {
    **{f"cp4-{model}-{m}": _fit(f"cp4-{model}-{m}", model, cp_size=4, method=m)
       for model, m in (("gpt", "ring"), ("attn-sgd", "ring"), ("attn-sgd", "all_to_all"))},
    **{f"cp2dp2-{mode}-attn-sgd": _fit(f"cp2dp2-{mode}-attn-sgd", "attn-sgd", cp_size=2, dp_size=2, dp_mode=mode)
       for mode in ("ddp", "zero1", "zero2", "zero3")},
    "cp2dp2-zero3-gpt-all_to_all": _fit("cp2dp2-zero3-gpt-all_to_all", "gpt", cp_size=2, dp_size=2, dp_mode="zero3",
                                        method="all_to_all"),
    "cp2tp2-sp-gpt-ring": _fit("cp2tp2-sp-gpt-ring", "gpt", cp_size=2, tp_size=2, sequence_parallel=True),
    "cp2tp2-sp-gpt-h4-all_to_all": _fit("cp2tp2-sp-gpt-h4-all_to_all", "gpt-h4", cp_size=2, tp_size=2,
                                        sequence_parallel=True, method="all_to_all"),
    **{f"cp2pp2-1f1b-gpt-{m}": _fit(f"cp2pp2-1f1b-gpt-{m}", "gpt", cp_size=2, pp_size=2, schedule="1f1b",
                                    num_microbatches=2, method=m) for m in METHODS},
    # the user's model (4 heads: all-to-all splits them over cp x tp = 4) with its own plan and pipeline stages
    **{f"cp2tp2-attn-sgd-{m}": _fit(f"cp2tp2-attn-sgd-{m}", "attn-sgd", cp_size=2, tp_size=2, method=m)
       for m in METHODS},
    **{f"cp2pp2-1f1b-attn-sgd-{m}": _fit(f"cp2pp2-1f1b-attn-sgd-{m}", "attn-sgd", cp_size=2, pp_size=2,
                                         schedule="1f1b", num_microbatches=2, method=m) for m in METHODS},
    **{f"cp2dp2-{mode}-gpt-ring": _fit(f"cp2dp2-{mode}-gpt-ring", "gpt", cp_size=2, dp_size=2, dp_mode=mode)
       for mode in ("ddp", "zero1", "zero2")},
    "cp2dp2-zero2-attn-adamw-all_to_all": _fit("cp2dp2-zero2-attn-adamw-all_to_all", "attn-adamw", cp_size=2,
                                               dp_size=2, dp_mode="zero2", method="all_to_all"),
}


def _samples() -> int:
    return MICRO * 2 * STEPS


WORLD8 = {
    **{f"dp2cp2tp2-{mode}-gpt": _fit(f"dp2cp2tp2-{mode}-gpt", "gpt", dp_size=2, cp_size=2, tp_size=2,
                                     sequence_parallel=True, dp_mode=mode) for mode in ("zero1", "zero3")},
    "cp2tp2pp2-1f1b-gpt": _fit("cp2tp2pp2-1f1b-gpt", "gpt", cp_size=2, tp_size=2, pp_size=2, schedule="1f1b",
                               num_microbatches=2, sequence_parallel=True),
    "dp2cp2tp2-zero2-gpt-h4-all_to_all": _fit("dp2cp2tp2-zero2-gpt-h4-all_to_all", "gpt-h4", dp_size=2, cp_size=2,
                                              tp_size=2, sequence_parallel=True, dp_mode="zero2", method="all_to_all"),
    "dp2cp2tp2-zero1-attn-sgd-all_to_all": _fit("dp2cp2tp2-zero1-attn-sgd-all_to_all", "attn-sgd", dp_size=2,
                                                cp_size=2, tp_size=2, dp_mode="zero1", method="all_to_all"),
    "cp2tp2pp2-1f1b-attn-sgd-all_to_all": _fit("cp2tp2pp2-1f1b-attn-sgd-all_to_all", "attn-sgd", cp_size=2,
                                               tp_size=2, pp_size=2, schedule="1f1b", num_microbatches=2,
                                               method="all_to_all"),
}


@pytest.fixture(scope="module")
def world2() -> dict:
    cases = [*WORLD2.values(), *BF16.values()]
    return run_plan(2, cases, token_data(_samples()), token_data(8, seed=1), timeout_s=900)


@pytest.fixture(scope="module")
def world8() -> dict:
    return run_plan(8, list(WORLD8.values()), token_data(_samples()), token_data(8, seed=1), timeout_s=900)


#: the world-4 case that saves a checkpoint (parameters sharded by zero3 over dp_shard x cp = 4 ranks), and the
#: layouts it is then validated under: none of them has cp, or the same sharding
SAVER = "cp2dp2-zero3-gpt-all_to_all"
RELOAD = {"reload-dp2-ddp": dict(dp_size=2), "reload-cp2-zero2": dict(cp_size=2, dp_mode="zero2")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cp") / "cp2dp2.ckpt")


@pytest.fixture(scope="module")
def world4(checkpoint) -> dict:
    WORLD4[SAVER]["save"] = checkpoint
    return run_plan(4, list(WORLD4.values()), token_data(_samples()), token_data(8, seed=1), timeout_s=900)


@pytest.fixture(scope="module")
def reloaded(world4, checkpoint) -> dict:
    plan = [{"kind": "validate", "name": name, "micro_batch": MICRO, "ckpt": checkpoint, "options": options}
            for name, options in RELOAD.items()]
    return run_plan(2, plan, token_data(_samples()), token_data(8, seed=1), timeout_s=900)


def _factory(model: str):
    if model.startswith("gpt"):
        from tests.support.p3d import make_model

        return lambda: make_model({"model": model})
    return lambda: make_attention_lm(optimizer=model.rsplit("-", 1)[1])


def _check(runs: list[dict], case: dict) -> None:
    options = case["options"]
    world = len(runs)
    dims = ParallelDims(dp_size=options.get("dp_size", -1), tp_size=options.get("tp_size", 1),
                        pp_size=options.get("pp_size", 1), cp_size=options["cp_size"], world_size=world)
    one_per_piece = {}
    for r in runs:  # one rank per (dp, cp) piece of the global batch: tp ranks hold the same loss
        c = dims.coordinates(r["rank"])
        one_per_piece.setdefault((c["dp"], c["cp"]), r["losses"])
    losses = [sum(v[i] for v in one_per_piece.values()) / len(one_per_piece) for i in range(STEPS)]
    if options.get("pp_size", 1) > 1:  # the micro-batches' gradients summed in the pipeline's order
        ref_losses, ref_params = reference_fit_microbatched(
            _factory(case["model"]), token_data(_samples()), MICRO, STEPS, options["num_microbatches"], dims.dp_size
        )
    else:
        ref_losses, ref_params = reference_fit(_factory(case["model"]), token_data(_samples()),
                                               MICRO * dims.dp_size, STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in runs:
        assert_params_close(r["state"], ref_params)
        # each rank held 1/cp of every sequence (16 tokens), with the method asked for
        assert r["extras"]["cp_tokens_per_sequence"] == 16 // options["cp_size"]
        assert r["extras"]["cp_method"] == options.get("method", "ring")


@pytest.mark.parametrize("name", list(WORLD2))
def test_cp2_matches_one_process(world2, name):
    _check(world2[name], WORLD2[name])


@pytest.mark.parametrize("name", list(WORLD4))
def test_cp4_and_cp_with_dp_modes_and_tp_match_one_process(world4, name):
    _check(world4[name], WORLD4[name])


@pytest.mark.parametrize("name", list(BF16))
def test_bf16_mixed_through_cp(world2, name):
    """bf16-mixed against one process in bf16-mixed, at the tolerance of the other strategies' half-precision runs
    where a reduction order differs (tests/core/test_techniques.py): the ring merges blocks' partial softmax
    results in fp32 where one process computes one softmax, so losses within ``u = 2**-8`` and parameters' updates
    within ``2**-4`` relative."""
    from tests.core.test_techniques import HALF_LOSS_RTOL, HALF_UPDATE_RTOL
    from tests.support.precision import reference_fit_precision

    case, runs = BF16[name], world2[name]
    ref_losses, ref_params, initial = reference_fit_precision(
        _factory(case["model"]), token_data(_samples()), MICRO, STEPS, 1, 1, "bf16-mixed"
    )
    losses = [sum(v) / len(v) for v in zip(*(r["losses"] for r in runs))]
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=HALF_LOSS_RTOL, atol=0)
    for r in runs:
        assert r["extras"]["precision"] == "bf16-mixed"
        diff = sum(((r["state"][k].double() - ref_params[k].double()) ** 2).sum() for k in ref_params) ** 0.5
        update = sum(((ref_params[k].double() - initial[k].double()) ** 2).sum() for k in ref_params) ** 0.5
        assert diff / update <= HALF_UPDATE_RTOL, (float(diff / update), r["rank"])


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(WORLD8))
def test_world8_dp2_cp2_tp2_and_cp2_tp2_pp2_match_one_process(world8, name):
    _check(world8[name], WORLD8[name])


@pytest.mark.parametrize("name", list(RELOAD))
def test_a_checkpoint_saved_under_cp_loads_into_other_layouts_and_one_process(world4, reloaded, checkpoint, name):
    from tests.support.p3d import reference_val_loss

    trained = world4[SAVER][0]["state"]
    expected = reference_val_loss(trained, token_data(8, seed=1))
    assert reference_val_loss(None, token_data(8, seed=1), path=checkpoint) == pytest.approx(expected, rel=1e-6)
    for r in reloaded[name]:
        assert r["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_mesh_strategy_with_cp_size_under_a_plain_trainer():
    """``Trainer(strategy=MeshStrategy(cp_size=2))`` on the user's LM: the same losses and parameters as one process."""
    from lightning_par.strategies import MeshStrategy
    from tests.support.helpers import run_fit

    runs = run_fit(2, lambda: MeshStrategy(cp_size=2, timeout_s=60), lambda: make_attention_lm("sgd"),
                   token_data(_samples()), MICRO, STEPS, None, lambda module, strategy: strategy.full_state_dict())
    ref_losses, ref_params = reference_fit(lambda: make_attention_lm("sgd"), token_data(_samples()), MICRO, STEPS)
    losses = [sum(v) / 2 for v in zip(*(r["losses"] for r in runs))]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in runs:
        assert_params_close(r["state"], ref_params)
        assert r["extras"]["cp_size"] == 2 and r["extras"]["cp_tokens_per_sequence"] == 8


def test_the_pipeline_preset_takes_cp_with_no_edit_of_its_own():
    """``PipelineStrategy(cp_size=2, pp_size=2)``: a preset accepts every axis added on the registry (it excludes only
    ``tp``), and runs it through the same ``parallelize()`` path: the user's LM at one process's losses and
    parameters (SGD with momentum, 1F1B over 2 micro-batches)."""
    from lightning_par.strategies import PipelineStrategy
    from tests.support.helpers import run_fit

    case = {"model": "attn-sgd", "options": {"cp_size": 2, "pp_size": 2, "num_microbatches": 2}}
    runs = run_fit(4, lambda: PipelineStrategy(cp_size=2, pp_size=2, schedule="1f1b", num_microbatches=2,
                                               timeout_s=60),
                   _factory("attn-sgd"), token_data(_samples()), MICRO, STEPS, None,
                   lambda module, strategy: strategy.full_state_dict())
    _check(runs, case)
