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

Training is different: the schedule's backward needs the loss of each micro-batch on the last stage as it goes
(``loss_fn``), so the user's ``training_step`` cannot produce it. It still runs, for what it logs:
:class:`TrainingStepCapture` calls it on the last stage for every micro-batch, without gradient, its network call
answered by that micro-batch's outputs, records its ``self.log`` calls, and every rank replays their micro-batch means.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.compat import tree_flatten, tree_unflatten

__all__ = ["TrainingStepCapture", "broadcast_outputs", "network_returns", "split_microbatches"]


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


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """``batch`` (a tensor or a tree of them, as the DataLoader gives it) cut into ``num_microbatches`` equal pieces
    along dim 0, as the schedule cuts its inputs; tensors whose dim 0 is not the batch size stay whole."""
    leaves, spec = tree_flatten(batch)
    size = next((t.shape[0] for t in leaves if isinstance(t, Tensor) and t.dim() > 0), None)
    pieces = [
        list(t.tensor_split(num_microbatches)) if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == size
        else [t] * num_microbatches
        for t in leaves
    ]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(num_microbatches)]


class TrainingStepCapture:
    """The LightningModule's own ``training_step``, run on the last stage for each micro-batch the schedule has just
    computed (no gradient: the schedule's backward came from ``loss_fn``), its network call returning that
    micro-batch's outputs. What it logs is recorded, not logged: :meth:`share` averages each value over the
    micro-batches, weighed as the loss weighs them (:attr:`weights`: each micro-batch's share of the counted tokens) and sends the records over the pp group, and
    every rank replays them with :meth:`replay` (so ``sync_dist`` and the loggers see the same calls on every rank).

    ``self.all_gather`` inside ``training_step`` under pipelining is refused (the other stages are inside the schedule
    then); an exception of the step (or a value that cannot be replayed: a torchmetrics ``Metric``) ends the step on
    every rank, the original exception on the last stage.

    Args:
        module: the LightningModule.
        network: the module at ``module.<attr>`` (this rank's holder of the network).
        attr: ``module_attr``.
        call: runs the LightningModule's ``training_step`` on a batch (Lightning's strategy path).
        micro_batches: the batch's micro-batches, as the step sees them (every axis's batch transform applied).
        first_inputs: each micro-batch's first stage input (what the network call must receive).
    """

    def __init__(self, module: Any, network: nn.Module, attr: str, call: Callable[[Any], Any],
                 micro_batches: list[Any], first_inputs: list[Tensor]) -> None:
        self.module, self.network, self.attr, self.call = module, network, attr, call
        self.micro_batches, self.first_inputs = micro_batches, first_inputs
        #: each logged name's ``(micro-batch, value)``: a 0-dim tensor (read in :meth:`share`) or a number
        self.values: dict[str, list[tuple[int, Any]]] = {}
        #: the micro-batches' weights in the logged means (the pipeline's logging weights, a tensor until
        #: :meth:`share` reads it with the logged values; 1 each when unset)
        self.weights: list[float] | Tensor = []
        self.calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.error: BaseException | None = None

    def __call__(self, i: int, outputs: Any) -> None:
        if self.error is not None:
            return
        from lightning_par import contract

        module, owner = self.module, type(self.module).__name__

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(value, Tensor) and value.numel() == 1:  # kept on its device: share() reads them all at once
                value = (value.detach().to_local() if isinstance(value, DTensor) else value.detach()).reshape(())
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                value = float(value)
            else:
                raise ValueError(
                    f"{owner}.training_step logs {name!r} as a {type(value).__name__} under pipelining (pp_size > 1): "
                    f"the step runs on the last stage per micro-batch and its logged values are averaged and replayed "
                    f"on every rank, so they must be scalars (a tensor or a number); log a metric's computed value, "
                    f"or use pp_size=1."
                )
            self.values.setdefault(name, []).append((i, value))
            self.calls.setdefault(name, (args, kwargs))

        def all_gather(*args: Any, **kwargs: Any) -> Any:
            raise ValueError(
                f"{owner}.training_step calls self.all_gather under pipelining (pp_size > 1): the step runs on the last "
                f"stage only, inside the schedule, where the other ranks cannot join a collective. Log the value with "
                f"self.log(..., sync_dist=True) instead, or gather in validation_step (which runs on every rank)."
            )

        own = {k: module.__dict__[k] for k in ("log", "all_gather") if k in module.__dict__}
        module.log, module.all_gather = log, all_gather
        try:
            outputs = contract.pipeline_output(self.network, outputs)
            with torch.no_grad(), network_returns(self.network, self.first_inputs[i], outputs, owner, self.attr,
                                                  "training_step"):
                self.call(self.micro_batches[i])
        except Exception as err:  # noqa: BLE001 - re-raised on every rank by share()
            self.error = err
        finally:
            del module.log, module.all_gather
            module.__dict__.update(own)

    def _read_to_host(self) -> None:
        """The logging weights and every logged tensor value as Python floats, in one read to the host per step (a
        read per value and micro-batch before: each a synchronisation on a GPU)."""
        tensors = [v for vals in self.values.values() for _, v in vals if isinstance(v, Tensor)]
        weights = self.weights if isinstance(self.weights, Tensor) else None
        parts = ([weights.detach().reshape(-1)] if weights is not None else []) + [t.reshape(1) for t in tensors]
        if not parts:
            return
        device = parts[0].device
        host = torch.cat([p.to(device, torch.float64) for p in parts]).tolist()  # the step's one read
        if weights is not None:
            self.weights, host = host[:weights.numel()], host[weights.numel():]
        it = iter(host)
        self.values = {name: [(i, next(it) if isinstance(v, Tensor) else v) for i, v in vals]
                       for name, vals in self.values.items()}

    def _mean(self, values: list[tuple[int, float]]) -> float:
        weights = [self.weights[i] if i < len(self.weights) else 1.0 for i, _ in values]
        total = sum(weights)
        if total <= 0:
            return sum(v for _, v in values) / len(values)
        return sum(w * v for w, (_, v) in zip(weights, values)) / total

    def share(self, src: int, group: dist.ProcessGroup, holds_last: bool) -> list[tuple[str, float, tuple, dict]]:
        """The records ``(name, mean value, args, kwargs)`` of the last stage (global rank ``src``), on every rank of
        ``group``. Collective.

        Raises:
            the step's exception on the last stage; ``RuntimeError`` naming it elsewhere.
        """
        import pickle

        box: list[Any] = [None]
        if holds_last:
            if self.error is None:
                try:
                    self._read_to_host()
                except Exception as err:  # noqa: BLE001 - re-raised on every rank below
                    self.error = err
            records = [(name, self._mean(v), *self.calls[name]) for name, v in self.values.items()]
            message = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
            if message is None:
                try:
                    pickle.dumps(records)
                except Exception as err:  # noqa: BLE001
                    message = (f"ValueError: the arguments {type(self.module).__name__}.training_step passes to "
                               f"self.log cannot be sent to the other pipeline stages ({err}); pass plain values.")
                    self.error = ValueError(message)
            box[0] = (records if message is None else None, message)
        dist.broadcast_object_list(box, src=src, group=group)
        records, message = box[0]
        if message is not None:
            if holds_last and self.error is not None:
                raise self.error
            raise RuntimeError(f"training_step on the last pipeline stage (global rank {src}) raised {message}")
        return records

    @staticmethod
    def replay(module: Any, records: list[tuple[str, float, tuple, dict]], device: torch.device) -> set[str]:
        """``module.log`` each record; returns the names logged. A value logged with ``sync_dist`` goes to a collective
        and is put on ``device``; the others are logged as CPU tensors (Lightning keeps a tensor's device: no upload
        per value and step, see :func:`~lightning_par.callbacks.metrics.log_host_number`)."""
        for name, value, args, kwargs in records:
            where = device if kwargs.get("sync_dist") else None
            module.log(name, torch.tensor(value, dtype=torch.float32, device=where), *args, **kwargs)
        return {name for name, *_ in records}
