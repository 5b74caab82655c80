"""A heartbeat sender's own view of its lateness (neuron_serving/unit/late_beats.py)."""

import logging

import pytest

from neuron_serving.unit.late_beats import LateBeats, main_thread_at


def test_a_late_beat_is_counted_and_logged_with_where_the_main_thread_was(caplog):
    beats = LateBeats(0.5, "rank 1", logging.getLogger("test.late_beats"))
    with caplog.at_level(logging.WARNING, logger="test.late_beats"):
        assert beats.sent(10.0) == 0.0  # the first beat has nothing to be late for
        assert beats.sent(10.6) == pytest.approx(0.6)  # under 2 intervals: on time
        assert beats.late == 0 and not caplog.records
        assert beats.sent(13.1) == pytest.approx(2.5)
    assert beats.late == 1 and beats.max_gap_s == pytest.approx(2.5)
    (record,) = caplog.records
    text = record.getMessage()
    assert "rank 1: heartbeat 2.5 s after the previous one" in text
    # The main thread here is pytest's, inside this test.
    assert "main thread at" in text and "test_late_beats.py" in text


def test_main_thread_at_names_the_innermost_frames():
    # Called on the main thread: its innermost frame is main_thread_at itself.
    inner, caller = main_thread_at(depth=2).split(" <- ")
    assert inner.startswith("main_thread_at (late_beats.py:")
    assert caller.startswith("test_main_thread_at_names_the_innermost_frames (test_late_beats.py:")
