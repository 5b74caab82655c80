"""Host-bound TCPStores and the ns-tcp:// rendezvous of vLLM's torch.distributed world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from neuron_serving.unit import store
from tests.procs import REPO, free_port_block, non_loopback_ipv4


def _listening(pid: int | None = None) -> list[tuple[str, int]]:
    proc = psutil.Process(pid)
    return [
        (c.laddr.ip, c.laddr.port)
        for c in proc.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    ]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_master_store_listens_on_its_host_only(host):
    port = free_port_block()
    master = store.tcp_store(host, port, 2, is_master=True, timeout=timedelta(seconds=10))
    client = store.tcp_store(host, port, 2, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", b"v")
    assert master.get("k") == b"v"
    mine = [a for a in _listening() if a[1] == port]
    assert mine == [(host, port)], f"store port {port} listens on {mine}"


def test_plain_tcpstore_would_listen_everywhere():
    # Why store.py exists: torch's own master listens on the wildcard address
    # whatever host it is given. If this ever fails, torch fixed it upstream.
    port = free_port_block()
    plain = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    mine = [a for a in _listening() if a[1] == port]
    assert mine and all(ip in ("0.0.0.0", "::") for ip, _ in mine), mine
    del plain


def test_listen_socket_refuses_a_port_in_use():
    port = free_port_block()
    held = store.listen_socket("127.0.0.1", port)
    try:
        with pytest.raises(OSError):
            store.tcp_store("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=5))
    finally:
        held.close()


def test_failed_master_store_closes_only_its_own_descriptor(monkeypatch, tmp_path):
    # A real TCPStore that fails after taking the listening descriptor (no
    # worker joins in time) closes that descriptor itself. Another thread may
    # then open a file under the same number before tcp_store unwinds: modelled
    # by opening one right after the failure. That file must stay open, and
    # the caller must see torch's error (not EBADF from closing twice).
    real, reused = dist.TCPStore, []

    def store_then_reuse(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except Exception:
            reused.append(os.open(tmp_path / "other-thread", os.O_CREAT | os.O_RDWR))
            raise

    monkeypatch.setattr(dist, "TCPStore", store_then_reuse)
    port = free_port_block()
    with pytest.raises(dist.DistStoreError, match="waiting for clients"):
        store.tcp_store(
            "127.0.0.1",
            port,
            2,
            is_master=True,
            timeout=timedelta(seconds=0.5),
            wait_for_workers=True,
        )
    (fd,) = reused
    try:
        os.fstat(fd)  # EBADF if tcp_store closed a descriptor it no longer owned
    finally:
        os.close(fd)
    # Nothing of the failed store is left listening: the port binds again.
    store.listen_socket("127.0.0.1", port).close()


_RANK = textwrap.dedent(
    """
    import json, sys
    import psutil, torch, torch.distributed as dist
    from neuron_serving.unit import store  # registers ns-tcp://
    rank, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    dist.init_process_group(
        "gloo", init_method=store.init_method(host, port), rank=rank, world_size=2
    )
    sub = dist.new_group([0, 1], backend="gloo")  # as vLLM's TP groups
    dist.all_reduce(torch.ones(1), group=sub)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.barrier()
    listening = [
        [c.laddr.ip, c.laddr.port]
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    ]
    print(json.dumps({"sum": t.item(), "listening": listening}))
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_process_group_over_ns_tcp_binds_everything_to_its_host():
    # Two real processes rendezvous as vLLM's workers do (init_process_group
    # with the unit's init method, then a Gloo subgroup): the world store on
    # rank 0 and every Gloo listener of both ranks bind the unit's host. A
    # non-loopback host (where there is one) also shows Gloo's pairs follow the
    # unit's address, not the one the host name resolves to (loopback here);
    # tests/e2e/test_unit.py checks a loopback unit with real vLLM.
    host = non_loopback_ipv4() or "127.0.0.1"
    port = free_port_block()
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(rank), host, str(port)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert [o["sum"] for o in outs] == [3.0, 3.0]
    store_sockets = [a for a in outs[0]["listening"] if a[1] == port]
    assert store_sockets == [[host, port]], outs[0]["listening"]
    elsewhere = [(r, a) for r, o in enumerate(outs) for a in o["listening"] if a[0] != host]
    assert elsewhere == [], f"(rank, listener) not on {host}: {elsewhere}"
