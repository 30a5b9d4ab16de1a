"""Calibrate the ``"cpu"`` device from measurements on this machine, and load it.

:func:`calibrate_cpu` starts, for each world size ``N``, ``N`` gloo processes with the thread count the training job
gives them (``cpu_count // N``, at least 1) and measures, with every process busy at once (as in a training step),
as throughputs over a common window:

* ``matmul_flops``: FLOP/s of an fp32 ``(1024 x 128) @ (128 x 512)`` matmul (the small GPT's MLP shapes) per process;
* ``idle_speedup``: the same matmul on rank 0 alone while the others wait, over the busy rate;
* ``op_overhead_s``: seconds per operator of the reference GPT block's forward + backward at a negligible size
  (hidden 16, 4 tokens: dispatch, autograd and module overhead), over its
  :data:`~lightning_par.planner.model.GPT_BLOCK_OPS` operators;
* ``tp_layer_overhead_s``: the same block under the GPT's tensor-parallel plan on a one-rank mesh (DTensor's host
  cost, no communication), minus the plain block's time;
* ``optimizer_tensor_overhead_s`` / ``sharded_optimizer_tensor_overhead_s``: seconds per tensor of an AdamW step over
  64 tiny tensors, plain and as ``Shard(0)`` DTensors on the world's mesh (what the ZeRO modes step);
* ``memory_bandwidth``: bytes/s of a 32 MiB tensor copy (read + write) per process;
* gloo all-reduce latency and bandwidth (``N > 1``): a least-squares fit of ``time = latency + sent / bandwidth``
  over all-reduces of 4 KiB to 4 MiB, with ``sent = 2 n (N-1)/N`` bytes per rank; the per-message latency is the
  fitted latency over the ring's ``2 (N-1)`` steps;
* ``reserved_bytes``: each process's resident set after the imports and the measurements (not available to tensors).

The results go to a JSON file (default ``$LIGHTNING_PAR_CPU_CALIBRATION`` or ``~/.cache/lightning_par/
cpu_calibration.json``) that :func:`load_cpu_device` turns into a :class:`~lightning_par.planner.devices.DeviceSpec`
per world size. Load averages before and after each world are recorded: on a shared machine the figures move with
the load. This module starts processes only in :func:`calibrate_cpu`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_par.comm_cost import all_reduce_bytes, ring_steps
from lightning_par.planner.devices import DeviceSpec

__all__ = ["CpuCalibration", "calibrate_cpu", "default_calibration_path", "load_cpu_device"]

_MATMUL = (1024, 128, 512)
_ALLREDUCE_BYTES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)
_ALLREDUCE_CALLS = 15


def default_calibration_path() -> Path:
    """``$LIGHTNING_PAR_CPU_CALIBRATION`` if set, else ``~/.cache/lightning_par/cpu_calibration.json``."""
    env = os.environ.get("LIGHTNING_PAR_CPU_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "lightning_par" / "cpu_calibration.json"


@dataclass
class CpuCalibration:
    """Measured figures of this machine, per world size.

    Attributes:
        worlds: world size -> measured figures (see the module docstring; keys ``matmul_flops``, ``idle_speedup``,
            ``op_overhead_s``, ``tp_layer_overhead_s``, ``optimizer_tensor_overhead_s``,
            ``sharded_optimizer_tensor_overhead_s``,
            ``memory_bandwidth``, ``allreduce_latency_s``, ``allreduce_bandwidth``, ``message_latency_s``,
            ``reserved_bytes``,
            ``loadavg_before``, ``loadavg_after``).
        machine: ``cpu_count``, ``memory_bytes``, ``torch``, ``platform``, ``measured_at``.
    """

    worlds: dict[int, dict[str, float]] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    def device_spec(self, num_processes: int) -> DeviceSpec:
        """The ``"cpu"`` :class:`~lightning_par.planner.devices.DeviceSpec` for ``num_processes`` processes.

        Raises:
            ValueError: that world size was not calibrated (the message lists those that were).
        """
        if num_processes not in self.worlds:
            raise ValueError(
                f"num_devices={num_processes} is not valid for device='cpu': calibrated world sizes are "
                f"{sorted(self.worlds)}; run lightning_par.planner.calibrate_cpu(world_sizes=[..., {num_processes}])."
            )
        w = self.worlds[num_processes]
        # One process's link: gloo on one host. A world of one has no collective: any finite link will do.
        bandwidth = w.get("allreduce_bandwidth") or self._fallback("allreduce_bandwidth", 1e9)
        latency = w.get("message_latency_s") or self._fallback("message_latency_s", 0.0)
        memory = float(self.machine.get("memory_bytes") or 8 * (1 << 30)) / num_processes
        return DeviceSpec(
            name=f"cpu[{num_processes} processes]",
            memory_bytes=memory,
            peak_flops=w["matmul_flops"],
            memory_bandwidth=w["memory_bandwidth"],
            intra_node_bandwidth=bandwidth,
            inter_node_bandwidth=bandwidth,
            intra_node_latency_s=latency,
            inter_node_latency_s=latency,
            matmul_efficiency=1.0,
            comm_overlap=0.0,  # gloo and compute share the cores: the ddp benchmark's A/B finds ~0 ms hidden a step
            reserved_bytes=min(w["reserved_bytes"], 0.5 * memory),
            idle_speedup=min(float(num_processes), max(1.0, w["idle_speedup"])),
            op_overhead_s=w["op_overhead_s"],
            tp_layer_overhead_s=w["tp_layer_overhead_s"],
            optimizer_tensor_overhead_s=w["optimizer_tensor_overhead_s"],
            sharded_optimizer_tensor_overhead_s=w["sharded_optimizer_tensor_overhead_s"],
            default_precision="fp32",
        )

    def _fallback(self, key: str, default: float) -> float:
        values = [w[key] for w in self.worlds.values() if w.get(key)]
        return values[0] if values else default

    def save(self, path: str | Path | None = None) -> Path:
        """Write the calibration as JSON (parents created); returns the path."""
        path = Path(path) if path is not None else default_calibration_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"machine": self.machine, "worlds": {str(k): v for k, v in sorted(self.worlds.items())}}
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path | None = None) -> CpuCalibration:
        """Read a calibration written by :meth:`save`.

        Raises:
            ValueError: no file at ``path`` (the message says how to make one) or a file that is not a calibration.
        """
        path = Path(path) if path is not None else default_calibration_path()
        if not path.exists():
            raise ValueError(
                f"device='cpu' needs a calibration of this machine, and {path} does not exist: run "
                f"`python recipes/plan_validate.py --calibrate-only` or lightning_par.planner.calibrate_cpu().save()."
            )
        try:
            data = json.loads(path.read_text())
            return cls(worlds={int(k): v for k, v in data["worlds"].items()}, machine=data.get("machine", {}))
        except (KeyError, ValueError, AttributeError) as err:
            raise ValueError(f"{path} is not a CPU calibration file ({err}).") from err


def load_cpu_device(num_processes: int, calibration: CpuCalibration | str | Path | None = None) -> DeviceSpec:
    """The calibrated ``"cpu"`` device for ``num_processes`` processes, from a calibration or its file.

    Raises:
        ValueError: no calibration file, or that world size not calibrated.
    """
    if not isinstance(calibration, CpuCalibration):
        calibration = CpuCalibration.load(calibration)
    return calibration.device_spec(num_processes)


# ---------------------------------------------------------------------------------------------------- measuring
def _seconds_per_call(fn: Any, window_s: float) -> float:
    """Wall seconds per call of ``fn`` averaged over a window of ``window_s`` (after one warm-up call).

    A throughput over the window, not a median of calls: when processes share cores, a short call mostly runs
    within one time slice, so the median would hide the time the process spends descheduled.
    """
    fn()
    calls = 0
    start = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window_s and calls >= 3:
            return elapsed / calls


def _fit_alpha_beta(sent: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares ``seconds = alpha + sent / beta``; returns ``(alpha >= 0, beta > 0)``."""
    n = len(sent)
    mx, my = sum(sent) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sent)
    slope = sum((x - mx) * (y - my) for x, y in zip(sent, seconds)) / sxx if sxx else 0.0
    if slope <= 0:  # latency-bound throughout: use the largest message's rate
        return max(0.0, min(seconds)), max(sent) / max(seconds)
    return max(0.0, my - slope * mx), 1.0 / slope


