from __future__ import annotations

import pytest

from neuron_serving.capacity.histogram import LATENCY_BUCKETS, quantile


def test_quantile_as_prometheus() -> None:
    bounds = (0.1, 0.5, 1.0)
    assert quantile(0.99, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.5, bounds, [10, 0, 0, 0]) == pytest.approx(0.05)  # from 0
    assert quantile(0.5, bounds, [0, 10, 0, 0]) == pytest.approx(0.3)  # inside (0.1, 0.5]
    assert quantile(0.99, bounds, [0, 0, 0, 5]) == 1.0  # overflow: the last bound
    assert quantile(0.99, bounds, [98, 1, 1, 0]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        quantile(0.5, bounds, [1, 2])


def test_buckets_are_the_proxys() -> None:
    # proxy/serving/metrics.py _LATENCY_BUCKETS, read from the source (capacity may not import proxy)
    from pathlib import Path

    src = (Path(__file__).resolve().parents[3] / "proxy" / "serving" / "metrics.py").read_text()
    line = next(ln for ln in src.splitlines() if ln.startswith("_LATENCY_BUCKETS ="))
    assert eval(line.split("=", 1)[1]) == LATENCY_BUCKETS  # noqa: S307 (our own source)
