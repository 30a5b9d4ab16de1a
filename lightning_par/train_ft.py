"""The fault-tolerant job on one machine: one torchft lighthouse and ``num_replica_groups`` replica groups.

    python recipes/train_ft.py strategy=zero2 parallel=dp2 model=tiny trainer=smoke \\
        strategy.fault_tolerance.enabled=true strategy.fault_tolerance.num_replica_groups=2

(installed without this repository: ``python -m lightning_par.train_ft ...``). The launcher

1. starts torchft's lighthouse server (the ``torchft_lighthouse`` program of torchft's wheel) as a child process on a
   free port, with ``--min_replicas`` = ``strategy.fault_tolerance.min_replicas`` (its log: ``<run_dir>/lighthouse.log``),
   listening on ``strategy.fault_tolerance.bind`` (``auto``: loopback only; it has no authentication), and waits
   until it answers;
2. starts one recipe world per replica group, ``python -m lightning_par.train`` with the same overrides plus
   ``strategy.fault_tolerance.replica_group_id=g``, the lighthouse's address and the run directory
   ``<run_dir>/group<g>``. Each group's launcher picks its own free ``MASTER_PORT``: its own world;
3. watches the lighthouse while the groups run: its death stops every group and is named at once;
4. waits for every group, writes ``<run_dir>/summary.json`` (each group's summary, under ``groups``) and stops the
   lighthouse. The groups die with this launcher (``PR_SET_PDEATHSIG``), and an exception or signal here kills them
   first: nothing outlives it.

On a cluster the same pieces are started by hand: one ``torchft_lighthouse``, one torchrun (or SLURM job step) per
group (docs/fault-tolerance.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lightning_par.fault_tolerance.options import FaultToleranceOptions, check_lighthouse, url_host
from lightning_par.launcher import find_free_port

__all__ = ["launch_ft_job", "main", "run_ft_recipe"]

#: Lighthouse timings for one machine: a group that stops heartbeating is dropped after 2 s; a quorum waits 5 s for
#: late groups to join (``torchft_lighthouse``'s ``--heartbeat_timeout_ms`` / ``--join_timeout_ms``).
_HEARTBEAT_TIMEOUT_MS, _JOIN_TIMEOUT_MS = 2000, 5000

#: The longest the lighthouse may take to answer after its start.
_LIGHTHOUSE_START_S = 30.0

#: Overrides the launcher sets itself for each group.
_OWN = ("strategy.fault_tolerance.replica_group_id", "strategy.fault_tolerance.lighthouse", "hydra.run.dir")


def _refuse(msg: str) -> ValueError:
    err = ValueError(msg)
    err.lightning_par_refusal = True  # type: ignore[attr-defined]
    return err


def _group_overrides(overrides: list[str], group: int, lighthouse: str, run_dir: Path) -> list[str]:
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in _OWN]
    return [*kept, f"strategy.fault_tolerance.replica_group_id={group}",
            f"strategy.fault_tolerance.lighthouse={lighthouse}", f"hydra.run.dir={run_dir / f'group{group}'}"]


def _bind_host(bind: str) -> str:
    """The lighthouse's listening address: ``strategy.fault_tolerance.bind``, loopback for ``"auto"`` (every group
    runs on this host). Raises the options' ``ValueError`` for a bad value."""
    options = FaultToleranceOptions(bind=bind)
    return "127.0.0.1" if options.bind == "auto" else options.bind_host()


def _reach(host: str) -> str:
    """Where the groups on this host reach a server bound to ``host`` (loopback for a wildcard)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _status(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def _lighthouse_program() -> str:
    """The ``torchft_lighthouse`` program: beside this Python, else on ``PATH``."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise _refuse("strategy.fault_tolerance needs torchft and its torchft_lighthouse program (not found beside "
                      f"{sys.executable} nor on PATH): pip install 'lightning_par[ft]'.")
    return found


def _preexec() -> None:
    # In the lighthouse and each group's launcher, before exec: die with this process, even one killed by SIGKILL.
    # SIGKILL, not SIGTERM: a group's ranks may sit in torchft's quorum wait (native code, up to quorum_timeout_s)
    # where a Python handler does not run, and its launcher would wait for them; its ranks die with it (their own
    # PR_SET_PDEATHSIG).
    from lightning_par.fault.process import die_with_parent

    die_with_parent(signal.SIGKILL)


