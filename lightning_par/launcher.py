"""Start a multi-process world on one machine, run a function on every rank, and never hang or leave orphans.

Used by the recipes (one Hydra job = one world, so a multirun sweep never re-runs itself in the children: the
children run a function, not the command line) and by every distributed test.

Each child gets the environment variables that torchrun would set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so Lightning's ``LightningEnvironment`` treats the processes as created
externally and does not launch again. The parent watches the children:

* the first rank that raises or dies ends the whole world; the parent then waits a moment (``settle_s``) for the
  whole picture and names the *cause*: a rank killed by a signal (by name, e.g. SIGKILL) or that exited without a
  result comes before a rank that raised, and a rank that raised its own error comes before the peers that only lost
  their connection to it ("Connection reset by peer");
* a world that outlives ``timeout_s`` is killed; with ``watchdog_s``, so is a world where a rank stops making
  progress (heartbeats, :mod:`lightning_par.fault.heartbeat`), naming that rank and its process state;
* the rendezvous store listens on 127.0.0.1 only (``MASTER_ADDR``; torch's own would listen on every interface);
* the children die with the parent: each asks the kernel for SIGKILL when its parent exits (``PR_SET_PDEATHSIG``),
  so even a launcher killed with SIGKILL leaves no rank running, and each child leads its own process group, which
  the parent signals as a whole (DataLoader workers included) when it stops the world. SIGTERM and SIGHUP to the
  parent stop the world cleanly before the parent exits;
* with ``preemption_signal``, that signal to the parent is forwarded to every rank (which agree, save a checkpoint
  and exit, :mod:`lightning_par.fault.preemption`), and a world whose ranks were preempted raises
  :class:`~lightning_par.fault.preemption.Preempted` (exit status 75) instead of an error. The parent's handlers are
  never inherited: the signals are blocked while the ranks are started, and each rank sets its own before it
  unblocks them.

All of these but preemption raise :class:`DistributedRunError` in the parent.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import queue
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning_par.fault.heartbeat import HEARTBEAT_DIR_ENV, LAUNCHER_WATCHDOG_ENV, stalled_ranks
from lightning_par.fault.preemption import (
    PREEMPTED_EXIT_CODE,
    PREEMPTION_GRACE_ENV,
    PREEMPTION_SIGNAL_ENV,
    Preempted,
    PreemptionWatch,
    parse_signal,
)
from lightning_par.fault.process import describe_exit, die_with_parent, process_state

__all__ = ["DistributedRunError", "LauncherSignalled", "find_free_port", "init_process_group_from_env", "run_distributed"]

#: Seconds a rank that ended may take for its result to come through the queue before it counts as lost.
_REPORT_GRACE_S = 1.0
#: Seconds between two heartbeat checks.
_WATCHDOG_POLL_S = 1.0
#: Signals the launcher handles itself (SIGUSR1 only as a preemption signal); blocked while the ranks start.
_LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
#: A rank's report "preempted" on the results queue (else True: a result, or False: a traceback).
_PREEMPTED = "preempted"

#: Errors a rank raises when a *peer* failed (closed sockets, a collective that timed out waiting): a consequence.
_PEER_FAILURE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|ECONNRESET|EPIPE|Connection refused|"
    r"DistNetworkError|DistBackendError|Timed out waiting|timed out|Socket Timeout|NCCL communicator was aborted|"
    r"ProcessGroupGloo|gloo/transport",
    re.IGNORECASE,
)


class DistributedRunError(RuntimeError):
    """A rank raised, died, stalled, or the world ran past its timeout. The message names the rank and the cause
    first, then what the other ranks reported."""


class LauncherSignalled(DistributedRunError):
    """The launcher received SIGTERM or SIGHUP (not the preemption signal) and stopped every rank.

    Attributes:
        signum: the signal's number (a caller that exits on it conventionally uses status ``128 + signum``).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"the launcher received {signal.Signals(signum).name}: every rank was stopped")
        self.signum = signum


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


#: The address the ranks rendezvous on: one machine, so loopback only.
_MASTER_ADDR = "127.0.0.1"
#: Rank 0's rendezvous store until the default process group holds it (see _bind_store).
_bound_store: Any = None


