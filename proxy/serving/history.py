"""The dashboard's time series: throughput, TTFT and ITL p50/p99, queue depth per class,
KV usage per unit and each unit's health over the last ``window_s``
(``GET /status/history``).

Two sources, one shape. ``PrometheusHistory`` asks a Prometheus that scrapes the fleet
(``history.prometheus_url``; `up` starts one) with range queries, so every replica
draws the fleet's history, across restarts of the proxy. ``ProxyHistory`` is the
fallback when there is none, or it does not answer within its timeout: a window this
proxy samples every ``interval_s`` from its own metrics (its requests, its TTFT and
ITL histograms, flow control's queues, the leaders' load reports, the units' states),
so it shows this replica's view since it started.

The shape (``view``): ``t`` (epoch seconds), ``series`` name -> list of values (None
where unknown) aligned with ``t``, and ``health`` unit -> list of states aligned
with ``t`` ("routable", "degraded", "unhealthy", "ejected", "draining", or None).
Series: ``requests_per_s``, ``tokens_per_s``, ``ttft_p50_s``, ``ttft_p99_s``,
``itl_p50_s``, ``itl_p99_s``, ``queued:<class>``, ``kv_usage:<unit>``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy.config import HistoryConfig

log = logging.getLogger(__name__)

# (unit id, state, KV usage or None) of every registered unit, and queued per class.
UnitsNow = Callable[[], list[tuple[str, str, float | None]]]
QueuedNow = Callable[[], dict[str, int]]
LATENCIES = (("ttft", "proxy_time_to_first_token_seconds"),
             ("itl", "proxy_inter_token_latency_seconds"))  # fmt: skip


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile over cumulative (upper bound, count) pairs
    sorted by bound, the last one +Inf: linear within the bucket the rank falls in;
    the highest finite bound when it falls in +Inf; None with no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def _cumulative(families: list[Any], name: str) -> tuple[list[tuple[float, float]], float]:
    """A histogram's buckets summed over all its label sets, and its count."""
    by_bound: dict[float, float] = {}
    count = 0.0
    for family in families:
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == name + "_bucket":
                bound = float(s.labels["le"])
                by_bound[bound] = by_bound.get(bound, 0.0) + s.value
            elif s.name == name + "_count":
                count += s.value
    return sorted(by_bound.items()), count


def _counter(families: list[Any], name: str) -> float:
    return sum(s.value for f in families if f.name == name for s in f.samples
               if s.name == name + "_total")  # fmt: skip


@dataclass
class _Reading:
    t: float
    requests: float
    hists: dict[str, tuple[list[tuple[float, float]], float]]


@dataclass
class ProxyHistory:
    """This proxy's own window, sampled by ``run`` (or ``sample`` in tests)."""

    registry: Any  # ProxyMetrics.registry
    units: UnitsNow
    queued: QueuedNow
    cfg: HistoryConfig = field(default_factory=HistoryConfig)
    clock: Callable[[], float] = time.time
    _last: _Reading | None = None
    _points: deque[dict[str, Any]] = field(default_factory=deque)

    def sample(self) -> None:
        now = self.clock()
        families = list(self.registry.collect())  # once: it renders every collector
        reading = _Reading(now, _counter(families, "proxy_requests"),
                           {key: _cumulative(families, name) for key, name in LATENCIES})  # fmt: skip
        point: dict[str, Any] = {"t": now, "series": {}, "health": {}}
        last, self._last = self._last, reading
        if last is not None and now > last.t:
            dt = now - last.t
            point["series"]["requests_per_s"] = max(0.0, reading.requests - last.requests) / dt
            # First tokens plus inter-token gaps: the tokens this proxy streamed.
            tokens = sum(reading.hists[k][1] - last.hists[k][1] for k in ("ttft", "itl"))
            point["series"]["tokens_per_s"] = max(0.0, tokens) / dt
            for key, _ in LATENCIES:
                delta = _delta(reading.hists[key][0], last.hists[key][0])
                point["series"][f"{key}_p50_s"] = quantile(0.5, delta)
                point["series"][f"{key}_p99_s"] = quantile(0.99, delta)
        for cls, n in self.queued().items():
            point["series"][f"queued:{cls}"] = float(n)
        for unit, state, kv in self.units():
            point["health"][unit] = state
            point["series"][f"kv_usage:{unit}"] = kv
        self._points.append(point)
        keep = int(self.cfg.window_s / self.cfg.interval_s) + 1
        while len(self._points) > keep:
            self._points.popleft()

    async def run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed point must not end the history
                log.exception("history sample failed")
            await asyncio.sleep(self.cfg.interval_s)

    def view(self) -> dict[str, Any]:
        points = list(self._points)
        names = sorted({n for p in points for n in p["series"]})
        units = sorted({u for p in points for u in p["health"]})
        return {
            "source": "proxy",
            "interval_s": self.cfg.interval_s,
            "window_s": self.cfg.window_s,
            "t": [p["t"] for p in points],
            "series": {n: [_finite(p["series"].get(n)) for p in points] for n in names},
            "health": {u: [p["health"].get(u) for p in points] for u in units},
        }


def _delta(now: list[tuple[float, float]], before: list[tuple[float, float]]):
    old = dict(before)
    return [(bound, count - old.get(bound, 0.0)) for bound, count in now]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# The same series as PromQL over the fleet (the proxies' and the leaders' metrics).
def _q(quantile_: float, metric: str) -> str:
    return f"histogram_quantile({quantile_}, sum by (le) (rate({metric}_bucket[1m])))"


