"""Units and nodes as the proxy sees them.

The registry is plain state shared by the health checker (which writes node
health), the outlier detector (which writes ejections), the dispatcher (which
writes in-flight counts) and the admin API (which adds, removes and drains
units). Everything runs on one asyncio loop, so no locks: every mutation is a
synchronous method call between two awaits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from proxy.config import UnitSpec
from proxy.traffic_class import TrafficClass

NodeRole = Literal["leader", "follower"]
RegistryEvent = Literal["added", "removed"]


@dataclass(slots=True)
class NodeHealth:
    """One process of a unit. Starts unhealthy: nothing is routable before its first probe."""

    node_id: str  # "<unit>/leader" or "<unit>/follower-<rank>"
    role: NodeRole
    addr: str
    healthy: bool = False
    # Envoy: a host that has never passed a check needs only one success to become
    # healthy, so a freshly started unit takes traffic after one interval, not M.
    initial: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_probe_at: float | None = None  # time.time() of the last probe result
    last_probe_latency_s: float | None = None
    last_error: str = ""
    rank: int = 0  # its rank in the unit (the leader's is 0)
    probes_total: int = 0
    probe_failures_total: int = 0


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A unit's own view of its load: its leader's vLLM scheduler stats, as the
    leader last pushed them over its OpenAI channel (``openai_channel.Load``).
    Counts every request the engine holds, whichever proxy sent it."""

    running: int  # sequences in the running batch
    waiting: int  # requests queued in the engine, not yet scheduled
    kv_usage: float  # fraction of KV cache blocks in use, 0..1
    max_num_seqs: int  # the engine's running-batch bound (vLLM's max_num_seqs)
    at: float  # time.monotonic() when the proxy received it
    num_blocks: int = 0  # the engine's KV cache size in blocks; 0 = not reported
    # Ranks the leader judges persistently slower than their peers (the unit's
    # slow-rank detector): still serving, but the unit runs at their pace.
    degraded_ranks: tuple[int, ...] = ()


@dataclass(slots=True)
class UnitState:
    spec: UnitSpec
    nodes: list[NodeHealth]
    # The checkpoint version the unit serves: starts as the config's, then what the
    # leader announces (its model config's "model_version", read by the health
    # checker each time the leader becomes healthy, i.e. after every restart, and by
    # the dispatcher from each request's first response). Routing and response tags
    # use this, so a unit recreated on a new version is never mislabelled.
    model_version: str = ""
    draining: bool = False
    in_flight: int = 0
    # in_flight by traffic class (proxy/traffic_class.py: index = the class's value):
    # flow control lets a class wait in the engine behind slots less urgent ones hold.
    class_in_flight: list[int] = field(default_factory=lambda: [0] * len(TrafficClass))
    # The leader's last load report; None while its channel is not connected (then
    # flow control has only the proxy's own in-flight count). Set it with
    # ``set_engine_load``, which also notes ``in_flight`` then (``load_now``).
    engine_load: EngineLoad | None = None
    # (report, this proxy's in-flight count there when the report arrived).
    load_base: tuple[EngineLoad, int] | None = field(default=None, repr=False)
    # Outlier detection (written only by proxy.serving.outlier).
    consecutive_errors: int = 0
    times_ejected: int = 0
    ejected_until: float = 0.0  # time.monotonic(); 0 = never ejected
    last_ejection_end: float = 0.0
    ejections_total: int = 0
    requests_total: int = 0
    errors_total: int = 0

    @property
    def unit_id(self) -> str:
        return self.spec.unit_id

    @property
    def leader(self) -> NodeHealth:
        return self.nodes[0]

    def fresh_load(self, now: float, max_age_s: float) -> EngineLoad | None:
        """The engine's last report if it is at most ``max_age_s`` old, else None."""
        report = self.engine_load
        if report is None or now - report.at > max_age_s:
            return None
        return report

    def sequences(self, report: EngineLoad | None) -> int:
        """The unit's load in sequences, the one figure flow control and routing share:
        the engine's running + waiting (every proxy's requests) or this proxy's
        in-flight count there, whichever is higher (a report lags the requests just
        sent; in-flight also holds answers still being relayed: see flow_control.py)."""
        if report is None:
            return self.in_flight
        return max(self.in_flight, report.running + report.waiting)

    def set_engine_load(self, report: EngineLoad | None) -> None:
        """A load report arrived (None: the channel is gone). The same report set again
        (a unit announced at a connected channel) keeps the in-flight count noted when
        it first arrived."""
        if report is not None and (self.load_base is None or self.load_base[0] is not report):
            self.load_base = (report, self.in_flight)
        self.engine_load = report

    def load_now(self, report: EngineLoad | None) -> int:
        """Routing's estimate of the unit's sequences now: the report's running +
        waiting, plus this proxy's requests started there since it arrived, minus
        those that ended since (the engine's count moved by as much, whatever the
        other proxies did meanwhile); never below this proxy's in-flight count there.
        A report lags: the leader pushes a change at most every 100 ms, so the last
        report of a burst may still count sequences that this proxy has seen end
        (``sequences`` would keep them: flow control's bound, on purpose). Without the
        in-flight count at the report's arrival (one assigned directly), ``sequences``."""
        if report is None:
            return self.in_flight
        base = self.load_base
        if base is None or base[0] is not report:
            return self.sequences(report)
        return max(self.in_flight, report.running + report.waiting + self.in_flight - base[1])

    def nodes_healthy(self) -> bool:
        return all(n.healthy for n in self.nodes)

    def has_started(self) -> bool:
        """Every node has passed a probe at least once (it may have failed since)."""
        return not any(n.initial for n in self.nodes)

    def is_ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def routing_state(self, now: float) -> str:
        """What routing sees: draining, ejected, routable (degraded: routable with a
        rank its leader finds slow) or unhealthy."""
        if self.draining:
            return "draining"
        if self.is_ejected(now):
            return "ejected"
        if not self.nodes_healthy():
            return "unhealthy"
        load = self.engine_load
        return "degraded" if load is not None and load.degraded_ranks else "routable"


