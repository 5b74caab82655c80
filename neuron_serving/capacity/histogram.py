"""Quantiles from cumulative-bucket histograms, as Prometheus' histogram_quantile.

The controller will read TTFT/ITL percentiles from the proxy's histograms
(``proxy_time_to_first_token_seconds``: the difference of two scrapes is the window);
the simulator keeps the same buckets so its p99 signal has the same resolution.
"""

from __future__ import annotations

from collections.abc import Sequence

# proxy/serving/metrics.py _LATENCY_BUCKETS (the proxy's TTFT, ITL and E2E histograms); copied,
# not imported: capacity sits beside the proxy, not above it (tests/test_layering.py).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip


def quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The ``q`` quantile of observations counted per bucket.

    ``counts[i]`` is the (not cumulative) count in (bounds[i-1], bounds[i]]; one more
    entry, ``counts[len(bounds)]``, counts those above the last bound. Linear
    interpolation inside the bucket (from 0 for the first), the last finite bound for
    the overflow bucket, None when empty: Prometheus' rules."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} outside [0, 1]")
    if len(counts) != len(bounds) + 1:
        raise ValueError("counts needs one entry per bound plus the overflow")
    total = float(sum(counts))
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts[:-1]):
        if n > 0 and seen + n >= rank:
            lo = bounds[i - 1] if i else 0.0
            return lo + (bounds[i] - lo) * (rank - seen) / n
        seen += n
    return float(bounds[-1])