PROMQL: dict[str, str] = {
    "requests_per_s": "sum(rate(proxy_requests_total[1m]))",
    "tokens_per_s": "sum(rate(vllm:generation_tokens_total[1m]))",
    "ttft_p50_s": _q(0.5, "proxy_time_to_first_token_seconds"),
    "ttft_p99_s": _q(0.99, "proxy_time_to_first_token_seconds"),
    "itl_p50_s": _q(0.5, "proxy_inter_token_latency_seconds"),
    "itl_p99_s": _q(0.99, "proxy_inter_token_latency_seconds"),
}
BY_LABEL: dict[str, tuple[str, str]] = {  # prefix -> (PromQL, the label that names the series)
    "queued": ("sum by (class) (proxy_class_queued)", "class"),
    "kv_usage": ("max by (unit) (vllm:kv_cache_usage_perc)", "unit"),
}
HEALTH = {  # unit -> 1/0: routable on some replica; a slow rank in it
    "routable": "max by (unit) (proxy_unit_healthy)",
    "degraded": "max by (unit) (proxy_node_degraded)",
}


# A range query's answer is read up to this (a window of a few hundred points for a
# few series is kilobytes): a misconfigured URL must not fill the proxy's memory.
MAX_RESPONSE_BYTES = 8 << 20


class PrometheusUnavailable(Exception):
    pass


@dataclass
class PrometheusHistory:
    """Range queries over ``window_s`` at ``interval_s``; the answer is reused until the
    next point is due, so dashboards polling at once cost Prometheus one set of queries
    an interval."""

    cfg: HistoryConfig
    clock: Callable[[], float] = time.time
    _last: tuple[float, dict[str, Any]] | None = None

    async def view(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        end = math.floor(self.clock() / self.cfg.interval_s) * self.cfg.interval_s
        if self._last is not None and self._last[0] == end:
            return self._last[1]
        view = await self._query(session, end)
        self._last = (end, view)
        return view

    async def _query(self, session: aiohttp.ClientSession, end: float) -> dict[str, Any]:
        start = end - self.cfg.window_s
        t = [start + i * self.cfg.interval_s
             for i in range(int(round(self.cfg.window_s / self.cfg.interval_s)) + 1)]  # fmt: skip
        queries = {**PROMQL, **{k: v[0] for k, v in BY_LABEL.items()},
                   **{f"health:{k}": v for k, v in HEALTH.items()}}  # fmt: skip
        results = await asyncio.gather(
            *(self._range(session, q, start, end) for q in queries.values())
        )
        raw = dict(zip(queries, results, strict=True))
        series: dict[str, list[float | None]] = {}
        for name in PROMQL:
            matrix = raw[name]
            series[name] = _aligned(matrix[0]["values"] if matrix else [], t)
        for prefix, (_, label) in BY_LABEL.items():
            for m in raw[prefix]:
                series[f"{prefix}:{m['metric'].get(label, '')}"] = _aligned(m["values"], t)
        routable = {m["metric"].get("unit", ""): _aligned(m["values"], t)
                    for m in raw["health:routable"]}  # fmt: skip
        degraded = {m["metric"].get("unit", ""): _aligned(m["values"], t)
                    for m in raw["health:degraded"]}  # fmt: skip
        health = {u: [_state(r, d) for r, d in zip(v, degraded.get(u, [None] * len(t)),
                                                   strict=True)]
                  for u, v in routable.items()}  # fmt: skip
        return {"source": "prometheus", "interval_s": self.cfg.interval_s,
                "window_s": self.cfg.window_s, "t": t, "series": series, "health": health}  # fmt: skip

    async def _range(self, session: aiohttp.ClientSession, query: str, start: float,
                     end: float) -> list[dict[str, Any]]:  # fmt: skip
        args = urllib.parse.urlencode({"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                       "step": f"{self.cfg.interval_s:g}"})  # fmt: skip
        url = f"{self.cfg.prometheus_url.rstrip('/')}/api/v1/query_range?{args}"
        timeout = aiohttp.ClientTimeout(total=self.cfg.prometheus_timeout_s)
        try:
            async with session.get(url, timeout=timeout) as r:
                if r.status != 200:
                    raise PrometheusUnavailable(f"HTTP {r.status} for a range query")
                raw = bytearray()
                async for chunk in r.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > MAX_RESPONSE_BYTES:
                        raise PrometheusUnavailable(
                            f"a range query's answer over {MAX_RESPONSE_BYTES} bytes"
                        )
                body = json.loads(raw)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise PrometheusUnavailable(f"{type(e).__name__}: {e}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            raise PrometheusUnavailable(f"query failed: {str(body)[:200]}")
        return list(body["data"]["result"])


def _aligned(values: Iterable[list[Any]], t: list[float]) -> list[float | None]:
    by_t = {round(float(ts), 3): _finite(float(v)) for ts, v in values}
    return [by_t.get(round(x, 3)) for x in t]


def _state(routable: float | None, degraded: float | None) -> str | None:
    if routable is None:
        return None
    if not routable:
        return "unhealthy"
    return "degraded" if degraded else "routable"


async def history_view(own: ProxyHistory, prometheus: PrometheusHistory | None,
                       session: aiohttp.ClientSession | None) -> dict[str, Any]:  # fmt: skip
    """Prometheus's view when configured and answering, else this proxy's own (saying
    why in ``fallback``)."""
    if prometheus is not None and session is not None:
        try:
            return await prometheus.view(session)
        except PrometheusUnavailable as e:
            return {**own.view(), "fallback": f"Prometheus did not answer: {e}"}
    return own.view()
