"""A launcher whose ranks run until killed: the test kills THIS process with SIGKILL and checks that no rank is left.

    python launcher_victim_script.py <heartbeat dir>
"""

import sys
import time

from lightning_par.fault.heartbeat import beat
from lightning_par.launcher import run_distributed


def forever() -> None:
    step = 0
    while True:
        beat(step, "sleeping")
        step += 1
        time.sleep(0.2)


if __name__ == "__main__":
    run_distributed(forever, 2, timeout_s=120, heartbeat_dir=sys.argv[1])
