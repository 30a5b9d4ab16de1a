"""The parallel runtime: what a training step needs, for any host loop (Lightning's Trainer, Lightning Fabric).

* :mod:`lightning_par.runtime.core` — :class:`~lightning_par.runtime.core.StrategyCore`: the strategy's keywords
  validated (sizes, option groups, timeout), the layout they give, the options :func:`~lightning_par.parallelize.
  parallelize` runs with under a precision.
* :mod:`lightning_par.runtime.step` — the step on a :class:`~lightning_par.parallelize.ParallelModel`: batch
  preparation (every axis's batch transform), forward and loss (aux-loss factor, document masks, the axes' step
  wrappers: token weighting over cp and dp), backward between the dp engine's hooks, the gradient finishers, clipping,
  evaluation, the global token mean, and the one-call step of a loop that gives the batch and a loss function.
* :mod:`lightning_par.runtime.host` — what a host's strategy does around the step: world ranks, the process group and
  the mesh, the model's checks before the group, building or reusing the ParallelModel, stage refusals, resharding,
  teardown, the loss and step contexts.
* :mod:`lightning_par.runtime.collectives` — the process group's start and the host's collectives.
* :mod:`lightning_par.runtime.checkpoint` — the model's and optimizers' state for sharded checkpoints, and the record
  written beside it.

The two hosts are adapters: :class:`lightning_par.strategies.MeshStrategy` (Lightning's hooks) and
:class:`lightning_par.fabric.MeshStrategy` (Fabric's). This package imports neither of them, nor ``lightning.pytorch``,
nor the layout planner (``tests/runtime/test_runtime_layers.py``). A host hands its own parts in as arguments (its
precision plugin's backward, its collective helpers), so one implementation of the step serves both.

This file imports nothing: ``lightning_par.parallelize`` reaches :mod:`lightning_par.runtime.step` through
:mod:`lightning_par.steps` while it is itself being imported.
"""
