"""``strategy.fault_tolerance``: the options of the fault-tolerant replicate axis, the checks run before any process
starts, and the addresses its servers listen on and reach the lighthouse at (:mod:`lightning_par.fault_tolerance`)."""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from lightning_par.validation import check_bool, check_int, check_number

__all__ = ["FT_DP_MODES", "FT_GROUP_SIZES", "FaultToleranceOptions", "check_fault_tolerance", "check_lighthouse",
           "is_loopback_host", "url_host"]

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

