"""failures.py: what its health probe reports for each way a server answers, and
the request bodies each system is sent (no deployment starts)."""

from __future__ import annotations

import http.server
import socket
import threading

from neuron_serving.bench.failures import Deployment, probe
from neuron_serving.ports import free_port


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/ok" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_probe_tells_ok_unavailable_refused_and_silent_apart():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert probe(base + "/ok") == "200"
        assert probe(base + "/health") == "503"
        assert probe(f"http://127.0.0.1:{free_port()}/health") == "refused"
        assert probe(f"http://127.0.0.1:{silent.getsockname()[1]}/health", 0.3) == "timeout"
    finally:
        silent.close()
        server.shutdown()


def test_both_systems_get_the_same_greedy_long_requests_in_their_own_api():
    def bodies(system):
        return Deployment(system, None, None, 0, "", "", None).bodies(2)  # type: ignore[arg-type]

    unit, vllm = bodies("unit"), bodies("vllm_mn")
    assert [b["text_input"] for b in unit] == [b["prompt"] for b in vllm]
    assert unit[0]["parameters"] == {k: vllm[0][k] for k in unit[0]["parameters"]}
    assert unit[0]["stream"] and vllm[0]["stream"] and unit[0]["parameters"]["ignore_eos"]
