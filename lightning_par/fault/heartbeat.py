"""Heartbeats: every rank records its progress in a small file; a watchdog ends a job whose ranks stop progressing.

A rank that stops making progress (stopped with SIGSTOP, stuck in a kernel call, spinning in a loop) keeps its peers
waiting inside a collective until the collective timeout (``strategy.timeout_s``, 30 min by default), and a rank
that never reaches the first collective is not covered by that timeout at all. Progress is therefore recorded by
the rank itself at every Lightning hook of a step (:class:`HeartbeatCallback`, throttled to a few writes a second),
as one JSON file per rank ``<dir>/rank-<rank>.json``: ``{"rank", "pid", "time", "step", "phase", "warm"}``
(``time`` in seconds since the epoch; ``warm`` once this process finished its first optimizer step).

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
    "WATCHDOG_EXIT_CODE",
    "Beat",
    "HeartbeatCallback",
    "Stall",
    "beat",
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
    """

    rank: int
    pid: int
    time: float
    step: int
    phase: str
    warm: bool


def _path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.json"


def write_beat(directory: str | Path, rank: int, step: int, phase: str, warm: bool) -> None:
    """Record ``rank``'s progress now (atomically: a reader never sees half a file)."""
    path = _path(directory, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = {"rank": rank, "pid": os.getpid(), "time": time.time(), "step": int(step), "phase": phase, "warm": warm}
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_beats(directory: str | Path) -> dict[int, Beat]:
    """Every rank's last :class:`Beat` in ``directory`` (files that cannot be read are skipped), by rank."""
    beats: dict[int, Beat] = {}
    for path in Path(directory).glob("rank-*.json"):
        try:
            data = json.loads(path.read_text())
            b = Beat(int(data["rank"]), int(data["pid"]), float(data["time"]), int(data["step"]), str(data["phase"]),
                     bool(data["warm"]))
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
            f"last heartbeat at step {self.beat.step} ({self.beat.phase})" if self.beat is not None
            else "no heartbeat since it started"
        )
        pid = f" (pid {self.beat.pid})" if self.beat is not None else ""
        state = f"; its process is {self.state}" if self.state else ""
        return f"rank {self.rank}{pid} made no progress for {self.idle_s:.0f} s (limit {self.limit_s:g} s): {where}{state}"


def stalled_ranks(
    directory: str | Path,
    ranks: list[int],
    started_at: float,
    watchdog_s: float,
    startup_grace_s: float,
    pids: dict[int, int] | None = None,
    now: float | None = None,
) -> list[Stall]:
    """The ranks of ``ranks`` over their progress limit, most likely culprit first.

    A rank is over its limit when ``now`` minus its last heartbeat (``started_at`` if none, or if the file is older
    than ``started_at``: a previous run's, in a reused directory) exceeds ``startup_grace_s`` before its first
    optimizer step and ``watchdog_s`` after. Ranks waiting in a collective for a
    stuck peer go stale too, so the culprit is ordered first: a stopped process, then the rank whose heartbeat is
    oldest (the others kept going until they had to wait for it).

    Args:
        directory: the heartbeat directory.
        ranks: the ranks to check (e.g. those still running).
        started_at: when the ranks were started, seconds since the epoch.
        watchdog_s: limit after the first step, in seconds.
        startup_grace_s: limit before it, in seconds.
        pids: rank -> pid, to read process states of ranks that sent no heartbeat yet.
        now: the current time (``time.time()`` if None).

    Returns:
        The stalled ranks (empty when every rank is within its limit).
    """
    now = time.time() if now is None else now
    beats = read_beats(directory)
    stalls = []
    for rank in ranks:
        b = beats.get(rank)
        if b is not None and b.time < started_at:
            b = None  # left by an earlier run in this directory
        last = b.time if b is not None else started_at
        limit = watchdog_s if (b is not None and b.warm) else startup_grace_s
        idle = now - last
        if idle > limit:
            pid = b.pid if b is not None else (pids or {}).get(rank)
            stalls.append(Stall(rank, idle, limit, b, process_state(pid) if pid else None))
    stalls.sort(key=lambda s: (not (s.state or "").startswith("stopped"), -s.idle_s))
    return stalls


