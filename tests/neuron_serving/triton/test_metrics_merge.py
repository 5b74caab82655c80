"""The leader's metrics port merges real upstream HTTP servers."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter, start_http_server

from neuron_serving.ports import free_port
from neuron_serving.triton.metrics_merge import MetricsMerger


def test_merges_upstreams_and_survives_a_dead_one() -> None:
    registry = CollectorRegistry()
    Counter("vllm:fake_tokens", "doc", registry=registry).inc(3)
    up_port = free_port()
    server, thread = start_http_server(up_port, addr="127.0.0.1", registry=registry)
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    merger = MetricsMerger("127.0.0.1", 0, [f"http://127.0.0.1:{up_port}/metrics", dead])
    merger.start()
    try:
        url = f"http://127.0.0.1:{merger.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        assert "vllm:fake_tokens_total 3.0" in text
        assert f"# upstream {dead} unavailable" in text
    finally:
        merger.stop()
        server.shutdown()
        thread.join(timeout=5)
