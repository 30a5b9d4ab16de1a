"""A pool of gloo worlds kept alive for the whole test session: ranks forked once per world size, given cells to run.

:func:`run_in_pool` has :func:`lightning_par.launcher.run_distributed`'s contract for a cell that is expected to
train (``fn(*args)`` on every rank, the ranks' return values by rank, :class:`~lightning_par.launcher.DistributedRunError`
naming the rank and its traceback otherwise), but the ranks are not started for the cell: a world of that size forked
from the pytest process at its first use keeps serving cells until the session ends.

Why (measured on the 2-core machine, tests/README.md): the first fit of a tiny tensor-parallel GPT in a fresh rank
costs about 1.0-1.25 s of CPU per rank, the same fit again in the same process 0.24-0.29 s, with bit-identical losses:
DTensor's sharding propagation and the fake-tensor shape propagation behind it are cached per process (keyed by the
mesh's layout, not its process group), and a world forked per launch throws that cache away every time.

What a cell sees is what a world forked for it would see, but for the process group:

* the pytest process's environment variables, working directory and random states (torch, ``random``, numpy) *at the
  call*, plus the torchrun variables (one rendezvous port per world, its store on 127.0.0.1), one intra-op thread;
* the default process group the world's first cell started, and the groups of the meshes earlier cells built, stay
  (as when one launch runs several fits in sequence, which many of these tests did before): a cell's strategy finds
  the group started and uses it. They must stay: DTensor's cached shardings hold the meshes they were computed on,
  and a group destroyed under them fails the next cell ("Could not resolve the process group registered under the
  name ..."). A cell that destroys the group itself, or a rank whose kept groups hold more than ``_MAX_LOAD``
  threads and file descriptors, retires its world after the cell.

A cell that fails, or a world past ``timeout_s``, ends the pool's world of that size (a rank may be stuck in a
collective its peers left): the next cell starts a fresh one. Tests of launching, killing, signals, timeouts or the
watchdog keep :func:`~lightning_par.launcher.run_distributed`. Functions and arguments travel to the live ranks with
``cloudpickle`` (lambdas and closures by value), results come back with plain pickle; a cell whose function or
arguments cloudpickle cannot carry (a hash object) runs in a world forked for it, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch

from lightning_par.fault.process import describe_exit, die_with_parent
from lightning_par.launcher import DistributedRunError, find_free_port

__all__ = ["run_in_pool", "shut_down"]

_MASTER_ADDR = "127.0.0.1"
#: Seconds the other ranks get to report once one rank reported a failure.
_SETTLE_S = 0.5
#: Seconds between two checks of the ranks while a cell runs.
_POLL_S = 0.2
#: Threads plus open file descriptors past which a rank's world is retired after its cell (each gloo group a cell
#: leaves behind keeps worker threads and a socket per peer).
_MAX_LOAD = 3000


def _rng_state() -> tuple:
    import numpy as np

    return torch.random.get_rng_state(), random.getstate(), np.random.get_state()


def _set_rng_state(state: tuple) -> None:
    import numpy as np

    torch_state, py_state, np_state = state
    torch.random.set_rng_state(torch_state)
    random.setstate(py_state)
    np.random.set_state(np_state)


def _group_alive() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _load() -> int:
    """This process's threads plus open file descriptors: what the process groups kept alive cost (gloo's worker
    threads and sockets)."""
    return len(os.listdir("/proc/self/task")) + len(os.listdir("/proc/self/fd"))


def _serve(rank: int, world_size: int, port: int, tasks: Any, replies: Any, parent_pid: int) -> None:
    """A rank of the pool: run each cell sent to it, reply with its value or its traceback, until ``None`` comes."""
    gc.freeze()  # never collect what was inherited from pytest (see lightning_par.launcher._child)
    die_with_parent(signal.SIGKILL, expected_parent=parent_pid)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    if rank == 0:
        from lightning_par.launcher import _bind_store  # the launcher's loopback-only rendezvous store

        _bind_store(_MASTER_ADDR, port)
    while True:
        task = tasks.get()
        if task is None:
            return
        ident, env, cwd, rng, payload = task
        alive_before = _group_alive()
        try:
            os.environ.clear()
            os.environ.update(env)
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                              LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", MASTER_ADDR=_MASTER_ADDR,
                              MASTER_PORT=str(port))
            os.chdir(cwd)
            torch.set_num_threads(1)
            _set_rng_state(rng)
            fn, args = cloudpickle.loads(payload)
            value = fn(*args)
            reply = (ident, rank, True, pickle.dumps(value))
        except BaseException:  # noqa: BLE001 - every failure must reach the parent
            reply = (ident, rank, False, traceback.format_exc())
        # The default group and the meshes' groups stay for the next cell: DTensor's cached shardings hold the
        # meshes they were computed on. A cell that destroyed the group, or a rank holding too many groups' threads
        # and sockets, retires this world (the next cell gets a fresh one).
        retire = (alive_before and not _group_alive()) or _load() > _MAX_LOAD
        replies.put((*reply, retire))


class _World:
    """``size`` ranks serving cells; ended by :meth:`close` (or with the pytest process)."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("fork")
        self.size = size
        self.tasks = [ctx.SimpleQueue() for _ in range(size)]
        self.replies: Any = ctx.Queue()
        self.next_ident = 0
        self.retired = False
        port = find_free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, size, port, self.tasks[r], self.replies, os.getpid()),
                                  name=f"lightning_par-pool{size}-rank{r}", daemon=False) for r in range(size)]
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1))
        try:
            for p in self.procs:
                p.start()
                with contextlib.suppress(OSError):
                    os.setpgid(p.pid, p.pid)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def run(self, payload: bytes, timeout_s: float | None) -> list[Any]:
        self.next_ident += 1
        ident = self.next_ident
        task = (ident, dict(os.environ), os.getcwd(), _rng_state(), payload)
        for q in self.tasks:
            q.put(task)
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
        first_failure: float | None = None
        while len(outcomes) < self.size:
            try:
                got, rank, ok, value, retire = self.replies.get(timeout=_POLL_S)
                if got == ident:
                    outcomes[rank] = (ok, value)
                    self.retired = self.retired or retire
                    if not ok and first_failure is None:
                        first_failure = time.monotonic()
            except queue.Empty:
                pass
            now = time.monotonic()
            lost = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None and r not in outcomes]
            if lost:
                r, code = lost[0]
                raise DistributedRunError(f"rank {r} of the pool's world of {self.size} (pid {self.procs[r].pid}) "
                                          f"{describe_exit(code)} without reporting a result")
            if first_failure is not None and now - first_failure > _SETTLE_S:
                break
            if now > deadline:
                missing = sorted(set(range(self.size)) - set(outcomes))
                raise DistributedRunError(f"timed out after {timeout_s:.0f} s; ranks {missing} had not finished")
        failed = sorted(r for r, (ok, _) in outcomes.items() if not ok)
        if failed:
            head = f"rank {failed[0]} raised:\n{outcomes[failed[0]][1]}"
            others = [f"rank {r} raised {outcomes[r][1].strip().splitlines()[-1]}" for r in failed[1:]]
            missing = sorted(set(range(self.size)) - set(outcomes))
            others += [f"rank {r} did not finish" for r in missing]
            raise DistributedRunError(head + ("\nOther ranks: " + "; ".join(others) if others else ""))
        return [pickle.loads(outcomes[r][1]) for r in range(self.size)]

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5)
        self.replies.close()
        for q in self.tasks:
            q.close()


