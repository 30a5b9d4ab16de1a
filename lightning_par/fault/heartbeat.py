"""Heartbeats: every rank records its progress in a small file; a watchdog ends a job whose ranks stop progressing.

A rank that stops making progress (stopped with SIGSTOP, stuck in a kernel call, spinning in a loop) keeps its peers
waiting inside a collective until the collective timeout (``strategy.timeout_s``, 30 min by default), and a rank
that never reaches the first collective is not covered by that timeout at all. Progress is therefore recorded by
the rank itself at every Lightning hook of a step (:class:`HeartbeatCallback`), as one JSON file per rank
``<dir>/rank-<rank>.json``: ``{"rank", "pid", "time", "step", "phase", "warm", "where", "collective"}`` (``time``:
when the rank last made progress, seconds since the epoch; ``phase``: one of :data:`PHASES`; ``warm`` once this
process finished its first optimizer step). The hooks only update memory; a recorder thread writes the file a few
times a second, so the file always shows the phase the rank is in, also when it blocks right after entering it. Once
the rank has been idle for a second, the recorder adds where its main thread is (``where``: the innermost line of
user code; ``collective``: the collective it waits in, :mod:`lightning_par.fault.where`).

The rank that stopped is the one *behind*: peers that wait for it in a collective go idle too, and one of them may
have gone idle first. :func:`culprit_key` orders ranks by progress: a stopped process first, then the lowest step,
then the earliest phase of that step, then a rank that is not waiting in a collective, then the oldest heartbeat.

Two watchdogs read them:

* the local launcher (:func:`lightning_par.launcher.run_distributed` with ``watchdog_s``) checks every rank's file
  and ends the whole world when one rank has made no progress for ``watchdog_s`` seconds (``startup_grace_s`` until
  its first step is done: imports, data preparation, process-group set-up and the first step take longer), naming
  the rank, its last step and its process state (:func:`stalled_ranks`);
* under an outside launcher (``torchrun``, SLURM) there is no parent of ours, so each rank runs a daemon thread
  that watches its own progress (:class:`HeartbeatCallback` ``watchdog_s``): when it stalls, it prints which rank
  is furthest behind (from the files of the ranks that share the directory) and exits the process, which makes
  ``torchrun`` or ``srun`` end (or restart) the job.

Torchtitan and Megatron-LM guard the same failure with a flight-recorder/NCCL watchdog thread; this one is
backend-independent (gloo on CPU has no watchdog) and measures progress, not collective completion.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from lightning_par.fault.process import process_state

__all__ = [
    "HEARTBEAT_DIR_ENV",
    "LAUNCHER_WATCHDOG_ENV",
    "PHASES",
    "WATCHDOG_EXIT_CODE",
    "Beat",
    "HeartbeatCallback",
    "Stall",
    "beat",
    "culprit_key",
    "read_beats",
    "stalled_ranks",
    "write_beat",
]

#: Environment variable holding the heartbeat directory (set by the launcher for its ranks).
HEARTBEAT_DIR_ENV = "LP_HEARTBEAT_DIR"
#: Set to ``"1"`` by the local launcher when it watches the heartbeats itself (the ranks then run no thread).
LAUNCHER_WATCHDOG_ENV = "LP_LAUNCHER_WATCHDOG"
#: Exit status of a rank ended by its own watchdog thread (``timeout(1)``'s convention).
WATCHDOG_EXIT_CODE = 124

#: The phases a rank records, in the order a rank passes them at one value of ``step`` (the trainer's
#: ``global_step``, which grows at the optimizer step: a step's checkpoint, validation and the next batch's loading
#: come at the new value, before that batch's forward). Any other phase (a user's :func:`beat`) sorts before them.
PHASES = ("setup", "checkpointing", "validation", "data loading", "forward", "backward", "optimizer step", "end")
#: Seconds without progress after which the recorder adds where the main thread is.
_LOCATE_AFTER_S = 1.0


@dataclass(frozen=True)
class Beat:
    """One rank's last recorded progress.

    Attributes:
        rank: global rank.
        pid: its process id.
        time: when it was recorded, seconds since the epoch.
        step: the trainer's ``global_step`` then (optimizer steps done).
        phase: the hook that recorded it (``"train_batch_end"``, ``"validation_batch_end"``, ``"save_checkpoint"``, ...).
        warm: whether this process had finished its first optimizer step.
        where: where its main thread was when it had been idle for a second (``None`` before).
        collective: the collective that thread waited in then, if any.
    """

    rank: int
    pid: int
    time: float
    step: int
    phase: str
    warm: bool
    where: str | None = None
    collective: str | None = None

    def describe(self) -> str:
        """``"step 3, forward, in training_step (model.py:42): time.sleep(60)"``, or ``"... waiting in all_reduce"``."""
        text = f"step {self.step}, {self.phase}"
        if self.collective:
            text += f", waiting in collective {self.collective}"
        if self.where:
            text += f", at {self.where}"
        return text


def _path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.json"


def write_beat(
    directory: str | Path,
    rank: int,
    step: int,
    phase: str,
    warm: bool,
    at: float | None = None,
    where: str | None = None,
    collective: str | None = None,
) -> None:
    """Record ``rank``'s progress (atomically: a reader never sees half a file).

    Args:
        at: when the progress was made, seconds since the epoch (default now).
        where, collective: see :class:`Beat`.
    """
    path = _path(directory, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    data = {"rank": rank, "pid": os.getpid(), "time": time.time() if at is None else at, "step": int(step),
            "phase": phase, "warm": warm, "where": where, "collective": collective}
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_beats(directory: str | Path) -> dict[int, Beat]:
    """Every rank's last :class:`Beat` in ``directory`` (files that cannot be read are skipped), by rank."""
    beats: dict[int, Beat] = {}
    for path in Path(directory).glob("rank-*.json"):
        try:
            data = json.loads(path.read_text())
            b = Beat(int(data["rank"]), int(data["pid"]), float(data["time"]), int(data["step"]), str(data["phase"]),
                     bool(data["warm"]), data.get("where"), data.get("collective"))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        beats[b.rank] = b
    return beats


