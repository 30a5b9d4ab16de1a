"""The optimizers a module builds by name (``optimizer="muon"``, the recipe's ``model.optimizer=muon``): one entry each.

An entry (:class:`OptimizerEntry`) says everything a host needs to offer an optimizer: its name, its options (a frozen
dataclass declaring each hyper-parameter once, with its default and its check) and how to build it for a module. The
reference GPT (:class:`~lightning_par.models.GPTLightningModule`), the Hugging Face module
(:class:`~lightning_par.hf.HFCausalLM`) and the recipe's model schemas read the entries; none names an optimizer.

Options reach an entry as flat keywords ``<name>_<field>`` (``muon_lr=0.01``, ``model.muon_lr=0.01``): the same
keywords for every host, generated from the options dataclass (:meth:`OptimizerEntry.keywords`).

Per-layout handling stays inside the optimizer, through what the strategies already give every optimizer: a DTensor
parameter (tensor parallelism, ZeRO-3, expert stacks) carries its placements; a ZeRO-1/2 chunk is announced to an
optimizer that has ``set_global_views(views)`` (``{id(chunk): chunk-shaped tensor -> DTensor of the whole
parameter}``, :meth:`lightning_par.data_parallel.zero.ZeroShardedDataParallel.shard_optimizer`). So a new optimizer is one file
plus one entry in :data:`OPTIMIZERS` (docs/adding-an-optimizer.md); an optimizer outside the package is named by its
import path instead (``optimizer="my_pkg.optim:SIGN"``, a module the program has imported; the name is
never imported here, as it may come from a checkpoint), with no entry here at all.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "OPTIMIZERS", "BaseHParams", "OptimizerEntry", "builtin_keywords", "optimizer_entry", "optimizer_keywords",
    "optimizer_names",
]


@dataclass(frozen=True)
class BaseHParams:
    """What the host module's own optimizer settings give every entry (the AdamW side of a hybrid such as Muon's).

    Attributes:
        learning_rate: the module's learning rate (AdamW's).
        weight_decay: its decoupled weight decay.
        betas: AdamW's ``(beta1, beta2)``.
        eps: AdamW's ``eps``.
    """

    learning_rate: float
    weight_decay: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer a module can build by name.

    Attributes:
        name: the value of ``optimizer=`` and the prefix of its keywords (``muon`` -> ``muon_lr``).
        options: a frozen dataclass of the optimizer's own hyper-parameters, each with its default; its
            ``__post_init__`` raises ``ValueError`` naming the keyword (``muon_lr=-1 is not valid: ...``).
        build: ``build(module, options, base) -> torch.optim.Optimizer`` over the module's trainable parameters.
    """

    name: str
    options: type
    build: Callable[[nn.Module, Any, BaseHParams], torch.optim.Optimizer]

    def keywords(self) -> dict[str, Any]:
        """``{"<name>_<field>": default}`` for every field of :attr:`options`."""
        return {f"{self.name}_{f.name}": f.default for f in dataclasses.fields(self.options)}

    def options_from(self, keywords: Mapping[str, Any]) -> Any:
        """The options dataclass from the keywords of this entry found in ``keywords`` (others are ignored).

        Raises:
            ValueError: an invalid value (the options dataclass's own check).
        """
        prefix = f"{self.name}_"
        return self.options(**{k[len(prefix):]: v for k, v in keywords.items() if k.startswith(prefix)
                               and k[len(prefix):] in {f.name for f in dataclasses.fields(self.options)}})

    def create(self, module: nn.Module, keywords: Mapping[str, Any], base: BaseHParams) -> torch.optim.Optimizer:
        """Build the optimizer for ``module`` from the flat ``keywords`` (:meth:`options_from`)."""
        return self.build(module, self.options_from(keywords), base)


#: The package's optimizers (besides the hosts' own ``adamw``/``sgd``): name -> the import path of its
#: :class:`OptimizerEntry`, imported when it is asked for. A new optimizer adds its line here.
OPTIMIZERS: tuple[tuple[str, str], ...] = (
    ("muon", "lightning_par.optim.muon:MUON"),
)


