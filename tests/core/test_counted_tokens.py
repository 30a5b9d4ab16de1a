"""Which targets a token-mean loss counts (``lightning_par.contract.batch_counted_tokens``): the weight of a rank's
loss among the dp replicas and cp ranks of a label-masked batch."""

from __future__ import annotations

import torch
from torch import nn

from lightning_par.contract import batch_counted_tokens


class _Plain(nn.Module):
    pass


class _Mapped(nn.Module):
    def pipeline_batch(self, batch):
        return batch["ids"], batch["answer"]


def test_targets_of_tuple_mapping_and_pipeline_batch_are_counted_without_ignore_index():
    y = torch.tensor([[-100, -100, 3, 4], [-100, 5, 6, -100]])
    x = torch.zeros_like(y)
    assert batch_counted_tokens(_Plain(), (x, y)) == 4.0
    assert batch_counted_tokens(_Plain(), (x, y, torch.arange(4))) == 4.0  # cp's (x, y, position_ids)
    assert batch_counted_tokens(_Plain(), {"input_ids": x, "labels": y}) == 4.0
    assert batch_counted_tokens(_Mapped(), {"ids": x, "answer": y[:1]}) == 2.0


def test_no_integer_targets_or_an_opt_out_weigh_every_rank_alike():
    x = torch.zeros(2, 4)
    assert batch_counted_tokens(_Plain(), (x, torch.randn(2, 4))) == 1.0  # a regression target
    assert batch_counted_tokens(_Plain(), x) == 1.0  # no (inputs, targets) pair
    module = _Plain()
    module.token_mean_loss = False  # a summed or per-sample loss
    assert batch_counted_tokens(module, (x, torch.full((2, 4), -100))) == 1.0
    assert batch_counted_tokens(_Plain(), (x, torch.full((2, 4), -100))) == 0.0  # nothing counted


def test_a_mapping_batch_the_pipeline_batch_cannot_read_falls_back_to_its_labels():
    class _Tuples(nn.Module):  # a pipeline_batch written for (x, y) batches
        def pipeline_batch(self, batch):
            x, y = batch
            return x, y

    y = torch.tensor([[-100, 1, 2]])
    assert batch_counted_tokens(_Tuples(), {"input_ids": torch.zeros_like(y), "labels": y}) == 2.0