@dataclass(frozen=True, slots=True)
class Event:
    """A recent happening worth showing an SRE (health flips, ejections, admin actions)."""

    at: float  # time.time()
    unit_id: str
    kind: str
    detail: str = ""


def make_unit_state(spec: UnitSpec) -> UnitState:
    nodes = [NodeHealth(f"{spec.unit_id}/leader", "leader", spec.leader_grpc)]
    nodes += [
        NodeHealth(f"{spec.unit_id}/follower-{rank}", "follower", addr, rank=rank)
        for rank, addr in enumerate(spec.followers, start=1)
    ]
    return UnitState(spec=spec, nodes=nodes, model_version=spec.model_version)


Listener = Callable[[RegistryEvent, UnitState], None]


@dataclass
class Registry:
    units: dict[str, UnitState] = field(default_factory=dict)
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=200))
    _listeners: list[Listener] = field(default_factory=list)

    def subscribe(self, listener: Listener) -> None:
        """``listener`` is called synchronously after every add and remove."""
        self._listeners.append(listener)

    def record(self, unit_id: str, kind: str, detail: str = "") -> None:
        self.events.append(Event(time.time(), unit_id, kind, detail))

    def add(self, spec: UnitSpec) -> UnitState:
        if spec.unit_id in self.units:
            raise KeyError(f"unit {spec.unit_id!r} already exists")
        unit = make_unit_state(spec)
        self.units[spec.unit_id] = unit
        self.record(spec.unit_id, "added", spec.leader_grpc)
        for listener in self._listeners:
            listener("added", unit)
        return unit

    def remove(self, unit_id: str) -> UnitState:
        """In-flight requests on a removed unit finish; it only stops getting new ones."""
        unit = self.units.pop(unit_id)  # KeyError if unknown
        self.record(unit_id, "removed")
        for listener in self._listeners:
            listener("removed", unit)
        return unit

    def set_draining(self, unit_id: str, draining: bool) -> UnitState:
        unit = self.units[unit_id]
        if unit.draining != draining:
            unit.draining = draining
            self.record(unit_id, "drain" if draining else "undrain")
        return unit

    def set_version(self, unit: UnitState, version: str) -> None:
        if version and version != unit.model_version:
            self.record(unit.unit_id, "version", f"{unit.model_version or '-'} -> {version}")
            unit.model_version = version

    def versions(self, model: str) -> set[str]:
        return {u.model_version for u in self.for_model(model)}

    def get(self, unit_id: str) -> UnitState | None:
        return self.units.get(unit_id)

    def for_model(self, model: str) -> list[UnitState]:
        return [u for u in self.units.values() if u.spec.model == model]

    def models(self) -> list[str]:
        return sorted({u.spec.model for u in self.units.values()})
