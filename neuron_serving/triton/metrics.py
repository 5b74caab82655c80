"""Prometheus metrics of the Triton model process (the Python backend stub).

vLLM's ``PrometheusStatLogger`` records into prometheus_client's default registry
of the process that owns the AsyncLLM front end, which here is the backend stub,
not tritonserver. Triton's metrics port cannot see that registry, so the model
serves it on ``vllm_metrics_port`` (loopback by default) and the leader launcher
merges it with Triton's own metrics on the public metrics port (see
``metrics_merge.py``). Metric families do not overlap (``nv_*`` from Triton,
``vllm:*`` from vLLM, ``neuron_serving_*`` from us), so concatenating the two
text expositions is a valid exposition.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

log = logging.getLogger(__name__)


class BackendMetrics:
    """Our own counters beside vLLM's; created once per model process."""

    def __init__(self, unit_id: str, registry: CollectorRegistry = REGISTRY) -> None:
        labels = {"unit": unit_id}
        self.ready = Gauge(
            "neuron_serving_triton_unit_ready",
            "1 while the inference unit behind the Triton model is healthy.",
            list(labels),
            registry=registry,
        ).labels(**labels)
        self.requests = Counter(
            "neuron_serving_triton_requests",
            "Requests handled by the Triton model, by outcome.",
            [*labels, "outcome"],
            registry=registry,
        )
        self.progress_reports = Counter(
            "neuron_serving_triton_progress_reports",
            "Progress reports sent for requests that had nothing else to send (a prompt "
            "queued, a non-streamed answer being generated): slow, not dead.",
            list(labels),
            registry=registry,
        ).labels(**labels)
        self._unit = unit_id
        self.canary_seconds = Histogram(
            "neuron_serving_triton_canary_seconds",
            "Latency of the idle canary (one greedy token through every rank).",
            list(labels),
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        ).labels(**labels)

    def outcome(self, outcome: str) -> None:
        """outcome: ok, invalid, cancelled, unavailable, error."""
        self.requests.labels(unit=self._unit, outcome=outcome).inc()


def serve_registry(host: str, port: int) -> None:
    """Serve the process's default registry (vLLM's metrics and ours)."""
    if port:
        start_http_server(port, addr=host)
        log.info("vLLM engine metrics on http://%s:%d/metrics", host, port)
