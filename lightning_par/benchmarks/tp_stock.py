"""torch's own Megatron plan for the reference GPT, written only with torch's parallel styles: the baseline the
``tp`` benchmark compares :func:`~lightning_par.tensor_parallel.apply_tensor_parallel` with.

The plan is torchtitan's (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp``) mapped onto the GPT's
module names: the token embedding ``RowwiseParallel(input_layouts=Replicate())``, attention ``q/k/v`` and the MLP's
``c_fc`` ``ColwiseParallel``, both ``c_proj`` ``RowwiseParallel``, the LM head ``ColwiseParallel`` with logits kept
sharded on the vocabulary for ``loss_parallel``. Without sequence parallelism the norms and the position table are
left alone (plain tensors). With it, the norms are ``SequenceParallel``, the sub-blocks take their input through
``PrepareModuleInput`` (all-gather), the row-parallel layers reduce-scatter (``output_layouts=Shard(1)``), and the
position table's output is cut to this rank's positions with ``PrepareModuleOutput`` (torch has no style for a learned
position table; torchtitan's models use rotary embeddings).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["apply_stock_tp"]


def apply_stock_tp(gpt: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Split a :class:`~lightning_par.models.gpt.GPT` over ``tp_mesh`` with torch's styles only (in place).

    Run its loss under ``torch.distributed.tensor.parallel.loss_parallel()``: the logits are a DTensor sharded on the
    vocabulary.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
    parallelize_module(gpt, tp_mesh, plan, src_data_rank=None)
    for block in gpt.blocks.values():
        layer: dict = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=seq),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            layer |= {
                "ln_1": SequenceParallel(),
                "ln_2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, tp_mesh, layer, src_data_rank=None)
    return gpt
