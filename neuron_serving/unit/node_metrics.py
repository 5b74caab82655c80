"""Control-plane metrics of one node, in Prometheus format (served at /metrics
on the node's health HTTP port; the Triton launcher merges the leader's into
the public metrics port).

Everything is read at scrape time from the objects that already keep it
(``NodeStatus``, ``BroadcastStats``, the leader's follower links), so the step
hot path pays nothing beyond ``BroadcastStats.record``.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from neuron_serving.unit import gc_pauses
from neuron_serving.unit.broadcast_stats import BroadcastStats
from neuron_serving.unit.late_beats import LateBeats
from neuron_serving.unit.load_io import LoadStats
from neuron_serving.unit.node_status import NodeState, NodeStatus
from neuron_serving.unit.step_timing import TIMING, StepTiming
from neuron_serving.unit.straggler import RankVerdict

# How long a read of gc.get_freeze_count() is reused (NodeCollector._frozen_objects).
FROZEN_EVERY_S = 60.0
# (metric name, help, BroadcastStats attribute) of the control-plane counters.
_COUNTERS = (
    ("neuron_serving_control_broadcasts", "Control broadcasts (executor calls)", "messages"),
    (
        "neuron_serving_control_broadcast_payload_bytes",
        "Serialized call bytes broadcast",
        "payload_bytes",
    ),
    (
        "neuron_serving_control_broadcast_wire_bytes",
        "Bytes put on the Gloo broadcast (fixed first frame + overflow)",
        "wire_bytes",
    ),
)


class NodeCollector(Collector):
    def __init__(
        self,
        status: NodeStatus,
        stats: Callable[[], BroadcastStats | None] = lambda: None,
        heartbeat_ages: Callable[[], dict[int, float]] = dict,
        load_stats: Callable[[], list[LoadStats]] = list,
        late_beats: Callable[[], dict[str, LateBeats | None]] = dict,
        heartbeat_rtts: Callable[[], dict[str, float]] = dict,
        rank_verdicts: Callable[[], dict[int, RankVerdict]] = dict,
        timing: StepTiming = TIMING,
    ) -> None:
        self.status = status
        self.stats = stats
        self.heartbeat_ages = heartbeat_ages
        self.load_stats = load_stats
        # "self": this process's own beats as sent; a rank: that peer's as they arrive.
        self.late_beats = late_beats
        self.heartbeat_rtts = heartbeat_rtts  # by peer: "leader" or a follower's rank
        self.rank_verdicts = rank_verdicts  # the leader's slow-rank detector
        self.timing = timing
        self.gc_pauses = gc_pauses.install()
        self._frozen: tuple[float, int] | None = None  # (when read, count)

    def _frozen_objects(self) -> int:
        """``gc.get_freeze_count()``, read at most every ``FROZEN_EVERY_S``: CPython
        counts the permanent generation by walking it, and over a rank's frozen heap
        that made each scrape of a rank cost tens of milliseconds (bench/README.md,
        "scrape"). The count changes only when a process freezes (once, at start)
        or frozen objects die."""
        now = time.monotonic()
        if self._frozen is None or now - self._frozen[0] >= FROZEN_EVERY_S:
            self._frozen = (now, gc.get_freeze_count())
        return self._frozen[1]

    def collect(self) -> Iterable:
        # The same labels on every family, and on every process of the fleet.
        labels, lv = self.status.metric_labels()
        state = GaugeMetricFamily(
            "neuron_serving_node_state", "1 for the node's current state", labels=[*labels, "state"]
        )
        for s in NodeState:
            state.add_metric([*lv, str(s)], 1.0 if self.status.state is s else 0.0)
        yield state
        steps = CounterMetricFamily("neuron_serving_steps", "Model steps executed", labels=labels)
        steps.add_metric(lv, self.status.steps)
        yield steps
        age = GaugeMetricFamily(
            "neuron_serving_last_step_age_seconds", "Seconds since the last step", labels=labels
        )
        if self.status.last_step_monotonic is not None:
            age.add_metric(lv, time.monotonic() - self.status.last_step_monotonic)
        yield age

        st = self.stats()
        if st is not None:
            for name, doc, attr in _COUNTERS:
                counter = CounterMetricFamily(name, doc, labels=labels)
                counter.add_metric(lv, getattr(st, attr))
                yield counter
            yield _latency(st, labels, lv)

        beats = GaugeMetricFamily(
            "neuron_serving_follower_heartbeat_age_seconds",
            "Seconds since the leader last heard from each follower",
            labels=[*labels, "follower_rank"],
        )
        for rank, seconds in sorted(self.heartbeat_ages().items()):
            beats.add_metric([*lv, str(rank)], seconds)
        yield beats
        yield from _late_beats(self.late_beats(), labels, lv)
        yield from _per_peer(
            "neuron_serving_heartbeat_rtt_seconds",
            "Round trip of the last heartbeat echoed by each peer",
            self.heartbeat_rtts(), labels, lv,
        )  # fmt: skip
        yield from _load(self.load_stats(), labels, lv)
        yield from _gc(self.gc_pauses, labels, lv, self._frozen_objects())
        yield from _steps(self.timing, labels, lv)
        yield from _verdicts(self.rank_verdicts(), labels, lv)
        yield from _process(self.status, labels, lv)


def _steps(timing: StepTiming, labels: list[str], lv: list[str]) -> Iterable:
    """This rank's step time and its wait in the TP collectives (step_timing.py)."""
    for name, doc, hist in (
        ("neuron_serving_step_seconds",
         "Wall time of each model step (execute_model) on this rank", timing.step_hist),
        ("neuron_serving_collective_wait_seconds",
         "Time of each step this rank spent in TP collectives: waiting for its peers",
         timing.wait_hist),
    ):  # fmt: skip
        h = HistogramMetricFamily(name, doc, labels=labels)
        h.add_metric(lv, hist.cumulative(), sum_value=hist.sum_s)
        yield h


