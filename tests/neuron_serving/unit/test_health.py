"""Node health server: grpc.health.v1 and HTTP /healthz on loopback."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from neuron_serving.unit.health import HealthServer
from neuron_serving.unit.state import NodeState, NodeStatus
from tests.procs import free_port_block


def _grpc_status(port):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status


def _http(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/healthz", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _eventually(fn, want, timeout=5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn() == want:
            return
        time.sleep(0.05)
    assert fn() == want


def test_health_follows_node_state():
    status = NodeStatus("unit-a", 1, 2)
    server = HealthServer(status, "127.0.0.1", free_port_block(), poll_interval_s=0.05)
    server.start()
    try:
        _eventually(lambda: _grpc_status(server.port), health_pb2.HealthCheckResponse.NOT_SERVING)
        code, body = _http(server.port)
        assert code == 503 and body["state"] == "joining" and body["rank"] == 1
        assert body["unit_id"] == "unit-a" and "vllm" in body["versions"]
        status.set_state(NodeState.READY)
        status.step_done()
        _eventually(lambda: _grpc_status(server.port), health_pb2.HealthCheckResponse.SERVING)
        code, body = _http(server.port)
        assert code == 200 and body["steps"] == 1 and body["last_step_age_s"] is not None
        status.set_state(NodeState.FAILED, "rank 1 lost the leader")
        status.set_state(NodeState.READY)  # FAILED is terminal
        _eventually(lambda: _grpc_status(server.port), health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _http(server.port)[1]["failure"] == "rank 1 lost the leader"
    finally:
        server.stop()
