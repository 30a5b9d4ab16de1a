"""This rank's torchft :class:`torchft.Manager` and the per-step protocol of the replica groups
(:mod:`lightning_par.fault_tolerance`): quorum, gradient mean over the live groups, commit vote, and the state a
joining group receives from a live peer (module, optimizers, Lightning's loop counters).

torchft is imported only when a :class:`FaultTolerantReplicas` is built (``fault_tolerance.enabled``).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.compat.lightning import batches_that_stepped, set_batches_that_stepped
from lightning_par.compat.torchft import quorum_id as torchft_quorum_id
from lightning_par.fault_tolerance.options import (
    FaultToleranceOptions,
    _ip,
    _unreachable,
    check_lighthouse,
    url_host,
)

__all__ = ["FaultTolerantReplicas"]


def _advertised(host: str) -> str:
    """The name peers reach a server bound to ``host`` at: the host itself, or this host's name for a wildcard."""
    ip = _ip(host)
    return socket.gethostname() if ip is not None and ip.is_unspecified else host


#: Serialises the rebinding of torchft's servers (module attributes, see :func:`_torchft_servers_bound_to`).
_BIND_LOCK = threading.Lock()


@contextlib.contextmanager
def _torchft_servers_bound_to(host: str) -> Any:
    """While a :class:`torchft.Manager` is built: its manager server and its HTTP checkpoint server listen on ``host``.

    torchft 0.2.0's ``Manager.__init__`` starts ``ManagerServer(bind=f"[::]:{port}")`` and its ``HTTPTransport``
    an ``_IPv6HTTPServer(("", 0))``: every interface, whatever the job needs, and neither authenticates (a peer on the
    network could read the weights or stop the group). It takes no bind address, so the two names it looks up in
    its modules are replaced by ones that bind ``host``, for the constructor only.
    """
    import torchft.manager as manager_module

    from lightning_par.compat.torchft import http_server_class, set_http_server_class

    server_cls, http_cls = manager_module.ManagerServer, http_server_class()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def manager_server(*args: Any, **kwargs: Any) -> Any:
        port = str(kwargs["bind"]).rsplit(":", 1)[1]
        return server_cls(*args, **{**kwargs, "bind": f"{url_host(host)}:{port}"})

    class BoundHTTPServer(http_cls):  # type: ignore[misc, valid-type]
        address_family = family

        def __init__(self, server_address: tuple[str, int], handler: Any) -> None:
            super().__init__((host, server_address[1]), handler)

    with _BIND_LOCK:
        manager_module.ManagerServer = manager_server
        set_http_server_class(BoundHTTPServer)
        try:
            yield
        finally:
            manager_module.ManagerServer = server_cls
            set_http_server_class(http_cls)


