"""Point-to-point transfers between pipeline stages: tagged, non-blocking sends and blocking receives.

Every message of a step has its own tag (kind, virtual stage, micro-batch), so messages between the same two ranks
match however the two schedules interleave them (with interleaving, one pair of ranks carries activations one way
and gradients the same way at once). A transfer between two chunks of the same rank never touches the network.

Shapes: a stage learns the shape and dtype of its incoming activation from a small header that the sender adds to
the first activation of each new input shape (the key is the micro-batch input shape, which every rank of the
pipeline knows, since they all read the same batch). Gradients need no header: the gradient of a stage's output has
the output's shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["StageComm"]

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8
_ACT, _GRAD, _HEADER = 0, 1, 2


class StageComm:
    """Sends and receives of one pipeline rank within its pp group.

    Args:
        group: the pp process group (``None``: the default group, for a world that is one pipeline).
        pp_rank: this rank's index in ``group``.
        pp_size: ranks in ``group``.
        num_stages: virtual stages in the whole pipeline (``pp_size * virtual_stages``).
        device: where received tensors are allocated.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, pp_rank: int, pp_size: int, num_stages: int, device: torch.device
    ) -> None:
        self.group = group
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.num_stages = num_stages
        self.device = device
        self._pending: list[tuple[object, Tensor]] = []
        self._local: dict[int, Tensor] = {}
        self._sent_headers: set[tuple] = set()
        self._shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self.num_microbatches = 1

    def _rank_of(self, stage: int) -> int:
        return stage % self.pp_size

    def _tag(self, kind: int, stage: int, microbatch: int) -> int:
        return (kind * self.num_stages + stage) * self.num_microbatches + microbatch

    def _send(self, tensor: Tensor, dst_stage: int, tag: int) -> None:
        dst = self._rank_of(dst_stage)
        if dst == self.pp_rank:
            self._local[tag] = tensor
            return
        peer = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        work = dist.isend(tensor, peer, group=self.group, tag=tag)
        # Keep each tensor alive until its send lands, and no longer: 1F1B frees a micro-batch's activations at its
        # backward, which holding every sent tensor to the end of the step would undo.
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((work, tensor))

    def _recv(self, shape: torch.Size, dtype: torch.dtype, src_stage: int, tag: int) -> Tensor:
        src = self._rank_of(src_stage)
        if src == self.pp_rank:
            return self._local.pop(tag)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        peer = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.irecv(buf, peer, group=self.group, tag=tag).wait()
        return buf

    def send_activation(self, tensor: Tensor, stage: int, microbatch: int, key: tuple) -> None:
        """Send the output ``tensor`` of virtual stage ``stage`` for ``microbatch`` to stage ``stage + 1``.

        ``key`` identifies the micro-batch input shape; the first send of each key carries a shape header.

        Raises:
            ValueError: the tensor has a dtype or more dimensions than the header can describe.
        """
        tensor = tensor.detach().contiguous()
        header_key = (stage, key)
        if header_key not in self._sent_headers:
            if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
                raise ValueError(
                    f"a pipeline stage output of dtype {tensor.dtype} and shape {tuple(tensor.shape)} cannot be sent: "
                    f"expected one of {list(_DTYPES)} with at most {_MAX_DIMS} dimensions."
                )
            header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=tensor.device)
            header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
            header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            self._send(header, stage + 1, self._header_tag(stage))
            self._sent_headers.add(header_key)
        self._send(tensor, stage + 1, self._tag(_ACT, stage, microbatch))

    def _header_tag(self, stage: int) -> int:
        return (_HEADER * self.num_stages + stage) * self.num_microbatches

    def recv_activation(self, stage: int, microbatch: int, key: tuple) -> Tensor:
        """Receive the input of virtual stage ``stage`` for ``microbatch`` from stage ``stage - 1``."""
        header_key = (stage - 1, key)
        if header_key not in self._shapes:
            header = self._recv(torch.Size([2 + _MAX_DIMS]), torch.int64, stage - 1, self._header_tag(stage - 1))
            ndim = int(header[1])
            self._shapes[header_key] = (torch.Size(header[2 : 2 + ndim].tolist()), _DTYPES[int(header[0])])
        shape, dtype = self._shapes[header_key]
        return self._recv(shape, dtype, stage - 1, self._tag(_ACT, stage - 1, microbatch))

    def send_grad(self, grad: Tensor, stage: int, microbatch: int) -> None:
        """Send the gradient of the input of virtual stage ``stage`` to stage ``stage - 1``."""
        self._send(grad.contiguous(), stage - 1, self._tag(_GRAD, stage, microbatch))

    def recv_grad(self, like: Tensor, stage: int, microbatch: int) -> Tensor:
        """Receive the gradient of the output ``like`` of virtual stage ``stage`` from stage ``stage + 1``."""
        return self._recv(like.shape, like.dtype, stage + 1, self._tag(_GRAD, stage + 1, microbatch))

    def wait_sends(self) -> None:
        """Block until every send posted so far has landed (call at the end of a step)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
        if self._local:
            raise RuntimeError(f"pipeline transfers within one rank were never received: tags {sorted(self._local)}")
