"""Node health server: grpc.health.v1 on ``port``; HTTP ``/healthz`` (JSON) and
``/metrics`` (Prometheus, control plane) on ``port + 1``.

The gRPC Health Checking Protocol is what the proxy and ECS probe; the HTTP
view is for people and curl. Service "" (the node) is SERVING only in state
``ready``; NOT_SERVING otherwise, so "process is up" and "node can serve" differ.

Hostile by default (both ports may face the VPC in ECS):
- Threads are bounded whatever callers do: gRPC serves ``Check`` from a fixed
  pool (``Watch`` would hold a pool thread per stream, so it is not served);
  HTTP serves from a fixed pool and closes connections beyond a cap at once.
  An idle TCP connection costs a file descriptor, never a thread.
- Every request has a deadline from accept (HTTP: the whole request; gRPC: the
  HTTP/2 handshake), so slow senders are cut off; idle gRPC connections close.
- ``/healthz`` detail (host name, versions, failure text) goes to loopback
  callers and to callers presenting ``Authorization: Bearer
  $NEURON_SERVING_HEALTH_TOKEN``; anyone else gets ``{"state": ...}`` alone.
  ``/metrics`` carries counters labelled by unit id and rank, no host names,
  versions or failure text, and stays open for the scraper.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST

from neuron_serving import envs
from neuron_serving.bearer import bearer_matches
from neuron_serving.netaddr import host_port, is_loopback
from neuron_serving.unit.node_metrics import NodeCollector, render
from neuron_serving.unit.node_status import NodeState, NodeStatus

SERVICE_NAME = "neuron_serving.Node"

logger = logging.getLogger("neuron_serving.unit.health_server")


@dataclass(frozen=True, slots=True)
class HealthLimits:
    """Resource bounds of one node's health server (both protocols)."""

    # HTTP: worker threads, open connections (queued ones included; beyond it a
    # new connection is closed at once), and the deadline of a whole request
    # counted from accept (a GET has no body: the request head must arrive by then).
    http_workers: int = 4
    http_max_connections: int = 64
    http_request_timeout_s: float = 5.0
    # gRPC: pool threads, RPCs in flight or queued (beyond: RESOURCE_EXHAUSTED),
    # deadline of the HTTP/2 handshake, and how long an idle connection stays.
    grpc_workers: int = 4
    grpc_max_concurrent_rpcs: int = 64
    grpc_handshake_timeout_s: float = 5.0
    grpc_idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("http_workers", "http_max_connections", "grpc_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grpc_max_concurrent_rpcs < self.grpc_workers:
            raise ValueError("grpc_max_concurrent_rpcs must be >= grpc_workers")
        for name in ("http_request_timeout_s", "grpc_handshake_timeout_s", "grpc_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class _CheckOnlyHealth(health.HealthServicer):
    # A Watch stream holds one of the sync server's pool threads for its whole
    # life: a few of them would starve Check. The proxy, ECS and
    # grpc_health_probe all use Check.
    def Watch(self, request, context, send_response_callback=None):  # noqa: N802 (gRPC API)
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served here; use Check")


class HealthServer:
    def __init__(
        self,
        status: NodeStatus,
        host: str,
        port: int,
        poll_interval_s: float = 0.2,
        collector: NodeCollector | None = None,
        limits: HealthLimits | None = None,
        detail_token: str | None = None,
    ):
        self.status = status
        self.collector = collector or NodeCollector(status)
        self.host = host
        self.port = port
        self.limits = limits or HealthLimits()
        token = detail_token if detail_token is not None else envs.NEURON_SERVING_HEALTH_TOKEN
        self._poll = poll_interval_s
        self._stop = threading.Event()
        self._servicer = _CheckOnlyHealth()
        lim = self.limits
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=lim.grpc_workers, thread_name_prefix="health-grpc"
            ),
            maximum_concurrent_rpcs=lim.grpc_max_concurrent_rpcs,
            options=[
                # Health messages are a few bytes.
                ("grpc.max_receive_message_length", 4096),
                ("grpc.max_send_message_length", 4096),
                ("grpc.max_concurrent_streams", 16),
                ("grpc.server_handshake_timeout_ms", int(lim.grpc_handshake_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(lim.grpc_idle_timeout_s * 1000)),
                # gRPC sets SO_REUSEPORT by default: another local process could
                # then bind the same port and answer (or read) probes.
                ("grpc.so_reuseport", 0),
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._grpc)
        bound = self._grpc.add_insecure_port(host_port(host, port))
        if bound == 0:
            raise OSError(f"health server cannot bind gRPC {host}:{port}")
        self.port = bound
        self._http = BoundedHTTPServer(
            (host, bound + 1), _handler(status, self.collector, token), lim
        )

    def start(self) -> None:
        self._grpc.start()
        threading.Thread(
            target=self._http.serve_forever, args=(0.25,), name="healthz-http", daemon=True
        ).start()
        threading.Thread(target=self._sync, name="health-sync", daemon=True).start()

    def _sync(self) -> None:
        # Polling keeps NodeStatus free of callbacks into gRPC from hot paths.
        last = None
        while not self._stop.is_set():
            serving = self.status.state is NodeState.READY
            if serving != last:
                code = (
                    health_pb2.HealthCheckResponse.SERVING
                    if serving
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                self._servicer.set("", code)
                self._servicer.set(SERVICE_NAME, code)
                last = serving
            self._stop.wait(self._poll)

    def stop(self) -> None:
        self._stop.set()
        self._grpc.stop(grace=0.5)
        self._http.shutdown()
        self._http.server_close()


class BoundedHTTPServer(socketserver.TCPServer):
    """An HTTP/1.0 server with a fixed worker pool, a connection cap and a
    per-request deadline enforced from outside the worker.

    ``ThreadingHTTPServer`` starts a thread per connection and never times one
    out; a socket timeout alone does not stop a slow-loris sender (each byte
    restarts it). Here the serving thread's ``service_actions`` (run every
    poll interval by ``serve_forever``) shuts down sockets past their deadline,
    which also unblocks a worker stuck reading one.
    """

    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, handler, limits: HealthLimits):
        self.limits = limits
        self.dropped = 0  # connections closed at accept because the cap was reached
        self.timed_out = 0  # connections cut at their deadline
        self._open: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(
            max_workers=limits.http_workers, thread_name_prefix="healthz-http"
        )
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        with self._lock:
            if len(self._open) >= self.limits.http_max_connections:
                self.dropped += 1
                admitted = False
            else:
                self._open[request] = time.monotonic() + self.limits.http_request_timeout_s
                admitted = True
        if not admitted:
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError:
            pass  # peer gone or cut at its deadline: nothing to answer
        except Exception:
            logger.exception("healthz request from %s failed", client_address[0])
        finally:
            with self._lock:
                self._open.pop(request, None)
            self.shutdown_request(request)

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [s for s, deadline in self._open.items() if deadline < now]
        for sock in overdue:
            self.timed_out += 1
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its worker

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            socks = list(self._open)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)


def _handler(
    status: NodeStatus, collector: NodeCollector, token: str | None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # No software versions in the Server header (see version_string).
        server_version = "neuron-serving"
        # Parser errors before a version was read still get a status line and headers.
        default_request_version = "HTTP/1.0"
        # Socket timeout of each read and write; the whole request's deadline is
        # the server's (BoundedHTTPServer.service_actions).
        timeout = 5.0
        server: BoundedHTTPServer  # the server _handler's class is made for

        def setup(self) -> None:
            # Per instance, as StreamRequestHandler.setup reads it; typeshed declares
            # the attribute a ClassVar.
            self.timeout = self.server.limits.http_request_timeout_s  # type: ignore[misc]
            super().setup()

        def version_string(self) -> str:
            return self.server_version

        def _detail_allowed(self) -> bool:
            if is_loopback(self.client_address[0]):
                return True
            # http.server decodes header values as latin-1: back to the bytes sent.
            got = self.headers.get("Authorization", "").encode("latin-1", "replace")
            return bearer_matches(got, token)

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._send(200, render(collector), CONTENT_TYPE_LATEST)
                return
            if path != "/healthz":
                self.send_error(404)
                return
            snap = status.snapshot()
            if not self._detail_allowed():
                # Liveness for anyone; who runs what where is not for strangers.
                snap = {"state": snap["state"]}
            code = 200 if snap["state"] == NodeState.READY else 503
            self._send(code, json.dumps(snap).encode(), "application/json")

        def send_error(self, code: int, message: str | None = None, explain=None) -> None:
            # Parser errors too (bad request line, oversized headers): JSON, and
            # never the caller's own text echoed back.
            phrase = HTTPStatus(code).phrase
            self.close_connection = True
            body = json.dumps({"error": phrase}).encode()
            self._send(code, body, "application/json")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if getattr(self, "command", None) != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # probes are frequent
            pass

    return Handler
