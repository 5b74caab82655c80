"""The dashboard's history: Prometheus's histogram_quantile as the proxy computes it,
and the fallback to the proxy's own window when Prometheus does not answer."""

from __future__ import annotations

import math

import aiohttp
import pytest

from proxy.config import HistoryConfig
from proxy.serving.history import (
    PrometheusHistory,
    ProxyHistory,
    history_view,
    quantile,
)
from proxy.serving.metrics import ProxyMetrics
from tests.procs import free_port_block

INF = math.inf


def test_quantile_interpolates_as_prometheus_does() -> None:
    # 10 observations <= 0.1, 10 more <= 1: the median is the first bucket's top edge,
    # p75 half way through the second bucket.
    b = [(0.1, 10.0), (1.0, 20.0), (INF, 20.0)]
    assert quantile(0.5, b) == pytest.approx(0.1)
    assert quantile(0.75, b) == pytest.approx(0.55)
    assert quantile(0.25, b) == pytest.approx(0.05)
    # Ranks in +Inf: the highest finite bound; nothing observed: None.
    assert quantile(0.99, [(0.1, 1.0), (INF, 10.0)]) == 0.1
    assert quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None
    assert quantile(0.5, []) is None


def test_the_own_window_turns_counters_into_rates_and_quantiles() -> None:
    m = ProxyMetrics()
    clock = iter([100.0, 110.0]).__next__
    h = ProxyHistory(m.registry, lambda: [("u0", "routable", 0.25)], lambda: {"batch": 3},
                     HistoryConfig(interval_s=5, window_s=60), clock=clock)  # fmt: skip
    h.sample()
    for _ in range(20):
        m.requests.labels("completions", "200", "u0", "t", "real-time").inc()
        m.ttft.labels("u0", "real-time").observe(0.2)
    for _ in range(30):
        m.itl.observe(0.02)
    h.sample()
    v = h.view()
    assert v["t"] == [100.0, 110.0] and v["source"] == "proxy"
    assert v["series"]["requests_per_s"] == [None, 2.0]
    assert v["series"]["tokens_per_s"] == [None, 5.0]  # (20 first tokens + 30 gaps) / 10 s
    assert 0.1 < v["series"]["ttft_p50_s"][1] <= 0.25
    assert v["series"]["queued:batch"] == [3.0, 3.0]
    assert v["series"]["kv_usage:u0"] == [0.25, 0.25]
    assert v["health"] == {"u0": ["routable", "routable"]}


async def test_a_silent_prometheus_falls_back_to_the_own_window_and_says_why() -> None:
    m = ProxyMetrics()
    own = ProxyHistory(m.registry, list, dict, HistoryConfig())
    own.sample()
    dead = f"http://127.0.0.1:{free_port_block()}"
    prom = PrometheusHistory(HistoryConfig(prometheus_url=dead, prometheus_timeout_s=1.0))
    async with aiohttp.ClientSession() as session:
        v = await history_view(own, prom, session)
    assert v["source"] == "proxy" and "Prometheus did not answer" in v["fallback"]
    assert len(v["t"]) == 1


def test_the_config_is_checked() -> None:
    with pytest.raises(ValueError, match="prometheus_url"):
        HistoryConfig(prometheus_url="ftp://x")
    with pytest.raises(ValueError, match="window_s"):
        HistoryConfig(interval_s=5, window_s=5)


async def test_history_wants_a_key_and_refuses_in_the_apis_format(fleet) -> None:
    """With client keys, /status/history without one (or with a wrong one) is a 401 in
    OpenAI's error format, no traceback; with one, the series."""
    from tests.proxy.conftest import url

    key = "history-key-0123456789"
    u1 = await fleet.unit("u1")
    proxy = await fleet.proxy([u1], api_key=key, history={"interval_s": 1, "window_s": 10})
    session = fleet.session()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "x" * 5000}):
        async with session.get(url(proxy, "/status/history"), headers=headers) as r:
            assert r.status == 401, headers
            body = await r.json()
        assert body["error"]["code"] == "invalid_api_key" and "Traceback" not in str(body)
    async with session.get(url(proxy, "/status/history"),
                           headers={"Authorization": f"Bearer {key}"}) as r:  # fmt: skip
        assert r.status == 200 and (await r.json())["source"] == "proxy"


async def test_an_oversized_prometheus_answer_is_refused_and_the_view_reused() -> None:
    """A URL that answers a range query with more than MAX_RESPONSE_BYTES is treated as
    unavailable; within one interval a second view reuses the first."""
    from aiohttp import web

    from proxy.serving import history

    calls: list[str] = []

    async def query_range(request: web.Request) -> web.Response:
        calls.append(request.query["query"])
        return web.Response(body=b"[" + b"0," * (history.MAX_RESPONSE_BYTES // 2) + b"0]")

    app = web.Application()
    app.router.add_get("/api/v1/query_range", query_range)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port_block()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        cfg = HistoryConfig(prometheus_url=f"http://127.0.0.1:{port}", prometheus_timeout_s=10)
        prom = PrometheusHistory(cfg, clock=lambda: 1000.0)
        async with aiohttp.ClientSession() as session:
            with pytest.raises(history.PrometheusUnavailable, match="bytes"):
                await prom.view(session)
            # A good answer, then the same interval again: one set of queries.
            app_calls = len(calls)
            prom._last = (1000.0, {"source": "prometheus", "t": [1000.0]})
            assert (await prom.view(session))["t"] == [1000.0]
            assert len(calls) == app_calls
    finally:
        await runner.cleanup()