class HeartbeatCallback(L.Callback):
    """Record this rank's progress at every step hook; optionally end the process when it stops progressing.

    Works for any LightningModule and strategy. Writes at most every ``min_interval_s`` seconds (a phase change to
    ``warm`` is always written).

    Args:
        directory: where the heartbeat files go; default ``$LP_HEARTBEAT_DIR``. With neither, the callback does
            nothing.
        watchdog_s: when set (and the local launcher does not watch already, ``$LP_LAUNCHER_WATCHDOG``), a daemon
            thread ends this process with status :data:`WATCHDOG_EXIT_CODE` after ``watchdog_s`` seconds without
            progress, printing which rank is furthest behind. For ``torchrun`` / SLURM, where no parent of ours
            watches.
        startup_grace_s: the limit before the first optimizer step of this process is done (default ``watchdog_s``).
        min_interval_s: least time between two writes.

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
        for name, value in (("watchdog_s", watchdog_s), ("startup_grace_s", startup_grace_s)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"HeartbeatCallback {name}={value!r} is not valid: expected seconds > 0 or None.")
        directory = directory if directory is not None else os.environ.get(HEARTBEAT_DIR_ENV)
        self.directory = Path(directory) if directory else None
        self.watchdog_s = watchdog_s
        self.startup_grace_s = startup_grace_s if startup_grace_s is not None else watchdog_s
        self.min_interval_s = min_interval_s
        self._rank = 0
        self._created = time.time()
        self._last_write = 0.0
        self._last_progress = time.time()
        self._warm = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ recording
    def _beat(self, trainer: L.Trainer, phase: str, force: bool = False) -> None:
        now = time.time()
        self._last_progress = now
        if self.directory is None or (not force and now - self._last_write < self.min_interval_s):
            return
        self._last_write = now
        try:
            write_beat(self.directory, self._rank, trainer.global_step, phase, self._warm)
        except OSError:  # a full or vanished disk must not end the run: the watchdog then names this rank
            pass

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._rank = trainer.global_rank
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._beat(trainer, f"setup:{getattr(stage, 'value', stage)}", force=True)
        launcher_watches = os.environ.get(LAUNCHER_WATCHDOG_ENV) == "1"
        if self.watchdog_s is not None and not launcher_watches and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="lightning_par-watchdog", daemon=True)
            self._thread.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._beat(trainer, f"teardown:{getattr(stage, 'value', stage)}", force=True)
        self._stop.set()
        self._thread = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "train_start", force=True)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._beat(trainer, "train_batch_start")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self._beat(trainer, "before_backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "after_backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._beat(trainer, "before_optimizer_step")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        first = not self._warm
        self._warm = True
        self._beat(trainer, "train_batch_end", force=first)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "validation_start")

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._beat(trainer, "validation_batch_end")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "validation_end")

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._beat(trainer, "save_checkpoint", force=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer, "train_end", force=True)

    # ------------------------------------------------------------------ in-rank watchdog (outside launchers)
    def _watch(self) -> None:
        assert self.watchdog_s is not None and self.startup_grace_s is not None
        poll = min(5.0, self.watchdog_s / 4)
        while not self._stop.wait(poll):
            limit = self.watchdog_s if self._warm else self.startup_grace_s
            idle = time.time() - self._last_progress
            if idle <= limit:
                continue
            lines = [f"lightning_par watchdog: rank {self._rank} made no progress for {idle:.0f} s (limit {limit:g} s)."]
            if self.directory is not None:
                beats = {r: b for r, b in read_beats(self.directory).items() if b.time >= self._created}
                if beats:
                    behind = min(beats.values(), key=lambda b: (b.step, b.time))
                    lines.append(
                        f"Furthest behind: rank {behind.rank} (pid {behind.pid}), last heartbeat at step {behind.step} "
                        f"({behind.phase}) {time.time() - behind.time:.0f} s ago."
                    )
            lines.append("Ending this process so that the launcher ends (or restarts) the job.")
            print("\n".join(lines), file=sys.stderr, flush=True)
            os._exit(WATCHDOG_EXIT_CODE)
