"""Sliding windows over concurrency samples (Knative's stable and panic windows).

One sample per decision: (time, interactive concurrency, batch concurrency). The
history is an immutable tuple carried in the policy's state, so the decision stays
a pure function of (signals, state, config). Only the stable window's worth is kept:
at a 2 s tick and a 60 s window that is 30 samples.
"""

from __future__ import annotations

Sample = tuple[float, float, float]  # (t, interactive, batch)


def push(samples: tuple[Sample, ...], sample: Sample, keep_s: float) -> tuple[Sample, ...]:
    """``samples`` with ``sample`` appended and those older than ``keep_s`` dropped.

    A sample whose time is not after the last one replaces it (a repeated tick must
    not weigh twice)."""
    now = sample[0]
    kept = [s for s in samples if now - keep_s < s[0] < now]
    kept.append(sample)
    return tuple(kept)


def mean(samples: tuple[Sample, ...], now: float, window_s: float) -> tuple[float, float]:
    """Mean (interactive, batch) concurrency of the samples in (now - window_s, now].

    Samples are taken once per tick, so the plain mean is the time average. With
    none in the window (a first decision) it is (0, 0)."""
    inside = [s for s in samples if s[0] > now - window_s]
    if not inside:
        return 0.0, 0.0
    n = len(inside)
    return sum(s[1] for s in inside) / n, sum(s[2] for s in inside) / n
