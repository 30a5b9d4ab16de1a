"""Preemption: a signal to any rank, to the launcher or to every rank ends the job at the next step boundary with a
checkpoint, and the exit code :data:`PREEMPTED_EXIT_CODE` ("preempted, resumable").

A cluster announces preemption with a signal (SLURM: SIGTERM, or SIGUSR1 with ``--signal=USR1@120``; torchrun
forwards SIGTERM to every worker), sometimes to one process only. Three parts:

* :class:`PreemptionWatch` (one per process) turns the signal into a flag. Its Python handler does nothing itself: the
  interpreter's C handler writes the signal number to a wake-up pipe (``signal.set_wakeup_fd``), which a thread
  reads, so the signal is noticed also while the main thread is blocked inside a collective. The first signal sets
  the flag and starts the grace period; a second signal, or the end of the grace period, ends the process at once
  with :data:`PREEMPTED_EXIT_CODE` (a checkpoint is committed atomically or not at all, so the last good one stays).
* :class:`PreemptionCallback`, at every step boundary (``on_train_batch_end``), agrees on the flag with an
  all-reduce (MAX) over every rank, which every rank runs at the same point of the same step: no collective ever runs
  in a signal handler. When any rank was signalled, every rank saves the step's checkpoint
  (:meth:`~lightning_par.fault.step_checkpoint.StepCheckpoint.save_now`) and stops; ``fit`` returns, and the caller
  raises :class:`Preempted`. Lightning's own SIGTERM handler (its ``SignalConnector``, which broadcasts from inside
  the handler on the signalled rank only, a collective the other ranks never join) is switched off.
* the launcher (:func:`lightning_par.launcher.run_distributed`) forwards the signal to its ranks and exits with
  the same code; under torchrun each worker exits with it.

Status 75 means "resume": it is used only when a checkpoint to resume from exists (the one just saved, or an earlier
complete one). Preempted with nothing to resume from (``trainer.checkpoint=false``, no checkpoint callback, nothing
saved yet), the status is ``128 + the signal's number`` (143 for SIGTERM, 138 for SIGUSR1: what the signal itself
would have given), so that a scheduler requeuing on 75 does not restart the job from step 0 forever
(:func:`preempted_exit_code`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from typing import Any

import lightning as L

from lightning_par.fault.process import ORPHAN_SIGNAL

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PREEMPTION_GRACE_ENV",
    "PREEMPTION_SIGNALS",
    "PREEMPTION_SIGNAL_ENV",
    "Preempted",
    "PreemptionCallback",
    "PreemptionWatch",
    "parse_signal",
    "preempted_exit_code",
]

log = logging.getLogger(__name__)

#: Exit status of a preempted job or rank: a checkpoint was saved (or the last good one kept) and ``ckpt_path=last``
#: continues. ``EX_TEMPFAIL`` of ``sysexits.h``: "a temporary failure, the user is invited to retry".
PREEMPTED_EXIT_CODE = 75
#: The signals that can announce preemption.
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
#: Set by the launcher for its ranks: the preemption signal's name, and the grace period in seconds.
PREEMPTION_SIGNAL_ENV = "LP_PREEMPTION_SIGNAL"
PREEMPTION_GRACE_ENV = "LP_PREEMPTION_GRACE_S"


def preempted_exit_code(resumable: bool, signum: int = signal.SIGTERM) -> int:
    """The exit status of a preempted job: :data:`PREEMPTED_EXIT_CODE` (75) when a checkpoint to resume from exists,
    else ``128 + signum`` (the status the signal itself gives a process it ends)."""
    return PREEMPTED_EXIT_CODE if resumable else 128 + int(signum)


def parse_signal(name: str, field: str = "preemption_signal") -> signal.Signals:
    """The signal named ``name`` (one of :data:`PREEMPTION_SIGNALS`).

    Raises:
        ValueError: another name; the message names ``field``.
    """
    if name not in PREEMPTION_SIGNALS:
        raise ValueError(f"{field}={name!r} is not valid: expected one of {list(PREEMPTION_SIGNALS)}.")
    return signal.Signals[name]


def _check_grace(grace_s: Any) -> float:
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s > 0:
        raise ValueError(f"preemption_grace_s={grace_s!r} is not valid: expected a number of seconds > 0.")
    return float(grace_s)


class Preempted(SystemExit):
    """The run stopped because of a preemption signal; its exit status is :data:`PREEMPTED_EXIT_CODE` when a
    checkpoint to resume from exists, else ``128 + signum`` (:func:`preempted_exit_code`).

    A ``SystemExit``, so that a script (and a Hydra sweep, which stops) ends with that status; ``str()`` is the
    message (a plain ``SystemExit`` would print it and exit with 1).

    Args:
        message: what stopped, at which step, with which checkpoint.
        resumable: whether a checkpoint to resume from exists.
        signum: the preemption signal (sets the status when not resumable).
    """

    def __init__(self, message: str, resumable: bool = True, signum: int = signal.SIGTERM) -> None:
        super().__init__(preempted_exit_code(resumable, signum))
        self.message = message
        self.resumable = resumable
        self.signum = int(signum)

    def __str__(self) -> str:
        return self.message


def _say(text: str) -> None:
    rank = os.environ.get("RANK")
    # One system call, no lock: ranks share the stream, and this may run in a freshly forked process.
    with contextlib.suppress(OSError):
        os.write(2, f"[lightning_par{'' if rank is None else f' rank {rank}'}] {text}\n".encode())


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler: nothing to do here (the wake-up pipe tells the watch thread)."""