def launch_ft_job(cfg: DictConfig, overrides: list[str], run_dir: str | Path,
                  timeout_s: float | None = None) -> dict[str, Any]:
    """Start the lighthouse and every replica group of ``cfg``, wait for them, stop the lighthouse.

    Args:
        cfg: the composed recipe config; ``strategy.fault_tolerance.enabled`` must be true.
        overrides: the command line's overrides, passed on to each group.
        run_dir: the job's directory; group ``g`` runs in ``run_dir/group<g>``.
        timeout_s: the longest the groups may run (``None``: ``trainer.job_timeout_s``, else no limit).

    Returns:
        ``{"lighthouse": address, "groups": [summary of group 0, ...]}`` (also written to ``run_dir/summary.json``).

    Raises:
        ValueError: fault tolerance off, a ``lighthouse`` given (this launcher starts its own), a ``bind`` that is not
            an IP address, or torchft missing; before any process starts.
        RuntimeError: a group exited with a non-zero status or ran past ``timeout_s``, or the lighthouse died (every
            group is then stopped); the message names the group (or the lighthouse), its status and its log.
    """
    ft = cfg.strategy.get("fault_tolerance")
    if ft is None or not ft.get("enabled"):
        raise _refuse("strategy.fault_tolerance.enabled=false: the fault-tolerant launcher (train_ft) starts replica "
                      "groups; set strategy.fault_tolerance.enabled=true (and num_replica_groups), or run "
                      "recipes/train.py for one world.")
    if ft.get("lighthouse"):
        raise _refuse(f"strategy.fault_tolerance.lighthouse={ft.lighthouse!r}: train_ft starts its own lighthouse; "
                      "leave it unset (to join an existing lighthouse, run recipes/train.py once per group).")
    try:
        host = _bind_host(ft.get("bind", "auto"))
    except ValueError as err:
        raise _refuse(f"strategy.{err}") from None
    server = _lighthouse_program()
    groups, min_replicas = int(ft.num_replica_groups), int(ft.min_replicas)
    if timeout_s is None:
        timeout_s = cfg.trainer.get("job_timeout_s")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    lighthouse: subprocess.Popen | None = None
    logs = [run_dir / f"group{g}.log" for g in range(groups)]
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def _stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        for s in previous:
            signal.signal(s, _stop)
        port = find_free_port()
        address = f"http://{url_host(_reach(host))}:{port}"
        with open(run_dir / "lighthouse.log", "ab") as log:
            lighthouse = subprocess.Popen(
                [server, "--min_replicas", str(min_replicas), "--bind", f"{url_host(host)}:{port}",
                 "--join_timeout_ms", str(_JOIN_TIMEOUT_MS), "--heartbeat_timeout_ms", str(_HEARTBEAT_TIMEOUT_MS)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_preexec)
        try:
            check_lighthouse(address, _LIGHTHOUSE_START_S)
        except ConnectionError as err:
            raise RuntimeError(f"train_ft: the lighthouse ({server}) did not start: "
                               f"{(run_dir / 'lighthouse.log').read_text(errors='replace')[-2000:]}") from err
        for g in range(groups):
            cmd = [sys.executable, "-m", "lightning_par.train", *_group_overrides(overrides, g, address, run_dir)]
            with open(logs[g], "ab") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                              start_new_session=True, preexec_fn=_preexec))
        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        while any(p.poll() is None for p in procs):
            if lighthouse.poll() is not None:
                raise RuntimeError(
                    f"train_ft: the lighthouse ({address}, pid {lighthouse.pid}) died "
                    f"({_status(lighthouse.returncode)}) while the replica groups ran: no group can form a quorum "
                    f"without it, so every group was stopped (its log: {run_dir / 'lighthouse.log'}; the groups' "
                    f"logs: {run_dir}/group*.log)")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"train_ft: the replica groups ran past {timeout_s} s; every group was stopped "
                                   f"(logs: {run_dir}/group*.log)")
            time.sleep(0.2)
        failed = [(g, p.returncode) for g, p in enumerate(procs) if p.returncode != 0]
        if failed:
            g, rc = failed[0]
            tail = logs[g].read_text(errors="replace")[-4000:]
            raise RuntimeError(f"train_ft: replica group {g} exited with status {rc} (log {logs[g]}):\n{tail}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()
        for s, h in previous.items():
            signal.signal(s, h)
    summaries = []
    for g in range(groups):
        path = run_dir / f"group{g}" / "summary.json"
        summaries.append(json.loads(path.read_text()) if path.exists() else None)
    summary = {"lighthouse": address, "num_replica_groups": groups, "groups": summaries}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


#: Per-group fields the launcher prints at the end.
_PRINTED = ("steps", "final_train_loss", "final_val_loss", "ft_live_replicas", "ft_steps_committed",
            "ft_steps_skipped", "ft_manager_step", "ft_recoveries")


def run_ft_recipe(cfg: DictConfig) -> None:
    """The Hydra task of ``recipes/train_ft.py``: :func:`launch_ft_job` in the Hydra output directory, with the
    command line's overrides; print each group's main figures. A refusal prints its message alone (exit status 1)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    try:
        summary = launch_ft_job(cfg, list(hc.overrides.task), hc.runtime.output_dir)
    except ValueError as err:
        if not getattr(err, "lightning_par_refusal", False):
            raise
        sys.stderr.write(f"Error: {err}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    printed = [{k: (s or {}).get(k) for k in _PRINTED} for s in summary["groups"]]
    print(json.dumps({"groups": printed}, indent=2))


def main() -> None:
    """``python -m lightning_par.train_ft [overrides]``: the fault-tolerant job on the packaged config."""
    import hydra

    import lightning_par  # noqa: F401  (registers the strategies)
    from lightning_par.config.schema import register_configs

    register_configs()
    hydra.main(version_base=None, config_path=None, config_name="config")(run_ft_recipe)()


if __name__ == "__main__":
    main()
