"""``predict_run``: the planner's prediction for a composed run config (the ``"config"`` each job's ``summary.json``
stores), so a sweep report can put predicted next to measured.

Reads the run config the way ``recipes/train.py`` builds the run: the GPT from ``model`` (preset + overrides), the
layout from ``parallel`` (``cp_size`` included), the dp mode / schedule / micro-batches / sequence parallelism / cp
method from ``strategy`` (flat keys, or nested ``strategy.pipeline.*`` / ``strategy.tensor_parallel.*`` /
``strategy.context_parallel.method``), the per-replica batch from ``data.batch_size``
(cut into ``num_microbatches`` by the pipelined strategies) and ``trainer.accumulate_grad_batches``, the precision
from ``trainer.precision``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning_par.planner.devices import DeviceSpec
from lightning_par.planner.layouts import AXIS_OPTIONS, WORLD_SIZE_FIELDS, Layout, comm_axes, size_fields
from lightning_par.planner.plan import predict

__all__ = ["layout_from_run", "model_from_run", "predict_run", "predicted_columns"]

_PIPELINED = ("gpipe", "1f1b", "pipeline", "parallel_3d")
_DP_MODE_OF = {"ddp_overlap": "ddp", "tensor_parallel": "ddp", "gpipe": "ddp", "1f1b": "ddp", "pipeline": "ddp",
               "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}


def _get(cfg: Mapping[str, Any], *paths: str, default: Any = None) -> Any:
    """The first of ``paths`` (dotted) present in ``cfg`` and not None."""
    for path in paths:
        node: Any = cfg
        for key in path.split("."):
            if not isinstance(node, Mapping) or key not in node:
                node = None
                break
            node = node[key]
        if node is not None:
            return node
    return default


def model_from_run(cfg: Mapping[str, Any]) -> Any:
    """The model of a run config: a ``GPTConfig`` from ``model.preset`` and its overrides.

    Raises:
        ValueError: no ``model.preset`` (a model the planner cannot read from the config).
    """
    model = cfg.get("model") or {}
    if "preset" not in model:
        target = model.get("_target_")
        raise ValueError(
            f"model.preset is missing: the planner reads the reference GPT's config (model.preset and its overrides) "
            f"and this model is {'model._target_=' + repr(target) if target else 'not one'}; plan any other model "
            f"with lightning_par.planner.plan(model=ModelSpec(num_params=..., num_layers=..., hidden_size=..., "
            f"num_heads=..., seq_len=..., vocab_size=...)) (docs/planner.md)."
        )
    from lightning_par.models.gpt import GPTConfig

    keys = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "num_experts", "moe_every", "moe_top_k",
            "moe_hidden", "moe_shared_expert")
    overrides = {k: model[k] for k in keys if model.get(k) is not None}
    return GPTConfig.from_preset(model["preset"], **overrides)


def layout_from_run(cfg: Mapping[str, Any]) -> Layout:
    """The :class:`~lightning_par.planner.layouts.Layout` a run config trains with.

    Raises:
        ValueError: a strategy name the planner does not know, or a batch that does not split into micro-batches.
    """
    par = cfg.get("parallel") or {}
    tp, pp, world = int(par.get("tp_size", 1)), int(par.get("pp_size", 1)), int(par.get("world_size", 1))
    sizes = {size: int(par.get(size, 1)) for size in size_fields()}  # cp_size, dp_replicate_size, ep_size
    added = math.prod(n for size, n in sizes.items() if size in WORLD_SIZE_FIELDS)  # cp: in the world size
    dp = int(par.get("dp_size", -1))
    if dp == -1:
        dp = world // (tp * pp * added)
    name = _get(cfg, "strategy.name", default="ddp_overlap")
    if name == "parallel_3d":
        dp_mode = _get(cfg, "strategy.dp_mode", default="ddp")
    elif name in _DP_MODE_OF:
        dp_mode = _DP_MODE_OF[name]
    else:
        raise ValueError(f"strategy.name={name!r} is not valid for predict_run: expected one of "
                         f"{sorted(_DP_MODE_OF) + ['parallel_3d']}.")
    batch = int(_get(cfg, "data.batch_size", default=1))
    accumulate = int(_get(cfg, "trainer.accumulate_grad_batches", default=1))
    if name in _PIPELINED and pp > 1:  # at pp 1 no strategy cuts the batch: one micro-batch per forward
        chunks = int(_get(cfg, "strategy.pipeline.num_microbatches", "strategy.num_microbatches", default=1))
        schedule = _get(cfg, "strategy.pipeline.schedule", "strategy.schedule",
                        default=name if name in ("gpipe", "1f1b") else "1f1b")
    else:
        chunks, schedule = 1, "none"
    if batch % chunks:
        raise ValueError(f"data.batch_size={batch} is not valid with num_microbatches={chunks}: expected a multiple.")
    if pp == 1:
        schedule = "none"
    virtual = _get(cfg, "strategy.pipeline.virtual_stages", "strategy.virtual_stages")
    if virtual is None:
        virtual = 2 if schedule == "interleaved_1f1b" else 1
    sp = bool(_get(cfg, "strategy.tensor_parallel.sequence_parallel", "strategy.sequence_parallel", default=False))
    options = {  # the cp method, read where the axis is used
        o.name: _get(cfg, f"strategy.{o.strategy_key}", default=o.values[0]) if sizes[o.size] > 1 else o.values[0]
        for o in AXIS_OPTIONS
    }
    return Layout(
        dp_size=dp, tp_size=tp, pp_size=pp, dp_mode=dp_mode if dp * added > 1 else "ddp",
        micro_batch_size=batch // chunks, num_microbatches=chunks * accumulate, schedule=schedule,
        virtual_stages=int(virtual), activation_checkpointing="none", sequence_parallel=sp and tp > 1,
        **sizes, **options,
    )


def predict_run(
    run_config: Mapping[str, Any],
    device: str | DeviceSpec | None = None,
    devices_per_node: int | None = None,
    calibration: Any = None,
) -> dict[str, Any]:
    """Predict a run from its composed config.

    Args:
        run_config: the resolved run config as plain containers (``summary.json["config"]``).
        device: the device spec or name; None: ``"cpu"`` (this machine, calibrated) when the run's accelerator is
            the CPU, else a ``ValueError``.
        devices_per_node: None: the run's world size (one node).
        calibration: for ``"cpu"``: the calibration file or object (None: the default file).

    Returns:
        ``{"layout", "device", "step_time_s", "tokens_per_s", "model_state_bytes", "bytes_per_device",
        "activation_bytes", "fits", "mfu", "compute_s", "memory_bound_s", "overhead_s", "tp_comm_s", "cp_comm_s",
        "ep_comm_s", "pp_comm_s", "bubble_s", "dp_comm_s", "optimizer_s"}`` (``<axis>_comm_s`` for each of
        :func:`~lightning_par.planner.layouts.comm_axes`): ``model_state_bytes`` is the largest of any rank
        (parameters + gradients + optimizer state), the other bytes those of the fullest device; times in seconds per
        optimizer step.

    Raises:
        ValueError: a config the planner cannot read, an accelerator without ``device=``, or no CPU calibration.
    """
    layout = layout_from_run(run_config)
    if device is None:
        accelerator = _get(run_config, "trainer.accelerator", default="auto")
        if accelerator == "auto":
            import torch

            accelerator = "gpu" if torch.cuda.is_available() else "cpu"
        if accelerator != "cpu":
            raise ValueError(f"trainer.accelerator={accelerator!r}: pass device= (a preset name or a DeviceSpec).")
        device = "cpu"
    precision = _get(run_config, "trainer.precision", default="32-true")
    pred = predict(
        model_from_run(run_config), layout, device=device,
        devices_per_node=devices_per_node or layout.world_size, precision=precision, calibration=calibration,
    )
    t = pred.time
    return {
        "layout": layout.describe(),
        "device": device if isinstance(device, str) else device.name,
        "step_time_s": t.step_time_s,
        "tokens_per_s": pred.tokens_per_s,
        "model_state_bytes": pred.memory.max_model_state_bytes,
        "bytes_per_device": pred.bytes_per_device,
        "activation_bytes": pred.memory.activation_bytes,
        "fits": pred.fits,
        "mfu": pred.mfu,
        "compute_s": t.compute_s,
        "memory_bound_s": t.memory_bound_s,
        "overhead_s": t.overhead_s,
        "tp_comm_s": t.tp_comm_s,
        **{f"{axis}_comm_s": getattr(t, f"{axis}_comm_s") for axis in comm_axes()},  # cp_comm_s, ep_comm_s
        "pp_comm_s": t.pp_comm_s,
        "bubble_s": t.bubble_s,
        "dp_comm_s": t.dp_comm_s,
        "optimizer_s": t.optimizer_s,
    }


def predicted_columns(summary: Mapping[str, Any], device: str | DeviceSpec | None = None) -> dict[str, Any]:
    """Predicted figures to set beside a run's measured ones in a sweep report.

    Args:
        summary: a run's ``summary.json`` (its ``"config"`` is predicted).
        device: as for :func:`predict_run`.

    Returns:
        ``{"pred_tokens_per_s", "pred_state_mib"}`` (global tokens/s; parameters + gradients + optimizer state of the
        fullest rank, MiB), each ``None`` when the run cannot be predicted (no config, a model or strategy the planner
        does not read, no CPU calibration on this machine).
    """
    try:
        pred = predict_run(summary["config"], device=device)
    except (KeyError, TypeError, ValueError):
        return {"pred_tokens_per_s": None, "pred_state_mib": None}
    return {"pred_tokens_per_s": pred["tokens_per_s"], "pred_state_mib": pred["model_state_bytes"] / 2**20}
