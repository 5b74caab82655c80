"""``CapacityController``: the live loop around ``policy.decide``.

Every ``policy.tick_s`` its thread runs one ``tick``:

    reader.read()            -> Signals (reader.py: proxy replicas + actuator.units())
    policy.decide(...)       -> Decision, next PolicyState (pure), on the serving units
                             only (warm spares are not capacity until promoted)
    act                      per unit to add: promote a warm spare (ready first, then
                             one still starting) or else actuator.add(purpose); per unit
                             to drain: actuator.hold(id) while the pool is short, else
                             actuator.remove(id); at most ``max_adds_per_tick`` /
                             ``max_removes_per_tick``; each call bounded by the actuator,
                             a failure logged and counted (the next tick decides again
                             from what the actuator then reports)
    refill                   ``warm_units`` > 0: one spare started (add(standby=True))
                             per tick while the pool is short and the units running
                             (spares included) stay within ``max_units``
    record                   one structured line per decision (``log``: JSON with the
                             signals, reason, held and what was done), the last
                             ``decisions_kept`` in memory, metrics

Nothing a tick meets ends the loop: a read that fails skips the tick (counted), an
actuator error is counted, anything unexpected is logged and counted. ``status()``
is the controller's view for supervisor.json, `neuron-serving status` and
/status-like pages; ``registry`` holds its Prometheus metrics:

    capacity_desired_units                          the last decision's desired count
    capacity_units{phase}                           starting, ready, draining, unhealthy,
                                                    standby (warm spares, any phase)
    capacity_decisions_total{action,reason}         action: add, remove, hold
    capacity_actuator_errors_total{op}              op: add, remove, promote, hold, fill
    capacity_pool_actions_total{op}                 op: promote, hold, fill
    capacity_read_errors_total                      ticks skipped: no signals
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from neuron_serving.capacity.actuator import Actuator, ActuatorError
from neuron_serving.capacity.config import PolicyConfig, policy_config_from_dict
from neuron_serving.capacity.policy import Decision, PolicyState, decide
from neuron_serving.capacity.reader import DEFAULT_LATENCY_WINDOW_S
from neuron_serving.capacity.signals import Phase, Purpose, Signals, UnitSignals

log = logging.getLogger(__name__)


class Reader(Protocol):
    def read(self) -> Signals: ...


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """The policy's knobs plus the loop's own (``from_dict`` takes both in one mapping)."""

    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    latency_window_s: float = DEFAULT_LATENCY_WINDOW_S  # the reader's TTFT/ITL window
    decisions_kept: int = 50
    # Bounds on one tick's actions (the policy's rate limits apply first).
    max_adds_per_tick: int = 2
    max_removes_per_tick: int = 1
    # Warm spares kept started but not routable (capacity/README.md, "Fast scale-up"):
    # a scale-up promotes one (routable in about a probe interval instead of a whole
    # start-up) and a scale-down keeps the drained unit as one. 0 = no pool. Spares
    # count against the policy's max_units: they hold a unit's resources.
    warm_units: int = 0

    def __post_init__(self) -> None:
        if not self.latency_window_s > 0:
            raise ValueError("latency_window_s must be > 0")
        if not 0 <= self.warm_units < self.policy.max_units:
            raise ValueError("warm_units must be in [0, max_units)")
        for name in ("decisions_kept", "max_adds_per_tick", "max_removes_per_tick"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], **policy_overrides: Any) -> ControllerConfig:
        """One mapping (a config file): the loop's keys above, every other key the
        policy's (unknown ones are an error there); ``policy_overrides`` (command-line
        flags such as min_units) win over the mapping."""
        if not isinstance(raw, dict):
            raise ValueError(f"capacity config: expected a mapping, got {type(raw).__name__}")
        own = {f.name for f in dataclasses.fields(cls)} - {"policy"}
        mine = {k: v for k, v in raw.items() if k in own}
        policy = {k: v for k, v in raw.items() if k not in own}
        policy.update({k: v for k, v in policy_overrides.items() if v is not None})
        return cls(policy=policy_config_from_dict(policy), **mine)


def _action(d: Decision) -> str:
    return "add" if d.add else "remove" if d.remove else "hold"


class CapacityController:
    def __init__(
        self,
        reader: Reader,
        actuator: Actuator,
        config: ControllerConfig | PolicyConfig,
        log_line: Callable[[str], None] | None = None,
        registry: CollectorRegistry | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(config, PolicyConfig):
            config = ControllerConfig(policy=config)
        self.reader = reader
        self.actuator = actuator
        self.config = config
        self.log_line = log_line or (lambda line: log.info("%s", line))
        self.wall_clock = wall_clock
        self.state = PolicyState()
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=config.decisions_kept
        )
        self.ticks = 0
        self.read_errors = 0
        self.actuator_errors = 0
        self.last_error: str | None = None
        self.last_action: dict[str, Any] | None = None  # the last decision that acted
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        r = self.registry = registry or CollectorRegistry()
        self.m_desired = Gauge(
            "capacity_desired_units", "Units the last capacity decision asked for", registry=r
        )
        self.m_max = Gauge(
            "capacity_max_units", "The policy's bound on units (max_units)", registry=r
        )
        self.m_max.set(config.policy.max_units)
        self.m_units = Gauge(
            "capacity_units", "Units paid for, by phase (last decision)", ["phase"], registry=r
        )
        self.m_decisions = Counter(
            "capacity_decisions", "Capacity decisions by action and reason",
            ["action", "reason"], registry=r,
        )  # fmt: skip
        self.m_actuator_errors = Counter(
            "capacity_actuator_errors", "Actuator calls that failed, by operation",
            ["op"], registry=r,
        )  # fmt: skip
        self.m_read_errors = Counter(
            "capacity_read_errors", "Ticks skipped: the signals could not be read", registry=r
        )
        self.m_pool = Counter(
            "capacity_pool_actions", "Warm pool actions: promote, hold, fill", ["op"], registry=r
        )
        self.spares = 0  # warm spares at the last tick (any phase)

    # ---- the loop ----------------------------------------------------------------------

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="capacity", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ends the loop after the tick in progress (its actuator calls are bounded)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        period = self.config.policy.tick_s
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the loop must outlive any tick
                self._error(f"tick failed: {type(e).__name__}: {e}")
                log.exception("capacity tick failed")
            next_at += period
            delay = next_at - time.monotonic()
            if delay < 0:  # a slow tick: start the next one now, do not catch up
                next_at, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    def _error(self, msg: str) -> None:
        with self._lock:
            self.last_error = msg
        self.log_line(
            json.dumps({"event": "capacity_error", "at": self.wall_clock(), "error": msg})
        )

    def tick(self) -> dict[str, Any] | None:
        """Read, decide, act, record; the decision's record, or None when no signals."""
        try:
            signals = self.reader.read()
        except Exception as e:  # noqa: BLE001 - ReaderError, ActuatorError, anything
            self.read_errors += 1
            self.m_read_errors.inc()
            self._error(f"no signals: {e}")
            return None
        spares = [u for u in signals.units if u.standby]
        serving = msgspec.structs.replace(
            signals, units=tuple(u for u in signals.units if not u.standby)
        )
        decision, self.state = decide(serving, self.state, self.config.policy)
        decided_at = self.wall_clock()
        done = self._act(decision, spares, signals.units)
        record = {
            "event": "capacity_decision",
            "wall_time": round(decided_at, 3),  # before acting: decision -> routable
            "act_s": round(self.wall_clock() - decided_at, 3),
            **decision.to_dict(),
            "action": _action(decision),
            "added": done["added"],
            "removed": done["removed"],
            "errors": done["errors"],
        }
        if self.config.warm_units:
            record["pool"] = {
                "spares": len(spares),
                "promoted": done["promoted"],
                "held": done["held"],
                "filled": done["filled"],
            }
        self.spares = len(spares) - len(done["promoted"]) + len(done["held"]) + len(done["filled"])
        self._record(decision, record)
        return record

    def _call(
        self, op: str, errors: list[str], fn: Callable[..., Any], *args: Any
    ) -> tuple[bool, Any]:
        """One bounded actuator call: (done, its value); a failure is counted and kept
        in ``errors``."""
        try:
            return True, fn(*args)
        except Exception as e:  # noqa: BLE001 - ActuatorError or a bug: counted
            errors.append(self._actuator_failed(op, e))
            return False, None

    def _act(
        self, d: Decision, spares: list[UnitSignals], units: tuple[UnitSignals, ...]
    ) -> dict[str, list[str]]:
        cfg = self.config
        added: list[str] = []
        removed: list[str] = []
        errors: list[str] = []
        promoted: list[str] = []
        held: list[str] = []
        filled: list[str] = []
        # Promotable first: warm (READY), then still starting (sooner than a cold start).
        order = {Phase.READY: 0, Phase.STARTING: 1}
        pool = sorted((u for u in spares if u.phase in order), key=lambda u: order[u.phase])
        adds = [Purpose.INTERACTIVE] * d.add_interactive + [Purpose.BATCH] * d.add_batch
        for purpose in adds[: cfg.max_adds_per_tick]:
            if pool:
                spare = pool.pop(0).unit_id
                if not self._call("promote", errors, self.actuator.promote, spare, purpose)[0]:
                    continue
                self.m_pool.labels("promote").inc()
                promoted.append(spare)
                added.append(spare)
                continue
            ok, unit_id = self._call("add", errors, self.actuator.add, purpose)
            if ok:
                added.append(unit_id)
        n_spares = len(spares) - len(promoted)
        for unit_id in d.remove[: cfg.max_removes_per_tick]:
            if n_spares < cfg.warm_units:
                if self._call("hold", errors, self.actuator.hold, unit_id)[0]:
                    self.m_pool.labels("hold").inc()
                    held.append(unit_id)
                    removed.append(unit_id)
                    n_spares += 1
                continue
            if self._call("remove", errors, self.actuator.remove, unit_id)[0]:
                removed.append(unit_id)
        # Refill: the units running after this tick (draining ones on their way out
        # excepted, spares included) must stay within max_units.
        running = sum(1 for u in units if u.standby or u.phase != Phase.DRAINING)
        running += len(added) - len(promoted) - (len(removed) - len(held))
        if n_spares < cfg.warm_units and running < cfg.policy.max_units:
            ok, unit_id = self._call("fill", errors, self.actuator.add, Purpose.INTERACTIVE, True)
            if ok:
                self.m_pool.labels("fill").inc()
                filled.append(unit_id)
        return {"added": added, "removed": removed, "errors": errors,
                "promoted": promoted, "held": held, "filled": filled}  # fmt: skip

    def _actuator_failed(self, op: str, e: Exception) -> str:
        self.actuator_errors += 1
        self.m_actuator_errors.labels(op).inc()
        what = str(e) if isinstance(e, ActuatorError) else f"{type(e).__name__}: {e}"
        msg = f"{op}: {what}"[:500]
        with self._lock:
            self.last_error = msg
        return msg

    def _record(self, d: Decision, record: dict[str, Any]) -> None:
        self.ticks += 1
        self.m_desired.set(d.desired)
        unhealthy = d.current - d.ready - d.starting
        for phase, n in ((Phase.STARTING, d.starting), (Phase.READY, d.ready),
                         (Phase.DRAINING, d.draining), (Phase.UNHEALTHY, unhealthy),
                         ("standby", self.spares)):  # fmt: skip
            self.m_units.labels(str(phase)).set(n)
        self.m_decisions.labels(record["action"], str(d.reason)).inc()
        with self._lock:
            self.decisions.append(record)
            if (
                record["added"]
                or record["removed"]
                or record["errors"]
                or any(record.get("pool", {}).get("filled", ()))
            ):
                self.last_action = record
        self.log_line(json.dumps(record, separators=(",", ":")))

    # ---- views -------------------------------------------------------------------------

    def status(self, last: int = 10) -> dict[str, Any]:
        """The controller now: bounds, the last decision's counts, the last action, the
        last ``last`` decisions (newest last), counters."""
        p = self.config.policy
        with self._lock:
            decisions = list(self.decisions)
            last_action, last_error = self.last_action, self.last_error
        d = decisions[-1] if decisions else None
        return {
            "enabled": True,
            "min_units": p.min_units,
            "max_units": p.max_units,
            "tick_s": p.tick_s,
            "target_utilization": p.target_utilization,
            "unit_curve": [list(pt) for pt in p.unit_curve],
            "warm_units": self.config.warm_units,
            "spares": self.spares,
            "desired": None if d is None else d["desired"],
            "current": None if d is None else d["current"],
            "ready": None if d is None else d["ready"],
            "starting": None if d is None else d["starting"],
            "draining": None if d is None else d["draining"],
            "mode": None if d is None else d["mode"],
            "reason": None if d is None else d["reason"],
            "held": None if d is None else d["held"],
            "last_action": last_action,
            "ticks": self.ticks,
            "read_errors": self.read_errors,
            "actuator_errors": self.actuator_errors,
            "last_error": last_error,
            "decisions": decisions[-last:] if last else [],
        }

    def render_metrics(self) -> bytes:
        return generate_latest(self.registry)
