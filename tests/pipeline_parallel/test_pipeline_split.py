"""Stage boundaries and cutting, without processes: balancing (parameter count, measured time), explicit splits,
parameter names kept, cut stages composing to the whole network, and the errors raised before training."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_par.models import GPT, GPTConfig, GPTLightningModule
from lightning_par.parallel_dims import ParallelDims
from lightning_par.contract import pipeline_layers
from lightning_par.pipeline_parallel import balance_costs, cut_network, layer_costs, plan_split
from lightning_par.pipeline_parallel.split import validate_split
from lightning_par.strategies.pipeline import PipelineStrategy
from tests.support.pipeline import RegressionDataset, SequentialModule


def brute_force(costs, parts, first=0.0, last=0.0):
    """Smallest achievable max-stage cost, by trying every set of cut points."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        loads = [sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


def load_of(costs, counts, first=0.0, last=0.0):
    loads, start = [], 0
    for n in counts:
        loads.append(sum(costs[start : start + n]))
        start += n
    loads[0] += first
    loads[-1] += last
    return max(loads)


def uneven_sequential() -> nn.Sequential:
    """Parameter counts per layer: 320, 260, 20, 20, 20."""
    widths = (4, 64, 4, 4, 4, 4)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])])


def test_balance_by_params_on_an_uneven_sequential():
    seq = uneven_sequential()
    costs, first, last = layer_costs(seq, "params")
    assert costs == [320, 260, 20, 20, 20] and first == last == 0
    assert plan_split(seq, 2) == [1, 4]  # 320 | 320
    assert plan_split(seq, 3) == [1, 1, 3]  # 320 | 260 | 60


@pytest.mark.parametrize("seed", range(20))
def test_balance_is_optimal(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=g))
    parts = int(torch.randint(1, n + 1, (1,), generator=g))
    costs = torch.randint(1, 50, (n,), generator=g).tolist()
    first, last = float(torch.randint(0, 60, (1,), generator=g)), float(torch.randint(0, 60, (1,), generator=g))
    counts = balance_costs(costs, parts, first, last)
    assert len(counts) == parts and min(counts) >= 1 and sum(counts) == n
    assert load_of(costs, counts, first, last) == brute_force(costs, parts, first, last)


def test_gpt_split_pins_embeddings_first_and_head_last():
    gpt = GPT(GPTConfig(n_layer=8, n_head=2, n_embd=32, block_size=16, vocab_size=4096))
    costs, first, last = layer_costs(gpt, "params")
    assert len(costs) == 8 and len(set(costs)) == 1
    assert first == gpt.wte.weight.numel() + gpt.wpe.weight.numel()
    assert last == gpt.lm_head.weight.numel() + sum(p.numel() for p in gpt.ln_f.parameters())
    counts = plan_split(gpt, 3)
    # 131k-parameter embedding and head outweigh ~12.7k-parameter blocks: the middle stage takes most blocks.
    assert counts == [1, 6, 1]
    assert load_of(costs, counts, first, last) == brute_force(costs, 3, first, last)
    small = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=256))
    assert plan_split(small, 2) == [2, 2]