def _bound_http_transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``host`` (its own ``address()`` names ``gethostname()``, which
    a server bound to loopback may not answer at). Built inside :func:`_torchft_servers_bound_to`."""
    from torchft.checkpointing.http_transport import HTTPTransport

    from lightning_par.compat.torchft import transport_server

    class BoundHTTPTransport(HTTPTransport):
        def address(self) -> str:
            port = transport_server(self).socket.getsockname()[1]
            return f"http://{url_host(_advertised(host))}:{port}/checkpoint/"

    return BoundHTTPTransport(timeout=timeout, num_chunks=0)

#: How many torchft managers this process has built (every rank of a replica group builds them in the same order: one
#: per fit); names the store key of :func:`_clear_stale_manager_address`.
_MANAGERS_BUILT = itertools.count()


def _clear_stale_manager_address(group_rank: int, timeout: timedelta) -> None:
    """Before a :class:`torchft.Manager` is built: drop the manager address a previous manager of this world left in
    the world's store, and let the other ranks go on only once it is dropped.

    torchft 0.2.0's ``Manager.__init__`` has group rank 0 ``set`` its manager server's address under the fixed key
    ``manager_addr`` of the store at ``MASTER_ADDR:MASTER_PORT``, and every other rank ``get`` it. A second manager in
    the same processes (a second ``fit``, e.g. a resume after a first fit, in one script) meets the first one's key:
    rank 1 could read the address of the server rank 0 shut down at the end of the first fit before rank 0 wrote the
    new one, and fail with ``failed to connect to http://...: Connection refused`` (seen in 3 of 4 tries of
    ``tests/core/test_device_rule.py``'s fault-tolerant case). Rank 0 deletes the old keys and then sets a key
    of this manager's generation; the others wait for that key, so their ``get`` blocks until rank 0's new manager
    writes its address.
    """
    import os

    from torch.distributed import TCPStore
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    generation = next(_MANAGERS_BUILT)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return  # torchft raises its own error for a world without a store
    store = TCPStore(host_name=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]), is_master=False,
                     wait_for_workers=False, timeout=timeout)
    ready = f"lightning_par/ft_manager_generation_{generation}"
    if group_rank == 0:
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
        store.set(ready, "1")
    else:
        store.wait([ready])


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _local_tree(obj: Any) -> Any:
    """``obj`` (an optimizer state dict, nested dicts/lists) with every DTensor replaced by its local shard."""
    if isinstance(obj, Tensor):
        return _local(obj)
    if isinstance(obj, dict):
        return {k: _local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local_tree(v) for v in obj)
    return obj


def _redistribute_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict`` of local shards: each per-parameter state tensor of a DTensor parameter
    (``exp_avg``, ``momentum_buffer``, ...: the shape of the parameter's local shard) becomes a DTensor on the
    parameter's mesh and placements again, as the optimizer made it (a step would mix Tensor and DTensor otherwise).
    Scalars (``step``) stay as they are."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor) or p not in optimizer.state:
                continue
            shard = p.to_local()
            state = optimizer.state[p]
            for k, v in state.items():
                if isinstance(v, Tensor) and not isinstance(v, DTensor) and v.dim() > 0 and v.shape == shard.shape:
                    state[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                  stride=p.stride())


def _nbytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0

class FaultTolerantReplicas:
    """This rank's torchft manager and the per-step protocol the strategy drives.

    Per optimizer step: :meth:`begin_step` (quorum; a joining group applies the live peer's state here, before its
    forward), the step's backward and the dp reduction inside the group, :meth:`average_gradients` (mean over the
    live groups), then :meth:`commit` (``False``: skip the optimizer step).

    Args:
        options: the validated options (``enabled``).
        module: the LightningModule (its whole state, local tensors, is what a joining group receives).
        optimizers: returns the run's (unwrapped) optimizers; their state and parameters travel too.
        group_rank: this rank within its replica group's world.
        group_world_size: the replica group's world size.
    """

    def __init__(self, options: FaultToleranceOptions, module: nn.Module,
                 optimizers: Callable[[], list[torch.optim.Optimizer]], group_rank: int, group_world_size: int) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.options = options
        self.module = module
        self._optimizers = optimizers
        address = options.lighthouse_address()
        host = options.bind_host(address)
        check_lighthouse(address, options.connect_timeout_s)
        self._lighthouse = address
        timeout = timedelta(seconds=options.step_timeout_s)
        self.pg = ProcessGroupGloo(timeout=timeout)
        store_timeout = timedelta(seconds=options.connect_timeout_s + options.quorum_timeout_s)
        _clear_stale_manager_address(group_rank, store_timeout)
        with _torchft_servers_bound_to(host):
            transport = _bound_http_transport(host, timeout)
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=self._load_state_dict,
                state_dict=self._state_dict,
                min_replica_size=options.min_replicas,
                use_async_quorum=False,  # a joining group applies the peer's state before its forward, then joins
                timeout=timeout,
                quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
                connect_timeout=timedelta(seconds=options.connect_timeout_s),
                rank=group_rank,
                world_size=group_world_size,
                lighthouse_addr=address,
                replica_id=f"lightning_par_group_{options.replica_group_id}",
                init_sync=options.init_sync,
                hostname=_advertised(host),
                checkpoint_transport=transport,
            )
        self._in_step = False
        self._quorum_id: Any = None
        self.live_replicas = 0
        self.quorum_changes = 0
        self.steps_committed = 0
        self.steps_skipped = 0
        self.recovery_s: float | None = None
        self.recovery_bytes = 0
        self.recoveries = 0
        self.joined_at_step: int | None = None
        self.data_position: tuple[int, int] | None = None
        self.data_moves = 0
        self.diloco: Any = None

    def enter_diloco(self, inner_optimizer: torch.optim.Optimizer) -> None:
        """Hand the step protocol to torchft's DiLoCo (``diloco_sync_every > 0``): its hooks on ``inner_optimizer``
        run the quorum and the pseudo-gradient sync every ``H`` inner steps; :meth:`begin_step`,
        :meth:`average_gradients` and :meth:`commit` are then not used."""
        from torchft.local_sgd import DiLoCo

        o = self.options
        outer = torch.optim.SGD(self.module.parameters(), lr=o.diloco_outer_lr, momentum=o.diloco_outer_momentum,
                                nesterov=o.diloco_outer_momentum > 0)
        self.diloco = DiLoCo(self.manager, [self.module], inner_optimizer, outer, sync_every=o.diloco_sync_every)
        self.diloco.__enter__()

    # ------------------------------------------------------------------ state streamed to a joining group
    def _state_dict(self) -> dict[str, Any]:
        optimizers = self._optimizers()
        return {
            "module": {k: _local(v) for k, v in self.module.state_dict().items()},
            "params": [[_local(p.data) for g in o.param_groups for p in g["params"]] for o in optimizers],
            "optimizers": [_local_tree(o.state_dict()) for o in optimizers],
            "progress": self._progress_state(),
        }

    def _trainer(self) -> Any:
        return getattr(self.module, "_trainer", None)

    def _progress_state(self) -> dict[str, Any]:
        """Lightning's loop counters and the lr schedulers' states: a joining group continues at the live group's step,
        learning rate, epoch and batch index within the epoch, not at 0.

        The counters are Lightning's own progress objects (what a checkpoint's ``loops`` entry saves), taken whole: the
        epoch's (``current.processed`` is the epoch index the sampler is set to), the batches' within the epoch and in
        total (``current.ready``: batches of this epoch already fetched), the optimizer steps' (``global_step``) and
        the schedulers'. The live group sends them from the same point of its step as the joining group applies them
        (before a window's first batch goes to the device, :meth:`begin_step`; DiLoCo: inside the optimizer step), so
        they are consistent as they are."""
        trainer = self._trainer()
        if trainer is None:
            return {}
        fit_loop = trainer.fit_loop
        loop = fit_loop.epoch_loop
        return {
            "global_step": trainer.global_step,
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "epoch_progress": fit_loop.epoch_progress.state_dict(),
            "batch_progress": loop.batch_progress.state_dict(),
            "scheduler_progress": loop.scheduler_progress.state_dict(),
            "optim_progress": loop.automatic_optimization.optim_progress.state_dict(),
            "manual_optim_step_progress": loop.manual_optimization.optim_step_progress.state_dict(),
            # the loggers' step axis; a private counter of Lightning's epoch loop (no public setter in 2.6.6)
            "batches_that_stepped": batches_that_stepped(trainer),
        }

    def _load_progress(self, progress: dict[str, Any]) -> None:
        trainer = self._trainer()
        if trainer is None or not progress:
            return
        fit_loop = trainer.fit_loop
        loop = fit_loop.epoch_loop
        own = (fit_loop.epoch_progress.current.processed, loop.batch_progress.current.ready)
        fit_loop.epoch_progress.load_state_dict(progress["epoch_progress"])
        loop.batch_progress.load_state_dict(progress["batch_progress"])
        loop.scheduler_progress.load_state_dict(progress["scheduler_progress"])
        loop.automatic_optimization.optim_progress.load_state_dict(progress["optim_progress"])
        loop.manual_optimization.optim_step_progress.load_state_dict(progress["manual_optim_step_progress"])
        set_batches_that_stepped(trainer, progress["batches_that_stepped"])
        for config, state in zip(trainer.lr_scheduler_configs, progress["schedulers"]):
            config.scheduler.load_state_dict(state)
        live = (fit_loop.epoch_progress.current.processed, loop.batch_progress.current.ready)
        # this group's loader is elsewhere in the data (a restarted process reads epoch 0 from batch 0; a resumed one
        # is behind): the strategy moves it to the live group's place (:func:`move_train_data`) before the batch
        if live != own:
            self.data_position = live

    def take_data_position(self) -> tuple[int, int] | None:
        """``(epoch, batches of that epoch already read)`` of the live group this rank joined at its last recovery,
        once, where this rank's loader was elsewhere; ``None`` otherwise."""
        position, self.data_position = self.data_position, None
        return position

    @torch.no_grad()
    def _load_state_dict(self, state: dict[str, Any]) -> None:
        own = self.module.state_dict()
        for k, v in state["module"].items():
            if k in own:
                _local(own[k]).copy_(v)
        for o, params, sd in zip(self._optimizers(), state["params"], state["optimizers"]):
            for p, v in zip((p for g in o.param_groups for p in g["params"]), params):
                _local(p.data).copy_(v)
            o.load_state_dict(sd)
            _redistribute_state(o)
        self._load_progress(state.get("progress", {}))
        self.recovery_bytes += _nbytes(state)
        self.recoveries += 1

    # ------------------------------------------------------------------ the step protocol
    def begin_step(self) -> None:
        """Quorum for the next optimizer step (once per accumulation window); a joining group receives and applies
        the live peer's state here (``use_async_quorum=False``), and with it the live group's place in the data
        (:meth:`take_data_position`). The strategy calls it when a window's first batch goes to the device, after the
        batch is fetched and before any hook sees it. Raises after ``quorum_timeout_s`` without a quorum."""
        if self._in_step:
            return
        t0 = time.perf_counter()
        before = self.recoveries
        try:
            self.manager.start_quorum()
        except Exception as err:
            lost = _unreachable(self._lighthouse)
            if lost is None:
                raise
            raise RuntimeError(
                f"replica group {self.options.replica_group_id} lost the torchft lighthouse: nothing answers at "
                f"fault_tolerance.lighthouse={self._lighthouse!r} any more ({lost}); it answered when the group "
                f"started, so it died (or its host became unreachable) during the run, and no quorum can form without "
                f"it. Restart the lighthouse and the groups (train_ft starts both). The quorum failed with: "
                f"{type(err).__name__}: {err}"
            ) from err
        self._in_step = True
        if self.recoveries > before:
            self.recovery_s = time.perf_counter() - t0
            self.joined_at_step = self.manager.current_step()
        quorum_id = torchft_quorum_id(self.manager)
        if quorum_id != self._quorum_id:
            self.quorum_changes += self._quorum_id is not None
            self._quorum_id = quorum_id
        self.live_replicas = self.manager.num_participants()

    @torch.no_grad()
    def average_gradients(self, params: list[Tensor]) -> None:
        """Mean of each gradient over the live replica groups (``params``: what the optimizers step on this rank)."""
        works = [self.manager.allreduce(_local(p.grad)) for p in params if p.grad is not None]
        for work in works:
            work.wait()

    def commit(self) -> bool:
        """Whether every live group finished the step's all-reduce (vote among this group's ranks and the manager):
        step the optimizer only then."""
        ok = self.manager.should_commit()
        self._in_step = False
        if ok:
            self.steps_committed += 1
        else:
            self.steps_skipped += 1
        return ok

    @property
    def in_step(self) -> bool:
        """Whether the quorum of the current optimizer step is taken (between :meth:`begin_step` and :meth:`commit`)."""
        return self._in_step

    def figures(self) -> dict[str, float]:
        """Per-step figures for the logger."""
        return {"ft_live_replicas": float(self.live_replicas), "ft_step": float(self.manager.current_step())}

    def summary(self) -> dict[str, Any]:
        """Figures for ``summary.json``."""
        return {
            "ft_replica_group_id": self.options.replica_group_id,
            "ft_live_replicas": self.live_replicas,
            "ft_quorum_changes": self.quorum_changes,
            "ft_steps_committed": self.steps_committed,
            "ft_steps_skipped": self.steps_skipped,
            "ft_manager_step": self.manager.current_step(),
            "ft_batches_committed": self.manager.batches_committed(),
            "ft_recoveries": self.recoveries,
            "ft_recovery_s": self.recovery_s,
            "ft_recovery_bytes": self.recovery_bytes,
            "ft_data_moves": self.data_moves,
        }

    def shutdown(self) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
