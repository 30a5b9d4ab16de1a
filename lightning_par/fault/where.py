"""Where a thread is right now, in words: the innermost line of its Python stack, and whether it waits in a collective.

The heartbeat recorder (:mod:`lightning_par.fault.heartbeat`) asks this of the training (main) thread once that
thread has made no progress for a while, so that a stall report says "rank 1 ... in training_step (model.py:42):
time.sleep(60)" for the rank that is stuck and "waiting in all_reduce" for its peers. Read from
``sys._current_frames()`` (documented in :mod:`sys`), which sees a thread's Python frames also while that thread is
blocked inside C++ code (a gloo collective, a sleep), without stopping it.
"""

from __future__ import annotations

import linecache
import re
import sys
import threading
from dataclasses import dataclass
from types import FrameType

__all__ = ["Location", "locate", "locate_frame"]

#: Path fragments of frames that are part of torch.distributed (collectives, FSDP, DDP, pipelining, DTensor).
_DISTRIBUTED = ("/torch/distributed/", "\\torch\\distributed\\")
#: A collective called on a line of user (or lightning_par) code: ``dist.all_reduce(...)``, ``work.wait()``, ...
_COLLECTIVE_CALL = re.compile(
    r"\b(all_reduce|all_gather(?:_into_tensor|_object)?|reduce_scatter(?:_tensor)?|broadcast(?:_object_list)?|"
    r"barrier|monitored_barrier|all_to_all(?:_single)?|reduce|gather|scatter|send|recv|isend|irecv|wait)\s*\("
)


@dataclass(frozen=True)
class Location:
    """Where a thread is.

    Attributes:
        where: the innermost frame outside torch.distributed, ``"function (file:line): source"``.
        collective: the collective it waits in (``"all_reduce"``, ``"wait"``, ...), or ``None`` when it is not
            inside one as far as the stack shows (a collective a C++ autograd hook runs, as torch DDP's, shows as
            the ``backward`` call that contains it).
    """

    where: str
    collective: str | None


def locate_frame(frame: FrameType | None) -> Location | None:
    """The :class:`Location` of a stack whose innermost frame is ``frame`` (``None`` for no frame)."""
    if frame is None:
        return None
    collective = None
    inner_distributed: FrameType | None = None
    f: FrameType | None = frame
    # Walk outwards past torch.distributed's own frames: the first frame outside it is the caller in user code.
    while f is not None and any(part in f.f_code.co_filename for part in _DISTRIBUTED):
        inner_distributed = f
        f = f.f_back
    user = f if f is not None else frame
    line = linecache.getline(user.f_code.co_filename, user.f_lineno).strip()
    if inner_distributed is not None:
        # The outermost torch.distributed frame is the API the user code called (e.g. all_reduce behind its logger).
        called = _outermost_distributed_name(frame)
        collective = called or inner_distributed.f_code.co_name
    else:
        match = _COLLECTIVE_CALL.search(line)
        if match:
            collective = match.group(1)
    filename = user.f_code.co_filename.rsplit("/", 1)[-1]
    where = f"{user.f_code.co_name} ({filename}:{user.f_lineno})" + (f": {line}" if line else "")
    return Location(where, collective)


def _outermost_distributed_name(frame: FrameType) -> str | None:
    name = None
    f: FrameType | None = frame
    while f is not None and any(part in f.f_code.co_filename for part in _DISTRIBUTED):
        if f.f_code.co_name not in ("wrapper", "inner", "inner_func", "_fn", "decorator"):
            name = f.f_code.co_name
        f = f.f_back
    return name


def locate(thread: threading.Thread | None = None) -> Location | None:
    """Where ``thread`` (default: the main thread) is now, or ``None`` if it is not running."""
    thread = thread or threading.main_thread()
    if thread.ident is None:
        return None
    return locate_frame(sys._current_frames().get(thread.ident))
