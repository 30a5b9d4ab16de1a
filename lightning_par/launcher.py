"""Start a multi-process world on one machine, run a function on every rank, and never hang.

Used by the recipes (one Hydra job = one world, so a multirun sweep never re-runs itself in the children: the
children run a function, not the command line) and by every distributed test.

Each child gets the environment variables that torchrun would set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so Lightning's ``LightningEnvironment`` treats the processes as created
externally and does not launch again. The parent watches the children: the first rank that raises or dies ends the
whole world, and a world that outlives ``timeout_s`` is killed; both raise :class:`DistributedRunError` in the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["DistributedRunError", "find_free_port", "init_process_group_from_env", "run_distributed"]


class DistributedRunError(RuntimeError):
    """A rank raised, died, or the world ran past its timeout. The message holds the first failure."""


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group_from_env(backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """Initialise the default process group from the torchrun variables, with a collective timeout.

    Args:
        backend: ``"gloo"`` on CPU, ``"nccl"`` on GPUs.
        timeout_s: seconds after which a collective that waits on a missing peer raises instead of hanging.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def _child(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    threads: int | None,
    results: mp.Queue,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        value = fn(*args)
        # Plain pickle copies tensors by value; the queue's own pickler would share them through file descriptors
        # that vanish when this process exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _stop(procs: list[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 300.0,
    start_method: str | None = None,
    threads_per_rank: int | None = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local processes and return each rank's return value, by rank.

    ``fn`` runs with the torchrun environment variables set; it (or the Lightning strategy it builds) initialises the
    process group. Return values travel back by pickling, so keep them small (floats, lists, state dicts of tiny
    models).

    Args:
        fn: a module-level function (it must be picklable under ``spawn``).
        world_size: number of processes.
        args: positional arguments, the same for every rank.
        timeout_s: wall-clock seconds for the whole world; past it every process is killed.
        start_method: ``"fork"`` (fast: imports are inherited; the default on CPU, or ``$LP_START_METHOD``) or
            ``"spawn"`` (needed once CUDA is initialised in the parent).
        threads_per_rank: ``torch.set_num_threads`` in each child (1 keeps 8 ranks on 2 cores from thrashing);
            ``None`` leaves torch's default.
        env: extra environment variables for the children.

    Returns:
        ``[fn's return value on rank 0, ..., on rank world_size - 1]``.

    Raises:
        ValueError: ``world_size < 1``.
        DistributedRunError: a rank raised (its traceback is in the message), a rank exited without reporting
            (killed, crashed), or the world ran past ``timeout_s``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not valid: expected an integer >= 1.")
    method = start_method or os.environ.get("LP_START_METHOD", "fork")
    ctx = mp.get_context(method)
    results: mp.Queue = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, args, rank, world_size, port, dict(env or {}), threads_per_rank, results),
            name=f"lightning_par-rank{rank}",
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    values: dict[int, Any] = {}
    failure: str | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size and failure is None:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    failure = f"timed out after {timeout_s:.0f} s; ranks {missing} had not finished"
                    break
                for rank, p in enumerate(procs):
                    if rank not in values and p.exitcode is not None:
                        # The process ended without reporting: give its queue message a moment to arrive.
                        try:
                            r, ok, value = results.get(timeout=2.0)
                        except queue.Empty:
                            failure = f"rank {rank} exited with code {p.exitcode} without reporting a result"
                            break
                        if ok:
                            values[r] = pickle.loads(value)
                        else:
                            failure = f"rank {r} raised:\n{value}"
                            break
                continue
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failure = f"rank {rank} raised:\n{value}"
    finally:
        if failure is not None:
            _stop(procs)
        else:
            for p in procs:
                p.join(timeout=30)
            _stop(procs)
        results.close()
    if failure is not None:
        raise DistributedRunError(failure)
    return [values[r] for r in range(world_size)]
