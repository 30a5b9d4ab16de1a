"""The preemption watch without a world: the flag, the second signal, the grace period, the options."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from lightning_par.fault.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionCallback, PreemptionWatch


def _in_a_child(body: str) -> tuple[int, float, str]:
    """Run ``body`` (Python source, after ``from lightning_par.fault.preemption import PreemptionWatch``) in a fresh
    interpreter (not a fork of this multi-threaded one); its exit status and how long it took (seconds)."""
    code = "import os, signal, time\nfrom lightning_par.fault.preemption import PreemptionWatch\n" + body
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return proc.returncode, time.monotonic() - started, proc.stderr


def test_a_signal_sets_the_flag_and_uninstall_restores_the_handler():
    before = signal.getsignal(signal.SIGUSR1)
    watch = PreemptionWatch.install(signal.SIGUSR1, grace_s=30)
    try:
        assert PreemptionWatch.current() is watch and not watch.requested.is_set()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.requested.wait(5)
    finally:
        watch.uninstall()
    assert PreemptionWatch.current() is None and signal.getsignal(signal.SIGUSR1) == before


def test_a_second_signal_exits_at_once_with_the_preemption_code():
    code, took, err = _in_a_child(
        "PreemptionWatch.install(signal.SIGTERM, grace_s=60)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.5)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(60)\n"
    )
    assert code == PREEMPTED_EXIT_CODE, (code, err)
    assert "received a second SIGTERM: exiting at once" in err and took < 60, (took, err)


def test_no_stop_within_the_grace_period_exits_with_the_preemption_code_while_the_main_thread_is_blocked():
    code, took, err = _in_a_child(
        "PreemptionWatch.install(signal.SIGTERM, grace_s=0.5)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "r, _ = os.pipe()\n"
        "os.read(r, 1)\n"  # blocked in C, as in a collective: only the watch thread can end it
    )
    assert code == PREEMPTED_EXIT_CODE, (code, err)
    assert "no clean stop within preemption_grace_s=0.5 s after SIGTERM" in err, err


def test_preempted_is_a_system_exit_with_code_75():
    err = Preempted("rank 0: preempted")
    assert isinstance(err, SystemExit) and err.code == 75 == PREEMPTED_EXIT_CODE and str(err) == "rank 0: preempted"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"signal_name": "SIGKILL"}, "preemption_signal='SIGKILL' is not valid: expected one of ['SIGTERM', 'SIGUSR1']"),
    ({"grace_s": 0}, "preemption_grace_s=0 is not valid: expected a number of seconds > 0"),
])
def test_preemption_callback_rejects_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PreemptionCallback(**kwargs)