def _kept(code: int) -> str:
    if code == PREEMPTED_EXIT_CODE:
        return "the last good checkpoint stays"
    return "there is no checkpoint to resume from (not resumable)"


class PreemptionWatch:
    """This process's preemption flag, set by ``signum`` (see the module docstring).

    Use :meth:`install` (main thread); :meth:`current` returns the installed watch.

    Args:
        signum: the preemption signal.
        grace_s: seconds from the first signal until the process ends at once with :data:`PREEMPTED_EXIT_CODE`.

    Raises:
        ValueError: ``grace_s`` not a positive number.
    """

    _current: PreemptionWatch | None = None

    def __init__(self, signum: int, grace_s: float) -> None:
        self.signum = signal.Signals(signum)
        self.grace_s = _check_grace(grace_s)
        self.requested = threading.Event()
        self.requested_at: float | None = None
        #: Set by :meth:`saved`: the step's checkpoint is written and the process is on its way out.
        self.stopped = threading.Event()
        #: Whether a checkpoint to resume from exists (set by :class:`PreemptionCallback`); ``None``: assume one
        #: does. Decides the status of an exit at once (:func:`preempted_exit_code`).
        self.resumable: Any = None
        self._count = 0
        self._stop = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._previous: tuple[Any, int] | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def current(cls) -> PreemptionWatch | None:
        """The watch installed in this process, if any."""
        return cls._current

    @classmethod
    def install(cls, signum: int, grace_s: float) -> PreemptionWatch:
        """Install a watch for ``signum`` (or return the one installed for it).

        Raises:
            RuntimeError: not called from the main thread (Python handles signals there only), or a watch for another
                signal is installed.
        """
        if cls._current is not None:
            if cls._current.signum != signum:
                raise RuntimeError(f"a preemption watch for {cls._current.signum.name} is installed already")
            return cls._current
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionWatch.install must run in the main thread")
        watch = cls(signum, grace_s)
        r, w = os.pipe()
        os.set_blocking(w, False)
        watch._pipe = (r, w)
        old_handler = signal.signal(watch.signum, _ignore)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        watch._previous = (old_handler, old_fd)
        watch._thread = threading.Thread(target=watch._run, name="lightning_par-preemption", daemon=True)
        watch._thread.start()
        cls._current = watch
        return watch

    def uninstall(self) -> None:
        """Restore the signal's previous handler and wake-up fd (main thread); a pending grace period is dropped."""
        if PreemptionWatch._current is not self:
            return
        PreemptionWatch._current = None
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous[1])
            signal.signal(self.signum, self._previous[0])
        self._stop.set()
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._pipe[1], b"\0")

    def saved(self) -> None:
        """The checkpoint of the agreed step is saved and this process is on its way out with
        :data:`PREEMPTED_EXIT_CODE`: ignore further signals from now on (main thread), so that an outside launcher
        that signals the ranks still running once the first one exited (torchrun) does not turn a clean exit into
        death by signal (at interpreter exit, Python would reset a Python-level handler to the default, which ends
        the process). SIGTERM too when the preemption signal is another one (SIGUSR1): torchrun ends the workers
        still running with SIGTERM. The grace period still bounds the exit."""
        if threading.current_thread() is threading.main_thread():
            for signum in {self.signum, signal.SIGTERM}:
                signal.signal(signum, signal.SIG_IGN)
        self.stopped.set()

    def exit_code(self) -> int:
        """The status of an exit at once now: 75 if a checkpoint to resume from exists, else ``128 + signum``."""
        try:
            resumable = True if self.resumable is None else bool(self.resumable())
        except Exception:  # noqa: BLE001 - deciding the status must not stop the exit
            resumable = True
        return preempted_exit_code(resumable, self.signum)

    def request(self) -> None:
        """Ask for the stop the signal asks for, without a signal (the orphan guard, when the launcher is gone): the
        flag and the grace period start as with a first signal; a later signal counts as the first."""
        if not self.requested.is_set():
            self.requested_at = time.monotonic()
            self.requested.set()

    def _run(self) -> None:
        assert self._pipe is not None
        r = self._pipe[0]
        while not self._stop.is_set():
            timeout = 1.0
            if self.requested_at is not None:
                left = self.requested_at + self.grace_s - time.monotonic()
                if left <= 0:
                    code = self.exit_code()
                    _say(f"no clean stop within preemption_grace_s={self.grace_s:g} s after {self.signum.name}: "
                         f"exiting at once with code {code}; {_kept(code)}.")
                    os._exit(code)
                timeout = min(timeout, left)
            ready, _, _ = select.select([r], [], [], timeout)
            if not ready:
                continue
            for number in os.read(r, 512):
                if number == self.signum and not self._stop.is_set():
                    self._note()
                elif number == ORPHAN_SIGNAL and not self._stop.is_set() and not self.requested.is_set():
                    # The outside launcher died (lightning_par.fault.orphan): a clean stop.
                    _say(f"the launcher that started this process is gone: stopping as if preempted (checkpoint at "
                         f"the next step boundary, within {self.grace_s:g} s).")
                    self.request()

    def _note(self) -> None:
        self._count += 1
        if self._count == 1:
            self.request()
            _say(f"received {self.signum.name}: saving a checkpoint at the next step boundary, then exiting with code "
                 f"{PREEMPTED_EXIT_CODE} (within {self.grace_s:g} s; a second {self.signum.name} exits at once).")
        else:
            code = self.exit_code()
            _say(f"received a second {self.signum.name}: exiting at once with code {code}; {_kept(code)}.")
            os._exit(code)


