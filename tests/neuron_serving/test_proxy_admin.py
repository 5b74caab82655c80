"""The admin fan-out client (neuron_serving/proxy_admin.py) against real proxies on
loopback, one replica that is down (nothing listens) and one that hangs (its
connection is accepted by the kernel and never answered)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_serving.proxy_admin import (
    AdminError,
    AdminFanOut,
    Replica,
    replicas_from_urls,
    sync_calls,
)
from neuron_serving.triton.launcher import free_port
from tests.proxy_thread import ADMIN_TOKEN, ProxyThread, two_replicas, unit

TIMEOUT_S = 0.5


@pytest.fixture
def proxies(tmp_path: Path) -> Iterator[list[ProxyThread]]:
    with two_replicas(tmp_path) as started:
        yield started


@pytest.fixture
def hanging() -> Iterator[str]:
    """An admin URL whose connections the kernel accepts and nobody ever answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def fan_out(*urls: str) -> AdminFanOut:
    return AdminFanOut(
        [Replica(f"r{i}", url) for i, url in enumerate(urls)], ADMIN_TOKEN, TIMEOUT_S
    )


def test_a_change_reaches_every_live_replica_and_names_the_others(proxies, hanging):
    down = f"http://127.0.0.1:{free_port()}"
    admin = fan_out(proxies[0].admin_url, down, proxies[1].admin_url, hanging)
    t0 = time.monotonic()
    out = admin.drain("unit-0")
    took = time.monotonic() - t0
    assert all(p.drained() == {"unit-0"} for p in proxies)
    assert [a.status for a in out.answers] == [200, 0, 200, 0]
    assert "refused" in out.answers[1].body.lower()
    assert "timed out" in out.answers[3].body
    # In parallel, each call bounded: the hanging replica costs one timeout, not more.
    assert took < 3 * TIMEOUT_S, took
    out.check(allow_unanswered=True)  # down replicas catch up when they are back
    with pytest.raises(AdminError) as e:
        out.check()
    assert "r1: no answer" in str(e.value) and "r3: no answer" in str(e.value)
    assert "r0" not in str(e.value)


def test_a_refusal_is_an_error_even_when_others_applied_it(proxies):
    proxies[1].call(_remove(proxies[1], "unit-1"))
    out = fan_out(proxies[0].admin_url, proxies[1].admin_url).drain("unit-1")
    with pytest.raises(AdminError, match="r1: HTTP 404"):
        out.check(allow_unanswered=True)
    out.check((200, 404))  # what a registrar's drain accepts: already gone is fine


def test_nothing_applied_is_an_error(tmp_path):
    out = fan_out(f"http://127.0.0.1:{free_port()}").undrain("unit-0")
    with pytest.raises(AdminError, match="no answer"):
        out.check(allow_unanswered=True)


def test_add_keeps_a_replicas_identical_unit_and_replaces_a_moved_one(proxies):
    admin = fan_out(proxies[0].admin_url, proxies[1].admin_url)
    proxies[1].call(_remove(proxies[1], "unit-1"))
    before = proxies[0].units()["unit-1"]
    same = {"unit_id": "unit-1", "leader_grpc": before.spec.leader_grpc, "model": "llm"}
    out = admin.add(same, draining=True)
    out.check((200, 201))
    assert proxies[0].units()["unit-1"] is before  # kept (its health state too), drained
    assert proxies[0].drained() == {"unit-1"} and proxies[1].drained() == {"unit-1"}
    admin.add(same).check((200, 201))  # an add never undrains
    assert proxies[0].drained() == {"unit-1"}
    moved = {**same, "leader_grpc": f"127.0.0.1:{free_port()}"}
    admin.add(moved).check((200, 201))
    for p in proxies:
        assert p.units()["unit-1"].spec.leader_grpc == moved["leader_grpc"]
        assert not p.drained()


def test_sync_gives_a_replica_its_siblings_units_and_drain_states(proxies, tmp_path):
    live, restarted = proxies
    admin = fan_out(live.admin_url, restarted.admin_url)
    extra = unit("unit-2", free_port())
    admin.add(extra, draining=True).check((201,))
    admin.drain("unit-0").check()
    admin.remove("unit-1").check()
    restarted.stop()  # comes back from its config: unit-0 and unit-1, none drained
    again = ProxyThread(tmp_path, [unit("unit-0", 1), unit("unit-1", free_port())])
    proxies[1] = again
    replica, reference = Replica("again", again.admin_url), admin.replicas[0]
    done = admin.sync(replica, reference)
    assert done == [
        "DELETE /admin/units/unit-1",
        "DELETE /admin/units/unit-0",  # another leader address than the sibling's
        "POST /admin/units",
        "POST /admin/units",
    ]
    assert {u: s.spec for u, s in again.units().items()} == {
        u: s.spec for u, s in live.units().items()
    }
    assert again.drained() == live.drained() == {"unit-0", "unit-2"}
    assert admin.sync(replica, reference) == []  # alike now
    assert admin.sync(replica, Replica("down", f"http://127.0.0.1:{free_port()}")) is None


def test_sync_calls_drain_and_undrain_in_place() -> None:
    spec = {"unit_id": "u", "leader_grpc": "h:1"}
    drained = {"u": {"spec": spec, "draining": True}}
    routable = {"u": {"spec": spec, "draining": False}}
    assert sync_calls(drained, routable) == [("POST", "/admin/units/u/drain", None)]
    assert sync_calls(routable, drained) == [("POST", "/admin/units/u/undrain", None)]
    assert sync_calls(drained, {}) == [("POST", "/admin/units", {**spec, "draining": True})]


def test_each_replicas_own_status_from_its_admin_port(proxies):
    down = f"http://127.0.0.1:{free_port()}"
    statuses = fan_out(proxies[0].admin_url, down).statuses()
    assert statuses["r1"] is None
    assert [u["unit_id"] for u in statuses["r0"]["units"]] == ["unit-0", "unit-1"]
    assert statuses["r0"]["redacted"] is False


def test_replicas_named_by_address() -> None:
    assert replicas_from_urls(["http://proxy-0.internal:8081/"]) == [
        Replica("proxy-0.internal:8081", "http://proxy-0.internal:8081/")
    ]


async def _remove(proxy: ProxyThread, unit_id: str) -> None:
    proxy.server.registry.remove(unit_id)
