"""Control-plane metrics of one node, in Prometheus format (served at /metrics
on the node's health HTTP port; the Triton launcher merges the leader's into
the public metrics port).

Everything is read at scrape time from the objects that already keep it
(``NodeStatus``, ``BroadcastStats``, the leader's follower links), so the step
hot path pays nothing beyond ``BroadcastStats.record``.
"""

from __future__ import annotations

import gc
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
from neuron_serving.unit.broadcast_stats import LATENCY_BUCKETS, BroadcastStats
from neuron_serving.unit.late_beats import LateBeats
from neuron_serving.unit.load_io import LoadStats
from neuron_serving.unit.node_status import NodeState, NodeStatus

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
    ) -> None:
        self.status = status
        self.stats = stats
        self.heartbeat_ages = heartbeat_ages
        self.load_stats = load_stats
        # "self": this process's own beats as sent; a rank: that peer's as they arrive.
        self.late_beats = late_beats
        self.gc_pauses = gc_pauses.install()

    def collect(self) -> Iterable:
        labels = ["unit_id", "rank"]
        lv = [self.status.unit_id, str(self.status.rank)]
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
        yield from _load(self.load_stats(), labels, lv)
        yield from _gc(self.gc_pauses, labels, lv)


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


def _gc(pauses: gc_pauses.GcPauses, labels: list[str], lv: list[str]) -> Iterable:
    """This process's collector pauses (a rank's pause stalls its whole unit) and how
    much of its heap is frozen (gc_pauses.py)."""
    h = HistogramMetricFamily(
        "neuron_serving_gc_pause_seconds",
        "Python garbage-collector pauses of this node's process, by generation",
        labels=[*labels, "generation"],
    )
    for generation in range(3):
        cumulative, running = [], 0
        for bound, count in zip(gc_pauses.BUCKETS, pauses.buckets[generation], strict=True):
            running += count
            cumulative.append((repr(bound), running))
        cumulative.append(("+Inf", pauses.count[generation]))
        h.add_metric([*lv, str(generation)], cumulative, sum_value=pauses.sum_s[generation])
    yield h
    frozen = GaugeMetricFamily(
        "neuron_serving_gc_frozen_objects",
        "Objects moved out of the collector's view once the node started (gc.freeze)",
        labels=labels,
    )
    frozen.add_metric(lv, gc.get_freeze_count())
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
    cumulative, running = [], 0
    for bound, count in zip(LATENCY_BUCKETS, st.bucket_counts, strict=False):
        running += count
        cumulative.append((repr(bound), running))
    cumulative.append(("+Inf", st.messages))
    h = HistogramMetricFamily(
        "neuron_serving_control_broadcast_seconds",
        "Leader-side latency of one control broadcast (all frames)",
        labels=labels,
    )
    h.add_metric(lv, cumulative, sum_value=st.latency_sum_s)
    return h


def render(collector: NodeCollector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
