"""The registry's presets: each is a :class:`~lightning_par.runtime.core.StrategyCore` that only sets defaults (a dp
mode, the axes it has, a schedule) under the registry names it stands for. Both hosts take them: the Trainer's
strategies are these presets on :class:`lightning_par.strategies.MeshStrategy` (``ZeroStrategy`` is :class:`ZeroCore`
there), and ``Fabric(strategy="zero3")`` holds ``ZeroCore(stage=3)`` as its core. What each strategy does, in full:
``docs/strategies.md``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_par.data_parallel.options import ZERO_STAGES, zero_dp_mode
from lightning_par.parallelize import ParallelOptions
from lightning_par.pipeline_parallel.options import take_schedule
from lightning_par.runtime.core import StrategyCore

__all__ = ["DDPOverlapCore", "Parallel3DCore", "PipelineCore", "PRESETS", "TensorParallelCore", "ZeroCore"]


class DDPOverlapCore(StrategyCore):
    """Data parallelism over the dp axis, the gradient all-reduce bucketed and overlapped with backward (PyTorch DDP,
    Li et al., VLDB 2020, §3.2); logs the communication left exposed (``parallel/comm_exposed_ms``). ``dp_mode="ddp"``,
    every axis but tp and pp; registered as ``"ddp_overlap"``. docs/strategies.md, "ddp_overlap".

    Args:
        dp_size: data-parallel size (``-1``: all processes).
        **options: the reducer group (``bucket_cap_mb``, ``comm_hook`` ``"none"``/``"fp16"``/``"bf16"``/
            ``"powersgd"``, ...) and :class:`~lightning_par.runtime.core.StrategyCore`'s keywords.

    Raises:
        ValueError: an invalid option, or one of an axis this strategy does not have (named in the message).
    """

    strategy_name: ClassVar[str] = "ddp_overlap"
    excluded_axes: ClassVar[frozenset[str]] = frozenset({"tp", "pp"})
    description: ClassVar[str] = "Data parallel, bucketed all-reduce overlapped with backward"

    def __init__(self, dp_size: int = -1, **options: Any) -> None:
        super().__init__(dp_size=dp_size, dp_mode="ddp", **options)


class ZeroCore(StrategyCore):
    """ZeRO (Rajbhandari et al., SC'20) over the dp axes: optimizer state (stage 1), + gradients (2), + parameters (3,
    FSDP2) sharded; HSDP with ``dp_replicate_size > 1``. ``dp_mode=f"zero{stage}"``, every axis but tp and pp;
    registered as ``"zero1"``, ``"zero2"``, ``"zero3"``. docs/strategies.md, "zero1, zero2, zero3".

    Args:
        stage: 1, 2 or 3.
        dp_size: data-parallel size (``-1``: all processes).
        **options: the zero group (:class:`~lightning_par.data_parallel.options.ZeroOptions`: ``cpu_offload``,
            ``mixed_precision``, ``reshard_after_forward``), the reducer group (stages 1-2), and
            :class:`~lightning_par.runtime.core.StrategyCore`'s keywords.

    Raises:
        ValueError: an invalid stage or option (see :func:`~lightning_par.data_parallel.options.resolve_zero_options`);
            before the process group starts: ``cpu_offload=True`` on a CPU device, a model with no trainable
            parameter.
    """

    strategy_name: ClassVar[str] = "zero1"
    excluded_axes: ClassVar[frozenset[str]] = frozenset({"tp", "pp"})
    description: ClassVar[str] = "ZeRO stage 1/2/3 (optimizer state / + gradients / + parameters sharded over dp)"
    registry_names: ClassVar[tuple[str, ...]] = ("zero1", "zero2", "zero3")
    registry_presets: ClassVar[dict[str, dict[str, Any]]] = {f"zero{k}": {"stage": k} for k in ZERO_STAGES}

    def __init__(self, stage: int = 3, dp_size: int = -1, **options: Any) -> None:
        super().__init__(dp_size=dp_size, dp_mode=zero_dp_mode(stage), **options)
        self.strategy_name = f"zero{stage}"  # type: ignore[misc]  # summary.json's "strategy"

    @property
    def stage(self) -> int:
        return int(self.dp_mode[-1])


class TensorParallelCore(StrategyCore):
    """Megatron tensor parallelism over the tp axis (Shoeybi et al. 2019, §3; ``sequence_parallel``: Korthikanti et
    al. 2022) with DTensor, the vocab-parallel loss when the plan has a ``vocab_head``; the dp axis as ``ddp_overlap``.
    ``dp_mode="ddp"``, every axis but pp; registered as ``"tensor_parallel"``. docs/strategies.md, "tensor_parallel".

    Args:
        tp_size: tensor-parallel size.
        dp_size: data-parallel size (``-1``: ``world_size // tp_size``).
        **options: the tensor_parallel group (``sequence_parallel``, ``plan``), the reducer group, and
            :class:`~lightning_par.runtime.core.StrategyCore`'s keywords.

    Raises:
        ValueError: here, an invalid option or plan style name; before the process group starts, a model the plan or
            ``tp_size`` does not fit (heads or widths not divisible by ``tp_size``, a plan naming a missing module,
            sequence parallelism with a model it does not support), each naming the field, value and what is valid.
    """

    strategy_name: ClassVar[str] = "tensor_parallel"
    excluded_axes: ClassVar[frozenset[str]] = frozenset({"pp"})
    description: ClassVar[str] = "Megatron tensor parallelism on tp (DTensor), data parallel on dp"

    def __init__(self, tp_size: int = 2, dp_size: int = -1, **options: Any) -> None:
        super().__init__(dp_size=dp_size, tp_size=tp_size, dp_mode="ddp", **options)


class PipelineCore(StrategyCore):
    """Pipeline parallelism over the pp axis with torch's schedules over micro-batches, ``ddp`` over dp; the model
    meets :mod:`lightning_par.contract` (``loss_fn``; the LightningModule's ``training_step`` is not called). Every axis
    but tp; registered as ``"gpipe"`` and ``"1f1b"`` (the schedule preset) and ``"pipeline"`` (any schedule).
    docs/strategies.md, "gpipe, 1f1b, pipeline".

    Args:
        pp_size: pipeline ranks.
        dp_size: data-parallel replicas (``-1``: the rest of the processes).
        schedule: ``"gpipe"`` (the default), ``"1f1b"``, or another key of
            :data:`lightning_par.pipeline_parallel.options.SCHEDULES`.
        **options: the rest of the pipeline group (:class:`~lightning_par.pipeline_parallel.options.PipelineOptions`),
            the reducer group, and :class:`~lightning_par.runtime.core.StrategyCore`'s keywords.

    Raises:
        ValueError: an invalid option, named in the message; before the process group starts, a model that does not
            fit the pipeline (fewer layers than virtual stages, an explicit split that does not cover it, no
            ``loss_fn``); a batch size that is not a multiple of ``num_microbatches``, before the first step.
    """

    strategy_name: ClassVar[str] = "gpipe"
    excluded_axes: ClassVar[frozenset[str]] = frozenset({"tp"})
    description: ClassVar[str] = "Pipeline parallel on the pp axis (torch's schedules), bucketed all-reduce on dp"
    registry_names: ClassVar[tuple[str, ...]] = ("gpipe", "1f1b", "pipeline")
    registry_presets: ClassVar[dict[str, dict[str, Any]]] = {"gpipe": {"schedule": "gpipe"},
                                                             "1f1b": {"schedule": "1f1b"}, "pipeline": {}}

    def __init__(self, pp_size: int = 2, dp_size: int = -1, schedule: str | None = None, **options: Any) -> None:
        # A bare PipelineStrategy() (and Trainer(strategy="pipeline")) is the preset of its strategy_name, "gpipe", as
        # documented; Hydra's strategy=pipeline and parallel_3d take PipelineOptions.schedule, "1f1b", instead.
        schedule = take_schedule(schedule, options, self.registry_presets[self.strategy_name]["schedule"])
        super().__init__(dp_size=dp_size, pp_size=pp_size, dp_mode="ddp", schedule=schedule, **options)
        self.strategy_name = schedule if schedule in ("gpipe", "1f1b") else "pipeline"  # type: ignore[misc]


class Parallel3DCore(StrategyCore):
    """TP inside each pipeline stage, PP across stages, DP (``dp_mode``) across replicas: ``dp * tp * pp = world``
    (Megatron-LM's PTD-P, Narayanan et al. 2021, §2.3), in :func:`lightning_par.parallelize.parallelize`'s order. Every
    axis and option (:class:`~lightning_par.runtime.core.StrategyCore`'s keywords and errors); ``pp_size=1`` runs the
    model's own steps. Registered as ``"parallel_3d"``. docs/strategies.md, "parallel_3d".
    """

    strategy_name: ClassVar[str] = "parallel_3d"
    excluded_axes: ClassVar[frozenset[str]] = frozenset()
    description: ClassVar[str] = "3D parallel: TP in each pipeline stage, PP across stages, ddp/zero1/zero2/zero3 on dp"

    def __init__(self, dp_size: int = -1, tp_size: int = 1, pp_size: int = 1, dp_mode: str = ParallelOptions.dp_mode,
                 **options: Any) -> None:
        super().__init__(dp_size=dp_size, tp_size=tp_size, pp_size=pp_size, dp_mode=dp_mode, **options)


#: Every preset, in the registry's order; the Trainer's strategies are these on ``MeshStrategy``.
PRESETS: tuple[type[StrategyCore], ...] = (DDPOverlapCore, TensorParallelCore, ZeroCore, PipelineCore, Parallel3DCore)
