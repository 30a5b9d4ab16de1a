"""The register's torchft part: the private names of ``torchft`` the package uses (fault tolerance,
:mod:`lightning_par.fault_tolerance`), each behind a helper of ours. torchft (the ``ft`` extra) is
imported only when a helper runs.

Checked on torchft 0.2.0. Each entry of :data:`PRIVATE_USES` is looked up by the canary in
tests/compat/test_private_api.py, which fails naming the entry when upstream moves it (skipped without torchft).
"""

from __future__ import annotations

from typing import Any

from lightning_par.compat.register import PrivateName

__all__ = ["PRIVATE_USES", "http_server_class", "quorum_id", "set_http_server_class", "transport_server"]

_CHECKED = "torchft 0.2.0"
_HTTP = "torchft.checkpointing.http_transport"


def http_server_class() -> Any:
    """The HTTP server class torchft's ``HTTPTransport`` serves checkpoints with (``_IPv6HTTPServer``)."""
    import torchft.checkpointing.http_transport as http_transport

    return http_transport._IPv6HTTPServer


def set_http_server_class(cls: Any) -> None:
    """Replace :func:`http_server_class` (looked up in its module when a transport starts)."""
    import torchft.checkpointing.http_transport as http_transport

    http_transport._IPv6HTTPServer = cls


def transport_server(transport: Any) -> Any:
    """The HTTP server an ``HTTPTransport`` runs (``transport._server``)."""
    return transport._server


def quorum_id(manager: Any) -> Any:
    """The id of the quorum a torchft ``Manager`` last joined (``manager._quorum_id``; it changes when a replica group
    leaves or joins; torchft 0.2.0 has no public reader)."""
    return manager._quorum_id


PRIVATE_USES: tuple[PrivateName, ...] = (
    PrivateName("torchft", "torchft.manager.Manager", "_quorum_id", "instance", _CHECKED, "quorum_id"),
    PrivateName("torchft", _HTTP, "_IPv6HTTPServer", "attribute", _CHECKED, "http_server_class, set_http_server_class"),
    PrivateName("torchft", f"{_HTTP}.HTTPTransport", "_server", "instance", _CHECKED, "transport_server"),
)
