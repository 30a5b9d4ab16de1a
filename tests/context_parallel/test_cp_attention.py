"""Context-parallel attention on gloo ranks against one process's F.scaled_dot_product_attention: outputs and the
gradients of q, k and v, for ring and Ulysses (all_to_all), causal and not, at cp=2 and cp=4, in the load-balanced
layout and with arbitrary positions; the layout helpers, the ring's pieces and the checks without processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_par.context_parallel.attention import _pieces
from lightning_par.context_parallel import (
    CPAttentionMode,
    check_ulysses_heads,
    gather_sequence,
    load_balanced_positions,
    ring_attention,
    split_sequence,
    ulysses_attention,
)
from lightning_par.launcher import init_process_group_from_env, run_distributed

pytestmark = pytest.mark.distributed

SHAPE = (2, 4, 16, 8)  # (batch, heads, seq, head_dim)
SEQ_DIM = 2
METHODS = {"ring": ring_attention, "all_to_all": ulysses_attention}
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def _inputs(dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """q, k, v (leaves that need gradients) and an upstream gradient, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(SHAPE, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]
    return qkv, torch.randn(SHAPE, generator=g, dtype=dtype)


def _max_diffs(method: str, is_causal: bool, dtype: torch.dtype, group, cp_rank: int, cp_size: int) -> dict:
    """Max abs differences of the gathered cp output and q/k/v gradients from the one-process reference."""
    (q, k, v), grad = _inputs(dtype)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    local = [split_sequence(t.detach(), cp_rank, cp_size, dim=SEQ_DIM).requires_grad_() for t in (q, k, v)]
    positions = load_balanced_positions(SHAPE[SEQ_DIM], cp_rank, cp_size)
    out = METHODS[method](*local, positions, group, is_causal=is_causal)
    out.backward(split_sequence(grad, cp_rank, cp_size, dim=SEQ_DIM))
    diffs = {"out": (gather_sequence(out.detach(), group, cp_size, dim=SEQ_DIM) - ref).abs().max().item()}
    for name, t, ref_grad in zip("qkv", local, ref_grads):
        diffs[f"d{name}"] = (gather_sequence(t.grad, group, cp_size, dim=SEQ_DIM) - ref_grad).abs().max().item()
    return diffs


def _mode_diff(group, cp_rank: int, cp_size: int) -> float:
    """A function calling F.scaled_dot_product_attention under CPAttentionMode against ring_attention called
    directly."""
    (q, k, v), _ = _inputs(torch.float32)
    local = [split_sequence(t.detach(), cp_rank, cp_size, dim=SEQ_DIM) for t in (q, k, v)]
    positions = load_balanced_positions(SHAPE[SEQ_DIM], cp_rank, cp_size)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).relu()  # relu: other functions pass through

    with CPAttentionMode("ring", group, positions):
        routed = attend(*local)
    direct = ring_attention(*local, positions, group, is_causal=True).relu()
    return (routed - direct).abs().max().item()


