"""A heartbeat sender's own view of its lateness (neuron_serving/unit/late_beats.py)."""

import logging

import pytest

from neuron_serving.unit.late_beats import (
    SATURATED_FACTOR,
    SATURATED_WINDOW_S,
    LateBeats,
    main_thread_at,
    silence_limit,
)
from neuron_serving.unit.node_metrics import NodeCollector, render
from neuron_serving.unit.node_status import NodeStatus
from tests.neuron_serving.unit.exposition import samples


def test_a_late_beat_is_counted_and_logged_with_where_the_main_thread_was(caplog):
    beats = LateBeats(0.5, "rank 1", logging.getLogger("test.late_beats"))
    with caplog.at_level(logging.WARNING, logger="test.late_beats"):
        assert beats.beat(10.0) == 0.0  # the first beat has nothing to be late for
        assert beats.beat(10.6) == pytest.approx(0.6)  # under 2 intervals: on time
        assert beats.late == 0 and not caplog.records
        assert beats.beat(13.1) == pytest.approx(2.5)
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


def test_a_peers_late_beats_are_counted_silently_and_relax_the_limit_for_a_while(caplog):
    mine = LateBeats(0.5, "leader", logging.getLogger("test.late_beats"))
    peer = LateBeats(0.5, "rank 1", None)
    with caplog.at_level(logging.WARNING, logger="test.late_beats"):
        for t in (0.0, 0.5, 1.0, 1.5):
            mine.beat(t)
            peer.beat(t)
        assert silence_limit(2.0, 1.5, mine, peer) == 2.0  # calm: the strict timeout
        peer.beat(3.0)  # 1.5 s after the previous one: late
    assert not caplog.records  # a peer's gaps are not this process's starvation
    assert peer.late == 1 and peer.last_late_at == 3.0
    assert silence_limit(2.0, 3.0, mine, peer) == SATURATED_FACTOR * 2.0
    assert silence_limit(2.0, 3.0 + SATURATED_WINDOW_S - 1, mine, peer) == SATURATED_FACTOR * 2.0
    assert silence_limit(2.0, 3.0 + SATURATED_WINDOW_S + 1, mine, peer) == 2.0
    assert silence_limit(2.0, 5.0) == 2.0


def test_late_beats_are_in_the_nodes_metrics():
    own = LateBeats(0.5, "leader", None)
    peer = LateBeats(0.5, "rank 1", None)
    for t in (0.0, 0.5, 2.0):  # one late gap of 1.5 s
        peer.beat(t)
    own.beat(0.0)
    collector = NodeCollector(
        NodeStatus("unit-0", 0, 2), late_beats=lambda: {"self": own, "1": peer, "2": None}
    )
    text = render(collector).decode()
    late = "neuron_serving_heartbeats_late_total"
    assert samples(text, late, peer="1", rank="0", unit="unit-0") == [1.0]
    assert samples(text, late, peer="self", rank="0", unit="unit-0") == [0.0]
    gap = "neuron_serving_heartbeat_max_gap_seconds"
    assert samples(text, gap, peer="1", rank="0", unit="unit-0") == [1.5]
    assert 'peer="2"' not in text  # a follower before its Welcome has no record yet