def beat(step: int = 0, phase: str = "step", warm: bool = True) -> None:
    """Record this rank's progress in ``$LP_HEARTBEAT_DIR`` (no-op when it is not set); for code that runs under
    :func:`~lightning_par.launcher.run_distributed` without Lightning. ``RANK`` names the rank."""
    directory = os.environ.get(HEARTBEAT_DIR_ENV)
    if directory:
        write_beat(directory, int(os.environ.get("RANK", "0")), step, phase, warm)


@dataclass(frozen=True)
class Stall:
    """A rank that made no progress for longer than allowed.

    Attributes:
        rank: global rank.
        idle_s: seconds since its last heartbeat (since the start when it never sent one).
        limit_s: the limit that applied (``startup_grace_s`` before its first step, ``watchdog_s`` after).
        beat: its last heartbeat, or ``None`` if it never sent one.
        state: its process state in words (``"stopped (SIGSTOP/SIGTSTP)"``, ``"sleeping"``, ...) or ``None``.
    """

    rank: int
    idle_s: float
    limit_s: float
    beat: Beat | None
    state: str | None

    def describe(self) -> str:
        """One line naming the rank, how long it was idle, where it was and what its process is doing."""
        where = (
            f"last heartbeat at {self.beat.describe()}" if self.beat is not None else "no heartbeat since it started"
        )
        pid = f" (pid {self.beat.pid})" if self.beat is not None else ""
        state = f"; its process is {self.state}" if self.state else ""
        return f"rank {self.rank}{pid} made no progress for {self.idle_s:.0f} s (limit {self.limit_s:g} s): {where}{state}"


def culprit_key(beat: Beat | None, state: str | None = None) -> tuple:
    """Sort key putting the rank most likely to hold the others up first: a stopped process, then the least progress
    (lower ``step``, then earlier phase of :data:`PHASES`; no heartbeat at all is least), then a rank that is not
    waiting in a collective, then the oldest heartbeat."""
    stopped = (state or "").startswith("stopped")
    if beat is None:
        return (not stopped, -1, -1, False, 0.0)
    phase = PHASES.index(beat.phase) if beat.phase in PHASES else -1
    return (not stopped, beat.step, phase, beat.collective is not None, beat.time)