class PreemptionCallback(L.Callback):
    """Agree on a preemption signal at every step boundary; save the step's checkpoint and stop when any rank got one.

    After ``fit`` returns, :attr:`preempted_at_step` is the step saved (``None`` when no signal came); the caller then
    exits (``raise preemption.error(rank)``): with :data:`PREEMPTED_EXIT_CODE` when a checkpoint to resume from
    exists (:attr:`resumable`), else ``128 + signum``. The checkpoint is written by the trainer's
    :class:`~lightning_par.fault.step_checkpoint.StepCheckpoint` callbacks (none: the run stops without one).

    Args:
        signal_name: ``"SIGTERM"`` or ``"SIGUSR1"``.
        grace_s: seconds from the signal until the process exits at once (see :class:`PreemptionWatch`).
        checkpoint_dir: a directory of ``step-<N>.ckpt`` the job resumes from (the recipe's ``<run dir>/checkpoints``),
            consulted by :attr:`resumable` besides the trainer's checkpoint callbacks (also before ``fit``).

    Raises:
        ValueError: an unknown signal or a grace period that is not a positive number.
    """

    def __init__(self, signal_name: str = "SIGTERM", grace_s: float = 60.0,
                 checkpoint_dir: str | os.PathLike | None = None) -> None:
        self.signum = parse_signal(signal_name)
        self.checkpoint_dir = checkpoint_dir
        self.grace_s = _check_grace(grace_s)
        self.preempted_at_step: int | None = None
        self.checkpoint: str | None = None
        self._watch: PreemptionWatch | None = None
        self._trainer: L.Trainer | None = None

    def setup_watch(self) -> None:
        """Start watching for the signal now (main thread), before ``fit``: a signal during start-up is kept."""
        if threading.current_thread() is threading.main_thread():
            self._watch = PreemptionWatch.install(self.signum, self.grace_s)
            # Under torchrun/SLURM: the agent's death now brings this signal (a checkpoint, then exit), not SIGKILL.
            from lightning_par.fault.orphan import guard_outside_launcher

            guard_outside_launcher(clean_stop=True)
        else:
            self._watch = PreemptionWatch.current()
        if self._watch is not None:
            self._watch.resumable = lambda: self.resumable

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning_par.compat import disable_lightning_signal_handlers

        disable_lightning_signal_handlers(trainer)
        self._trainer = trainer
        if self._watch is None:
            self.setup_watch()

    @property
    def resumable(self) -> bool:
        """Whether a checkpoint to resume from exists: the one saved at preemption, or a complete one in a
        :class:`~lightning_par.fault.step_checkpoint.StepCheckpoint` directory (another checkpoint callback: its
        last saved file)."""
        from lightning_par.fault.resume import latest_checkpoint
        from lightning_par.fault.step_checkpoint import StepCheckpoint

        if self.checkpoint is not None and os.path.exists(self.checkpoint):
            return True
        if self.checkpoint_dir is not None and latest_checkpoint(self.checkpoint_dir, on_skip=None) is not None:
            return True
        if self._trainer is None:
            return False

        for callback in self._trainer.checkpoint_callbacks:
            if isinstance(callback, StepCheckpoint):
                if callback.dirpath and latest_checkpoint(callback.dirpath, on_skip=None) is not None:
                    return True
            elif getattr(callback, "last_model_path", "") and os.path.exists(callback.last_model_path):
                return True
        return False

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.preempted_at_step is not None or self._watch is None:
            return
        if not self._agreed(trainer, self._watch.requested.is_set()):
            return
        from lightning_par.fault.step_checkpoint import StepCheckpoint

        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, StepCheckpoint):
                self.checkpoint = callback.save_now(trainer) or self.checkpoint
        self.preempted_at_step = trainer.global_step
        self._watch.saved()
        trainer.should_stop = True
        log.warning("Preempted at step %d: checkpoint %s", trainer.global_step, self.checkpoint)

    @staticmethod
    def _agreed(trainer: L.Trainer, flag: bool) -> bool:
        """Whether any rank's flag is set: an all-reduce (MAX) over every rank of the default group."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        device = trainer.strategy.root_device
        tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def message(self, rank: int) -> str:
        """What a preempted rank reports: the step, the checkpoint, how to continue (or that it cannot)."""
        saved = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint callback: nothing saved"
        if self.resumable:
            return (f"rank {rank}: preempted by {self.signum.name} at step {self.preempted_at_step} ({saved}); "
                    f"exit code {PREEMPTED_EXIT_CODE}, resume with ckpt_path=last")
        return (f"rank {rank}: preempted by {self.signum.name} at step {self.preempted_at_step} ({saved}); no "
                f"checkpoint to resume from, so not resumable: exit code {preempted_exit_code(False, self.signum)} "
                f"(not {PREEMPTED_EXIT_CODE}; trainer.checkpoint=true saves one at preemption)")

    def error(self, rank: int) -> Preempted:
        """The ``Preempted`` to raise after ``fit``: status 75 when :attr:`resumable`, else ``128 + signum``."""
        return Preempted(self.message(rank), resumable=self.resumable, signum=self.signum)
