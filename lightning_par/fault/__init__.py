"""Reliability: non-finite detection, heartbeats and the watchdog, preemption, checkpoints a run can resume from, and
the process facts the launcher uses to name a fault.

Callbacks for any Lightning ``Trainer`` (the recipes add all three)::

    from lightning_par.fault import HeartbeatCallback, NonFiniteGuard, StepCheckpoint

    trainer = L.Trainer(..., callbacks=[NonFiniteGuard("stop"), StepCheckpoint("ckpts", every_n_steps=100),
                                        HeartbeatCallback(watchdog_s=300)])
    trainer.fit(module, datamodule=dm, ckpt_path=resolve_ckpt_path(None, "ckpts"))
"""

from lightning_par.fault.heartbeat import HeartbeatCallback, beat, read_beats, stalled_ranks
from lightning_par.fault.no_progress import NoTrainingStepError, ProgressGuard
from lightning_par.fault.nonfinite import NonFiniteError, NonFiniteGuard
from lightning_par.fault.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionCallback
from lightning_par.fault.process import describe_exit, die_with_parent, process_state
from lightning_par.fault.resume import is_complete_checkpoint, latest_checkpoint, resolve_ckpt_path
from lightning_par.fault.step_checkpoint import StepCheckpoint

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "HeartbeatCallback",
    "NoTrainingStepError",
    "NonFiniteError",
    "NonFiniteGuard",
    "Preempted",
    "PreemptionCallback",
    "ProgressGuard",
    "StepCheckpoint",
    "beat",
    "describe_exit",
    "die_with_parent",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "process_state",
    "read_beats",
    "resolve_ckpt_path",
    "stalled_ranks",
]
