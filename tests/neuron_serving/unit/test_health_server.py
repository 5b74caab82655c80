"""Node health server: grpc.health.v1 and HTTP /healthz, and hostile callers of both."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from neuron_serving.unit.health_server import HealthLimits, HealthServer
from neuron_serving.unit.node_status import NodeState, NodeStatus
from tests.neuron_serving.unit.exposition import samples
from tests.procs import free_port_block, non_loopback_ipv4


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
    from neuron_serving.unit.broadcast_stats import BroadcastStats
    from neuron_serving.unit.node_metrics import NodeCollector

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
        assert samples(text, "neuron_serving_control_broadcasts_total", rank="0",
                       unit="unit-m") == [2.0]  # fmt: skip
        assert "neuron_serving_control_broadcast_payload_bytes_total" in text and "10000.0" in text
        assert samples(text, "neuron_serving_control_broadcast_seconds_bucket", le="0.0001",
                       rank="0", unit="unit-m") == [1.0]  # fmt: skip
        assert 'neuron_serving_follower_heartbeat_age_seconds{follower_rank="1"' in text
    finally:
        server.stop()


# -- hostile callers (issue 14, finding 12) ---------------------------------------------

FAST = HealthLimits(http_request_timeout_s=1.0, grpc_handshake_timeout_s=1.0)


def _started(host="127.0.0.1", limits=FAST, **kw) -> HealthServer:
    server = HealthServer(NodeStatus("unit-h", 1, 2), host, free_port_block(), limits=limits, **kw)
    server.start()
    return server


def _http_code_or_none(port) -> int | None:
    try:
        return _http(port)[0]
    except OSError:  # closed at the connection cap while the flood holds it
        return None


def _connect(host, port) -> socket.socket:
    return socket.create_connection((host, port), timeout=5)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_idle_connection_flood_keeps_threads_bounded_and_health_answers():
    server = _started()
    me = psutil.Process()
    socks: list[socket.socket] = []
    try:
        assert _grpc_status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _http(server.port)[0] == 503
        threads_before = me.num_threads()
        for _ in range(200):
            socks.append(_connect("127.0.0.1", server.port))  # gRPC
            socks.append(_connect("127.0.0.1", server.port + 1))  # HTTP
        time.sleep(0.5)  # let both servers accept everything
        threads_flood = me.num_threads()
        bound = FAST.http_workers + FAST.grpc_workers
        assert threads_flood - threads_before <= bound, (
            f"400 idle connections: {threads_before} -> {threads_flood} threads "
            f"(bound: +{bound}, the two pools)"
        )
        http = server._http
        assert http.open_connections() <= FAST.http_max_connections, http.open_connections()
        # Beyond the cap a connection is dropped; one held past the request timeout
        # (1 s here) is cut, freeing its place for a later one, so on a slow host
        # where the flood takes over a second both count. On a loaded host the last
        # few may still wait in the listen backlog half a second on (CI: 132 of 136
        # counted): bounded wait for them, not a fixed sleep.
        deadline = time.monotonic() + 10
        while (
            http.dropped + http.timed_out < 200 - FAST.http_max_connections
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert http.dropped + http.timed_out >= 200 - FAST.http_max_connections, (
            f"{http.dropped} HTTP connections dropped and {http.timed_out} timed out at "
            f"the cap of {FAST.http_max_connections}"
        )
        # gRPC Check is served while the flood is held open; /healthz once the
        # flood's deadlines have passed (its workers are freed by them).
        assert _grpc_status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        _eventually(lambda: _http_code_or_none(server.port), 503, timeout=15)
        assert http.timed_out > 0
        threads_after = me.num_threads()
        assert threads_after - threads_before <= bound, (threads_before, threads_after)
    finally:
        for s in socks:
            s.close()
        server.stop()


@pytest.mark.parametrize("port_offset", [1, 0], ids=["http", "grpc"])
def test_slow_loris_is_cut_off(port_offset):
    server = _started()
    try:
        sock = _connect("127.0.0.1", server.port + port_offset)
        # HTTP: a request head that never ends; gRPC: an HTTP/2 preface that never ends.
        trickle = b"GET /healthz HTTP/1.0\r\n" + b"X-Slow: y\r\n" * 200
        if port_offset == 0:
            trickle = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        sock.settimeout(0.1)
        t0 = time.monotonic()
        cut = False
        # Bounded: 30 s of trickling at most, far past both 1 s deadlines.
        for i in range(300):
            try:
                sock.sendall(trickle[i % len(trickle) : i % len(trickle) + 1])
                cut = _closed_by_peer(sock)
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                cut = True
            if cut:
                break
        elapsed = time.monotonic() - t0
        assert cut, f"a 1-byte-per-0.1 s sender was still connected after {elapsed:.1f} s"
        sock.close()
        # Legitimate callers are served afterwards.
        assert _grpc_status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _http(server.port)[0] == 503
    finally:
        server.stop()


def _raw_get(host, port, path, headers=b""):
    sock = _connect(host, port)
    try:
        sock.sendall(b"GET " + path + b" HTTP/1.0\r\n" + headers + b"\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head.decode(), body


def test_healthz_tells_strangers_only_the_state():
    host = non_loopback_ipv4()
    if host is None:
        pytest.skip("no non-loopback IPv4 address to call from")
    server = _started(host=host, detail_token="health-secret-0123456789")
    status = server.status
    status.set_state(NodeState.FAILED, "rank 1 lost the leader 10.0.0.7:29500")
    try:
        # A caller on the node's VPC address (not loopback), without or with a
        # wrong token: the state, nothing else.
        for auth in (b"", b"Authorization: Bearer wrong\r\n"):
            head, body = _raw_get(host, server.port + 1, b"/healthz", auth)
            assert head.startswith("HTTP/1.0 503"), head
            assert json.loads(body) == {"state": "failed"}, body
            assert "Python" not in head and "BaseHTTP" not in head, head
        head, body = _raw_get(
            host,
            server.port + 1,
            b"/healthz",
            b"Authorization: Bearer health-secret-0123456789\r\n",
        )
        detail = json.loads(body)
        assert detail["failure"] == "rank 1 lost the leader 10.0.0.7:29500"
        assert detail["host"] == status.host and "vllm" in detail["versions"]
        # Errors are JSON and echo nothing of the request.
        head, body = _raw_get(host, server.port + 1, b"/<script>")
        assert head.startswith("HTTP/1.0 404") and json.loads(body) == {"error": "Not Found"}
        sock = _connect(host, server.port + 1)
        sock.sendall(b"\x16\x03\x01 garbage <b>\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):  # headers and body arrive in two sends
            data += chunk
        sock.close()
        assert b" 400 " in data.split(b"\r\n")[0] and b"<b>" not in data, data
        assert json.loads(data.partition(b"\r\n\r\n")[2]) == {"error": "Bad Request"}
    finally:
        server.stop()


def test_grpc_watch_is_refused_and_check_served():
    server = _started()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                next(iter(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert _grpc_status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop()


def test_limits_are_checked():
    with pytest.raises(ValueError, match="http_workers"):
        HealthLimits(http_workers=0)
    with pytest.raises(ValueError, match="http_request_timeout_s"):
        HealthLimits(http_request_timeout_s=0)


def test_grpc_port_cannot_be_bound_twice():
    # gRPC's default SO_REUSEPORT would let another local process bind the
    # same port and receive a share of the probes.
    server = _started()
    try:
        other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", server.port))
        finally:
            other.close()
    finally:
        server.stop()