def _shuffled_diffs(method: str, group, cp_rank: int, cp_size: int) -> dict:
    """As :func:`_max_diffs`, causal, float64, with each rank holding an arbitrary set of positions (a random
    permutation of the sequence cut in cp pieces): no piece of the ring is all-visible or triangular, so the plain
    operators with an explicit mask run (and Ulysses' explicit mask, since the positions stay distinct but the check
    of order is exercised with a permutation)."""
    (q, k, v), grad = _inputs(torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    seq = SHAPE[SEQ_DIM]
    positions = torch.randperm(seq, generator=torch.Generator().manual_seed(1)).chunk(cp_size)[cp_rank]
    local = [t.detach()[:, :, positions].requires_grad_() for t in (q, k, v)]
    out = METHODS[method](*local, positions, group, is_causal=True)
    out.backward(grad[:, :, positions])
    diffs = {"out": (out.detach() - ref[:, :, positions]).abs().max().item()}
    for name, t, ref_grad in zip("qkv", local, ref_grads):
        diffs[f"d{name}"] = (t.grad - ref_grad[:, :, positions]).abs().max().item()
    return diffs


def _all_cases(group, cp_rank: int, cp_size: int) -> dict:
    cases = {}
    for method in METHODS:
        for is_causal in (True, False):
            for dtype in TOLERANCE:
                cases[(method, is_causal, dtype)] = _max_diffs(method, is_causal, dtype, group, cp_rank, cp_size)
        cases[(f"{method} shuffled", True, torch.float64)] = _shuffled_diffs(method, group, cp_rank, cp_size)
    return {"cases": cases, "mode": _mode_diff(group, cp_rank, cp_size)}


def _cp_worker(sub_cp: int | None) -> dict:
    """Every case over the whole world as the cp group; with ``sub_cp``, again over cp groups of that size."""
    init_process_group_from_env(timeout_s=60)
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {"world": _all_cases(None, rank, world)}
    if sub_cp is not None:
        # Every rank creates every group (new_group is collective); each uses its own: group ranks, not global ones.
        groups = [dist.new_group(list(range(s, s + sub_cp))) for s in range(0, world, sub_cp)]
        results["sub"] = _all_cases(groups[rank // sub_cp], rank % sub_cp, sub_cp)
    return results


def _check(results: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        for scope, r in per_rank.items():
            assert r["mode"] == 0.0, (rank, scope, r["mode"])
            for (method, is_causal, dtype), diffs in r["cases"].items():
                bad = {k: d for k, d in diffs.items() if not d <= TOLERANCE[dtype]}
                assert not bad, (rank, scope, method, is_causal, dtype, bad)


def test_cp2_matches_one_process():
    _check(run_distributed(_cp_worker, 2, (None,), timeout_s=240))


def test_cp4_and_cp2_subgroups_match_one_process():
    _check(run_distributed(_cp_worker, 4, (2,), timeout_s=300))


# --------------------------------------------------------------------------------------------------------------------
# Without processes


def test_load_balanced_positions_cp2():
    assert load_balanced_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 1, 2).tolist() == [2, 3, 4, 5]


def test_positions_of_all_ranks_cover_the_sequence_once():
    held = torch.cat([load_balanced_positions(24, r, 3) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))


def test_split_sequence_takes_the_two_chunks_along_dim():
    t = torch.arange(16).reshape(2, 8)
    assert split_sequence(t, 1, 2, dim=1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_seq_len_not_divisible_names_both_numbers():
    with pytest.raises(ValueError, match=r"seq_len=10 .*2 \* cp_size = 4"):
        load_balanced_positions(10, 0, 2)
    with pytest.raises(ValueError, match="seq_len=12"):
        split_sequence(torch.zeros(1, 12), 0, 4)


def test_ulysses_heads_not_divisible_names_the_sizes():
    check_ulysses_heads(8, 2, 4)
    with pytest.raises(ValueError, match=r"n_head=6 .*cp_size \* tp_size = 4 \* 1"):
        check_ulysses_heads(6, 4)
    with pytest.raises(ValueError, match=r"n_head=8 .*= 2 \* 8"):
        check_ulysses_heads(8, 2, tp_size=8)


def test_mode_rejects_a_mask_dropout_and_an_unknown_method():
    q = torch.zeros(1, 2, 4, 8)
    mode = CPAttentionMode("ring", None, torch.arange(4))
    with mode, pytest.raises(ValueError, match="attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with mode, pytest.raises(ValueError, match="dropout_p=0.1: set attention dropout to 0"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="method='tree'"):
        CPAttentionMode("tree", None, torch.arange(4))


def test_ring_pieces_in_the_load_balanced_layout_need_no_mask():
    """The own block is one triangle; every other block one or two all-visible pieces, or none; together they cover
    exactly the pairs a causal mask allows."""
    seq, cp = 32, 4
    positions = [load_balanced_positions(seq, r, cp) for r in range(cp)]
    for r in range(cp):
        q_pos = positions[r]
        for j in range(cp):
            pieces = _pieces(q_pos, positions[j], is_causal=True)
            assert all(kind != "mask" for _, _, kind in pieces), (r, j, pieces)
            if j == r:
                assert pieces == [(slice(0, 8), slice(0, 8), "causal")]
            covered = torch.zeros(8, 8, dtype=torch.bool)
            for qs, ks, kind in pieces:
                assert not covered[qs, ks].any()
                block = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.bool)
                covered[qs, ks] = block.tril() if kind == "causal" else block
            assert torch.equal(covered, positions[j].unsqueeze(0) <= q_pos.unsqueeze(1)), (r, j)


def test_ring_pieces_fall_back_to_a_mask_and_skip_what_no_query_sees():
    assert _pieces(torch.tensor([3, 1]), torch.tensor([0, 2]), is_causal=True) == [
        (slice(0, 1), slice(0, 2), "full"), (slice(1, 2), slice(0, 1), "full")]
    assert _pieces(torch.tensor([0, 1]), torch.tensor([2, 3]), is_causal=True) == []
    unordered = _pieces(torch.tensor([2, 0, 3]), torch.tensor([2, 0, 3]), is_causal=True)
    assert [kind for _, _, kind in unordered] == ["full", "mask", "mask", "causal"]  # q and k cut at [2] / [0, 3]
    assert _pieces(torch.tensor([0, 1]), torch.tensor([2, 3]), is_causal=False) == [
        (slice(0, 2), slice(0, 2), "full")]
