"""What a host's strategy does around the step, the same under both adapters: start the layout (world ranks, process
group, mesh), check and build the :class:`~lightning_par.parallelize.ParallelModel`, refuse a stage the layout cannot
run, tear down.

``host`` is the host's strategy (Lightning's or Fabric's ``ParallelStrategy``), read through the attributes both have
(``cluster_environment``, ``node_rank``, ``num_nodes``, ``num_processes``, ``local_rank``, ``global_rank``,
``root_device``); ``core`` is its :class:`~lightning_par.runtime.core.StrategyCore` (the Trainer's strategy is one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_par.compat.fabric import default_process_group_backend_for_device
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelModel, parallel_model_of, parallelize, validate
from lightning_par.precision import check_precision
from lightning_par.runtime import collectives

__all__ = [
    "HostDevices", "is_set_up", "loss_context", "refuse_stage", "reshard", "run_parts", "set_world_ranks",
    "setup_parallel_model", "split_batch", "start_layout", "step_context", "unparallelize_previous", "validate_model",
]

_log = logging.getLogger(__name__)


class HostDevices:
    """The devices of a host's strategy (a mixin of both adapters): one per local process, this one's by local
    rank."""

    parallel_devices: list[torch.device] | None
    local_rank: int

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0


def set_world_ranks(host: Any) -> None:
    """This process's global rank and the world size, from the host's node rank, processes per node and local rank;
    the rank ``rank_zero_only`` prints on."""
    if host.cluster_environment is not None:
        host.cluster_environment.set_global_rank(host.node_rank * host.num_processes + host.local_rank)
        host.cluster_environment.set_world_size(host.num_nodes * host.num_processes)
    rank_zero_only.rank = host.global_rank


def start_layout(core: Any, host: Any, check: Callable[[ParallelDims], None] | None = None,
                 before: Callable[[], None] | None = None) -> ParallelDims:
    """Resolve ``core``'s sizes against the host's world and check them, run ``check(dims)`` (both before any process
    group starts), start the process group (:func:`~lightning_par.runtime.collectives.start_process_group`; backend:
    the core's, else nccl on CUDA and gloo on CPU; ``before`` as there), build the mesh; ``core.parallel_dims`` is then
    the layout returned.

    Raises:
        ValueError: the sizes do not multiply to the world size, or the layout's options do not fit it
            (:meth:`~lightning_par.parallelize.ParallelOptions.check_layout`); what ``check`` raises.
    """
    dims = core.resolve_parallel_dims(host.num_nodes * host.num_processes)
    core.options.check_layout(dims.pp_size)
    if check is not None:
        check(dims)
    backend = core.process_group_backend or default_process_group_backend_for_device(host.root_device)
    core.process_group_backend = backend
    collectives.start_process_group(host.cluster_environment, backend, core.timeout_s, before=before)
    dims.build_mesh(host.root_device.type)
    core.parallel_dims = dims
    return dims


def validate_model(core: Any, dims: ParallelDims, module: Any, device: Callable[[], Any], scaler: bool,
                   later: bool) -> bool:
    """Check ``module`` against the layout before the process group starts: the layout's options, the precision
    (``core.precision``; ``scaler``: fp16 loss scaling is on), ``cpu_offload`` against ``device()`` (asked only
    then), and all of :func:`lightning_par.parallelize.validate` unless ``later`` (the layers are built later) or
    ``module`` was parallelised already (it is reused as it is). Returns whether ``validate`` ran.

    Raises:
        ValueError: see :func:`lightning_par.parallelize.validate`; ``cpu_offload=True`` on a CPU device; fp16 loss
            scaling (``"16-mixed"``) with pipelining.
    """
    core.options.check_layout(dims.pp_size)
    check_precision(core.precision, dims.pp_size, scaler)
    if core.options.zero is not None and core.options.zero.cpu_offload and device().type == "cpu":
        raise ValueError(
            "cpu_offload=True is not valid on a CPU device: FSDP2's CPUOffloadPolicy moves shards between an "
            "accelerator and the CPU. Run on a GPU or set cpu_offload=False."
        )
    if module is None or later or parallel_model_of(module) is not None:
        return False
    validate(module, dims, core.options)
    return True


def unparallelize_previous(module: Any, current: ParallelModel | None) -> None:
    """A ``module`` that another run parallelised (not ``current``, this host's) goes back to its plain form with the
    trained values (:meth:`~lightning_par.parallelize.ParallelModel.unparallelize`: collective, with that run's
    meshes); nothing happens to a plain module or to ``current``'s.

    Raises:
        RuntimeError: the process group the module was parallelised with is gone.
    """
    previous = parallel_model_of(module) if module is not None else None
    if previous is None or previous is current:
        return
    if not dist.is_initialized():
        raise RuntimeError(
            f"{type(module).__name__} was parallelised by an earlier lightning_par run whose process group is "
            f"gone, so its shards cannot be gathered back: build a new module and load the earlier run's "
            f"checkpoint (lightning_par.checkpoint.load_from_checkpoint), or keep the process group alive."
        )
    previous.unparallelize()


def is_set_up(module: Any, parallel: ParallelModel | None) -> bool:
    """Whether ``module`` is the one ``parallel`` (this host's) holds: then it is on its device and converted already,
    and is reused as it is. Moving or converting it again would replace every DTensor parameter's tensor
    (``nn.Module._apply`` swaps tensor subclasses), which drops the gradient hooks of the dp reducer and of tensor
    parallelism: measured, 0 hook calls after ``.cpu()`` on CPU, and zero gradients for the split parameters at dp 2 x
    tp 2."""
    return parallel is not None and parallel_model_of(module) is parallel


def setup_parallel_model(module: Any, current: ParallelModel | None, dims: ParallelDims, options: Any,
                         **kwargs: Any) -> ParallelModel:
    """``current`` if it holds ``module`` (set up again: reused as it is); else ``module`` parallelised
    (:func:`lightning_par.parallelize.parallelize` with ``kwargs``: collective), after ``current``'s hooks on another
    module are removed (its engines stay, undone if that module is parallelised again)."""
    if current is not None and current.module is module:
        return current
    if current is not None:
        current.remove_hooks()
    return parallelize(module, dims, options, **kwargs)


def loss_context(parallel: ParallelModel | None) -> AbstractContextManager[Any]:
    """The context a loss's forward and backward must run in (the vocab-parallel loss of a tp ``vocab_head``), else a
    no-op context."""
    return parallel.loss_context() if parallel is not None else nullcontext()


@contextmanager
def step_context(precision: Any, parallel: ParallelModel | None) -> Generator[None, None, None]:
    """Around each forward of a step the runtime runs itself (a pipeline schedule): the host precision plugin's
    ``forward_context()`` (autocast) and :func:`loss_context`."""
    with precision.forward_context(), loss_context(parallel):
        yield


def refuse_stage(parallel: ParallelModel | None, stage: str) -> None:
    """Refuse ``stage`` (``"predict"``, ...) under a layout that cannot run it (an axis's
    :attr:`~lightning_par.axis_registry.Build.refused_stages`).

    Raises:
        ValueError: the axis's reason (e.g. a sequence split over ranks: each ``predict_step`` would see its piece
            of every sequence only, and return outputs for that piece).
    """
    reason = parallel.refused_stages.get(stage) if parallel is not None else None
    if reason:
        raise ValueError(reason)


def reshard(parallel: ParallelModel | None) -> None:
    """Reshard the parameters after an evaluation loop (ZeRO-3 leaves the last ones gathered)."""
    if parallel is not None:
        parallel.engine.reshard()


def run_parts(parts: list[tuple[str, Callable[[], Any] | None]], failed: bool) -> None:
    """Run each ``(name, part)`` of a teardown in order (``None``: skipped). After the run's error (``failed``) every
    part is tried and none of its own errors replaces the user's: an error raised here would be printed last, the
    user's exception buried above it."""
    for name, part in parts:
        if part is None:
            continue
        if not failed:
            part()
            continue
        try:
            part()
        except Exception as err:  # noqa: BLE001 - the user's error is the one to see
            _log.debug("teardown after the run's error: %s failed: %r", name, err)


def split_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``(batch, the other positional arguments, the other keyword arguments)`` of a host's step call."""
    if args:
        return args[0], args[1:], kwargs
    rest = dict(kwargs)
    return rest.pop("batch", None), (), rest
