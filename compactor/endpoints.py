"""Where a gRPC endpoint points: its host, and whether it stays on this machine.

One rule for every side that refuses plaintext off the machine (`compactor serve --host`,
`compactor request --endpoint`, the plugin's `--compaction-endpoint`): a loopback host
(localhost, *.localhost, 127.0.0.0/8, ::1) or `inproc://` stays here; any other name may
resolve anywhere.
"""

from __future__ import annotations

import ipaddress

__all__ = ["endpoint_host", "is_loopback"]


def endpoint_host(endpoint: str) -> str:
    """The host of `host`, `host:port`, `grpc[s]://host:port` or `[v6]:port` (brackets
    removed; a bare IPv6 address is its own host)."""
    target = endpoint.split("://", 1)[-1]
    if target.startswith("["):
        return target[1:].split("]", 1)[0]
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or ":" in host:  # no port, or a bare IPv6 address
        return target
    return host


def is_loopback(endpoint: str) -> bool:
    """True for `inproc://` and for a loopback host, with or without a port."""
    if endpoint.startswith("inproc://"):
        return True
    host = endpoint_host(endpoint).lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
