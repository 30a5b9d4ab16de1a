"""The own launcher's rendezvous store listens on MASTER_ADDR (127.0.0.1) only, not on every interface."""

from __future__ import annotations

import os

import pytest

from lightning_par.launcher import init_process_group_from_env, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _listening(port: int) -> list[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp and tcp6; state 0A = LISTEN)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    if len(address) == 8:  # IPv4, little-endian bytes
                        found.append(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
                    else:
                        found.append("ipv6:" + address)
    return found


def _store_addresses() -> list[str]:
    import torch
    import torch.distributed as dist

    init_process_group_from_env("gloo", timeout_s=60)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group works over the bound store
    port = int(os.environ["MASTER_PORT"])
    return [os.environ["MASTER_ADDR"], *_listening(port), f"sum={t.item():g}"] if dist.get_rank() == 0 else []


def test_the_rendezvous_store_listens_on_master_addr_only():
    """During a job, the only socket listening on MASTER_PORT is 127.0.0.1's (torch's own store bound *:PORT)."""
    got = run_distributed(_store_addresses, 2, timeout_s=90)[0]
    assert got == ["127.0.0.1", "127.0.0.1", "sum=2"], got
