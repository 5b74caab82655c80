"""The one histogram a node's metrics keep: counts per bucket, their count and sum,
rendered cumulatively as Prometheus wants them. Plain ints and floats: its writer is
one thread (or holds the GIL, as gc callbacks do), readers take it at scrape time.
Kept free of torch and prometheus_client imports (the follower's health server
starts before torch is imported)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        # buckets[i]: samples <= bounds[i] and > the previous bound; the last slot
        # counts the samples above every bound.
        self.buckets = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum_s = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum_s += value
        self.buckets[bisect.bisect_left(self.bounds, value)] += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, samples at most le) for every bound and "+Inf"."""
        out, running = [], 0
        for bound, n in zip(self.bounds, self.buckets, strict=False):
            running += n
            out.append((repr(bound), float(running)))
        out.append(("+Inf", float(self.count)))
        return out
