"""printable and RateLimitedLog: escaping and the rate limit, on a fake clock."""

from __future__ import annotations

import logging

import pytest

from neuron_serving import logsafe
from neuron_serving.logsafe import RateLimitedLog, printable


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(logsafe.time, "monotonic", lambda: now[0])
    return now


def test_printable_escapes_control_characters_and_cuts():
    assert printable("evil\n2026 INFO forged\x1b[31m") == "evil\\n2026 INFO forged\\x1b[31m"
    assert printable("ok host-1") == "ok host-1"
    assert printable("x" * 500, 10) == "x" * 10 + "...[truncated]"
    assert printable("x" * 10, 10) == "x" * 10


def test_printable_escapes_what_could_pass_for_something_else():
    # A literal backslash is doubled: "\\n" typed by a peer is not an escaped newline.
    assert printable("a\\nb") == "a\\\\nb"
    # Line separators, direction overrides, look-alike letters, lone surrogates.
    assert printable("a\u2028b\u202ec\u0430\ud800") == "a\\u2028b\\u202ec\\u0430\\ud800"
    assert printable(b"\r\n") == "b'\\\\r\\\\n'"  # not a str: its repr, escaped too
    assert printable(400) == "400"


def test_burst_then_suppressed_then_counted(clock, caplog):
    log = RateLimitedLog(logging.getLogger("t"), burst=3, interval_s=10)
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(50):
            log.warning("bad peer %d", i)
        assert [r.getMessage() for r in caplog.records] == [
            "bad peer 0",
            "bad peer 1",
            "bad peer 2 (rate limit: similar messages suppressed for up to 10 s)",
        ]
        assert log.suppressed == 47
        clock[0] += 10
        log.warning("bad peer %d", 50)
    assert caplog.records[-1].getMessage() == "bad peer 50 (47 similar messages suppressed)"
    assert log.suppressed == 0


def test_levels_the_logger_drops_do_not_use_up_the_window(clock, caplog):
    log = RateLimitedLog(logging.getLogger("t"), burst=2, interval_s=1)
    with caplog.at_level(logging.INFO, logger="t"):
        for _ in range(100):
            log.debug("bad method")
        log.error("internal error %r", ValueError("x"))
    assert [r.getMessage() for r in caplog.records] == ["internal error ValueError('x')"]
    assert caplog.records[0].levelno == logging.ERROR


def test_a_percent_in_a_line_without_args_is_kept(clock, caplog):
    log = RateLimitedLog(logging.getLogger("t"), burst=1, interval_s=1)
    with caplog.at_level(logging.WARNING, logger="t"):
        log.warning("disk 100% full")
    assert caplog.records[0].getMessage() == (
        "disk 100% full (rate limit: similar messages suppressed for up to 1 s)"
    )


def test_a_failure_reported_once_per_interval_and_its_recovery(clock):
    seen: list[str] = []
    log = RateLimitedLog(seen.append, burst=1, interval_s=60)
    log.recovered("ok again")  # nothing failed: nothing to report
    for _ in range(50):
        log.warning("disk %s", "full")
    assert seen == ["disk full (rate limit: similar messages suppressed for up to 60 s)"]
    clock[0] += 60
    log.warning("disk %s", "full")
    assert seen[-1] == (
        "disk full (49 similar messages suppressed; "
        "rate limit: similar messages suppressed for up to 60 s)"
    )
    log.warning("disk full")
    log.recovered("%s again", "ok")  # the count of the spell's last failures survives
    log.recovered("ok again")
    assert seen[-1] == "ok again (1 similar messages suppressed)" and len(seen) == 3
    log.warning("disk full")  # a new spell is reported at once, whatever the window
    assert len(seen) == 4 and seen[-1].startswith("disk full (rate limit")


def test_the_recovery_is_logged_at_the_level_of_the_failures(clock, caplog):
    log = RateLimitedLog(logging.getLogger("t"), burst=1, interval_s=60)
    with caplog.at_level(logging.INFO, logger="t"):
        log.error("state file: %s", "No space left on device")
        log.recovered("state file written again")
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]


def test_a_failing_sink_never_raises(clock):
    calls = []

    def sink(msg: str) -> None:
        calls.append(msg)
        raise OSError(28, "No space left on device")

    log = RateLimitedLog(sink, burst=1, interval_s=60)
    log.warning("x")  # must not raise
    clock[0] += 60
    log.warning("%d", "not a number")  # nor a bad format (with a callable sink)
    log.recovered("y")
    assert calls == ["x (rate limit: similar messages suppressed for up to 60 s)", "y"]


def test_rejects_nonsense_limits():
    with pytest.raises(ValueError):
        RateLimitedLog(logging.getLogger("t"), burst=0)
    with pytest.raises(ValueError):
        RateLimitedLog(print, interval_s=0)
