from __future__ import annotations

import logging

import pytest

from neuron_serving.unit import log_limit
from neuron_serving.unit.log_limit import LimitedLog


def test_burst_then_suppressed_then_counted(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(log_limit.time, "monotonic", lambda: now[0])
    log = LimitedLog(logging.getLogger("t"), burst=3, interval_s=10)
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(50):
            log.warning("bad peer %d", i)
        assert [r.getMessage() for r in caplog.records] == [
            "bad peer 0",
            "bad peer 1",
            "bad peer 2 (rate limit: similar messages suppressed for up to 10 s)",
        ]
        now[0] += 10
        log.warning("bad peer %d", 50)
    assert caplog.records[-1].getMessage() == "bad peer 50 (47 similar messages suppressed)"


def test_rejects_nonsense_limits():
    with pytest.raises(ValueError):
        LimitedLog(logging.getLogger("t"), burst=0)
