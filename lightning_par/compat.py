"""The one place that touches torch's private names, gated by the torch version.

lightning_par builds on torch's distributed engines where they are public; where a feature is only reachable through
a private name (a DeviceMesh flatten, a DTensor's local shard without a dispatch), that name is used here and nowhere
else, so a torch upgrade that moves it breaks one module with a clear message instead of seventeen.

Supported: torch ``>= 2.10`` (pyproject.toml). Each helper says which private name it wraps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TORCH_VERSION", "concatenate_meshes", "flatten_mesh", "local_tensor"]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


#: ``(major, minor)`` of the installed torch.
TORCH_VERSION: tuple[int, int] = _version(torch.__version__)


def local_tensor(t: Tensor) -> Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard (``DTensor._local_tensor``, no dispatch, keeps
    autograd's view of the data), or ``t`` itself for a plain tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over the ranks of ``mesh`` (a sub-mesh of one or more axes), registered on the root mesh under
    ``name`` so that ``root[name]`` and ``root[(..., name)]`` find it (``DeviceMesh._flatten``, torch >= 2.5).

    Raises:
        RuntimeError: the installed torch has no ``DeviceMesh._flatten``.
    """
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise RuntimeError(f"torch {torch.__version__} has no DeviceMesh._flatten: lightning_par needs torch >= 2.10.")
    return flatten(name)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of ``meshes`` in order (sub-meshes of one root), as FSDP2 builds for FSDP + TP
    state (``DeviceMesh._concatenate``).

    Raises:
        RuntimeError: the installed torch has no ``DeviceMesh._concatenate``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no DeviceMesh._concatenate: lightning_par needs torch >= 2.10."
        )
    return concatenate(meshes)
