"""The supervisor's GET /metrics and /status (here serving the capacity controller's):
a real socket on loopback, the admin token required, hostile requests answered with a
4xx and the server still serving."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from neuron_serving.capacity.controller import CapacityController, ControllerConfig
from neuron_serving.monitoring.endpoint import TIMEOUT_S, MetricsEndpoint
from tests.neuron_serving.capacity.helpers import fleet, signals
from tests.neuron_serving.capacity.test_controller import FAST, FakeActuator, Script

TOKEN = "t" * 43


@pytest.fixture
def server() -> Iterator[MetricsEndpoint]:
    c = CapacityController(Script([signals(0, fleet(1), rt=30)]), FakeActuator(),
                           ControllerConfig(policy=FAST), log_line=lambda _: None)  # fmt: skip
    c.tick()
    srv = MetricsEndpoint("127.0.0.1", 0, TOKEN, c.render_metrics, c.status)
    srv.start()
    yield srv
    srv.stop()


def _get(srv: MetricsEndpoint, path: str, token: str | None = TOKEN,
         method: str = "GET") -> tuple[int, bytes]:  # fmt: skip
    host, port = srv.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    conn.request(method, path, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


def test_metrics_and_status_with_the_admin_token(server: MetricsEndpoint) -> None:
    status, body = _get(server, "/metrics")
    assert status == 200
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"capacity_desired_units", "capacity_units", "capacity_decisions"} <= names
    status, body = _get(server, "/status")
    view = json.loads(body)
    assert status == 200 and view["desired"] == 3 and view["reason"] == "panic"
    assert server.url.startswith("http://127.0.0.1:")


def test_hostile_requests_get_a_4xx_and_the_server_goes_on(server: MetricsEndpoint) -> None:
    assert _get(server, "/metrics", token=None)[0] == 401
    status, body = _get(server, "/status", token="x" * 43)
    assert status == 401 and json.loads(body) == {"error": "missing or wrong admin token"}
    assert _get(server, "/units")[0] == 404
    assert _get(server, "/metrics?x=" + "a" * 5000)[0] == 404
    assert _get(server, "/metrics", method="POST")[0] == 405
    assert _get(server, "/status", method="DELETE")[0] == 405
    # An oversized header line: the standard library refuses it before any handler.
    host, port = server.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n")
        assert b" 431 " in s.recv(64)
    # A client that connects and sends nothing is dropped after TIMEOUT_S, and others
    # are served meanwhile (one thread per connection).
    idle = socket.create_connection((host, port), timeout=TIMEOUT_S + 5)
    try:
        assert _get(server, "/metrics")[0] == 200
        assert idle.recv(1) == b""  # closed by the server (else recv times out: an error)
    finally:
        idle.close()
    assert _get(server, "/status")[0] == 200
