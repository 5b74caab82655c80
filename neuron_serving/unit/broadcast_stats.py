"""Control-plane counters of one node: cost of every control broadcast.

Kept free of torch imports: the follower's health server (which reads these)
starts before torch is imported, and OpenMP binding must be set first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from neuron_serving.unit.histogram import Histogram

# Broadcast latency buckets (seconds): loopback sends take tens of microseconds,
# a cross-host broadcast of a prefill step a few milliseconds.
LATENCY_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    50e-3,
    0.25,
    1.0,
)


@dataclass
class BroadcastStats:
    """Totals and a latency histogram for the node's lifetime (what /metrics
    serves), plus the most recent raw samples for benchmark percentiles."""

    messages: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))

    def record(self, payload: int, wire: int, latency_s: float) -> None:
        self.messages += 1
        self.payload_bytes += payload
        self.wire_bytes += wire
        self.latency.observe(latency_s)
        self.latencies_s.append(latency_s)
