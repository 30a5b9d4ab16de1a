"""Process facts the launcher needs to name a fault: how a process ended, what state it is in, and tying a child's
life to its parent's.

Linux only where noted (``/proc``, ``prctl``); elsewhere the functions degrade to "unknown" rather than fail.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

__all__ = ["ORPHAN_SIGNAL", "describe_exit", "die_with_parent", "process_state"]

#: The parent-death signal of a worker that stops cleanly when its outside launcher dies
#: (:mod:`lightning_par.fault.orphan`): a real-time signal nothing else sends. The kernel may deliver it several times
#: (once each time the worker is handed to another thread of the dying parent), so it cannot be the preemption signal,
#: whose second arrival means "exit at once".
ORPHAN_SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else signal.SIGTERM

#: ``prctl`` option that sets the signal a process receives when its parent thread exits (``<linux/prctl.h>``).
_PR_SET_PDEATHSIG = 1

#: ``/proc/<pid>/stat`` state letters (``man 5 proc``) in words.
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible I/O wait",
    "T": "stopped (SIGSTOP/SIGTSTP)",
    "t": "stopped by a tracer",
    "Z": "a zombie (exited, not reaped)",
    "X": "dead",
    "I": "idle",
}


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, in words, from a ``multiprocessing`` exit code or ``subprocess`` return code.

    Args:
        exitcode: ``None`` (still running), ``>= 0`` (exit status) or ``-N`` (killed by signal ``N``).

    Returns:
        e.g. ``"was killed by signal SIGKILL (9)"``, ``"exited with code 3"``, ``"is still running"``.
    """
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        number = -exitcode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        hint = "; the out-of-memory killer sends it too" if number == signal.SIGKILL else ""
        return f"was killed by signal {name} ({number}{hint})"
    return f"exited with code {exitcode}"


def process_state(pid: int) -> str | None:
    """The scheduler state of ``pid`` in words (from ``/proc/<pid>/stat``), or ``None`` when unknown (no such process,
    or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: the state is the first field after the last ')'.
    fields = stat[stat.rfind(")") + 1 :].split()
    if not fields:
        return None
    return _STATES.get(fields[0], f"state {fields[0]!r}")


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux ``PR_SET_PDEATHSIG``).

    Then a launcher killed with SIGKILL (which cannot run any clean-up) still takes its ranks with it. The signal
    fires when the parent *thread* that created this process exits, so launch from the main thread. If the parent
    already died before this call (a race at start-up), this process exits at once.

    Args:
        sig: the signal to receive.
        expected_parent: the pid of the parent that started this process; when given and the current parent differs
            (the parent is gone and this process was re-parented), exit immediately with status 1.

    Returns:
        ``True`` if the kernel accepted the request, ``False`` where it is not available (not Linux).
    """
    ok = False
    libc_name = ctypes.util.find_library("c")
    if libc_name and os.uname().sysname == "Linux":
        libc = ctypes.CDLL(libc_name, use_errno=True)
        ok = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)
    return ok
