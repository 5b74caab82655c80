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


def test_metrics_endpoint_reports_control_plane():
    from neuron_serving.unit.metrics import NodeCollector
    from neuron_serving.unit.stats import BroadcastStats

    status = NodeStatus("unit-m", 0, 2)
    stats = BroadcastStats()
    stats.record(1000, 4096, 80e-6)
    stats.record(9000, 9096, 3e-3)
    collector = NodeCollector(status, stats=lambda: stats, heartbeat_ages=lambda: {1: 0.4})
    server = HealthServer(status, "127.0.0.1", free_port_block(), collector=collector)
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port + 1}/metrics", timeout=2) as r:
            text = r.read().decode()
        assert 'neuron_serving_control_broadcasts_total{rank="0",unit_id="unit-m"} 2.0' in text
        assert "neuron_serving_control_broadcast_payload_bytes_total" in text and "10000.0" in text
        assert (
            'neuron_serving_control_broadcast_seconds_bucket{le="0.0001",rank="0",unit_id="unit-m"} 1.0'
            in text
        )
        assert 'neuron_serving_follower_heartbeat_age_seconds{follower_rank="1"' in text
    finally:
        server.stop()
