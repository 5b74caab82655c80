"""The leader's public metrics port: Triton's metrics plus the model process's.

tritonserver serves its own metrics (``nv_*``) on an internal loopback port and the
model process serves vLLM's (``vllm:*``) and ours (``neuron_serving_*``) on another
(see ``metrics.py``). This server answers ``GET /metrics`` on the public port with
both expositions concatenated, so a Prometheus scrape config needs one target per
leader. An upstream that does not answer (still loading, or gone) is skipped with
a comment line rather than failing the whole scrape: Triton's metrics are most
useful exactly when the model is down.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

_UPSTREAM_TIMEOUT_S = 2.0


class MetricsMerger:
    def __init__(self, host: str, port: int, upstreams: list[str]) -> None:
        self.upstreams = upstreams
        merger = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = merger.collect().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass  # scrapes every few seconds would drown the leader's log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-merge", daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def collect(self) -> str:
        parts = []
        for url in self.upstreams:
            try:
                with urllib.request.urlopen(url, timeout=_UPSTREAM_TIMEOUT_S) as r:
                    text = r.read().decode()
            except OSError as e:
                parts.append(f"# upstream {url} unavailable: {e}\n")
                continue
            parts.append(text if text.endswith("\n") else text + "\n")
        return "".join(parts)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