#: The live worlds of this pytest process, by size (a test helper's session cache, not package state).
_WORLDS: dict[int, _World] = {}


def run_in_pool(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float | None = 300.0) -> list[Any]:
    """Run ``fn(*args)`` on every rank of the pool's world of ``world_size`` gloo ranks; each rank's return value, by
    rank. Raises :class:`~lightning_par.launcher.DistributedRunError` as ``run_distributed`` does for a rank that
    raised, died or ran past ``timeout_s``, after which that world is replaced by a fresh one at its next use."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not valid: expected an integer >= 1.")
    try:
        payload = cloudpickle.dumps((fn, args))
    except Exception:  # noqa: BLE001 - an argument only a fork can carry (a hash object, a lock): a world of its own
        from lightning_par.launcher import run_distributed

        return run_distributed(fn, world_size, args, timeout_s=timeout_s)
    world = _WORLDS.get(world_size)
    if world is None:
        world = _WORLDS[world_size] = _World(world_size)
    try:
        values = world.run(payload, timeout_s)
    except BaseException:
        # a failed cell may leave a rank inside a collective its peers left: never give that world another cell
        _WORLDS.pop(world_size, None)
        world.close(graceful=False)
        raise
    if world.retired:
        _WORLDS.pop(world_size, None)
        world.close(graceful=True)
    return values


def shut_down() -> None:
    """End every world of the pool (at the end of the session; the ranks also die with the pytest process)."""
    while _WORLDS:
        _, world = _WORLDS.popitem()
        world.close(graceful=True)


atexit.register(shut_down)
