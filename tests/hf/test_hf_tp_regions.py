"""Hugging Face models whose split attention or MLP holds what their plan leaves out, under tp2 and tp2+SP against one
process (issue 33's matrix cells, one launch of 2 ranks per layout; :mod:`tests.support.hf_matrix` runs and judges):

* Apertus' xIELU activation (learned scalars inside the split MLP) and Sarvam's per-head ``q_norm``/``k_norm`` (inside
  the split attention) get gradients from this rank's part only: they were 4.3e-04 and 4.4e-03 apart after 4 steps;
  now planned ``replicate_grad_sum``.
* Shared experts inside a mixture-of-experts block (a per-token module under SP): GLM-4-MoE trained 7.5e-03 apart,
  Llama 4 crashed after start (its in-place add on the row-parallel output; a flattened ``(tokens, hidden)`` input
  gathered as if it were the sequence); now whole on every tp rank like the routed experts.
* Doge's attention builds a mask for every key/value head from a row-parallel output: refused before start, naming it.

The optimizers are the matrix's (SGD with momentum and AdamW alternate over the cells).
"""

from __future__ import annotations

import pytest

from tests.support import hf_matrix as M

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

CELLS = {
    "tp2": {"apertus": "PASS", "sarvam_moe": "PASS", "doge": "refused"},
    "tp2sp": {"glm4_moe": "PASS", "llama4_text": "PASS"},
}


@pytest.mark.parametrize("layout", sorted(CELLS))
def test_split_regions_match_one_process_or_are_refused_before_start(layout: str) -> None:
    expected = CELLS[layout]
    assert {M.optimizer_of(mt, layout) for layouts in CELLS for mt in CELLS[layouts]} == {"sgd", "adamw"}
    with M.quiet():
        results = M.run_layout(layout, list(expected))
        verdicts = {mt: M.judge(mt, layout, results[mt]) for mt in expected}
    for mt, status in expected.items():
        verdict = verdicts[mt]
        assert verdict["status"] == status, f"{mt} under {layout}: {verdict}"
    if "doge" in verdicts:  # refused before the first batch, naming the module that cannot be split
        assert verdicts["doge"]["detail"].startswith("ValueError: tensor parallelism (tp_size=2) is not valid for "
                                                     "DogeForCausalLM (model_type='doge'): its split region "
                                                     "'model.layers.0.self_attn' (DogeAttention"), verdicts["doge"]
