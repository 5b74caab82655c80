"""Prometheus metrics of the proxy, in their own ``CollectorRegistry`` (one per
proxy instance, so several proxies in one test process do not collide).

Names follow vLLM's where the meaning is the same (TTFT, inter-token latency,
end-to-end latency), prefixed ``proxy_`` since they are measured here, at the
client's side of the proxy. Per-unit health gauges are refreshed from the
registry at scrape time rather than on every probe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proxy.config import UnitSpec
from proxy.registry import Registry
from proxy.routing.kv.accuracy import KvAccuracy

# Seconds; LLM latencies span 10 ms (a token) to minutes (a long generation).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Key on the aiohttp request under which a front end records the serving unit's id.
REQUEST_UNIT = web.RequestKey("proxy_unit", str)

# The proxy's own share of a request's TTFT: sub-millisecond when it is idle.
_HOP_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1,
)  # fmt: skip
_PROBE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class ProxyMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # unit: the unit that served the request's (first) token, "" if none did (a bad
        # request, overload, no routable unit). Set by the front ends on the aiohttp
        # request (REQUEST_UNIT) and read when the response is counted.
        # tenant: the API key's tenant, "" when unauthenticated; only configured tenant
        # names, so a client cannot grow the label's cardinality.
        self.requests = Counter(
            "proxy_requests",
            "Client requests by endpoint, HTTP status, serving unit, tenant and traffic class",
            ["endpoint", "code", "unit", "tenant", "class"],
            registry=r,
        )
        self.upstream_attempts = Counter(
            "proxy_upstream_attempts",
            "Upstream attempts by unit and outcome (ok, unit_fault, request_error)",
            ["unit", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "proxy_time_to_first_token_seconds",
            "Time to first token by the unit that produced it and the request's traffic "
            "class (the capacity controller reads the interactive classes' p99)",
            ["unit", "class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Envoy's downstream vs upstream request time, for the first token: what the
        # proxy adds (parse, admission, routing, the upstream call's set-up, the
        # first response's decode and the first SSE write, and any wait for the
        # proxy's own CPU). Streams served by their first attempt only: a retry's
        # time is the failed unit's, not the hop's.
        self.hop = Histogram(
            "proxy_added_time_to_first_token_seconds",
            "Streamed requests: TTFT at the proxy (request in -> first chunk written) "
            "minus the unit's (request written -> first response read)",
            buckets=_HOP_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "proxy_inter_token_latency_seconds",
            "Time between streamed chunks",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "proxy_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.routing_decisions = Counter(
            "proxy_routing_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "proxy_retries", "Retries before the first token, by outcome", ["outcome"], registry=r
        )
        self.migrations = Counter(
            "proxy_migrations", "Mid-stream request migrations by outcome", ["outcome"], registry=r
        )
        self.ejections = Counter(
            "proxy_outlier_ejections", "Outlier ejections by unit", ["unit"], registry=r
        )
        self.probe_latency = Histogram(
            "proxy_probe_latency_seconds",
            "Health probe latency by node role",
            ["role"],
            buckets=_PROBE_BUCKETS,
            registry=r,
        )
        self.probe_failures = Counter(
            "proxy_probe_failures",
            "Failed health probes by unit and node",
            ["unit", "node"],
            registry=r,
        )
        self.unit_routable = Gauge(
            "proxy_unit_healthy",
            "1 if every node of the unit is healthy",
            ["unit", "model", "version"],
            registry=r,
        )
        self.unit_draining = Gauge(
            "proxy_unit_draining", "1 if the unit is draining", ["unit"], registry=r
        )
        self.unit_ejected = Gauge(
            "proxy_unit_ejected", "1 if the unit is ejected", ["unit"], registry=r
        )
        self.node_healthy = Gauge(
            "proxy_node_healthy",
            "1 if the node passes its health checks",
            ["unit", "node"],
            registry=r,
        )
        self.node_degraded = Gauge(
            "proxy_node_degraded",
            "1 if the node's unit leader judges it persistently slower than its peers",
            ["unit", "node", "rank"],
            registry=r,
        )
        self.in_flight = Gauge(
            "proxy_unit_in_flight",
            "Sequences in flight by unit (a request with n choices counts n)",
            ["unit"],
            registry=r,
        )
        self.unit_upstream = Gauge(
            "proxy_unit_upstream",
            "1 for the transport that carries the unit's OpenAI calls now: channel (the "
            "leader's OpenAI channel) or grpc (Triton's gRPC front end)",
            ["unit", "transport"],
            registry=r,
        )
        self.channel_fallbacks = Counter(
            "proxy_openai_channel_fallbacks",
            "OpenAI calls sent over Triton because their unit's channel could not be "
            "connected or did not prove the channel token",
            registry=r,
        )
        self.queued = Gauge("proxy_admission_queued", "Requests waiting for admission", registry=r)
        self.active = Gauge("proxy_admission_active", "Requests admitted and running", registry=r)
        # Flow control per traffic class (proxy/serving/flow_control.py).
        self.flow_queued = Gauge(
            "proxy_class_queued", "Requests waiting in the class's queue", ["class"], registry=r
        )
        self.batches_active = Gauge(
            "proxy_batches_active",
            "Batches not final yet (validating, in progress, finalizing, cancelling)",
            registry=r,
        )
        self.batch_requests = Counter(
            "proxy_batch_requests",
            "Batch lines this replica finished, by outcome (completed: a 200 answer)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("completed", "failed"):  # from 0: increase() sees the first line
            self.batch_requests.labels(outcome)
        self.flow_queue_limit = Gauge(
            "proxy_class_queue_limit",
            "Requests the class's queue holds (its queue_size); beyond it: 429",
            ["class"],
            registry=r,
        )
        self.flow_active = Gauge(
            "proxy_class_active", "Requests of the class started and running", ["class"], registry=r
        )
        self.flow_wait = Histogram(
            "proxy_class_queue_wait_seconds",
            "Time from a request's arrival to its start on a unit, by class",
            ["class"],
            buckets=(0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.flow_dispatched = Counter(
            "proxy_class_dispatched", "Requests started on a unit, by class", ["class"], registry=r
        )
        self.flow_rejected = Counter(
            "proxy_class_rejected",
            "Requests that could not start, by class and reason (queue_full: 429 on "
            "arrival; deadline: 429, no room within the class's queue_timeout_s; shed: "
            "503, dropped for a more urgent request)",
            ["class", "reason"],
            registry=r,
        )
        # Prefix cache hits per unit, predicted against vLLM's (proxy/routing/kv/accuracy.py).
        self.kv_accuracy = KvAccuracy(r)

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, cached: prometheus_client validates the values and
        takes a lock on every ``labels()`` call, several per request. The
        label values are bounded (endpoints, codes, unit ids, tenants, reasons), and so
        is this cache."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def first_token(self, request: web.Request, unit: str, ttft_s: float, cls: str) -> None:
        """Once per request, when its first token is ready: TTFT by unit and traffic
        class, and the unit for the request counter (which the server's middleware
        increments at the end)."""
        request[REQUEST_UNIT] = unit
        self.child(self.ttft, unit, cls).observe(ttft_s)

    def first_written(self, upstream_ttft_s: float | None, ttft_s: float) -> None:
        """Once per stream, after its first chunk is written (``ttft_s`` since the
        request came in)."""
        if upstream_ttft_s is not None:
            self.hop.observe(max(0.0, ttft_s - upstream_ttft_s))

    def refresh(
        self,
        registry: Registry,
        now: float,
        queued: int,
        active: int,
        upstream_of: Callable[[UnitSpec], str] | None = None,
        classes: Mapping[str, Mapping[str, int | float]] | None = None,
    ) -> None:
        # Units come and go: rebuild the per-unit series so removed units disappear.
        for g in (
            self.unit_routable,
            self.unit_draining,
            self.unit_ejected,
            self.node_healthy,
            self.node_degraded,
            self.in_flight,
            self.unit_upstream,
        ):
            g.clear()
        for u in registry.units.values():
            self.unit_routable.labels(u.unit_id, u.spec.model, u.model_version).set(
                u.nodes_healthy()
            )
            self.unit_draining.labels(u.unit_id).set(u.draining)
            self.unit_ejected.labels(u.unit_id).set(u.is_ejected(now))
            self.in_flight.labels(u.unit_id).set(u.in_flight)
            if upstream_of is not None:
                self.unit_upstream.labels(u.unit_id, upstream_of(u.spec)).set(1)
            degraded = u.engine_load.degraded_ranks if u.engine_load is not None else ()
            for n in u.nodes:
                self.node_healthy.labels(u.unit_id, n.node_id).set(n.healthy)
                self.node_degraded.labels(u.unit_id, n.node_id, str(n.rank)).set(n.rank in degraded)
        self.queued.set(queued)
        self.active.set(active)
        for name, c in (classes or {}).items():
            self.flow_queued.labels(name).set(c["queued"])
            if "queue_size" in c:
                self.flow_queue_limit.labels(name).set(c["queue_size"])
            self.flow_active.labels(name).set(c["active"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