def _bind_store(addr: str, port: int) -> None:
    """Rank 0: start the rendezvous store (a ``TCPStore`` server) on a socket bound to ``addr`` only.

    torch's ``env://`` rendezvous makes rank 0's ``TCPStore`` listen on every interface (``*:MASTER_PORT``), whatever
    ``MASTER_ADDR`` says: anyone who reaches the machine could read and write its keys during a job. A server started
    here on a socket we bound (``master_listen_fd``) with ``multi_tenant=True`` is the one rank 0's
    ``init_process_group`` then uses (torch keeps one multi-tenant server per port and process), so the store listens
    on ``addr`` only. Our reference is dropped once the default group exists: a group destroyed and started again in
    the same process then gets a fresh store (no keys of the previous group), bound by torch itself.
    """
    global _bound_store
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(1024)
    _bound_store = dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                                 master_listen_fd=sock.detach(), timeout=timedelta(seconds=300))

    def release() -> None:
        global _bound_store
        while not dist.is_initialized():
            time.sleep(0.05)
        _bound_store = None

    threading.Thread(target=release, name="lightning_par-store", daemon=True).start()


def _child(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    threads: int | None,
    results: mp.Queue,
    parent_pid: int,
) -> None:
    # Never collect what was inherited: a gloo process group the launcher's process had dropped (a Trainer run in it
    # before) may still wait in its garbage, and destroying it here joins worker threads that a forked process does
    # not have: the rank hangs in ~ProcessGroupGloo (seen in the test suite: ranks idle in a futex from a
    # garbage collection inside a model's __init__, until the launch's timeout). Objects made from here on are
    # collected as usual.
    gc.freeze()
    # Die with the launcher, even one killed with SIGKILL; lead a process group the launcher can signal as a whole.
    die_with_parent(signal.SIGKILL, expected_parent=parent_pid)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    # The launcher's own handlers are not for ranks; the signals stayed blocked since the fork (see run_distributed).
    for sig in _LAUNCHER_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    if env.get(PREEMPTION_SIGNAL_ENV):
        PreemptionWatch.install(parse_signal(env[PREEMPTION_SIGNAL_ENV]), float(env[PREEMPTION_GRACE_ENV]))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _LAUNCHER_SIGNALS)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        MASTER_ADDR=_MASTER_ADDR,
        MASTER_PORT=str(port),
    )
    try:
        if rank == 0:
            _bind_store(_MASTER_ADDR, port)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        try:
            value = fn(*args)
        except Preempted as preempted:
            results.put((rank, _PREEMPTED, (str(preempted), preempted.resumable, preempted.signum)))
            return
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


def _signal_group(p: mp.process.BaseProcess, sig: int) -> None:
    """Send ``sig`` to the child's process group (the child and its own children), or to the child alone."""
    if p.pid is None:
        return
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


