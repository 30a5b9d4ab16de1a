"""Whole-model checkpoints from pipeline stages, and back.

Each stage holds its parameters under their whole-model names (see :mod:`lightning_par.pipeline_parallel.split`), so
the model's state dict is the union of the stages' state dicts, gathered over the pp group. Optimizer states are keyed
by parameter index inside each rank's optimizer, which means nothing to another layout; here they are re-keyed by
parameter name, so the gathered state describes the whole model and each stage picks its own entries back out on
load, whatever the layout was when it was saved (the same idea as torch's ``get_optimizer_state_dict`` with full state
dicts).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

__all__ = [
    "gather_state_dicts",
    "load_local_state_dict",
    "merge_optimizer_states",
    "optimizer_state_by_name",
    "optimizer_state_from_names",
]


def gather_state_dicts(local: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Union of every rank's ``local`` dict over ``group`` (keys must be disjoint or hold equal values).

    Tensors travel by pickling (``all_gather_object``): fine for checkpoints of the models this project trains on one
    machine; a sharded format (torch.distributed.checkpoint) is the way for large models.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(local)
    parts: list[Any] = [None] * dist.get_world_size(group)
    mine = {k: v.detach().cpu() if hasattr(v, "detach") else v for k, v in local.items()}
    dist.all_gather_object(parts, mine, group=group)
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


def load_local_state_dict(module: nn.Module, state: dict[str, Any]) -> None:
    """Load the entries of a whole-model ``state`` that ``module`` (one or more stages) holds; ignore the rest.

    Raises:
        KeyError: an entry of ``module`` is missing from ``state`` (names them).
    """
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} entries this pipeline stage holds, e.g. {missing[:5]}")
    module.load_state_dict({k: state[k] for k in own}, strict=True)


def _names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def optimizer_state_by_name(optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter indices replaced by the parameters' names in ``module``.

    Returns:
        ``{"state": {name: per-parameter state}, "param_groups": [{..hyper-parameters.., "params": [name, ...]}]}``.

    Raises:
        KeyError: the optimizer holds a parameter that ``module`` does not.
    """
    names = _names(module)
    raw = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    for group, raw_group in zip(optimizer.param_groups, raw["param_groups"]):
        for p, index in zip(group["params"], raw_group["params"]):
            if id(p) not in names:
                raise KeyError("the optimizer holds a parameter that is not part of the module")
            index_to_name[index] = names[id(p)]
    return {
        "state": {index_to_name[i]: s for i, s in raw["state"].items()},
        "param_groups": [{**g, "params": [index_to_name[i] for i in g["params"]]} for g in raw["param_groups"]],
    }


def merge_optimizer_states(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One name-keyed optimizer state from the stages' (see :func:`optimizer_state_by_name`): states united, and
    param group ``i`` of every stage united into group ``i`` (every stage's optimizer comes from the same
    ``configure_optimizers``, so group ``i`` has the same hyper-parameters everywhere)."""
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for part in parts:
        merged["state"].update(part["state"])
        for i, group in enumerate(part["param_groups"]):
            if i == len(merged["param_groups"]):
                merged["param_groups"].append({**group, "params": list(group["params"])})
            else:
                seen = set(merged["param_groups"][i]["params"])
                merged["param_groups"][i]["params"] += [n for n in group["params"] if n not in seen]
    return merged


def optimizer_state_from_names(optimizer: Optimizer, module: nn.Module, state: dict[str, Any]) -> None:
    """Load a name-keyed optimizer state (of the whole model) into this stage's ``optimizer``.

    Each local param group takes the hyper-parameters of the saved group that contains its first parameter.

    Raises:
        KeyError: a local parameter is missing from every saved param group.
    """
    names = _names(module)
    local = optimizer.state_dict()
    saved_group_of = {n: i for i, g in enumerate(state["param_groups"]) for n in g["params"]}
    new_groups, new_state = [], {}
    for group, raw_group in zip(optimizer.param_groups, local["param_groups"]):
        group_names = [names[id(p)] for p in group["params"]]
        missing = [n for n in group_names if n not in saved_group_of]
        if missing:
            raise KeyError(f"the checkpoint's optimizer state lacks parameters this stage holds, e.g. {missing[:5]}")
        saved = state["param_groups"][saved_group_of[group_names[0]]] if group_names else raw_group
        new_groups.append({**saved, "params": raw_group["params"]})
        for index, name in zip(raw_group["params"], group_names):
            if name in state["state"]:
                new_state[index] = state["state"][name]
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
