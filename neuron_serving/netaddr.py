"""Host strings: is it loopback, and how it is written next to a port.

Imported by ``proxy`` and by ``neuron_serving``'s packages alike, so it depends on
the standard library only.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind host or a peer address) is on loopback.

    IPv4-mapped IPv6 (``::ffff:127.0.0.1``, how a dual-stack socket reports an IPv4
    peer) counts as its IPv4 address, and a zone (``::1%lo``) is ignored. The name
    ``localhost`` counts: it resolves to loopback by RFC 6761 and glibc's default
    hosts file. Any other name does not, whatever it resolves to today: the answer
    decides whether to demand credentials, so it errs towards "reachable from
    elsewhere". Peer addresses are numeric, so the name rule only concerns bind hosts.
    """
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (URLs, gRPC targets and binds)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
