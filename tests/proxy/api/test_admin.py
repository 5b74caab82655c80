import asyncio
import socket

from tests.neuron_serving.test_bearer import hostile_authorizations
from tests.proxy.conftest import ADMIN_TOKEN, url
from tests.proxy.fakes import wait_until
from tests.proxy.http_raw import parse_response

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def test_admin_requires_bearer_token_and_changes_nothing(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    proxy = await fleet.proxy([a])
    s = fleet.session()
    new_unit = {"unit_id": "u1", "leader_grpc": b.triton.addr}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_TOKEN}):
        for method, path, body in (
            ("POST", "/admin/units", new_unit),
            ("DELETE", "/admin/units/u0", None),
            ("POST", "/admin/units/u0/drain", None),
            ("GET", "/admin/units", None),
        ):
            async with s.request(
                method, url(proxy, path, admin=True), json=body, headers=headers
            ) as r:
                assert r.status == 401
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert (await r.json())["error"]["type"] == "authentication_error"
    assert list(proxy.registry.units) == ["u0"] and not proxy.registry.get("u0").draining


async def test_admin_add_drain_undrain_remove(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    proxy = await fleet.proxy([a], outlier={"panic_threshold_pct": 0})
    s = fleet.session()
    admin = lambda p: url(proxy, p, admin=True)  # noqa: E731
    body = {"unit_id": "u1", "leader_grpc": b.triton.addr, "followers": [b.followers[0].addr]}
    async with s.post(admin("/admin/units"), json=body, headers=AUTH) as r:
        assert r.status == 201
    async with s.post(admin("/admin/units"), json=body, headers=AUTH) as r:
        assert r.status == 409
    async with s.post(
        admin("/admin/units"), json={"unit_id": "x", "leader_grpc": "nope"}, headers=AUTH
    ) as r:
        assert r.status == 400 and "HOST:PORT" in (await r.json())["error"]["message"]
    await wait_until(lambda: proxy.registry.get("u1").nodes_healthy())  # new unit is probed

    async with s.post(admin("/admin/units/u0/drain"), json=None, headers=AUTH) as r:
        assert r.status == 200 and (await r.json())["draining"] is True
    for i in range(4):  # drained u0 gets nothing
        async with s.post(
            url(proxy, "/v1/completions"), json={"model": "llm", "prompt": f"q{i}"}
        ) as r:
            assert r.status == 200
    assert a.behavior.started == 0 and b.behavior.started == 4
    async with s.post(admin("/admin/units/u0/undrain"), headers=AUTH) as r:
        assert r.status == 200 and (await r.json())["draining"] is False

    assert b.triton.addr in proxy.clients.addrs()
    async with s.delete(admin("/admin/units/u1"), headers=AUTH) as r:
        assert r.status == 200
    await wait_until(lambda: b.triton.addr not in proxy.clients.addrs())  # channel closed
    async with s.delete(admin("/admin/units/u1"), headers=AUTH) as r:
        assert r.status == 404
    async with s.get(admin("/admin/units"), headers=AUTH) as r:
        assert [u["unit_id"] for u in (await r.json())["units"]] == ["u0"]
    async with s.get(url(proxy, "/status")) as r:
        kinds = [e["kind"] for e in (await r.json())["events"]]
    assert (
        kinds.count("added") == 2 and "drain" in kinds and "undrain" in kinds and "removed" in kinds
    )


async def test_admin_add_drained_is_never_routed_before_undrain(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    proxy = await fleet.proxy([a], outlier={"panic_threshold_pct": 0})
    s = fleet.session()
    admin = lambda p: url(proxy, p, admin=True)  # noqa: E731
    body = {"unit_id": "u1", "leader_grpc": b.triton.addr, "draining": True}
    async with s.post(admin("/admin/units"), json={**body, "draining": "yes"}, headers=AUTH) as r:
        assert r.status == 400 and "'draining'" in (await r.json())["error"]["message"]
    async with s.post(admin("/admin/units"), json=body, headers=AUTH) as r:
        assert r.status == 201 and (await r.json())["draining"] is True
    await wait_until(lambda: proxy.registry.get("u1").nodes_healthy())
    for i in range(3):
        async with s.post(
            url(proxy, "/v1/completions"), json={"model": "llm", "prompt": f"q{i}"}
        ) as r:
            assert r.status == 200
    assert b.behavior.started == 0  # healthy, but drained from the start
    async with s.post(admin("/admin/units/u1/undrain"), headers=AUTH) as r:
        assert r.status == 200 and (await r.json())["draining"] is False


async def _admin_status(proxy, authorization: bytes) -> int:
    """GET /admin/units with raw header bytes no HTTP client would send."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.admin_port)
    try:
        writer.write(
            b"GET /admin/units HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Authorization: " + authorization + b"\r\n\r\n"
        )
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return parse_response(raw)[0]


async def test_admin_token_check_survives_hostile_headers(fleet):
    """The scheme in any case is accepted; invalid UTF-8, non-ASCII, a huge token, a
    bare scheme, another scheme are each a 401, never a 500 (neuron_serving/bearer.py)."""
    a = await fleet.unit("u0")
    proxy = await fleet.proxy([a])
    assert await _admin_status(proxy, b"bEARER " + ADMIN_TOKEN.encode()) == 200
    for value in hostile_authorizations(ADMIN_TOKEN):
        assert await _admin_status(proxy, value) == 401, value[:40]


async def test_admin_list_carries_each_units_spec_as_post_takes_it(fleet):
    """What a restarted replica is given from a sibling (neuron_serving/proxy_admin.py):
    each listed unit's spec, which POST /admin/units takes back unchanged."""
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    first = await fleet.proxy([a, b])
    second = await fleet.proxy([])
    s = fleet.session()
    async with s.get(url(first, "/admin/units", admin=True), headers=AUTH) as r:
        listed = (await r.json())["units"]
    assert listed[0]["spec"]["leader_grpc"] == a.triton.addr
    for unit in listed:
        body = {**unit["spec"], "draining": unit["unit_id"] == "u1"}
        async with s.post(url(second, "/admin/units", admin=True), json=body, headers=AUTH) as r:
            assert r.status == 201
    assert second.registry.get("u0").spec == first.registry.get("u0").spec
    assert second.registry.get("u1").draining and not second.registry.get("u0").draining


async def test_the_admin_port_serves_this_replicas_status_and_metrics(fleet):
    a = await fleet.unit("u0")
    proxy = await fleet.proxy([a])
    s = fleet.session()
    async with s.get(url(proxy, "/status", admin=True)) as r:
        assert r.status == 401  # the admin port's token, as for every admin route
    async with s.get(url(proxy, "/status", admin=True), headers=AUTH) as r:
        body = await r.json()
    assert not body["redacted"] and body["units"][0]["state"] == "routable"
    assert body["batches"]["replica_id"] == f"{socket.gethostname()}:{proxy.port}"
    async with s.get(url(proxy, "/metrics", admin=True), headers=AUTH) as r:
        assert r.status == 200 and "proxy_unit_healthy" in await r.text()


async def test_replicas_with_reuse_port_share_the_client_port(fleet):
    from neuron_serving.triton.launcher import free_port

    a = await fleet.unit("u0")
    port = free_port()
    one = await fleet.proxy([a], port=port, reuse_port=True, batch={"replica_id": "proxy-0"})
    two = await fleet.proxy([a], port=port, reuse_port=True, batch={"replica_id": "proxy-1"})
    assert one.port == two.port == port and one.admin_port != two.admin_port
    s = fleet.session()
    for _ in range(8):  # a fresh connection each: the kernel picks a replica
        async with s.post(
            url(one, "/v1/completions"),
            json={"model": "llm", "prompt": "hi"},
            headers={"Connection": "close"},
        ) as r:
            assert r.status == 200
    assert a.behavior.started == 8