def _calibration_worker(window_s: float) -> dict[str, float]:
    """One rank's measurements (runs under :func:`lightning_par.launcher.run_distributed`)."""
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.models.gpt import GPT, GPTConfig
    from lightning_par.parallel_dims import ParallelDims
    from lightning_par.models.gpt_tp_plan import gpt_tp_plan
    from lightning_par.tensor_parallel import apply_tensor_parallel
    from lightning_par.planner.model import GPT_BLOCK_OPS

    init_process_group_from_env("gloo", timeout_s=120.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, float] = {}

    def together(fn: Any) -> float:  # every rank runs fn over the same window
        dist.barrier()
        return _seconds_per_call(fn, window_s)

    m, k, n = _MATMUL
    a, b = torch.randn(m, k), torch.randn(k, n)
    seconds = together(lambda: a @ b)
    out["matmul_flops"] = 2 * m * k * n / seconds
    dist.barrier()
    alone = _seconds_per_call(lambda: a @ b, window_s) if rank == 0 else 0.0
    dist.barrier()
    out["idle_speedup"] = (seconds / alone) if rank == 0 else 1.0

    tiny = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=4)
    x = torch.randn(1, 4, 16, requires_grad=True)
    block = GPT(tiny).blocks["0"]
    plain_block = together(lambda: block(x).sum().backward())
    out["op_overhead_s"] = plain_block / GPT_BLOCK_OPS
    # The same block tensor-parallel over a mesh of one rank: DTensor's host cost without any communication.
    dims = ParallelDims(dp_size=world, tp_size=1, world_size=world)
    dims.build_mesh("cpu")
    tp_mesh = dims.get_mesh("tp")
    tp_block = apply_tensor_parallel(GPT(tiny), tp_mesh, gpt_tp_plan()).blocks["0"]
    out["tp_layer_overhead_s"] = max(0.0, together(lambda: tp_block(x).sum().backward()) - plain_block)

    tensors = [torch.nn.Parameter(torch.randn(16 * world)) for _ in range(64)]
    for p in tensors:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(tensors)
    out["optimizer_tensor_overhead_s"] = together(opt.step) / len(tensors)
    mesh = init_device_mesh("cpu", (world,))
    shards = [torch.nn.Parameter(distribute_tensor(torch.randn(16 * world), mesh, [Shard(0)])) for _ in range(64)]
    for p in shards:
        p.grad = distribute_tensor(torch.randn(16 * world), mesh, [Shard(0)])
    sharded_opt = torch.optim.AdamW(shards)
    out["sharded_optimizer_tensor_overhead_s"] = together(sharded_opt.step) / len(shards)

    src, dst = torch.empty(8 << 20), torch.empty(8 << 20)  # 32 MiB each
    out["memory_bandwidth"] = 2 * src.numel() * 4 / together(lambda: dst.copy_(src))

    if world > 1:  # a fixed number of calls on every rank (a time-based loop would desynchronise the collectives)
        sent, secs = [], []
        for size in _ALLREDUCE_BYTES:
            buf = torch.ones(size // 4)
            dist.barrier()
            for _ in range(2):
                dist.all_reduce(buf)
            calls = []
            for _ in range(_ALLREDUCE_CALLS):
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                calls.append(time.perf_counter() - t0)
            secs.append(statistics.median(calls))
            sent.append(all_reduce_bytes(size, world))
        out["allreduce_latency_s"], out["allreduce_bandwidth"] = _fit_alpha_beta(sent, secs)
        out["message_latency_s"] = out["allreduce_latency_s"] / ring_steps("all_reduce", world)
    out["reserved_bytes"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    dist.barrier()
    dist.destroy_process_group()
    return out


#: Figures where more is better (rates); of the others (times), less is better.
_RATES = ("matmul_flops", "memory_bandwidth", "allreduce_bandwidth")


def calibrate_cpu(
    world_sizes: tuple[int, ...] = (1, 2, 4, 8), window_s: float = 1.0, timeout_s: float = 300.0, repeats: int = 1
) -> CpuCalibration:
    """Measure this machine for ``device="cpu"`` at each world size (see the module docstring). Takes a few
    seconds per world size; starts ``N`` processes for each.

    Args:
        world_sizes: process counts to calibrate (each a world of gloo processes).
        window_s: seconds each throughput measurement runs for (all ranks at once).
        timeout_s: limit of each world.
        repeats: measure each world this many times and keep each figure's best (highest rate, lowest time): on a
            shared machine other processes only ever slow a measurement down.

    Returns:
        The :class:`CpuCalibration` (call :meth:`CpuCalibration.save` to make it the default).

    Raises:
        ValueError: a world size below 1.
        lightning_par.launcher.DistributedRunError: a rank failed.
    """
    import torch

    from lightning_par.launcher import run_distributed

    for w in world_sizes:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"world_sizes={world_sizes!r} is not valid: expected positive integers.")
    cpus = os.cpu_count() or 1
    cal = CpuCalibration(machine={
        "cpu_count": cpus,
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    })
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is not valid: expected an integer >= 1.")
    for w in sorted(set(world_sizes)):
        before = os.getloadavg()[0]
        measured = []
        for _ in range(repeats):
            ranks = run_distributed(_calibration_worker, w, (window_s,), timeout_s=timeout_s,
                                    threads_per_rank=max(1, cpus // w))
            figures = {key: statistics.median(r[key] for r in ranks) for key in ranks[0]}
            figures["idle_speedup"] = ranks[0]["idle_speedup"]
            figures["reserved_bytes"] = max(r["reserved_bytes"] for r in ranks)
            measured.append(figures)
        best = {key: (max if key in _RATES or key == "reserved_bytes" else min)(m[key] for m in measured)
                for key in measured[0]}
        best["idle_speedup"] = statistics.median(m["idle_speedup"] for m in measured)
        best.update(loadavg_before=before, loadavg_after=os.getloadavg()[0], repeats=repeats)
        cal.worlds[w] = best
    return cal
