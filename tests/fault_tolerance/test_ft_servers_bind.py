"""The fault-tolerance servers closed to the network (issue 50): ``strategy.fault_tolerance.bind`` validated, loopback
for a lighthouse on this host, every server torchft's ``Manager`` starts (manager server, checkpoint transfer) listening
on the bind address only; a group that loses its lighthouse says so. Bound addresses are read from ``/proc/net``: no
traffic leaves loopback."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_par.fault_tolerance import FaultToleranceOptions, FaultTolerantReplicas

pytest.importorskip("torchft")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket of process ``pid`` in the LISTEN state."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc/net stores each 32-bit word in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if width == 8 else socket.AF_INET6
            out.append((socket.inet_ntop(family, words), int(hex_port, 16)))
    return out


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or address.startswith("::ffff:127.")


@pytest.mark.parametrize("bind", ["anywhere", "localhost", "10.0.0", 5, ""])
def test_a_bad_bind_is_named(bind) -> None:
    with pytest.raises(ValueError, match=rf"fault_tolerance.bind={bind!r} is not valid: expected 'auto'.*IP address"):
        FaultToleranceOptions(enabled=True, bind=bind)


def test_auto_is_loopback_for_a_lighthouse_on_this_host() -> None:
    options = FaultToleranceOptions(enabled=True)
    assert options.bind == "auto"
    for lighthouse in ("http://127.0.0.1:1", "http://localhost:1", "http://[::1]:1", f"http://{socket.gethostname()}:1"
                       if all(i[4][0].startswith("127.") for i in socket.getaddrinfo(socket.gethostname(), None))
                       else "http://127.0.0.2:1"):
        assert options.bind_host(lighthouse) == "127.0.0.1", lighthouse
    assert FaultToleranceOptions(enabled=True, bind="10.0.0.5").bind_host("http://10.0.0.1:1") == "10.0.0.5"
    assert FaultToleranceOptions(enabled=True, bind="[::1]").bind_host("http://10.0.0.1:1") == "::1"


def test_auto_with_a_lighthouse_elsewhere_is_refused() -> None:
    """Address literals only: no name is resolved, nothing is sent."""
    with pytest.raises(ValueError, match=r"fault_tolerance.bind='auto' is not valid with the lighthouse "
                                         r"'http://10.0.0.1:29510'.*no authentication.*Set fault_tolerance.bind"):
        FaultToleranceOptions(enabled=True, lighthouse="http://10.0.0.1:29510").bind_host()


def test_every_torchft_server_of_a_group_listens_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a one-rank group, with a lighthouse on loopback: torchft's manager server and its HTTP checkpoint
    server (both on every interface in torchft 0.2.0) listen on 127.0.0.1 only, and advertise that address."""
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    before = set(_listening(os.getpid()))
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    lighthouse_port = lighthouse.address().rsplit(":", 1)[1]
    options = FaultToleranceOptions(enabled=True, lighthouse=f"http://127.0.0.1:{lighthouse_port}",
                                    connect_timeout_s=5.0)
    replicas = FaultTolerantReplicas(options, torch.nn.Linear(2, 2), lambda: [], 0, 1)
    try:
        new = set(_listening(os.getpid())) - before
        ours = {p for _, p in new}
        manager_port = int(replicas.manager._manager.address().rsplit(":", 1)[1])
        http_port = int(replicas.manager._checkpoint_transport.address().split(":")[2].split("/")[0])
        assert {manager_port, http_port} <= ours, (new, manager_port, http_port)
        assert all(_is_loopback(a) for a, p in new if p in (manager_port, http_port)), new
        assert replicas.manager._manager.address().startswith("http://127.0.0.1:")
        assert replicas.manager._checkpoint_transport.address().startswith("http://127.0.0.1:")
    finally:
        replicas.shutdown()
        lighthouse.shutdown()
        del store


class _QuorumFails:
    def start_quorum(self) -> None:
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')


def test_a_group_that_loses_the_lighthouse_says_so() -> None:
    replicas = FaultTolerantReplicas.__new__(FaultTolerantReplicas)
    address = f"http://127.0.0.1:{_free_port()}"  # nothing listens there any more
    replicas.options = FaultToleranceOptions(enabled=True, lighthouse=address, replica_group_id=0)
    replicas._lighthouse, replicas._in_step, replicas.recoveries = address, False, 0
    replicas.manager = _QuorumFails()
    with pytest.raises(RuntimeError, match=rf"replica group 0 lost the torchft lighthouse: nothing answers at "
                                           rf"fault_tolerance.lighthouse='{address}'.*TimeoutError: status: Cancelled"):
        replicas.begin_step()


def test_a_quorum_error_with_the_lighthouse_alive_is_left_as_it_is() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"http://127.0.0.1:{server.getsockname()[1]}"
        replicas = FaultTolerantReplicas.__new__(FaultTolerantReplicas)
        replicas.options = FaultToleranceOptions(enabled=True, lighthouse=address)
        replicas._lighthouse, replicas._in_step, replicas.recoveries = address, False, 0
        replicas.manager = _QuorumFails()
        with pytest.raises(TimeoutError, match="Timeout expired"):
            replicas.begin_step()
