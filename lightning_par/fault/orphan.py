"""Workers started by an outside launcher (torchrun's agent, SLURM's ``srun``) end when that launcher dies.

Our own launcher ties its ranks to itself (:func:`lightning_par.launcher.run_distributed`). Under torchrun, a worker
is a child of torchrun's *agent*; killed (SIGKILL), or ended by a signal it does not handle (SIGUSR1, the SLURM
preemption signal: its default action ends the agent at once, status 138), the agent cannot stop its workers, which
would keep training with parent pid 1, write checkpoints, prune the ones a restarted job resumes from, and hold the run
directory. :func:`guard_outside_launcher`, called in every worker as early as the recipe or the strategy starts:

* under torchrun, asks the kernel for a signal to this worker when the agent exits (Linux ``PR_SET_PDEATHSIG``,
  after checking that the parent is still the agent: the request is about the parent alive at the call). Without a
  preemption signal to honour, that signal is SIGKILL. With one (``trainer.preemption_signal``, or a
  :class:`~lightning_par.fault.preemption.PreemptionWatch` installed), it is :data:`~lightning_par.fault.process.
  ORPHAN_SIGNAL`, which the watch turns into the same clean stop as the preemption signal: every worker of the node
  stops at once, the ranks agree at the next step boundary, save that step's checkpoint and exit (within
  ``preemption_grace_s``). Not the preemption signal itself: the kernel sends the parent-death signal again each time
  the worker is handed to another thread of the dying agent (measured: two deliveries for torchrun), and a second
  preemption signal means "exit at once, without a checkpoint". ``PR_SET_PDEATHSIG`` fires when the parent *thread*
  that created the worker exits: torchrun's agent starts its workers from its main thread (``PContext.start``), so
  this is the agent's exit.
* under torchrun and SLURM, watches the parent pid from a thread (every 0.2 s): a worker re-parented (its launcher
  gone) asks its preemption watch for the same clean stop, or, with none, kills itself. Under SLURM this is the only
  guard (``slurmstepd`` may start tasks from a thread that ends before the task, which would fire
  ``PR_SET_PDEATHSIG`` early).

What the agent itself cannot do: torchrun's agent handles only ``--signals-to-handle`` (default
``SIGTERM,SIGINT,SIGHUP,SIGQUIT``): it forwards those to its workers and waits up to its shutdown timeout (30 s) before
SIGKILL. Pass ``--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1`` for the agent to forward SIGUSR1 too.
Either way the agent exits with its own status (1, or 128 + the signal), never the workers' 75: a scheduler that
requeues on status 75 must see a worker's status (``srun`` without torchrun) or the checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

from lightning_par.fault.process import ORPHAN_SIGNAL, die_with_parent

__all__ = ["guard_outside_launcher", "is_orphaned", "outside_launcher"]

#: Seconds between two looks at the parent pid.
_POLL_S = 0.2
#: Seconds an orphaned worker that saved its checkpoint has for its normal exit before it ends itself.
_EXIT_S = 2.0


def outside_launcher(environ: dict[str, str] | None = None) -> str | None:
    """``"torchrun"`` (``TORCHELASTIC_RUN_ID`` set by torchrun's agent), ``"slurm"`` (a task of ``srun``:
    ``SLURM_PROCID`` and ``SLURM_STEP_ID``), or ``None`` (our launcher, or no launcher)."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and env.get("SLURM_STEP_ID") not in (None, ""):
        return "slurm"
    return None


def _say(text: str) -> None:
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    with contextlib.suppress(OSError):
        os.write(2, f"[lightning_par{'' if rank is None else f' rank {rank}'}] {text}\n".encode())


