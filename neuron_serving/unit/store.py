"""Host-bound TCPStores: torch.distributed rendezvous that listens only where the unit says.

``torch.distributed.TCPStore(is_master=True)`` listens on every interface (``::``,
dual-stack) whatever host it is given: the host is only used by clients. The
unit's two stores (control-plane Gloo group at control port +1, vLLM's
torch.distributed world at +2) would then be reachable from any network the
node is on, and they carry no authentication. Here the leader binds the
listening socket itself, to the configured control host, and hands the file
descriptor to TCPStore (``master_listen_fd``, which works with both the libuv
and the legacy backend in torch 2.13; vLLM's ``create_tcp_store`` does the same).

vLLM's world is created by vLLM (``init_distributed_environment`` ->
``init_process_group(init_method=...)``), so the leader cannot pass it a store.
Instead the unit uses its own init-method scheme, ``ns-tcp://host:port``,
registered as a torch rendezvous handler: rank 0 gets a host-bound master
store, other ranks a plain client. The handler is registered when this module
is imported, which both the leader's executor and the followers' worker loop
do (through ``broadcast``) before vLLM initialises its world.

The handler also pins Gloo's interface for vLLM's groups: Gloo's default
device listens on the address the host name resolves to, which need not be
the unit's (a laptop's LAN address for a loopback unit). Unless the operator
set ``GLOO_SOCKET_IFNAME``, it is set to the interface this rank reaches the
store host over (loopback for a loopback unit).

What this does not change: TCPStore and Gloo have no authentication, and vLLM
unpickles what its groups carry. Binding to the unit's interface narrows who
can reach them; a security group admitting only the unit's members is what
makes that a boundary (unit/README.md, "Ports and binding").
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import socket
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import psutil
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from neuron_serving.netaddr import host_port

# The module, not the function torch.distributed re-exports under the same name.
_rdzv = importlib.import_module("torch.distributed.rendezvous")

SCHEME = "ns-tcp"
# Connections queue here while the store's event loop accepts them; a unit has
# at most a few hundred ranks, and torch's own listener uses a similar backlog.
LISTEN_BACKLOG = 2048


def init_method(host: str, port: int) -> str:
    """The init method vLLM's workers get: same host and port as ``tcp://``, host-bound."""
    return f"{SCHEME}://{host_port(host, port)}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on exactly ``host:port`` (never a wildcard)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICSERV
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As torch's own listener: a restarted leader rebinds while old
        # connections sit in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_store(
    host: str,
    port: int,
    world_size: int,
    *,
    is_master: bool,
    timeout: timedelta,
    wait_for_workers: bool = False,
) -> dist.TCPStore:
    """A TCPStore whose server (rank 0) listens on ``host:port`` only; clients as usual."""
    if not is_master:
        return dist.TCPStore(
            host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False
        )
    # TCPStore owns the descriptor it is given: it closes it with the store, and
    # also when its constructor fails (torch 2.13, both backends). It gets a
    # duplicate, so this function closes only its own descriptor, exactly once:
    # closing the handed-over number after a failure could close whatever file
    # another thread had opened under that number in the meantime.
    with listen_socket(host, port) as sock:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=wait_for_workers,
            master_listen_fd=os.dup(sock.fileno()),
        )


def _rendezvous_handler(url: str, timeout: timedelta = default_pg_timeout, **_kwargs):
    # Same contract as torch's tcp:// handler: init_process_group appends
    # ?rank=&world_size= and iterates once.
    parsed = urlparse(url)
    query = {k: v[0] for k, v in parse_qs(parsed.query).items()}
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"{SCHEME}:// rendezvous needs host:port, got {url!r}")
    if "rank" not in query or "world_size" not in query:
        raise ValueError(f"{SCHEME}:// rendezvous needs rank and world_size, got {url!r}")
    rank, world_size = int(query["rank"]), int(query["world_size"])
    pin_gloo_interface(parsed.hostname, parsed.port)
    store = tcp_store(
        parsed.hostname, parsed.port, world_size, is_master=rank == 0, timeout=timeout
    )
    yield store, rank, world_size
    raise RuntimeError(f"{SCHEME}:// rendezvous cannot re-rendezvous")


def pin_gloo_interface(store_host: str, store_port: int) -> str | None:
    """Set GLOO_SOCKET_IFNAME (read when a Gloo group is created) to the interface
    this process reaches ``store_host`` over; returns it. An operator's own
    choice is kept."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    family = socket.getaddrinfo(store_host, store_port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((store_host, store_port))  # UDP: routes, sends nothing
        local = ipaddress.ip_address(probe.getsockname()[0])
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == local:
                    os.environ["GLOO_SOCKET_IFNAME"] = name
                    return name
            except ValueError:
                continue  # link-layer addresses
    return None


def _register() -> None:
    # Importing twice (or a test re-importing) must not fail on a duplicate.
    if SCHEME not in _rdzv._rendezvous_handlers:
        _rdzv.register_rendezvous_handler(SCHEME, _rendezvous_handler)


_register()