def stalled_ranks(
    directory: str | Path,
    ranks: list[int],
    started_at: float,
    watchdog_s: float,
    startup_grace_s: float,
    pids: dict[int, int] | None = None,
    now: float | None = None,
) -> list[Stall]:
    """When a rank of ``ranks`` is over its progress limit: every idle rank, the one that holds the others up first.

    A rank is over its limit when ``now`` minus its last heartbeat (``started_at`` if none, or if the file is older
    than ``started_at``: a previous run's, in a reused directory) exceeds ``startup_grace_s`` before its first
    optimizer step and ``watchdog_s`` after. Ranks waiting in a collective for a stuck peer go idle too, and may go
    over the limit before it: so once one rank is over, every rank idle for at least half its limit is a candidate,
    ordered by :func:`culprit_key` (a stopped process, then the one behind).

    Args:
        directory: the heartbeat directory.
        ranks: the ranks to check (e.g. those still running).
        started_at: when the ranks were started, seconds since the epoch.
        watchdog_s: limit after the first step, in seconds.
        startup_grace_s: limit before it, in seconds.
        pids: rank -> pid, to read process states of ranks that sent no heartbeat yet.
        now: the current time (``time.time()`` if None).

    Returns:
        The idle ranks, culprit first (empty when every rank is within its limit).
    """
    now = time.time() if now is None else now
    beats = read_beats(directory)
    idle: list[Stall] = []
    over = False
    for rank in ranks:
        b = beats.get(rank)
        if b is not None and b.time < started_at:
            b = None  # left by an earlier run in this directory
        last = b.time if b is not None else started_at
        limit = watchdog_s if (b is not None and b.warm) else startup_grace_s
        seconds = now - last
        over = over or seconds > limit
        if seconds > limit / 2:
            pid = b.pid if b is not None else (pids or {}).get(rank)
            idle.append(Stall(rank, seconds, limit, b, process_state(pid) if pid else None))
    if not over:
        return []
    idle.sort(key=lambda s: culprit_key(s.beat, s.state))
    return idle


