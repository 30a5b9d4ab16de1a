"""Fault-tolerant replicate axis: replica groups, each its own world, averaging gradients through torchft.

Each replica group is a whole world of its own (its own launcher: ``torchrun`` job, Lightning launcher) running the
dp mode inside it (``ddp``, ``zero1``, ``zero2``, ``zero3`` over the group's dp ranks), optionally with tensor
parallelism. Across groups nothing is a process group of ours: torchft's :class:`torchft.Manager` (one per rank) asks
the lighthouse (the server that holds membership) for a quorum of live groups every step, and all-reduces the
gradients the optimizer will step (this rank's full gradients under ``ddp``, this rank's shard under
``zero1``/``zero2``, the local tensor of each DTensor gradient shard after FSDP2's reduce-scatter under ``zero3`` or
tp) with the rank of the same position in every other live group (every group has the same layout, so that rank
holds the same shards). A group that dies or hangs drops out of the next quorum; the others finish with the groups
that remain (the gradient mean over the live groups) and keep stepping. A restarted group joins at a step boundary:
its manager receives the parameters, the optimizer state (local shards, copied in place into its own), Lightning's
step counter and the lr schedulers' states of a live peer over HTTP (torchft's checkpoint transport), not from disk,
and applies them before its forward. With them come Lightning's loop counters (epoch, batch index within the epoch):
the joining group's data loader is moved to the live group's place in the data (same epoch, so the same shuffle, and
the same batch index; each group reads its own share), so it reads the batches it would have read had it never failed.

torchft is an optional dependency (the ``ft`` extra); it is imported only when ``fault_tolerance.enabled``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor, nn

from lightning_par.compat.lightning import batches_that_stepped, set_batches_that_stepped
from lightning_par.validation import check_bool, check_int, check_number

__all__ = ["FaultToleranceOptions", "FaultTolerantReplicas", "check_fault_tolerance", "check_lighthouse",
           "check_train_data", "is_loopback_host", "move_train_data", "url_host"]

#: dp modes the fault-tolerant axis runs inside a replica group. ``ddp``/``zero1``/``zero2`` step plain local tensors;
#: ``zero3`` (FSDP2) steps DTensor shards, whose local tensors are what travels (every group has the same layout, so
#: rank r of a joining group receives rank r's shards of a live peer) and what is averaged across groups.
FT_DP_MODES: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3")

#: sizes a replica group may set above 1: its dp ranks and its tensor-parallel ranks (DTensor shards of the same
#: positions in every group, averaged and streamed as local tensors like zero3's).
FT_GROUP_SIZES: tuple[str, ...] = ("dp_size", "dp_shard_size", "tp_size")


@dataclass(frozen=True)
class FaultToleranceOptions:
    """``strategy.fault_tolerance.*``.

    Attributes:
        enabled: average gradients across replica groups through torchft (each group its own world).
        lighthouse: the lighthouse address, ``"http://host:port"``; ``None``: ``$TORCHFT_LIGHTHOUSE``.
        replica_group_id: this group's index, ``0 <= replica_group_id < num_replica_groups``.
        num_replica_groups: how many groups the job has at full strength; the data is split over
            ``num_replica_groups * dp_size`` ranks, so a group that is down leaves its samples out (the global batch
            shrinks by one group's share while it is down).
        min_replicas: the fewest live groups a step may commit with (fewer: the step is skipped, not applied).
        step_timeout_s: seconds a cross-group all-reduce, a commit vote or a state transfer may take before the step is
            skipped (a hung peer group is dropped at the next quorum).
        quorum_timeout_s: seconds to wait for a quorum of ``min_replicas`` groups before the run raises.
        connect_timeout_s: seconds to reach the lighthouse; an unreachable one is named in the error within this
            time.
        init_sync: at the first step, every group takes the weights of one (as at a rejoin); ``False`` when every
            group initialises identically from the seed.
        diloco_sync_every: ``0``: synchronous (gradients averaged every step); ``H > 0``: torchft's DiLoCo: each group
            steps its own (inner) optimizer, and every ``H`` steps the groups average their pseudo-gradients
            (global weights minus local weights) and step an outer SGD on them.
        diloco_outer_lr: the outer SGD's learning rate.
        diloco_outer_momentum: the outer SGD's momentum (Nesterov when ``> 0``, as in the DiLoCo paper).
        bind: the address the servers of this run listen on (the lighthouse ``train_ft`` starts, rank 0's torchft
            manager server, each rank's checkpoint-transfer server), none of which authenticates its clients.
            ``"auto"``: loopback (``127.0.0.1``) when the lighthouse's host resolves to loopback only (every group
            on this host, as ``train_ft`` runs them), else refused: name the address. Otherwise an IP address of
            this host on a trusted network (``"10.0.0.5"``, ``"::1"``; ``"0.0.0.0"``/``"::"``: every interface).

    Raises:
        ValueError: a field of the wrong type or range, named in the message.
    """

    enabled: bool = False
    lighthouse: str | None = None
    replica_group_id: int = 0
    num_replica_groups: int = 1
    min_replicas: int = 1
    step_timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    init_sync: bool = True
    diloco_sync_every: int = 0
    diloco_outer_lr: float = 0.7
    diloco_outer_momentum: float = 0.9
    bind: str = "auto"

    def __post_init__(self) -> None:
        p = "fault_tolerance."
        check_bool(p + "enabled", self.enabled)
        check_bool(p + "init_sync", self.init_sync)
        check_int(p + "num_replica_groups", self.num_replica_groups, 1)
        check_int(p + "replica_group_id", self.replica_group_id, 0)
        check_int(p + "min_replicas", self.min_replicas, 1)
        check_int(p + "diloco_sync_every", self.diloco_sync_every, 0)
        check_number(p + "diloco_outer_lr", self.diloco_outer_lr, unit="")
        check_number(p + "diloco_outer_momentum", self.diloco_outer_momentum, inclusive=True, maximum=1.0)
        if self.replica_group_id >= self.num_replica_groups:
            raise ValueError(
                f"{p}replica_group_id={self.replica_group_id} is not valid with {p}num_replica_groups="
                f"{self.num_replica_groups}: expected 0 <= replica_group_id < num_replica_groups."
            )
        if self.min_replicas > self.num_replica_groups:
            raise ValueError(
                f"{p}min_replicas={self.min_replicas} is not valid with {p}num_replica_groups="
                f"{self.num_replica_groups}: expected at most num_replica_groups."
            )
        for name in ("step_timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            check_number(p + name, getattr(self, name), unit="seconds")
        if self.lighthouse is not None and (not isinstance(self.lighthouse, str) or not _host_port(self.lighthouse)):
            raise ValueError(
                f"{p}lighthouse={self.lighthouse!r} is not valid: expected 'http://host:port' or None "
                f"($TORCHFT_LIGHTHOUSE)."
            )
        if not isinstance(self.bind, str) or (self.bind != "auto" and _ip(self.bind) is None):
            raise ValueError(
                f"{p}bind={self.bind!r} is not valid: expected 'auto' (loopback when the lighthouse is on this host) "
                f"or an IP address of this host ('127.0.0.1', '10.0.0.5', '::1'; '0.0.0.0' or '::' for every "
                f"interface)."
            )

    def bind_host(self, lighthouse: str | None = None) -> str:
        """The address this run's servers listen on: :attr:`bind`, or for ``"auto"`` loopback (``127.0.0.1``) when
        ``lighthouse`` (default: :meth:`lighthouse_address`) is on loopback.

        Raises:
            ValueError: ``bind="auto"`` with a lighthouse on another host (the servers would have to listen where the
                other groups reach them: the user names that address).
        """
        if self.bind != "auto":
            return str(_ip(self.bind))
        address = lighthouse if lighthouse is not None else self.lighthouse_address()
        host_port = _host_port(address)
        if host_port is not None and is_loopback_host(host_port[0]):
            return "127.0.0.1"
        raise ValueError(
            f"fault_tolerance.bind='auto' is not valid with the lighthouse {address!r}, which is not on this host's "
            f"loopback: the groups' torchft servers (manager, checkpoint transfer) must listen where the other "
            f"groups reach them, and they have no authentication. Set fault_tolerance.bind to this host's address "
            f"on a trusted network (e.g. '10.0.0.5'; '0.0.0.0' or '::' for every interface)."
        )

    def lighthouse_address(self) -> str:
        """The lighthouse to use.

        Raises:
            ValueError: none given and ``$TORCHFT_LIGHTHOUSE`` unset.
        """
        import os

        address = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not address:
            raise ValueError(
                "fault_tolerance.lighthouse=None and $TORCHFT_LIGHTHOUSE is unset: give the lighthouse address "
                "('http://host:port'; start one with `torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510`)."
            )
        return address


def check_fault_tolerance(options: Any, sizes: dict[str, Any]) -> None:
    """Refuse, before any process starts, what the fault-tolerant replicate axis does not compose with.

    Args:
        options: the :class:`~lightning_par.parallelize.ParallelOptions`.
        sizes: the strategy's size fields and values.

    Raises:
        ValueError: naming the field, the value, and what would be valid.
    """
    ft: FaultToleranceOptions = options.fault_tolerance
    if not ft.enabled:
        given = sorted(k for k, v in vars(ft).items() if k != "enabled" and v != getattr(FaultToleranceOptions, k))
        if given:
            raise ValueError(
                f"fault_tolerance options {given} are given but fault_tolerance.enabled=False: set "
                f"fault_tolerance.enabled=True, or remove them."
            )
        return
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise ValueError(
            "fault_tolerance.enabled=True needs torchft: pip install 'lightning_par[ft]' (torchft>=0.2)."
        )
    if options.dp_mode not in FT_DP_MODES:
        raise ValueError(
            f"dp_mode={options.dp_mode!r} is not valid with fault_tolerance.enabled=True: the replica groups average "
            f"data-parallel gradients and stream data-parallel state. Use dp_mode in {list(FT_DP_MODES)}."
        )
    if ft.diloco_sync_every and options.dp_mode != "ddp":
        raise ValueError(
            f"fault_tolerance.diloco_sync_every={ft.diloco_sync_every} is not valid with dp_mode={options.dp_mode!r}: "
            f"torchft's DiLoCo keeps the module's own parameters as the global copy, which ZeRO's sharded optimizer "
            f"does not step. Use dp_mode='ddp' or fault_tolerance.diloco_sync_every=0."
        )
    if ft.diloco_sync_every and sizes.get("tp_size", 1) not in (1, -1):
        raise ValueError(
            f"fault_tolerance.diloco_sync_every={ft.diloco_sync_every} is not valid with tp_size={sizes['tp_size']}: "
            f"DiLoCo's outer step on tensor-parallel (DTensor) parameters has no parity proof in this version. Use "
            f"tp_size=1 or fault_tolerance.diloco_sync_every=0."
        )
    for name, value in sizes.items():  # every size but the group's own dp and tp ranks
        if name in FT_GROUP_SIZES or value in (1, -1):
            continue
        what = ("the replica groups are the replicate axis: use dp_shard_size (or dp_size) inside each group and "
                "fault_tolerance.num_replica_groups across them" if name == "dp_replicate_size" else
                "only data parallelism (dp_size/dp_shard_size, any dp_mode) and tensor parallelism (tp_size) run "
                "inside a fault-tolerant replica group in this version; pipeline, context and expert parallelism "
                "inside a group have no parity or rejoin proof under torchft yet")
        raise ValueError(f"{name}={value} is not valid with fault_tolerance.enabled=True: {what}. Use {name}=1.")


def _host_port(address: str) -> tuple[str, int] | None:
    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        port = parsed.port
    except ValueError:
        return None
    if not parsed.hostname or port is None:
        return None
    return parsed.hostname, port


def _ip(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        return None


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP address or a name, resolved by this host's resolver) is this host's loopback only."""
    ip = _ip(host)
    if ip is not None:
        return ip.is_loopback
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    ips = [_ip(str(info[4][0]).split("%", 1)[0]) for info in infos]
    return bool(ips) and all(ip is not None and ip.is_loopback for ip in ips)


def url_host(host: str) -> str:
    """``host`` as it goes in a URL or a ``host:port`` bind (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


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


def _unreachable(address: str, timeout_s: float = 2.0) -> str | None:
    """``None`` when something accepts a TCP connection at ``address`` now, else the connection error."""
    host_port = _host_port(address)
    if host_port is None:
        return None
    try:
        with socket.create_connection(host_port, timeout=timeout_s):
            return None
    except OSError as err:
        return repr(err)


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


def check_lighthouse(address: str, timeout_s: float) -> None:
    """Refuse an unreachable lighthouse within ``timeout_s`` (a TCP connect; torchft's own client would retry).

    Raises:
        ConnectionError: naming the address and the option to fix.
    """
    host_port = _host_port(address)
    if host_port is None:
        raise ValueError(f"fault_tolerance.lighthouse={address!r} is not valid: expected 'http://host:port'.")
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(host_port, timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            last = err
            time.sleep(0.2)
    raise ConnectionError(
        f"No torchft lighthouse answers at fault_tolerance.lighthouse={address!r} within "
        f"fault_tolerance.connect_timeout_s={timeout_s:g} s ({last!r}): start it first "
        f"(`torchft_lighthouse --min_replicas N --bind 127.0.0.1:PORT`) or fix the address."
    )


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


class _SkipOnce:
    """Stands in for a batch sampler's ``sampler`` for one iteration: the first ``n`` indices of the sampler's order
    are skipped (indices only: no sample is loaded), then the batch sampler gets its own sampler back."""

    def __init__(self, batch_sampler: Any, n: int) -> None:
        self.batch_sampler, self.sampler, self.n = batch_sampler, batch_sampler.sampler, n

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Any:
        self.batch_sampler.sampler = self.sampler
        return itertools.islice(iter(self.sampler), self.n, None)


def _set_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler and its batch sampler's sampler, where they have one (Lightning's
    injected ``DistributedSampler``: the epoch seeds its shuffle), as Lightning's fit loop does at an epoch's start."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def check_train_data(trainer: Any) -> None:
    """Refuse, before the first step, a training loop whose data a rejoining group could not be moved in.

    Raises:
        ValueError: a ``training_step`` that takes ``dataloader_iter`` (it fetches its own batches, after the point
            where a joining group learns its place in the data); ``reload_dataloaders_every_n_epochs > 0`` (a
            restarted group's loader would come from ``train_dataloader()`` at another epoch than the live group's).
    """
    from lightning_par.compat.lightning import data_fetcher, is_dataloader_iter_fetcher

    if trainer.reload_dataloaders_every_n_epochs:
        raise ValueError(
            f"Trainer(reload_dataloaders_every_n_epochs={trainer.reload_dataloaders_every_n_epochs}) is not supported "
            f"with fault_tolerance.enabled=True: a replica group that rejoins takes the live group's epoch, but its "
            f"loader is the one train_dataloader() returned when it started, not the one the live group reloaded. "
            f"Use reload_dataloaders_every_n_epochs=0."
        )

    if is_dataloader_iter_fetcher(data_fetcher(trainer)):
        raise ValueError(
            "fault_tolerance.enabled=True does not support a training_step that takes `dataloader_iter`: a replica "
            "group that rejoins learns its place in the data (the live group's epoch and batch) when a batch goes to "
            "the device, and a step that fetches its own batches would read from the wrong place. Take `batch` (and "
            "`batch_idx`) in training_step."
        )


def move_train_data(trainer: Any, epoch: int, ready: int, take: bool) -> Any:
    """Move the Trainer's training data to ``ready`` batches into epoch ``epoch``: the sampler's epoch set (its
    shuffle), a new iterator of Lightning's data fetcher, the first ``ready`` batches of the epoch passed over; then,
    with ``take``, the next batch fetched and returned (the one to train on now), else ``None`` (the next fetch of
    Lightning's loop reads it).

    With ``take``, a single loader skips the indices only (no sample is loaded) where it can: one with a
    ``start_pass_at(batches)`` method of its own (:class:`~lightning_par.data.resumable.ResumableDataLoader`, which
    then also counts the skipped batches in its ``state_dict``), or a ``DataLoader`` with a ``BatchSampler`` and no
    ``state_dict`` (Lightning's injected sampler). Any other loader (several loaders, an iterable dataset, a custom
    batch sampler, a loader with a state of its own that a skip behind its back would falsify), and every loader
    without ``take``, is read through and its batches dropped, which costs their loading time (no forward or
    backward). (Without ``take`` the new iterator may not be read before ``fit`` ends, and a skip left armed would
    apply to a later ``fit``.)

    Lightning 2.6.6 keeps the training data fetcher and the combined loader only in the private
    ``fit_loop._data_fetcher`` / ``fit_loop._combined_loader`` and has no public way to start an epoch's data at a
    batch other than 0 for a loader without ``state_dict`` (its own mid-epoch resume warns that such a loader starts
    again from the beginning of its epoch); these are the objects its epoch loop fetches from.
    """
    from lightning.fabric.utilities.data import sized_len
    from torch.utils.data import BatchSampler

    from lightning_par.compat.lightning import combined_loader, data_fetcher

    combined, fetcher = combined_loader(trainer), data_fetcher(trainer)
    loaders = combined.flattened
    for loader in loaders:
        _set_epoch(loader, epoch)
    length = sized_len(combined)
    loader = loaders[0] if len(loaders) == 1 else None
    batch_sampler = getattr(loader, "batch_sampler", None)
    by_index = take and loader is not None and length is not None and 0 < ready < length
    if by_index and callable(getattr(loader, "start_pass_at", None)):
        loader.start_pass_at(ready)
    elif by_index and isinstance(batch_sampler, BatchSampler) and not callable(getattr(loader, "state_dict", None)):
        batch_sampler.sampler = _SkipOnce(batch_sampler, ready * batch_sampler.batch_size)
    else:
        by_index = False
    iter(fetcher)  # a new iterator of every loader (the epoch's order), the fetcher's counters reset
    if by_index:
        fetcher.fetched = ready
        fetcher.done = fetcher.length is not None and fetcher.fetched >= fetcher.length
    else:
        for _ in range(ready):
            next(fetcher)
    if not take:
        return None
    batch, _, _ = next(fetcher)
    return batch


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
        quorum_id = self.manager._quorum_id
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
