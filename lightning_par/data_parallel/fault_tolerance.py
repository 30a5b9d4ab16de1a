"""The former place of :mod:`lightning_par.fault_tolerance` (its own folder now); its public names, re-exported for
code that imports them from here."""

from lightning_par.fault_tolerance import (
    FaultToleranceOptions,
    FaultTolerantReplicas,
    check_fault_tolerance,
    check_lighthouse,
    check_train_data,
    is_loopback_host,
    move_train_data,
    url_host,
)

__all__ = ["FaultToleranceOptions", "FaultTolerantReplicas", "check_fault_tolerance", "check_lighthouse",
           "check_train_data", "is_loopback_host", "move_train_data", "url_host"]
