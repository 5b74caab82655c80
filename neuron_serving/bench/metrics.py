"""Serving metrics with vLLM's definitions (``vllm.benchmarks.serve.calculate_metrics``).

Per request, from the send time and the arrival time of every streamed chunk that
carries output:

- TTFT: first chunk - send time.
- ITL: the gaps between consecutive chunks of one request (vLLM's ITL: with one
  token per chunk it is the per-token gap; chunks that arrive in one socket read
  get nearly equal timestamps, so a bundled chunk shows as a ~0 gap).
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with > 1 output token.
- E2EL: last chunk - send time.

Across a run: ITL samples of all requests pooled, one TTFT/TPOT/E2EL per request;
percentiles by linear interpolation (``numpy.percentile``, as vLLM). Output tok/s
is successful requests' output tokens over the run's wall time. Pure functions,
no vLLM import: the tests feed synthetic timestamps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestTiming:
    """One request's timing, field names as vLLM's ``RequestFuncOutput``."""

    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""


def from_chunks(
    start: float, chunk_times: Sequence[float], output_tokens: int | None = None
) -> RequestTiming:
    """A request's timing from its send time and its chunks' arrival times.

    ``output_tokens`` defaults to one token per chunk (what the server reports,
    when it does, is better: a chunk may carry several tokens)."""
    if not chunk_times:
        return RequestTiming(error="no output chunk")
    times = list(chunk_times)
    if any(b < a for a, b in zip(times, times[1:], strict=False)) or times[0] < start:
        raise ValueError("chunk times must be non-decreasing and not before the start")
    return RequestTiming(
        success=True,
        ttft=times[0] - start,
        itl=[b - a for a, b in zip(times, times[1:], strict=False)],
        latency=times[-1] - start,
        output_tokens=len(times) if output_tokens is None else output_tokens,
    )


def tpot(t: Any) -> float | None:
    """Time per output token after the first (None for a one-token request)."""
    if t.output_tokens <= 1:
        return None
    return (t.latency - t.ttft) / (t.output_tokens - 1)


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Quantile ``q`` (0-100) of the observations made between two scrapes of a
    Prometheus histogram (cumulative ``{le: count}``), as PromQL's
    ``histogram_quantile``: linear within the bucket, the first bucket starting at 0,
    the upper bound of the last finite bucket for ranks in +Inf. NaN if none."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    if not counts or counts[-1] <= 0:
        return math.nan
    rank = counts[-1] * q / 100
    lower, below = 0.0, 0.0
    for le, c in zip(les, counts, strict=True):
        if c >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (c - below) if c > below else 1.0)
        lower, below = le, c
    return lower


def _pct(values: Sequence[float], q: float) -> float:
    """``numpy.percentile`` (linear interpolation) without numpy."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(timings: Iterable[Any], duration_s: float) -> dict[str, Any]:
    """One run's figures: throughput, and mean/p50/p99 of TTFT, TPOT, ITL, E2EL in ms.

    ``timings`` are ``RequestTiming`` or vLLM ``RequestFuncOutput`` objects (same
    attribute names); failed requests count in ``failed`` and nowhere else."""
    timings = list(timings)
    ok = [t for t in timings if t.success]
    samples: dict[str, list[float]] = {
        "ttft": [t.ttft for t in ok],
        "tpot": [x for x in (tpot(t) for t in ok) if x is not None],
        "itl": [x for t in ok for x in t.itl],
        "e2el": [t.latency for t in ok],
    }
    tokens = sum(t.output_tokens for t in ok)
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "first_error": next((t.error for t in timings if not t.success), "")[:300],
        "duration_s": duration_s,
        "output_tokens": tokens,
        "output_tok_s": tokens / duration_s if duration_s > 0 else math.nan,
        "request_s": len(ok) / duration_s if duration_s > 0 else math.nan,
    }
    for name in METRICS:
        values = samples[name]
        out[f"{name}_mean_ms"] = 1e3 * sum(values) / len(values) if values else math.nan
        for q in PERCENTILES:
            out[f"{name}_p{q}_ms"] = 1e3 * _pct(values, q)
    return out


def figure_keys() -> list[str]:
    """The per-run figures that get a spread over repeats."""
    keys = ["output_tok_s", "request_s"]
    for name in METRICS:
        keys += [f"{name}_mean_ms"] + [f"{name}_p{q}_ms" for q in PERCENTILES]
    return keys
