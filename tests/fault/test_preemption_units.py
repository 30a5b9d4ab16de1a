"""The preemption watch without a world: the flag, the second signal, the grace period, the options."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from lightning_par.fault.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionCallback, PreemptionWatch
from tests.support.helpers import in_a_forked_child


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
    def body():
        PreemptionWatch.install(signal.SIGTERM, grace_s=60)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)

    code, took, err = in_a_forked_child(body, timeout_s=120)
    assert code == PREEMPTED_EXIT_CODE, (code, err)
    assert "received a second SIGTERM: exiting at once" in err and took < 60, (took, err)


def test_no_stop_within_the_grace_period_exits_with_the_preemption_code_while_the_main_thread_is_blocked():
    def body():
        PreemptionWatch.install(signal.SIGTERM, grace_s=0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        r, _ = os.pipe()
        os.read(r, 1)  # blocked in C, as in a collective: only the watch thread can end it

    code, took, err = in_a_forked_child(body, timeout_s=120)
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
