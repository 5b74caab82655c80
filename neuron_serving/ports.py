"""Free loopback ports for services we start (tests, local clusters, launchers).

Ports are drawn at random from *below* the kernel's ephemeral range
(``net.ipv4.ip_local_port_range``), never from it. Asking the kernel for port 0
hands out an ephemeral port, and between that check and our server's bind any
process's outgoing connection may take it; worse, a probe of a not-yet-bound
ephemeral port can TCP self-connect (both ends on the same port) and read its
own bytes back (seen here: it crashed a starting leader's readiness check).
Below the range only servers bind, so the check-then-bind race is between our
own services, and random draws make it unlikely.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection

_LOW = 10000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int = 1, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    """A base port such that ``base .. base + n - 1`` are all free on ``host`` and none
    of them is in ``exclude``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    high = _ephemeral_start() - n
    for _ in range(500):
        base = random.randrange(_LOW, high)
        if any(port in exclude for port in range(base, base + n)):
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no block of {n} free ports in {_LOW}..{high + n} on {host}")


def free_port(host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    """A free port, none of ``exclude``: ports already given to a service that has not
    bound them yet look free too (a leader's Triton metrics port once drew the HTTP
    port it was about to hand Triton, and Triton failed to start)."""
    return free_port_block(1, host, exclude)
