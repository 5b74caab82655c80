"""failures.py and twonode.py: what the health probe reports for each way a server
answers, the request bodies each system is sent and the engine settings each gets
(no deployment starts)."""

from __future__ import annotations

import http.server
import socket
import threading

from neuron_serving.bench.failures import bodies
from neuron_serving.bench.multinode import cli_args
from neuron_serving.bench.twonode import TwoNodeEngine, probe
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
    unit, vllm = bodies("unit", 2), bodies("vllm_mn", 2)
    assert [b["text_input"] for b in unit] == [b["prompt"] for b in vllm]
    assert unit[0]["parameters"] == {k: vllm[0][k] for k in unit[0]["parameters"]}
    assert unit[0]["stream"] and vllm[0]["stream"] and unit[0]["parameters"]["ignore_eos"]


def test_both_systems_get_the_same_engine_settings():
    engine = TwoNodeEngine(max_model_len=2048, kv_cache_bytes=512 << 20, max_num_seqs=64)
    ours, theirs = engine.leader_args(), cli_args(engine.vllm_kwargs())
    for flag in ("--max-model-len", "--max-num-seqs"):
        assert ours[ours.index(flag) + 1] == theirs[theirs.index(flag) + 1]
    assert (
        ours[ours.index("--kv-cache-bytes") + 1]
        == theirs[theirs.index("--kv-cache-memory-bytes") + 1]
    )
    assert "--enforce-eager" in ours and "--enforce-eager" in theirs
    assert theirs[theirs.index("--max-num-batched-tokens") + 1] == "2048"
    eager_off = TwoNodeEngine(max_model_len=1024, kv_cache_bytes=1 << 28, enforce_eager=False)
    assert "--enforce-eager" not in eager_off.leader_args()
    assert "--enforce-eager" not in cli_args(eager_off.vllm_kwargs())