def optimizer_names() -> tuple[str, ...]:
    """The names of :data:`OPTIMIZERS`."""
    return tuple(name for name, _ in OPTIMIZERS)


def optimizer_entry(name: str, owner: str = "", host_optimizers: tuple[str, ...] = ()) -> OptimizerEntry:
    """The entry of ``name``: one of :data:`OPTIMIZERS`, or ``"package.module:ATTRIBUTE"`` naming an
    :class:`OptimizerEntry` (an optimizer outside the package, e.g. a test's).

    Args:
        name: the optimizer's name or import path.
        owner: the caller's name for messages (``"HFCausalLM optimizer=..."``).
        host_optimizers: the names the caller builds itself, listed among the valid ones in messages.

    Raises:
        ValueError: an unknown name, a path that cannot be imported or that names no :class:`OptimizerEntry`.
    """
    path = dict(OPTIMIZERS).get(name, name)
    label = f"{owner} optimizer" if owner else "optimizer"
    if isinstance(path, str) and ":" in path:
        module_name, _, attribute = path.partition(":")
        # Looked up among the modules this process has already imported, never imported here: the name can come from
        # a checkpoint's hyper-parameters (load_from_checkpoint), and a checkpoint never runs code.
        module = sys.modules.get(module_name)
        if module is None or not hasattr(module, attribute):
            raise ValueError(f"{label}={name!r} is not valid: no imported module {module_name!r} has {attribute!r} "
                             f"(import the module that defines the OptimizerEntry before building the model).")
        entry = getattr(module, attribute)
        if isinstance(entry, OptimizerEntry):
            return entry
        raise ValueError(f"{label}={name!r} is not valid: it names a {type(entry).__name__}, not an OptimizerEntry.")
    raise ValueError(f"{label}={name!r} is not valid: expected one of {(*host_optimizers, *optimizer_names())} or "
                     f"'package.module:NAME' of an OptimizerEntry.")


def builtin_keywords() -> dict[str, Any]:
    """Every keyword of :data:`OPTIMIZERS` with its default (what a host and a model schema accept)."""
    out: dict[str, Any] = {}
    for name, _ in OPTIMIZERS:
        out.update(optimizer_entry(name).keywords())
    return out


def optimizer_keywords(owner: str, optimizer: str, given: Mapping[str, Any],
                       host_optimizers: tuple[str, ...] = ("adamw",)) -> dict[str, Any]:
    """Check a host's ``optimizer`` and the optimizer keywords it was given; returns the keywords to keep (its
    hyper-parameters): every keyword of :data:`OPTIMIZERS` with its value or default, and the chosen entry's.

    Keywords of a registered optimizer that is not the chosen one are accepted and kept (a checkpoint of a model
    trained with AdamW carries Muon's defaults); the chosen optimizer's values are checked by its options dataclass.

    Args:
        owner: the host's name for messages (``"GPTLightningModule"``).
        optimizer: the host's ``optimizer`` argument.
        given: the keyword arguments the host did not take itself.
        host_optimizers: the names the host builds itself (``adamw``, ``sgd``).

    Raises:
        ValueError: an unknown optimizer, a keyword that no optimizer takes, or an invalid value; the message names
            the owner, the keyword, the value and what is valid.
    """
    entry = None if optimizer in host_optimizers else optimizer_entry(optimizer, owner, host_optimizers)
    known = builtin_keywords()
    if entry is not None:
        known.update(entry.keywords())
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"{owner} {unknown[0]}={given[unknown[0]]!r} is not valid: expected a keyword of "
                         f"{owner} or of an optimizer, one of {sorted(known)}.")
    out = {**known, **given}
    if entry is not None:
        try:
            entry.options_from(out)
        except ValueError as err:
            raise ValueError(f"{owner} {err}") from None
    return out
