"""Restarts under ``torchrun --max-restarts``: a process group of its own for every restart attempt.

torchrun's agent keeps one TCPStore for the whole job, and workers connect to it (``TORCHELASTIC_USE_AGENT_STORE``)
without a per-attempt prefix (``torch.distributed.rendezvous`` assumes a new store per attempt). After a restart the
store still holds the previous attempt's peer addresses, and a rank that reaches ``init_process_group`` first connects
to a dead peer: measured here with torch 2.13 and gloo, attempt 2 fails with "Gloo connectFullMesh failed ... timed
out connecting: Connection refused" whenever its ranks start more than about a second apart (pytorch/pytorch#167288
reports the same with NCCL). Starting the default group on a ``PrefixStore`` named after
``TORCHELASTIC_RESTART_COUNT`` gives every attempt clean keys; Lightning's strategy then finds the group started.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_process_group_per_attempt"]


def init_process_group_per_attempt(accelerator: str, timeout_s: float) -> bool:
    """Start the default process group in a store namespace of this torchrun restart attempt.

    Does nothing (returns ``False``) outside torchrun's agent store or when a group exists already.

    Args:
        accelerator: ``"gpu"`` (nccl, after ``torch.cuda.set_device(LOCAL_RANK)``) or ``"cpu"`` (gloo).
        timeout_s: the collective timeout (the strategy's ``timeout_s``), also the store's.

    Returns:
        Whether the group was started here (then the caller destroys it at the end).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    backend = "gloo"
    if accelerator == "gpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"lightning_par/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )
    return True
