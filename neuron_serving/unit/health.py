"""Node health server: grpc.health.v1 on ``port``; HTTP ``/healthz`` (JSON) and
``/metrics`` (Prometheus, control plane) on ``port + 1``.

The gRPC Health Checking Protocol is what the proxy and ECS probe; the HTTP
view is for people and curl. Service "" (the node) is SERVING only in state
``ready``; NOT_SERVING otherwise, so "process is up" and "node can serve" differ.
"""

from __future__ import annotations

import json
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST

from neuron_serving.unit.metrics import NodeCollector, render
from neuron_serving.unit.state import NodeState, NodeStatus

SERVICE_NAME = "neuron_serving.Node"


class HealthServer:
    def __init__(
        self,
        status: NodeStatus,
        host: str,
        port: int,
        poll_interval_s: float = 0.2,
        collector: NodeCollector | None = None,
    ):
        self.status = status
        self.collector = collector or NodeCollector(status)
        self.host = host
        self.port = port
        self._poll = poll_interval_s
        self._stop = threading.Event()
        self._servicer = health.HealthServicer()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._grpc)
        bound = self._grpc.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"health server cannot bind gRPC {host}:{port}")
        self.port = bound
        self._http = ThreadingHTTPServer((host, bound + 1), _handler(status, self.collector))
        self._http.daemon_threads = True

    def start(self) -> None:
        self._grpc.start()
        threading.Thread(target=self._http.serve_forever, name="healthz-http", daemon=True).start()
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


def _handler(status: NodeStatus, collector: NodeCollector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            path = self.path.split("?")[0]
            if path == "/metrics":
                body = render(collector)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if path != "/healthz":
                self.send_error(404, "served here: /healthz, /metrics")
                return
            snap = status.snapshot()
            body = json.dumps(snap).encode()
            self.send_response(200 if snap["state"] == NodeState.READY else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # probes are frequent
            pass

    return Handler
