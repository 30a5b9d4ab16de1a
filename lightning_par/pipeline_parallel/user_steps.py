"""The LightningModule's own evaluation steps under pipelining, run on the last stage's outputs.

A schedule runs the network stage by stage; the whole batch's outputs exist only on the rank holding the last stage.
So that the user's ``validation_step`` / ``test_step`` runs unchanged, with what it logs (``self.log``, with or without
``sync_dist``), gathers (``self.all_gather``) and returns identical on every rank of the pipeline:

1. the last stage's outputs are broadcast over the pp group (:func:`broadcast_outputs`; a tensor, or a tuple / list /
   dict of them; a DTensor is sent as its local shard and rebuilt on the receiver's own mesh: the pp group pairs ranks
   with the same tp coordinate), and
2. every pp rank runs the user's step with the network answering its one call with those outputs
   (:func:`network_returns`).

The cost is one broadcast of the outputs per evaluation batch (for a language model: ``batch x seq x vocab`` values).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["broadcast_outputs", "network_returns"]


def broadcast_outputs(outputs: Any, src: int, group: dist.ProcessGroup, device: torch.device,
                      mesh: Callable[[], Any] | None = None) -> Any:
    """``outputs`` of global rank ``src`` on every rank of ``group`` (collective over ``group``).

    Args:
        outputs: on ``src``, a tensor or a tree (tuple / list / dict) of tensors and plain values; ignored elsewhere.
        src: the global rank that holds them.
        group: the pp group.
        device: where the received tensors go.
        mesh: the mesh a received DTensor is rebuilt on (this rank's tp mesh).
    """
    meta: list[Any] = [None]
    if dist.get_rank() == src:
        leaves, spec = tree_flatten(outputs)
        described = []
        for leaf in leaves:
            if isinstance(leaf, DTensor):
                described.append(("dtensor", leaf.to_local().shape, leaf.dtype, tuple(leaf.placements),
                                  leaf.shape, leaf.stride()))
            elif isinstance(leaf, Tensor):
                described.append(("tensor", leaf.shape, leaf.dtype))
            else:
                described.append(("value", leaf))
        meta[0] = (spec, described)
    dist.broadcast_object_list(meta, src=src, group=group)
    spec, described = meta[0]
    mine = tree_flatten(outputs)[0] if dist.get_rank() == src else None
    received = []
    for i, d in enumerate(described):
        if d[0] == "value":
            received.append(d[1])
            continue
        if mine is not None:
            local = mine[i].to_local() if d[0] == "dtensor" else mine[i]
            buffer = local.detach().contiguous()
        else:
            buffer = torch.empty(d[1], dtype=d[2], device=device)
        dist.broadcast(buffer, src=src, group=group)
        if d[0] == "dtensor":
            if mine is not None:
                received.append(mine[i].detach())
            else:
                assert mesh is not None, "a DTensor output needs the receiver's mesh"
                received.append(DTensor.from_local(buffer, mesh(), d[3], shape=d[4], stride=d[5], run_check=False))
        else:
            received.append(buffer)
    return tree_unflatten(received, spec)


@contextmanager
def network_returns(network: nn.Module, first_input: Tensor, outputs: Any, owner: str, attr: str,
                    hook: str) -> Generator[None, None, None]:
    """Inside the block, ``network(...)`` returns ``outputs`` (the whole network's outputs of this batch) instead of
    running this rank's stages.

    Args:
        network: the module at ``owner.<attr>``.
        first_input: the first stage's first input of the batch: the call's first tensor argument must equal it.
        outputs: what the call returns.
        owner, attr, hook: names for the error messages (the LightningModule's class, ``module_attr``, the step).

    Raises:
        ValueError: the step calls the network on another input, or not exactly once.
    """
    calls = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        given = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        if calls[0] > 1 or given is None or given.shape != first_input.shape or not torch.equal(given, first_input):
            raise ValueError(
                f"{owner}.{hook} under pipelining (pp_size > 1) must call its network self.{attr}(...) once, on the "
                f"batch's inputs (the first tensor as pipeline_batch gives it): the schedule has run the network on "
                f"them and the call returns the last stage's outputs. It called it "
                f"{'more than once' if calls[0] > 1 else 'on another input'}; compute everything from that one call."
            )
        return outputs

    network.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del network.forward
    if calls[0] != 1:
        raise ValueError(
            f"{owner}.{hook} under pipelining (pp_size > 1) must call its network self.{attr}(...) once (directly or "
            f"through self(...)): the schedule runs the network stage by stage, and that call returns the last "
            f"stage's outputs. It did not call it."
        )
