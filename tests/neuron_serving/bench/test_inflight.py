"""inflight.py against a real loopback HTTP server that ends its streams each way a
failing server can: completed, error event, non-200, cut, and hung until closed."""

from __future__ import annotations

import http.server
import json
import threading
import time

from neuron_serving.bench.inflight import InFlight

RELEASE = threading.Event()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *args):
        pass

    def do_POST(self):
        mode = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["mode"]
        if mode == "503":
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"unavailable")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self._event({"text_output": "a"})
        if mode == "done":
            self.wfile.write(b"data: [DONE]\n\n")
        elif mode == "finish":
            self._event({"text_output": "b", "finish_reason": "length"})
        elif mode == "error":
            self._event({"error": "rank 1 failed"})
        elif mode == "hang":
            RELEASE.wait(timeout=10)

    def _event(self, event):
        self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.flush()


def test_each_way_a_stream_ends_is_told_apart():
    modes = ["done", "finish", "error", "503", "cut", "hang"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    flight = InFlight("127.0.0.1", server.server_address[1], "/s",
                      [{"mode": m} for m in modes], read_timeout_s=10).start()  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while sum(r.ended is not None for r in flight.records) < 5 or not flight.all_streaming():
            assert time.monotonic() < deadline, [r.how for r in flight.records]
            time.sleep(0.02)
        time.sleep(0.3)
        since = flight.records[0].started
        out = dict(zip(modes, flight.outcomes(time.monotonic(), 0.2, since), strict=True))
        assert out["done"].startswith("completed, +") and out["finish"].startswith("completed")
        assert out["error"].startswith("error event: rank 1 failed")
        assert out["503"].startswith("error: HTTP 503")
        assert out["cut"].startswith("error: closed after 1 events")
        assert out["hang"].startswith("hung: open, no event for")
        assert flight.records[modes.index("hang")].events == 1
    finally:
        flight.close(join_timeout_s=5)
        RELEASE.set()
        server.shutdown()
    assert flight.all_ended()  # close ends the hung read too
