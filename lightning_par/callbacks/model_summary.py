"""Lightning's model summary of the whole model, whatever the layout.

Lightning's ``ModelSummary`` callback counts ``pl_module.parameters()`` on the rank that prints: under pipelining
that is one stage's parameters (15.3 K of a 30.1 K model). :class:`WholeModelSummary` is Lightning's
``ModelSummary`` with its counts taken from :meth:`lightning_par.parallelize.ParallelModel.parameter_counts` (every
stage, sharded parameters at their global shape). :func:`install` makes the Trainer's ``ModelSummary`` /
``RichModelSummary`` callbacks use it when the Trainer's strategy is a lightning_par one; each layer row counts the
parameters under its name in the whole model. Under pipelining the rows list the modules present on the printing rank
(the network and, deeper, its first stage's layers) and the example-input forward (input/output sizes) is skipped:
the stages are not the network.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary

from lightning_par.compat.lightning import summary_max_depth

__all__ = ["WholeModelSummary", "install", "whole_model_summary"]


class WholeModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` of ``model`` counting the whole model.

    Args:
        model: the LightningModule (this rank's part of it).
        max_depth: as Lightning's.
        counts: ``{one-process parameter name: (elements, requires_grad)}`` of the whole model.
        forward_example: run ``example_input_array`` through the module for input/output sizes (Lightning's default;
            ``False`` under pipelining).
    """

    def __init__(self, model: Any, max_depth: int, counts: dict[str, tuple[int, bool]],
                 forward_example: bool = True) -> None:
        self._counts = counts
        self._forward_example = forward_example
        self._summarized = model  # our own reference (Lightning keeps its own in a private attribute)
        super().__init__(model, max_depth)

    def summarize(self) -> dict[str, LayerSummary]:
        if self._forward_example:
            return super().summarize()
        model = self._summarized
        example, model.example_input_array = model.example_input_array, None
        try:
            return super().summarize()
        finally:
            model.example_input_array = example

    @property
    def param_nums(self) -> list[int]:
        return [sum(n for name, (n, _) in self._counts.items() if name.startswith(layer + "."))
                for layer in self.layer_names]

    @property
    def total_parameters(self) -> int:
        return sum(n for n, _ in self._counts.values())

    @property
    def trainable_parameters(self) -> int:
        return sum(n for n, trainable in self._counts.values() if trainable)


def _summary(callback: ModelSummaryCallback, trainer: Any, pl_module: Any) -> Any:
    parallel = getattr(trainer.strategy, "parallel", None)
    if parallel is None or parallel.module is not pl_module:
        return type(callback)._summary(callback, trainer, pl_module)
    return WholeModelSummary(pl_module, summary_max_depth(callback), parallel.parameter_counts(),
                             forward_example=not parallel.dims.pp_enabled)


def install(trainer: Any) -> None:
    """Make the Trainer's ``ModelSummary`` callbacks (``RichModelSummary`` too) summarize the whole model when its
    strategy parallelized the module (once per callback; a plain strategy keeps Lightning's summary)."""
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, ModelSummaryCallback) and "_summary" not in callback.__dict__:
            callback._summary = lambda trainer, pl_module, callback=callback: _summary(callback, trainer, pl_module)


def whole_model_summary(trainer: Any, max_depth: int = 1) -> ModelSummary:
    """The summary of ``trainer.lightning_module`` counting the whole model (Lightning's
    ``summarize(trainer.lightning_module)`` counts this rank's part). Collective over the pp group under pipelining:
    call it on every rank, after the strategy's ``setup`` (from ``on_fit_start`` on)."""
    return _summary(ModelSummaryCallback(max_depth=max_depth), trainer, trainer.lightning_module)
