"""A rank's step and collective-wait timing, the wrapper on a communicator class, and
the metrics they become; heartbeat round trips."""

from __future__ import annotations

import time

import pytest

from neuron_serving.unit.late_beats import BeatEcho
from neuron_serving.unit.node_metrics import NodeCollector, render
from neuron_serving.unit.node_status import NodeStatus
from neuron_serving.unit.step_timing import BUCKETS, StepTiming, time_collectives
from neuron_serving.unit.straggler import RankVerdict
from tests.neuron_serving.unit.exposition import labels_of, samples


class Communicator:
    def all_reduce(self, x: int) -> int:
        time.sleep(0.02)
        return x + 1

    def gather(self, x: int) -> int:
        raise RuntimeError("peer gone")


def test_collectives_count_as_the_running_steps_wait() -> None:
    timing = StepTiming()
    time_collectives(Communicator, timing)
    time_collectives(Communicator, timing)  # idempotent: wrapped once
    c = Communicator()
    # The step's first collective counts above its floor only (rank 0's head start on
    # its peers); the first ever is its own floor.
    assert c.all_reduce(1) == 2 and c.all_reduce(2) == 3
    with pytest.raises(RuntimeError, match="peer gone"):
        c.gather(0)  # a failed collective still counts its time
    timing.step(0.1)
    steps, step_s, wait_s = timing.totals()
    assert (steps, step_s) == (1, 0.1) and 0.02 <= wait_s < 0.04
    timing.step(0.2)  # no collective in this one
    assert timing.totals()[2] == wait_s
    assert timing.step_hist.count == 2 and timing.wait_hist.buckets[0] == 1
    assert Communicator.all_reduce.__name__ == "all_reduce"


def test_the_head_start_at_a_steps_first_collective_is_not_waiting() -> None:
    """Rank 0 waits 5 ms at every step's first collective (its peers' receive and
    decode): none of it counts. A peer that starts 45 ms late on some steps does."""
    timing = StepTiming()
    for _ in range(200):
        timing.collective(0.005)
        timing.collective(0.001)
        timing.step(0.02)
    steps, _, wait = timing.totals()
    assert steps == 200 and wait == pytest.approx(0.001 * 200, rel=0.05)
    for i in range(50):
        timing.collective(0.05 if i % 2 else 0.005)
        timing.collective(0.001)
        timing.step(0.07 if i % 2 else 0.02)
    late = timing.totals()[2] - wait
    assert late == pytest.approx(25 * 0.045 + 50 * 0.001, rel=0.05)


def test_node_metrics_carry_every_label_and_the_new_families() -> None:
    status = NodeStatus("unit-3", 0, 2, host="h1")
    status.set_checkpoint("/models/llama/v7/", "v7")
    status.restarts = 2
    timing = StepTiming()
    timing.collective(0.001)  # the step's first: its own floor, nothing counted
    timing.collective(0.004)
    timing.step(0.03)
    verdicts = {1: RankVerdict(share=0.4, over=3, degraded=True, reason="slow")}
    text = render(NodeCollector(status, timing=timing, rank_verdicts=lambda: verdicts,
                                heartbeat_rtts=lambda: {"1": 0.0012})).decode()  # fmt: skip
    want = {"unit": "unit-3", "rank": "0", "host": "h1", "role": "leader", "model": "llama",
            "version": "v7"}  # fmt: skip
    for name in ("neuron_serving_steps_total", "neuron_serving_step_seconds_count",
                 "neuron_serving_resident_memory_bytes", "neuron_serving_rank_degraded"):  # fmt: skip
        for labels in labels_of(text, name):
            assert {k: labels[k] for k in want} == want, name
    assert samples(text, "neuron_serving_step_seconds_bucket", le=repr(BUCKETS[5])) == [1.0]
    assert samples(text, "neuron_serving_step_seconds_bucket", le=repr(BUCKETS[4])) == [0.0]
    assert samples(text, "neuron_serving_collective_wait_seconds_sum") == [pytest.approx(0.004)]
    assert samples(text, "neuron_serving_rank_degraded", peer_rank="1") == [1.0]
    assert samples(text, "neuron_serving_rank_peer_wait_share", peer_rank="1") == [0.4]
    assert samples(text, "neuron_serving_heartbeat_rtt_seconds", peer="1") == [0.0012]
    assert samples(text, "neuron_serving_node_restarts") == [2.0]
    assert samples(text, "neuron_serving_resident_memory_bytes")[0] > 10 << 20
    follower = NodeStatus("unit-3", 1, 2)
    assert follower.metric_labels()[1][3:] == ["follower", "", "unversioned"]


def test_the_supervisors_restart_count_reaches_the_status(monkeypatch) -> None:
    monkeypatch.setenv("NEURON_SERVING_UNIT_RESTARTS", "4")
    assert NodeStatus("u", 1, 2).restarts == 4
    assert NodeStatus("u", 1, 2).snapshot()["restarts"] == 4


def test_heartbeat_round_trips_on_each_sides_own_clock() -> None:
    leader, follower = BeatEcho(), BeatEcho()
    # Follower beats at its t=100; the leader gets it at its t=5000 (another clock).
    b1 = follower.beat("ready", 3, 100.0, step_s=1.5, wait_s=0.5)
    assert (b1.sent, b1.echo, b1.held, b1.step_s, b1.wait_s) == (100.0, 0.0, 0.0, 1.5, 0.5)
    leader.received(b1, 5000.0)
    assert leader.rtt_s is None  # nothing echoed yet
    # The leader's next beat, 0.2 s later, echoes it; it reaches the follower at 100.25.
    b2 = leader.beat("ready", 0, 5000.2)
    assert (b2.echo, b2.held) == (100.0, pytest.approx(0.2))
    follower.received(b2, 100.25)
    assert follower.rtt_s == pytest.approx(0.05)
