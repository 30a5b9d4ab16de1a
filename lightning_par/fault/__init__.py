"""Reliability: non-finite detection, heartbeats and the watchdog, resuming from the latest complete checkpoint,
and the process facts the launcher uses to name a fault."""

from lightning_par.fault.heartbeat import HeartbeatCallback, beat, read_beats, stalled_ranks
from lightning_par.fault.process import describe_exit, die_with_parent, process_state

__all__ = [
    "HeartbeatCallback",
    "beat",
    "describe_exit",
    "die_with_parent",
    "process_state",
    "read_beats",
    "stalled_ranks",
]
