"""A layout planner: the best dp x tp x pp (dp mode, micro-batches, schedule, checkpointing) for N devices, and with
``cp_sizes``, ``dp_replicate_sizes`` and ``ep_sizes`` the layouts of context parallelism, HSDP and expert parallelism
(a MoE model). Each axis's rules and communication time come from its folder's ``planner.py`` through the axis
registry (:class:`~lightning_par.axis_registry.PlannerTerms`).

Predicts, for every valid layout of a model, the memory per device (model state per ZeRO stage, activations per
Korthikanti et al. 2022, buffers) and the step time (compute, exposed communication, pipeline bubble, optimizer),
and ranks them::

    from lightning_par.models import GPTConfig
    from lightning_par.planner import plan

    ranked = plan(model=GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304),
                  num_devices=64, devices_per_node=8, device="h100-80gb", global_batch_size=512, seq_len=2048)
    best = ranked[0]   # best.dp_size, best.tp_size, best.pp_size, best.bytes_per_device, best.step_time_s

Everything here is pure Python and starts no process, except :func:`calibrate_cpu` (measures this machine) and the
validation harness in :mod:`lightning_par.planner.validate`.
"""

from lightning_par.planner.calibrate import CpuCalibration, calibrate_cpu, load_cpu_device
from lightning_par.planner.devices import DEVICE_PRESETS, DeviceSpec, get_device
from lightning_par.planner.layouts import CHECKPOINTING, DP_MODES, SCHEDULES, Layout, check_layout, enumerate_layouts
from lightning_par.planner.memory import MemoryBreakdown, predict_memory
from lightning_par.planner.model import ModelSpec, model_spec
from lightning_par.planner.overrides import layout_overrides
from lightning_par.planner.plan import Prediction, plan, predict
from lightning_par.planner.precision import PRECISIONS, Precision, get_precision
from lightning_par.planner.report import format_table, to_csv, to_markdown, to_rows
from lightning_par.planner.run_config import predict_run, predicted_columns
from lightning_par.planner.step_time import TimeBreakdown, bubble_fraction, predict_step_time

__all__ = [
    "CHECKPOINTING",
    "DEVICE_PRESETS",
    "DP_MODES",
    "PRECISIONS",
    "SCHEDULES",
    "CpuCalibration",
    "DeviceSpec",
    "Layout",
    "MemoryBreakdown",
    "ModelSpec",
    "Precision",
    "Prediction",
    "TimeBreakdown",
    "bubble_fraction",
    "calibrate_cpu",
    "check_layout",
    "enumerate_layouts",
    "format_table",
    "get_device",
    "get_precision",
    "layout_overrides",
    "load_cpu_device",
    "model_spec",
    "plan",
    "predict",
    "predict_memory",
    "predict_run",
    "predict_step_time",
    "predicted_columns",
    "to_csv",
    "to_markdown",
    "to_rows",
]
