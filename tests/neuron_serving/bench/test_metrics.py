"""Serving metrics from synthetic chunk timestamps (vLLM's definitions)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from neuron_serving.bench.metrics import RequestTiming, from_chunks, summarize, tpot


def test_from_chunks_ttft_itl_e2el():
    t = from_chunks(10.0, [10.5, 10.6, 10.8, 11.1])
    assert t.success
    assert t.ttft == pytest.approx(0.5)
    assert t.itl == pytest.approx([0.1, 0.2, 0.3])
    assert t.latency == pytest.approx(1.1)
    assert t.output_tokens == 4  # one token per chunk by default


def test_tpot_uses_reported_tokens_not_chunks():
    # Two chunks carrying 5 tokens (stream_interval > 1): TPOT divides by tokens - 1.
    t = from_chunks(0.0, [0.2, 1.0], output_tokens=5)
    assert t.itl == pytest.approx([0.8])
    assert tpot(t) == pytest.approx((1.0 - 0.2) / 4)
    assert tpot(from_chunks(0.0, [0.3])) is None


def test_bundled_chunks_give_zero_gaps():
    t = from_chunks(0.0, [0.1, 0.1, 0.1, 0.4])
    assert t.itl == pytest.approx([0.0, 0.0, 0.3])


def test_from_chunks_rejects_bad_input():
    assert not from_chunks(0.0, []).success
    with pytest.raises(ValueError):
        from_chunks(1.0, [0.5])
    with pytest.raises(ValueError):
        from_chunks(0.0, [0.5, 0.4])


def test_summarize_matches_numpy_percentiles_and_skips_failures():
    timings = [from_chunks(0.0, [0.1 * (i + 1) + 0.01 * k for k in range(5)]) for i in range(10)]
    timings.append(RequestTiming(success=False, error="HTTP 503"))
    s = summarize(timings, duration_s=2.0)
    assert s["completed"] == 10 and s["failed"] == 1 and s["first_error"] == "HTTP 503"
    assert s["output_tokens"] == 50
    assert s["output_tok_s"] == pytest.approx(25.0)
    ttfts = [0.1 * (i + 1) for i in range(10)]
    assert s["ttft_p50_ms"] == pytest.approx(1e3 * np.percentile(ttfts, 50))
    assert s["ttft_p99_ms"] == pytest.approx(1e3 * np.percentile(ttfts, 99))
    assert s["itl_p50_ms"] == pytest.approx(10.0)
    assert s["tpot_mean_ms"] == pytest.approx(10.0)
    assert s["e2el_p50_ms"] == pytest.approx(1e3 * np.percentile([x + 0.04 for x in ttfts], 50))


def test_summarize_empty_run_is_nan_not_error():
    s = summarize([RequestTiming(error="x")], duration_s=1.0)
    assert s["completed"] == 0 and math.isnan(s["ttft_p50_ms"])


def test_histogram_quantile_matches_promql():
    from neuron_serving.bench.metrics import histogram_quantile

    inf = math.inf
    before = {0.001: 2, 0.002: 2, 0.005: 2, inf: 2}
    # 10 new observations: 4 in (0, 1 ms], 4 in (1, 2 ms], 2 in (2, 5 ms].
    after = {0.001: 6, 0.002: 10, 0.005: 12, inf: 12}
    assert histogram_quantile(before, after, 50) == pytest.approx(0.00125)
    assert histogram_quantile(before, after, 40) == pytest.approx(0.001)
    assert histogram_quantile(before, after, 100) == pytest.approx(0.005)
    assert math.isnan(histogram_quantile(after, after, 50))  # nothing observed
    # Ranks that fall in +Inf report the last finite bound (PromQL does the same).
    assert histogram_quantile({}, {0.001: 1, inf: 4}, 99) == 0.001