def _is_torchrun(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"torch" in f.read()
    except OSError:
        return False


class _Guard:
    def __init__(self, kind: str, parent: int) -> None:
        self.kind = kind
        self.parent = parent
        self.thread = threading.Thread(target=self._watch, name="lightning_par-orphan-guard", daemon=True)
        self._handled = False
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """At interpreter exit, orphaned: end here. The teardown that follows (the process group's destructor) waits
        on the dead launcher's rendezvous store (measured: 8 s and more), and threads can no longer run then."""
        if os.getppid() == self.parent:
            return
        from lightning_par.fault.preemption import PreemptionWatch

        watch = PreemptionWatch.current()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(watch.exit_code() if watch is not None and watch.stopped.is_set() else 1)

    def set_clean_stop(self, clean_stop: bool) -> None:
        """The parent-death signal: :data:`ORPHAN_SIGNAL` (a clean stop, see the module docstring) or SIGKILL."""
        if clean_stop and threading.current_thread() is threading.main_thread():
            signal.signal(ORPHAN_SIGNAL, self._on_signal)
            signum = ORPHAN_SIGNAL
        else:
            signum = signal.SIGKILL
        if self.kind == "torchrun":
            die_with_parent(signum, expected_parent=self.parent)  # exits (status 1) when the parent is gone already

    def _on_signal(self, signum: int, frame: Any) -> None:
        # The main thread's handler; with a preemption watch installed, its thread acts on the signal first.
        self._orphaned()

    @staticmethod
    def _finish(watch: Any) -> None:
        """Once the checkpoint is saved, leave the normal exit :data:`_EXIT_S` seconds, then end the process (a
        teardown in Python that waits on the dead launcher's store; at interpreter exit :meth:`_at_exit` does it)."""
        watch.stopped.wait()
        time.sleep(_EXIT_S)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(watch.exit_code())

    def _watch(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(_POLL_S)
        self._orphaned()

    def _orphaned(self) -> None:
        from lightning_par.fault.preemption import PreemptionWatch

        launcher = "torchrun's agent" if self.kind == "torchrun" else "the SLURM step"
        watch = PreemptionWatch.current()
        if watch is not None:
            if not self._handled:
                self._handled = True
                if not watch.requested.is_set():
                    _say(f"{launcher} (pid {self.parent}) is gone: stopping as if preempted (checkpoint at the next "
                         f"step boundary, within {watch.grace_s:g} s).")
                threading.Thread(target=self._finish, args=(watch,), name="lightning_par-orphan-exit",
                                 daemon=True).start()
            watch.request()
            return
        _say(f"{launcher} (pid {self.parent}) is gone: this worker stops now (SIGKILL); the last good checkpoint "
             f"stays.")
        os.kill(os.getpid(), signal.SIGKILL)


_guard: _Guard | None = None


def is_orphaned() -> bool:
    """Whether this worker's outside launcher is gone (it was guarded, and its parent changed)."""
    return _guard is not None and os.getppid() != _guard.parent


def guard_outside_launcher(clean_stop: bool = False) -> str | None:
    """Tie this worker's life to its outside launcher (see the module docstring); a no-op under our own launcher.

    Call it in the main thread, as early as possible; again to change ``clean_stop``. The parent is the one seen at
    the first call: a worker whose parent is already gone then (pid 1 that is not torchrun) exits at once with
    status 1.

    Args:
        clean_stop: the worker honours a preemption signal (``trainer.preemption_signal``, a
            :class:`~lightning_par.fault.preemption.PreemptionWatch`): the launcher's death stops it as a preemption
            does (checkpoint, then exit); ``False``: it is killed at once.

    Returns:
        ``"torchrun"`` or ``"slurm"`` when guarded, else ``None`` (no outside launcher, or not Linux).
    """
    global _guard
    kind = outside_launcher()
    if kind is None or os.uname().sysname != "Linux":
        return None
    if _guard is None:
        parent = os.getppid()
        if parent == 1 and not _is_torchrun(1):
            _say("the launcher that started this worker is gone already (parent pid 1): exiting.")
            os._exit(1)
        _guard = _Guard(kind, parent)
        _guard.set_clean_stop(clean_stop)
        _guard.thread.start()
    else:
        _guard.set_clean_stop(clean_stop)
    return kind