def _stop(procs: list[mp.process.BaseProcess], grace_s: float = 5.0) -> None:
    """SIGTERM every child's group, SIGKILL what is left after ``grace_s`` (a stopped process only dies that way)."""
    for p in procs:
        if p.is_alive():
            _signal_group(p, signal.SIGTERM)
            _signal_group(p, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        # The group even when the child is gone: its DataLoader workers may still be running.
        _signal_group(p, signal.SIGKILL)
        p.join(timeout=5)


@dataclass
class _Outcome:
    ok: bool
    value: Any = None  # the result (ok), the traceback text (raised) or the preemption message
    exitcode: int | None = None  # set when the rank ended without reporting
    preempted: bool = False  # it reported Preempted, or exited with a preempted status (75, or 128 + the signal)
    resumable: bool = True  # for a preempted rank: whether a checkpoint to resume from exists


def _last_line(tb: str) -> str:
    lines = [ln.strip() for ln in tb.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "an exception"


def _describe_failure(outcomes: dict[int, _Outcome], procs: list[mp.process.BaseProcess]) -> str:
    """The cause first (a lost rank, then an error of its own, then a peer failure), then the other ranks."""
    lost = sorted(r for r, o in outcomes.items() if not o.ok and o.exitcode is not None)
    raised = sorted(r for r, o in outcomes.items() if not o.ok and o.exitcode is None)
    own = [r for r in raised if not _PEER_FAILURE.search(_last_line(outcomes[r].value))]
    primary = (lost or own or raised)[0]
    o = outcomes[primary]
    if o.exitcode is not None:
        head = f"rank {primary} (pid {procs[primary].pid}) {describe_exit(o.exitcode)} without reporting a result"
    else:
        head = f"rank {primary} raised:\n{o.value}"
    others = []
    for r in sorted(outcomes):
        if r == primary or outcomes[r].ok:
            continue
        if outcomes[r].exitcode is not None:
            others.append(f"rank {r} {describe_exit(outcomes[r].exitcode)} without reporting a result")
        elif o.exitcode is None and _last_line(outcomes[r].value) == _last_line(o.value):
            others.append(f"rank {r} raised the same error")
        else:
            consequence = " (a consequence: it lost a peer)" if _PEER_FAILURE.search(_last_line(outcomes[r].value)) else ""
            others.append(f"rank {r} raised {_last_line(outcomes[r].value)}{consequence}")
    return head + ("\nOther ranks: " + "; ".join(others) if others else "")


class _Preemption:
    """The launcher's side of preemption: the signal forwarded to the ranks, and when the world must have stopped."""

    def __init__(self, signum: int | None, grace_s: float) -> None:
        self.signum = signum
        self.grace_s = grace_s
        self.since: float | None = None  # when the launcher got the signal or a rank reported preemption
        self.signals = 0

    def note(self, now: float) -> None:
        self.since = now if self.since is None else self.since

    def expired(self, now: float) -> bool:
        # The ranks end themselves at the grace period; a few seconds more for their reports to come through.
        return self.since is not None and now > self.since + self.grace_s + 5.0


@contextlib.contextmanager
def _stop_on_termination(procs: list[mp.process.BaseProcess], preemption: _Preemption) -> Iterator[None]:
    """In the main thread: turn SIGTERM/SIGHUP into an exception, so that the ``finally`` that stops the ranks runs;
    the preemption signal is forwarded to the ranks instead (the second one stops them at once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum != preemption.signum:
            raise LauncherSignalled(signum)
        preemption.signals += 1
        if preemption.signals > 1:
            raise Preempted(f"the launcher received a second {name}: every rank was stopped at once; the last good "
                            f"checkpoint stays (exit code {PREEMPTED_EXIT_CODE})")
        preemption.note(time.monotonic())
        print(f"[lightning_par launcher] received {name}: forwarded to every rank, which save a checkpoint at the next "
              f"step boundary and exit (within {preemption.grace_s:g} s; a second {name} stops them at once).",
              file=sys.stderr, flush=True)
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {}
    for sig in {signal.SIGTERM, signal.SIGHUP, preemption.signum} - {None}:
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _preempted_message(outcomes: dict[int, _Outcome], procs: list[mp.process.BaseProcess]) -> str:
    reports = [o.value for r, o in sorted(outcomes.items()) if o.preempted and o.exitcode is None]
    others = [f"rank {r} (pid {procs[r].pid}) {describe_exit(o.exitcode)}" for r, o in sorted(outcomes.items())
              if o.exitcode is not None]
    head = reports[0] if reports else "preempted: no rank saved a checkpoint; the last good one stays"
    if len(reports) == len(outcomes):
        return f"{head} (every rank stopped at that step)"
    return head + ("\nOther ranks: " + "; ".join(others) if others else "")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float | None = 300.0,
    start_method: str | None = None,
    threads_per_rank: int | None = 1,
    env: dict[str, str] | None = None,
    watchdog_s: float | None = None,
    startup_grace_s: float | None = None,
    heartbeat_dir: str | os.PathLike | None = None,
    settle_s: float = 3.0,
    preemption_signal: str | None = None,
    preemption_grace_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local processes and return each rank's return value, by rank.

    ``fn`` runs with the torchrun environment variables set; it (or the Lightning strategy it builds) initialises the
    process group. Return values travel back by pickling, so keep them small (floats, lists, state dicts of tiny
    models).

    Args:
        fn: a module-level function (it must be picklable under ``spawn``).
        world_size: number of processes.
        args: positional arguments, the same for every rank.
        timeout_s: wall-clock seconds for the whole world; past it every process is killed. ``None``: no limit.
        start_method: ``"fork"`` (fast: imports are inherited; the default on CPU, or ``$LP_START_METHOD``) or
            ``"spawn"`` (needed once CUDA is initialised in the parent).
        threads_per_rank: ``torch.set_num_threads`` in each child (1 keeps 8 ranks on 2 cores from thrashing);
            ``None`` leaves torch's default.
        env: extra environment variables for the children.
        watchdog_s: end the world when a rank has recorded no progress for this many seconds after its first step
            (the ranks record it with :class:`~lightning_par.fault.heartbeat.HeartbeatCallback` or
            :func:`~lightning_par.fault.heartbeat.beat`). ``None``: no watchdog.
        startup_grace_s: the limit before a rank's first step is done (default ``max(watchdog_s, 600)``).
        heartbeat_dir: where the ranks record progress (``$LP_HEARTBEAT_DIR`` in the children); a temporary directory,
            removed at the end, when ``None`` and ``watchdog_s`` is set.
        settle_s: after the first failure, seconds to wait for the other ranks' outcomes before naming the cause.
        preemption_signal: ``"SIGTERM"`` or ``"SIGUSR1"``: every rank watches for it
            (:class:`~lightning_par.fault.preemption.PreemptionWatch`, which ``fn`` uses through
            :class:`~lightning_par.fault.preemption.PreemptionCallback`), and the launcher forwards it to every rank.
            ``None``: not handled.
        preemption_grace_s: seconds from the preemption signal until a rank exits at once; the launcher stops what is
            left a few seconds later.

    Returns:
        ``[fn's return value on rank 0, ..., on rank world_size - 1]``.

    Raises:
        ValueError: ``world_size < 1``, or a limit that is not a positive number.
        DistributedRunError: a rank raised (its traceback is in the message), a rank ended without reporting (the
            exit code or the signal by name), a rank stopped progressing for ``watchdog_s``, the world ran past
            ``timeout_s``, or the launcher received SIGTERM/SIGHUP (not the preemption signal). The cause comes first
            in the message.
        lightning_par.fault.preemption.Preempted: a ``SystemExit`` with status 75: the ranks stopped for the
            preemption signal (a checkpoint saved, or the last good one kept); its message says which step. When the
            ranks report no checkpoint to resume from, status ``128 + signal`` (``resumable`` False); after a second
            signal to the launcher the ranks' view is not known (75; the recipe checks its run directory).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not valid: expected an integer >= 1.")
    for name, value in (("timeout_s", timeout_s), ("watchdog_s", watchdog_s), ("startup_grace_s", startup_grace_s)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{name}={value!r} is not valid: expected a number of seconds > 0, or None.")
    preempt_sig = parse_signal(preemption_signal) if preemption_signal is not None else None
    if preempt_sig is not None and (isinstance(preemption_grace_s, bool) or not isinstance(preemption_grace_s, (int, float))
                                    or not preemption_grace_s > 0):
        raise ValueError(f"preemption_grace_s={preemption_grace_s!r} is not valid: expected a number of seconds > 0.")
    method = start_method or os.environ.get("LP_START_METHOD", "fork")
    ctx = mp.get_context(method)
    results: mp.Queue = ctx.Queue()
    port = find_free_port()
    child_env = dict(env or {})
    own_dir = None
    if watchdog_s is not None and heartbeat_dir is None:
        heartbeat_dir = own_dir = tempfile.mkdtemp(prefix="lightning_par-heartbeat-")
    if heartbeat_dir is not None:
        os.makedirs(heartbeat_dir, exist_ok=True)
        for stale in Path(heartbeat_dir).glob("rank-*.json"):  # an earlier run's, in a reused run directory
            stale.unlink(missing_ok=True)
        child_env[HEARTBEAT_DIR_ENV] = str(heartbeat_dir)
    if watchdog_s is not None:
        child_env[LAUNCHER_WATCHDOG_ENV] = "1"
    if preempt_sig is not None:
        child_env[PREEMPTION_SIGNAL_ENV] = preempt_sig.name
        child_env[PREEMPTION_GRACE_ENV] = str(float(preemption_grace_s))
    preemption = _Preemption(preempt_sig, float(preemption_grace_s) if preempt_sig is not None else 0.0)
    grace = startup_grace_s if startup_grace_s is not None else max(watchdog_s or 0.0, 600.0)
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, args, rank, world_size, port, child_env, threads_per_rank, results, os.getpid()),
            name=f"lightning_par-rank{rank}",
            daemon=False,
        )
        for rank in range(world_size)
    ]

    outcomes: dict[int, _Outcome] = {}
    failure: str | None = None
    started_wall = time.time()
    deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
    ended_at: dict[int, float] = {}
    first_failure: float | None = None
    next_watch = time.monotonic() + _WATCHDOG_POLL_S
    preempted: Preempted | None = None
    try:
        with _stop_on_termination(procs, preemption):
            # Children inherit the signal mask and Python handlers of this thread: block the signals while forking,
            # each child installs its own handlers and then unblocks them (a signal meanwhile waits, not lost).
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _LAUNCHER_SIGNALS)
            try:
                for p in procs:
                    p.start()
                    with contextlib.suppress(OSError):  # the child does it too; whichever runs first wins
                        os.setpgid(p.pid, p.pid)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            while failure is None and preempted is None:
                try:
                    rank, kind, value = results.get(timeout=0.2)
                    if kind == _PREEMPTED:
                        message, resumable, _ = value
                        outcomes[rank] = _Outcome(False, message, preempted=True, resumable=resumable)
                    else:
                        outcomes[rank] = _Outcome(True, pickle.loads(value)) if kind else _Outcome(False, value)
                except queue.Empty:
                    pass
                now = time.monotonic()
                for rank, p in enumerate(procs):
                    if rank in outcomes or p.exitcode is None:
                        continue
                    # Ended without a result: give its message a moment to come through the queue.
                    ended_at.setdefault(rank, now)
                    if now - ended_at[rank] > _REPORT_GRACE_S:
                        # 75, or 128 + the preemption signal: a rank that ended itself at its grace period
                        # (preempted_exit_code), with or without a checkpoint to resume from.
                        unresumable = preempt_sig is not None and p.exitcode == 128 + preempt_sig
                        outcomes[rank] = _Outcome(False, exitcode=p.exitcode,
                                                  preempted=p.exitcode == PREEMPTED_EXIT_CODE or unresumable,
                                                  resumable=not unresumable)
                if any(o.preempted for o in outcomes.values()):
                    preemption.note(now)
                if preemption.since is not None:
                    # Preempting: ranks that lose their peers while the others exit are consequences; wait for all.
                    own = [o for o in outcomes.values() if not o.ok and not o.preempted and o.exitcode is None
                           and not _PEER_FAILURE.search(_last_line(o.value))]
                    # A rank that ended itself at its grace period (code 75, no report) leaves no peer to agree with.
                    gave_up = any(o.preempted and o.exitcode is not None for o in outcomes.values())
                    if own:
                        failure = _describe_failure(outcomes, procs)
                    elif len(outcomes) == world_size or gave_up or preemption.expired(now):
                        reported = [o for o in outcomes.values() if o.preempted]
                        resumable = all(o.resumable for o in reported) if reported else True
                        preempted = Preempted(_preempted_message(outcomes, procs), resumable=resumable,
                                              signum=preempt_sig or signal.SIGTERM)
                    continue
                failed = [o for o in outcomes.values() if not o.ok]
                if failed:
                    first_failure = first_failure if first_failure is not None else now
                    # A peer failure ("Connection reset by peer") is a consequence: wait for its cause to show.
                    only_consequences = all(o.exitcode is None and _PEER_FAILURE.search(_last_line(o.value)) for o in failed)
                    wait = settle_s if only_consequences else min(settle_s, 0.5)
                    if len(outcomes) == world_size or now - first_failure > wait:
                        failure = _describe_failure(outcomes, procs)
                    continue
                if len(outcomes) == world_size:
                    break
                if now > deadline:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    states = ", ".join(f"rank {r}: {process_state(procs[r].pid) or 'unknown'}" for r in missing)
                    failure = f"timed out after {timeout_s:.0f} s; ranks {missing} had not finished ({states})"
                elif watchdog_s is not None and now >= next_watch:
                    next_watch = now + _WATCHDOG_POLL_S
                    running = [r for r in range(world_size) if r not in outcomes]
                    pids = {r: procs[r].pid for r in running if procs[r].pid is not None}
                    stalls = stalled_ranks(heartbeat_dir, running, started_wall, watchdog_s, grace, pids)  # type: ignore[arg-type]
                    if stalls:
                        failure = (
                            f"watchdog: {stalls[0].describe()}.\n"
                            + "".join(f"Also idle: {s.describe()}.\n" for s in stalls[1:])
                            + "Every rank was stopped. If a step, a validation or a checkpoint legitimately takes "
                            "longer, raise the limit (trainer.watchdog_s / run_distributed(watchdog_s=...))."
                        )
    finally:
        if failure is not None or len(outcomes) < world_size:
            _stop(procs)
        else:
            for p in procs:
                p.join(timeout=30)
            _stop(procs)
        results.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
    if failure is not None:
        raise DistributedRunError(failure)
    if preempted is not None:
        raise preempted
    return [outcomes[r].value for r in range(world_size)]
