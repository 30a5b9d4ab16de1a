"""Context parallelism's checks before any process starts, and its batch split (no processes)."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_par.context_parallel.batch import SequenceSplit
from lightning_par.context_parallel.options import ContextParallelOptions
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelOptions, validate
from tests.support.user_models import make_attention_lm, make_mlp
from tests.support.zero import make_gpt


def test_a_network_without_position_ids_is_refused_naming_what_to_change():
    with pytest.raises(ValueError, match=re.escape(
            "context parallelism (cp_size > 1) is not valid for Sequential: its forward takes no position_ids")):
        validate(make_mlp(), ParallelDims(cp_size=2, world_size=2), ParallelOptions.build())


def test_the_gpt_and_a_user_attention_model_pass():
    for module in (make_gpt(), make_attention_lm()):
        validate(module, ParallelDims(cp_size=2, world_size=2), ParallelOptions.build(method="all_to_all"))


def test_all_to_all_needs_heads_divisible_by_cp_times_tp():
    gpt = make_gpt()  # 2 heads
    with pytest.raises(ValueError, match=re.escape("n_head=2 is not divisible by cp_size * tp_size = 2 * 2")):
        validate(gpt, ParallelDims(cp_size=2, tp_size=2, world_size=4), ParallelOptions.build(method="all_to_all"))
    validate(gpt, ParallelDims(cp_size=2, tp_size=2, world_size=4), ParallelOptions.build(method="ring"))


def test_cp_with_pipelining_validates_and_the_gpt_maps_positions_into_its_first_stage():
    gpt = make_gpt()
    validate(gpt, ParallelDims(cp_size=2, pp_size=2, world_size=4), ParallelOptions.build(schedule="1f1b",
                                                                                          num_microbatches=2))
    x = torch.zeros(4, 8, dtype=torch.long)
    (inputs, positions), targets = gpt.pipeline_batch((x, x, torch.tensor([0, 1, 6, 7])))
    assert positions.shape == (4, 4) and positions[3].tolist() == [0, 1, 6, 7] and targets is x
    assert gpt.pipeline_batch((x, x)) == (x, x)


def test_unknown_method_names_the_valid_ones():
    with pytest.raises(ValueError, match=re.escape("method='zigzag' is not valid: expected one of ['ring', 'all_to_all']")):
        ContextParallelOptions(method="zigzag")


def test_sequence_split_keeps_chunks_i_and_2cp_minus_1_minus_i_and_appends_positions():
    x = torch.arange(16).view(2, 8)  # (batch, seq)
    y = x + 100
    label = torch.tensor([7, 9])  # not a sequence tensor: left whole
    xs, ys, ls, pos = SequenceSplit(cp_rank=1, cp_size=2)((x, y, label))
    assert pos.tolist() == [2, 3, 4, 5]
    assert xs.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]] and torch.equal(ys, xs + 100) and torch.equal(ls, label)
    out = SequenceSplit(cp_rank=0, cp_size=2)({"input_ids": x})
    assert out["position_ids"].tolist() == [0, 1, 6, 7] and out["input_ids"].tolist()[0] == [0, 1, 6, 7]
    with pytest.raises(ValueError, match="seq_len=6"):
        SequenceSplit(cp_rank=0, cp_size=2)((torch.zeros(1, 6), torch.zeros(1, 6)))