class HeartbeatCallback(L.Callback):
    """Record this rank's progress and phase at every step hook; optionally end the process when it stops progressing.

    Works for any LightningModule and strategy. The hooks only note the step and phase (:data:`PHASES`) in memory; a
    recorder thread writes them every ``min_interval_s`` seconds when they changed (at once for a change to ``warm``
    or to ``checkpointing``), and adds where the main thread is once it has been idle for a second.

    Args:
        directory: where the heartbeat files go; default ``$LP_HEARTBEAT_DIR``. With neither, nothing is written (the
            in-rank watchdog still runs).
        watchdog_s: when set (and the local launcher does not watch already, ``$LP_LAUNCHER_WATCHDOG``), a daemon
            thread ends this process with status :data:`WATCHDOG_EXIT_CODE` after ``watchdog_s`` seconds without
            progress, printing which rank holds the others up. For ``torchrun`` / SLURM, where no parent of ours
            watches.
        startup_grace_s: the limit before the first optimizer step of this process is done (default ``watchdog_s``).
        min_interval_s: seconds between two writes of the recorder.

    Raises:
        ValueError: a limit that is not a positive number.
    """

    def __init__(
        self,
        directory: str | Path | None = None,
        watchdog_s: float | None = None,
        startup_grace_s: float | None = None,
        min_interval_s: float = 0.25,
    ) -> None:
        for name, value in (("watchdog_s", watchdog_s), ("startup_grace_s", startup_grace_s),
                            ("min_interval_s", min_interval_s)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"HeartbeatCallback {name}={value!r} is not valid: expected seconds > 0 or None.")
        directory = directory if directory is not None else os.environ.get(HEARTBEAT_DIR_ENV)
        self.directory = Path(directory) if directory else None
        self.watchdog_s = watchdog_s
        self.startup_grace_s = startup_grace_s if startup_grace_s is not None else watchdog_s
        self.min_interval_s = min_interval_s
        self._rank = 0
        self._created = time.time()
        # (time, step, phase): replaced as a whole by the main thread, read by the recorder (atomic under the GIL).
        self._progress: tuple[float, int, str] = (time.time(), 0, "setup")
        self._warm = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def _last_progress(self) -> float:
        return self._progress[0]

    # ------------------------------------------------------------------ recording
    def _beat(self, trainer: L.Trainer, phase: str, now_: bool = False) -> None:
        self._progress = (time.time(), trainer.global_step, phase)
        if now_:
            self._wake.set()

    def _write(self, where: str | None = None, collective: str | None = None) -> None:
        if self.directory is None:
            return
        at, step, phase = self._progress
        try:
            write_beat(self.directory, self._rank, step, phase, self._warm, at=at, where=where, collective=collective)
        except OSError:  # a full or vanished disk must not end the run: the watchdog then names this rank
            pass

    def _record(self) -> None:
        """The recorder thread: write what changed; once the main thread is idle, where it is."""
        from lightning_par.fault.where import locate

        written: tuple = ()
        located_for: tuple = ()
        while not self._stop.is_set():
            self._wake.wait(self.min_interval_s)
            self._wake.clear()
            state = (self._progress, self._warm)
            if state != written:
                self._write()
                written = state
            elif time.time() - self._progress[0] > _LOCATE_AFTER_S and located_for != state:
                loc = locate()
                self._write(loc.where if loc else None, loc.collective if loc else None)
                located_for = state

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._rank = trainer.global_rank
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._beat(trainer, "setup")
        self._write()
        self._stop.clear()
        if self.directory is not None:
            self._start(self._record, "lightning_par-heartbeat")
        launcher_watches = os.environ.get(LAUNCHER_WATCHDOG_ENV) == "1"
        if self.watchdog_s is not None and not launcher_watches:
            self._start(self._watch, "lightning_par-watchdog")

    def _start(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._beat(trainer, "end")
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            if thread.name == "lightning_par-heartbeat":
                thread.join(timeout=5)
        self._threads = []
        self._write()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "data loading")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._beat(trainer, "forward")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self._beat(trainer, "backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._beat(trainer, "optimizer step")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        first = not self._warm
        self._warm = True
        self._beat(trainer, "data loading", now_=first)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "validation")

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._beat(trainer, "validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "data loading")

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._beat(trainer, "checkpointing", now_=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "end", now_=True)

    # ------------------------------------------------------------------ in-rank watchdog (outside launchers)
    def _watch(self) -> None:
        assert self.watchdog_s is not None and self.startup_grace_s is not None
        poll = min(5.0, self.watchdog_s / 4)
        while not self._stop.wait(poll):
            limit = self.watchdog_s if self._warm else self.startup_grace_s
            idle = time.time() - self._last_progress
            if idle <= limit:
                continue
            print(self._stall_report(idle, limit), file=sys.stderr, flush=True)
            os._exit(WATCHDOG_EXIT_CODE)

    def _stall_report(self, idle: float, limit: float) -> str:
        """What this rank's watchdog prints: itself, then the rank that holds the others up (from the shared files)."""
        from lightning_par.fault.where import locate

        loc = locate()
        here = f" It is at step {self._progress[1]}, {self._progress[2]}"
        if loc is not None:
            here += (f", waiting in collective {loc.collective}" if loc.collective else "") + f", at {loc.where}"
        lines = [f"lightning_par watchdog: rank {self._rank} made no progress for {idle:.0f} s (limit {limit:g} s)."
                 + here + "."]
        if self.directory is not None:
            beats = [b for b in read_beats(self.directory).values() if b.time >= self._created]
            if beats:
                behind = min(beats, key=lambda b: culprit_key(b, process_state(b.pid)))
                lines.append(
                    f"Holding the others up: rank {behind.rank} (pid {behind.pid}), last heartbeat "
                    f"{time.time() - behind.time:.0f} s ago at {behind.describe()}."
                )
        lines.append("Ending this process so that the launcher ends (or restarts) the job.")
        return "\n".join(lines)