def _verdicts(verdicts: dict[int, RankVerdict], labels: list[str], lv: list[str]) -> Iterable:
    """The leader's slow-rank verdicts (straggler.py), by the judged rank."""
    share = GaugeMetricFamily(
        "neuron_serving_rank_peer_wait_share",
        "Share of each step the other ranks waited for this one in collectives, "
        "beyond its own wait (last window; the leader's view)",
        labels=[*labels, "peer_rank"],
    )
    degraded = GaugeMetricFamily(
        "neuron_serving_rank_degraded",
        "1 while the leader judges the rank persistently slower than its peers",
        labels=[*labels, "peer_rank"],
    )
    for rank, v in sorted(verdicts.items()):
        if v.share is not None:
            share.add_metric([*lv, str(rank)], v.share)
        degraded.add_metric([*lv, str(rank)], 1.0 if v.degraded else 0.0)
    yield share
    yield degraded


def _per_peer(name: str, doc: str, values: dict[str, float], labels: list[str],
              lv: list[str]) -> Iterable:  # fmt: skip
    g = GaugeMetricFamily(name, doc, labels=[*labels, "peer"])
    for peer, value in sorted(values.items()):
        g.add_metric([*lv, peer], value)
    yield g


def _process(status: NodeStatus, labels: list[str], lv: list[str]) -> Iterable:
    rss = GaugeMetricFamily(
        "neuron_serving_resident_memory_bytes", "Resident set size of this node's process",
        labels=labels,
    )  # fmt: skip
    rss.add_metric(lv, resident_bytes())
    yield rss
    restarts = GaugeMetricFamily(
        "neuron_serving_node_restarts",
        "Times the unit's supervisor restarted it before this process started",
        labels=labels,
    )
    restarts.add_metric(lv, status.restarts)
    yield restarts


def resident_bytes() -> float:
    """This process's RSS from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _late_beats(beats: dict[str, LateBeats | None], labels: list[str], lv: list[str]) -> Iterable:
    """Late heartbeats (late_beats.py): peer "self" for this process's own (it was
    starved), a rank for that peer's as they arrived here."""
    late = CounterMetricFamily(
        "neuron_serving_heartbeats_late",
        "Heartbeats more than 2 intervals after the previous one",
        labels=[*labels, "peer"],
    )
    gap = GaugeMetricFamily(
        "neuron_serving_heartbeat_max_gap_seconds",
        "Longest gap between two heartbeats",
        labels=[*labels, "peer"],
    )
    for peer, b in sorted(beats.items()):
        if b is not None:
            late.add_metric([*lv, peer], b.late)
            gap.add_metric([*lv, peer], b.max_gap_s)
    yield late
    yield gap


def _gc(
    pauses: gc_pauses.GcPauses, labels: list[str], lv: list[str], frozen_objects: int
) -> Iterable:
    """This process's collector pauses (a rank's pause stalls its whole unit) and how
    much of its heap is frozen (gc_pauses.py)."""
    h = HistogramMetricFamily(
        "neuron_serving_gc_pause_seconds",
        "Python garbage-collector pauses of this node's process, by generation",
        labels=[*labels, "generation"],
    )
    for generation, hist in enumerate(pauses.generations):
        h.add_metric([*lv, str(generation)], hist.cumulative(), sum_value=hist.sum_s)
    yield h
    frozen = GaugeMetricFamily(
        "neuron_serving_gc_frozen_objects",
        "Objects moved out of the collector's view once the node started (gc.freeze)",
        labels=labels,
    )
    frozen.add_metric(lv, frozen_objects)
    yield frozen


def _load(stats: list[LoadStats], labels: list[str], lv: list[str]) -> Iterable:
    """Each rank's weight load (the leader gathers every rank's at startup)."""
    seconds = GaugeMetricFamily(
        "neuron_serving_model_load_seconds",
        "Wall time of each rank's load_model",
        labels=[*labels, "load_rank"],
    )
    nbytes = GaugeMetricFamily(
        "neuron_serving_model_load_bytes",
        "Bytes each rank's load_model read (/proc/self/io: rchar = read syscalls incl. "
        "page-cache hits; read_bytes = fetched from storage)",
        labels=[*labels, "load_rank", "counter"],
    )
    for st in stats:
        seconds.add_metric([*lv, str(st.rank)], st.seconds)
        nbytes.add_metric([*lv, str(st.rank), "rchar"], st.rchar)
        nbytes.add_metric([*lv, str(st.rank), "read_bytes"], st.read_bytes)
    yield seconds
    yield nbytes


def _latency(st: BroadcastStats, labels: list[str], lv: list[str]) -> HistogramMetricFamily:
    h = HistogramMetricFamily(
        "neuron_serving_control_broadcast_seconds",
        "Leader-side latency of one control broadcast (all frames)",
        labels=labels,
    )
    h.add_metric(lv, st.latency.cumulative(), sum_value=st.latency.sum_s)
    return h


def render(collector: NodeCollector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
