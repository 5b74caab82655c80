"""The local supervisor's own endpoint: ``GET /metrics`` (Prometheus text: the
supervisor's unit restarts and failures, and the capacity controller's decisions when
`up` autoscales) and ``GET /status`` (JSON), for Prometheus and for tools that want
them without the supervisor's state file.

It binds the cluster's host (loopback unless `up --host` says otherwise) on the port
given (`up --metrics-port`; 0 = any free port, recorded in supervisor.json's
``metrics_url``), and every request must carry the proxies' admin token
(``Authorization: Bearer``, checked in constant time by neuron_serving/bearer.py), as
their admin ports do. Nothing is read from a request but its request line and
headers (the standard library bounds both: 64 KiB per line, 100 headers), and a
client gets ``TIMEOUT_S`` to send them. Only the two GETs exist; anything else is a
404 or 405 with a JSON error and no traceback.

The standard library's threading HTTP server, not aiohttp: two read-only GETs from a
scraper every few seconds need no event loop in the `up` process.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from neuron_serving.bearer import bearer_matches

TIMEOUT_S = 5.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class MetricsEndpoint:
    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        metrics: Callable[[], bytes],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = TIMEOUT_S  # per socket operation: a slow client is dropped

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, code: int, message: str) -> None:
                self._send(code, json.dumps({"error": message}).encode())

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if not bearer_matches(self.headers.get("Authorization"), server.token):
                    return self._error(401, "missing or wrong admin token")
                if self.path == "/metrics":
                    return self._send(200, server.metrics(), PROMETHEUS_TEXT)
                if self.path == "/status":
                    return self._send(200, json.dumps(server.status()).encode())
                self._error(404, "not found: GET /metrics or /status")

            def _not_allowed(self) -> None:
                self._error(405, "only GET /metrics and /status")

            do_POST = do_PUT = do_DELETE = do_PATCH = _not_allowed  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass  # scrapes every few seconds: not worth a line each

        self.token = token
        self.metrics = metrics
        self.status = status

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

        self.httpd = Server((host, port), Handler)
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="supervisor-metrics", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        # server_bind() stored getsockname()'s address: an AF_INET(6) socket's host is a str.
        assert isinstance(host, str)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(TIMEOUT_S)
