"""The planner's model-state bytes against what real gloo runs hold at world 8, for HSDP, cp and ep layouts.

One launch of 8 processes trains every case one optimizer step (fp32, AdamW: ``K = 8`` bytes of optimizer state per
parameter) and reads each rank's parameters, gradients and optimizer state (distinct storages, local shards:
:func:`~lightning_par.data_parallel.zero_memory.zero_state_bytes`). The fullest rank of each pipeline stage must match
the planner's :func:`~lightning_par.planner.memory.rank_state_bytes` within 1% (the optimizer's step counters and
ZeRO's whole rows per shard are the difference), and the fullest of all the planner's ``max_model_state_bytes``.
ZeRO shards each tensor on dim 0, so with fewer local experts than ``edp_shard`` ranks some ranks hold whole experts
and others none: the planner predicts the fullest.

The cases cover what the planner learnt: HSDP (the ZeRO shard is ``dp_shard * cp``, not ``dp``), cp (the ZeRO modes
shard over ``dp * cp``; ddp keeps a whole copy), ep (experts split ``1/ep``, their state sharded over
``edp_shard = dp_shard * cp / ep``; a MoE block's router and experts whole on every tp rank), and ep with HSDP, cp, tp
and pp at once. The planner before ep and HSDP (main at 483fb8b, the same layouts without ``dp_replicate_size`` and
``ep_size``) predicted the fullest rank of these runs 14-50% low (HSDP's state sharded over ``dp`` instead of
``dp_shard``; the experts counted as dense MLPs, sharded over ``dp * cp``).
"""

from __future__ import annotations

import pytest

from lightning_par.models import GPTConfig
from lightning_par.planner import Layout, predict
from lightning_par.planner.memory import rank_state_bytes
from lightning_par.planner.model import model_spec
from lightning_par.planner.precision import get_precision
from tests.support.p3d import CONFIG, run_plan, token_data

pytestmark = pytest.mark.distributed

MICRO = 2
MOE = GPTConfig(**{**CONFIG.__dict__, "num_experts": 4, "moe_every": 2})  # tests.support.p3d' "moegpt"
H4 = GPTConfig(**{**CONFIG.__dict__, "n_head": 4})  # "gpt-h4"


def _case(model: str, layout: Layout, **extra) -> dict:
    """A fit step of :func:`tests.support.p3d.run_step` for ``layout`` (its strategy keywords from the layout)."""
    options = {"dp_size": layout.dp_size, "tp_size": layout.tp_size, "pp_size": layout.pp_size,
               "cp_size": layout.cp_size, "ep_size": layout.ep_size, "dp_replicate_size": layout.dp_replicate_size,
               "dp_mode": layout.dp_mode, **extra}
    if layout.cp_size > 1:
        options["method"] = layout.cp_method
    if layout.pp_size > 1:
        options.update(schedule=layout.schedule, num_microbatches=layout.num_microbatches)
    return {"kind": "fit", "model": model, "strategy": "parallel_3d", "options": options, "steps": 1,
            "micro_batch": MICRO * layout.num_microbatches, "bytes": True}


#: name -> (model config, layout): HSDP, cp (ring and all-to-all), ep, and ep with HSDP, cp, tp and pp; zero1/2/3
CASES: dict[str, tuple[GPTConfig, Layout]] = {
    "hsdp2x2-tp2-zero3": (CONFIG, Layout(4, 2, 1, "zero3", dp_replicate_size=2)),
    "cp2-dp2-tp2-zero3-a2a": (H4, Layout(2, 2, 1, "zero3", cp_size=2, cp_method="all_to_all")),
    "ep2-dp8-zero2": (MOE, Layout(8, 1, 1, "zero2", ep_size=2)),
    "ep4-cp2-dp4-zero3": (MOE, Layout(4, 1, 1, "zero3", cp_size=2, ep_size=4)),
    "hsdp2x4-ep2-zero1": (MOE, Layout(8, 1, 1, "zero1", dp_replicate_size=2, ep_size=2)),
    "dp2-ep2-tp2-pp2-zero2": (MOE, Layout(2, 2, 2, "zero2", 1, 2, "1f1b", ep_size=2)),
}
_MODEL_NAME = {id(CONFIG): "gpt", id(MOE): "moegpt", id(H4): "gpt-h4"}


@pytest.fixture(scope="module")
def runs() -> dict:
    plan = [{**_case(_MODEL_NAME[id(config)], layout), "name": name} for name, (config, layout) in CASES.items()]
    return run_plan(8, plan, token_data(MICRO * 8 * 2), token_data(8, seed=1), timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_model_state_bytes_match_a_gloo_run_at_world_8(runs, name):
    config, layout = CASES[name]
    spec, fp32 = model_spec(config), get_precision("fp32")
    dims = layout.dims()
    fullest: dict[int, int] = {}  # per pipeline rank, the rank holding the most
    for r in runs[name]:
        pp_rank = dims.coordinates(r["rank"])["pp"]
        fullest[pp_rank] = max(fullest.get(pp_rank, 0), sum(r["bytes"].values()))
    for pp_rank, got in fullest.items():
        expected = rank_state_bytes(spec, layout, fp32, pp_rank)
        assert got == pytest.approx(expected, rel=0.01), (name, pp_rank, got, expected)
    largest = predict(config, layout, device="a100-80gb", precision="fp32").memory.max_model_state_bytes
    assert max(fullest.values()) == pytest.approx(largest, rel=0.01)