class Sleep(nn.Module):
    """A layer whose forward takes ``ms`` milliseconds (fixed, measurable compute)."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.ms / 1000)
        return x * self.w


def test_balance_by_measured_time_uses_fairscale_profiles():
    seq = nn.Sequential(Sleep(60), Sleep(15), Sleep(15), Sleep(15), Sleep(15))
    costs, _, _ = layer_costs(seq, "time", torch.ones(2, 3), timeout_s=0.4)  # several passes: load noise averages
    assert costs[0] > 2 * max(costs[1:])  # microseconds, about 60000 vs 15000 (4x; 2x leaves room for a loaded CPU)
    # 60 | 60 ms; the next best cut, 75 | 45 ms, is 25% worse: a margin sleep jitter on a loaded CPU stays within.
    assert plan_split(seq, 2, "time", torch.ones(2, 3), timeout_s=0.4) == [1, 4]
    assert all(p.grad is None for p in seq.parameters())  # profiling leaves no gradient behind


def test_balance_by_size_needs_cuda():
    with pytest.raises(ValueError, match=r"split='size' is not valid on device cpu: fairscale's profile_sizes"):
        layer_costs(uneven_sequential(), "size", torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"split='time' profiles the layers and needs a sample input batch"):
        layer_costs(uneven_sequential(), "time")


# ---------------------------------------------------------------------------------------------------- cutting
def test_cut_gpt_keeps_names_and_composes_to_the_whole_model():
    config = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=256)
    torch.manual_seed(0)
    whole = GPT(config)
    full_names = dict(whole.named_parameters())
    x = torch.randint(0, 256, (2, 16))
    counts, h = [1, 2, 1], x
    for stage in range(3):
        torch.manual_seed(0)
        holder, (chunk,) = cut_network(GPT(config), counts, [stage])
        names = {n for n, _ in holder.named_parameters()}
        assert names < set(full_names)
        for n, p in holder.named_parameters():
            torch.testing.assert_close(p, full_names[n], rtol=0, atol=0)
        assert ("wte" in holder._modules) == (stage == 0) and ("lm_head" in holder._modules) == (stage == 2)
        assert {n for n, _ in chunk.named_parameters()} == names
        h = chunk(h)
    torch.testing.assert_close(h, whole(x), rtol=0, atol=0)


def test_cut_gpt_interleaved_holds_both_chunks():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16))
    holder, chunks = cut_network(gpt, [1, 1, 1, 1], [1, 3])  # pp_size=2, rank 1: virtual stages 1 and 3
    assert sorted(holder.blocks.keys()) == ["1", "3"] and "wte" not in holder._modules and holder.lm_head is not None
    assert [list(c.blocks.keys()) for c in chunks] == [["1"], ["3"]]
    assert chunks[0].lm_head is None and chunks[1].lm_head is holder.lm_head


def test_cut_sequential_keeps_names_and_composes():
    torch.manual_seed(0)
    seq = SequentialModule().model
    x = torch.randn(3, 8)
    expected = seq(x)
    counts = plan_split(seq, 3)
    h, seen = x, set()
    for stage in range(3):
        holder, (chunk,) = cut_network(seq, counts, [stage])
        names = {n for n, _ in holder.named_parameters()}
        assert names <= {n for n, _ in seq.named_parameters()} and not names & seen
        seen |= names
        h = chunk(h)
    assert seen == {n for n, _ in seq.named_parameters()}
    torch.testing.assert_close(h, expected, rtol=0, atol=0)


def test_module_list_splits_like_sequential():
    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
    holder, chunks = cut_network(layers, [2, 2], [1])
    assert [n for n, _ in holder.named_parameters()] == ["2.weight", "2.bias", "3.weight", "3.bias"]


# ---------------------------------------------------------------------------------------------------- errors
def test_unsupported_network():
    with pytest.raises(ValueError, match=r"a network of type Linear cannot be split into pipeline stages"):
        pipeline_layers(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "split,layers,stages,match",
    [
        ("params", 3, 4, r"the model has 3 layers but the pipeline has 4 virtual stages: expected at least one layer"),
        ([2, 1], 4, 2, r"split=\[2, 1\] does not cover the model: its layer counts add up to 3 but the model has 4"),
        ([2, 2, 0], 4, 3, r"split=\[2, 2, 0\] is not valid: every virtual stage needs at least one layer"),
        ([2, 2], 4, 4, r"split=\[2, 2\] has 2 entries but the pipeline has 4 virtual stages"),
        ("even", 4, 2, r"split='even' is not valid: expected one of \['params', 'time', 'size'\]"),
        ([1.5, 2.5], 4, 2, r"expected one of .* or a list of integer layer counts"),
    ],
)
def test_validate_split_errors(split, layers, stages, match):
    with pytest.raises(ValueError, match=match):
        validate_split(split, layers, stages)


def _connected(module, **options) -> PipelineStrategy:
    strategy = PipelineStrategy(**options)
    strategy.connect(module)
    return strategy


def test_strategy_checks_the_model_before_the_process_group():
    """validate_model runs in setup_environment before the process group starts; called directly here."""
    module = GPTLightningModule(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    with pytest.raises(ValueError, match=r"the model has 2 layers but the pipeline has 4 virtual stages \(pp_size=4 x"):
        _connected(module, pp_size=4).validate_model(ParallelDims(pp_size=4, world_size=4))
    message = r"the model has 2 layers but the pipeline has 4 virtual stages \(pp_size=2 x virtual_stages=2\)"
    with pytest.raises(ValueError, match=message):
        _connected(module, pp_size=2, schedule="interleaved_1f1b", num_microbatches=2).validate_model(
            ParallelDims(pp_size=2, world_size=2)
        )
    with pytest.raises(ValueError, match=r"split=\[1, 2\] does not cover the model"):
        _connected(module, pp_size=2, split=[1, 2]).validate_model(ParallelDims(pp_size=2, world_size=2))
    _connected(module, pp_size=2, split=[1, 1]).validate_model(ParallelDims(pp_size=2, world_size=2))


def test_strategy_needs_a_loss_fn_and_a_splittable_network():
    module = SequentialModule()
    module.loss_fn = None
    with pytest.raises(ValueError, match=r"pipelining needs SequentialModule.loss_fn\(outputs, targets\)"):
        _connected(module).validate_model(ParallelDims(pp_size=2, world_size=2))
    with pytest.raises(ValueError, match=r"module_attr='net' is not valid for SequentialModule under pipelining"):
        _connected(SequentialModule(), module_attr="net").validate_model(ParallelDims(pp_size=2, world_size=2))


def test_batch_size_not_divisible_is_refused_before_the_first_step():
    module = SequentialModule()
    strategy = _connected(module, num_microbatches=4)
    module._trainer = SimpleNamespace(train_dataloader=DataLoader(RegressionDataset(), batch_size=6))
    with pytest.raises(ValueError, match=r"batch_size=6 is not valid with num_microbatches=4: expected a batch size"):
        strategy.on_train_start()
    module._trainer = SimpleNamespace(train_dataloader=DataLoader(RegressionDataset(), batch_size=8))
    strategy.on_train_start()


def test_plan_split_by_explicit_counts():
    seq = nn.Sequential(OrderedDict((str(i), nn.Linear(2, 2)) for i in range(5)))
    assert plan_split(seq, 2, [4, 1]) == [4, 1]
