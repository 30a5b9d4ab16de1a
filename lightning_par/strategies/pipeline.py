"""``PipelineStrategy``: pipeline parallelism on the pp axis with torch's schedules, inside Lightning's loop.

Lightning removed its only pipeline strategy in 1.4 (Lightning issue #17180 asks for one). This one cuts the network
into stages, runs one of torch's schedules over micro-batches inside ``training_step``
(:mod:`lightning_par.pipeline_parallel.steps`, :mod:`lightning_par.pipeline_parallel.engine`), and leaves the rest to
Lightning: the optimizer step, schedulers, accumulation, clipping (by the whole model's norm), validation, logging,
callbacks and checkpoints.
"""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_par.pipeline_parallel.options import take_schedule
from lightning_par.strategies.base import MeshStrategy

__all__ = ["PipelineStrategy"]


class PipelineStrategy(MeshStrategy):
    """Pipeline parallelism over the pp axis of the mesh, data parallelism (``ddp``) over the dp axis.

    The LightningModule keeps its network at ``.model`` (an ``nn.Sequential``, an ``nn.ModuleList``, or a network with
    ``pipeline_layers()``/``pipeline_stage()``, as the reference GPT) and defines ``loss_fn(outputs, targets)``; batches
    are ``(inputs, targets)`` or mapped by ``pipeline_batch(batch)``. The LightningModule's ``training_step`` is not
    called: see :mod:`lightning_par.contract`. It logs ``train_loss``, ``val_loss``, ``parallel/pp_bubble`` (the
    measured idle share of the step, mean over pp ranks) and ``parallel/pp_bubble_formula``; ``summary_extras()``
    reports busy and idle time per pp rank and the peak micro-batches whose activations a rank held. A preset of
    :class:`MeshStrategy` with ``dp_mode="ddp"`` and every axis but tp. Registered as ``"gpipe"`` and ``"1f1b"`` (the
    schedule preset) and ``"pipeline"`` (any schedule).

    Args:
        pp_size: pipeline ranks.
        dp_size: data-parallel replicas (``-1``: the rest of the processes).
        schedule: ``"gpipe"`` (the default), ``"1f1b"``, or another key of
            :data:`lightning_par.pipeline_parallel.options.SCHEDULES`.
        **options: the rest of the pipeline group (:class:`~lightning_par.pipeline_parallel.options.PipelineOptions`),
            the reducer group, and :class:`MeshStrategy`'s keywords.

    Raises:
        ValueError: an invalid option, named in the message; before the process group starts, a model that does not
            fit the pipeline (fewer layers than virtual stages, an explicit split that does not cover it, no
            ``loss_fn``); a batch size that is not a multiple of ``num_microbatches``, before the first step.
    """

    strategy_name: ClassVar[str] = "gpipe"
    excluded_axes: ClassVar[frozenset[str]] = frozenset({"tp"})
    description: ClassVar[str] = "Pipeline parallel on the pp axis (torch's schedules), bucketed all-reduce on dp"
    registry_names: ClassVar[tuple[str, ...]] = ("gpipe", "1f1b", "pipeline")
    registry_presets: ClassVar[dict[str, dict[str, Any]]] = {
        "gpipe": {"schedule": "gpipe"},
        "1f1b": {"schedule": "1f1b"},
        "pipeline": {},
    }

    def __init__(self, pp_size: int = 2, dp_size: int = -1, schedule: str | None = None, **options: Any) -> None:
        # A bare PipelineStrategy() (and Trainer(strategy="pipeline")) is the preset of its strategy_name, "gpipe", as
        # documented; Hydra's strategy=pipeline and parallel_3d take PipelineOptions.schedule, "1f1b", instead.
        schedule = take_schedule(schedule, options, self.registry_presets[self.strategy_name]["schedule"])
        super().__init__(dp_size=dp_size, pp_size=pp_size, dp_mode="ddp", schedule=schedule, **options)
        self.strategy_name = schedule if schedule in ("gpipe", "1f1b") else "pipeline"  # type: ignore[misc]
