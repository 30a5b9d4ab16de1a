"""The ep benchmark's formula and table, without processes."""

from lightning_par.benchmarks.expert_parallel import formula_bytes, render


def test_formula_counts_dispatch_and_combine_forward_and_backward():
    # 2 MoE layers, 512 tokens, top-2, width 128, fp32: at ep2 half of the routed copies leave the rank
    assert formula_bytes(2, moe_layers=2, tokens=512, top_k=2, dim=128) == 4 * 2 * 512 * 2 * 128 * 4 // 2
    assert formula_bytes(1, moe_layers=2, tokens=512, top_k=2, dim=128) == 0
    assert formula_bytes(4, moe_layers=1, tokens=8, top_k=1, dim=2) == 4 * 8 * 2 * 4 * 3 // 4


def test_table_gives_ratios_against_ep1_of_the_same_launch():
    cfg = dict(n_layer=4, n_head=4, n_embd=8, block_size=4, vocab_size=16, num_experts=4, moe_every=2)
    rows = [{"world": 2, "ep": 1, "wall_s": 0.1, "sent": 0, "expert_bytes": 400},
            {"world": 2, "ep": 2, "wall_s": 0.15, "sent": 2048, "expert_bytes": 200}]
    table = render(rows, cfg, batch=2)
    formula = formula_bytes(2, moe_layers=2, tokens=8, top_k=2, dim=8)
    assert f"| 2 | ep2 | 150.0 | 1.50 | 2048 | {formula} | {2048 / formula:.3f} | 200 | 1.000 |" in table
