"""A fleet simulator: the policy's own ``decide`` against a trace, on modelled units.

Discrete time, ``dt_s`` (1 s) a step. Requests are fluid cohorts (one per class per
step, seeded Poisson counts), not individual objects, so a day of hundreds of units
takes about a second. Each step:

1. units whose start-up (``startup_s``, measured) has passed become ready; drained
   units whose in-flight requests have finished stop;
2. arrivals join their class's queue (batch: the batch runner's backlog, no timeout);
   interactive cohorts older than their class's queue timeout fail (429);
3. the ready units serve the queues in priority order (real-time, near-real-time,
   then batch within its unit_share of the slots), FIFO within a class, up to what
   they can start this step: ready x throughput(max_num_seqs) x dt / output tokens;
4. the step is a steady state (Little's law): the served rate gives each ready unit's
   concurrency c = throughput^-1(rate x tokens / units); a served cohort's TTFT is
   its queue wait plus the unit's TTFT at c, log-normal through the measured p50 and
   p99. It meets the SLO with that probability; its TTFT mass goes into a histogram
   with the proxy's buckets, whose last ``latency_window_s`` gives the p99 signal;
5. every tick_s (the policy's) the same ``decide`` runs on the signals the proxy would
   show; added units start, removed ones drain (billed until their in-flight requests
   finish, one service time at c, plus the stop) or, still starting, stop at once.
   With ``warm_units`` (the controller's warm pool): spares are started and billed but
   not shown to ``decide``; an add promotes a warm spare (ready ``promote_s`` later)
   or one still starting before it starts a unit; a removal while the pool is short
   drains the unit into it; one spare is started a tick while the pool is short and
   the units running stay within max_units (controller.py's rules).

Unit-seconds count every unit paid for: starting, ready and draining. The model's
assumptions (README.md): routing spreads load evenly over ready units, a request's
service time is at most a few steps, the proxy's queue size limits are modelled only
as one bound on interactive requests queued or running (``max_in_flight``, off by
default) besides the timeouts, and no unit fails.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from neuron_serving.capacity import histogram
from neuron_serving.capacity.calibration import MEASURED, UnitModel
from neuron_serving.capacity.config import PolicyConfig
from neuron_serving.capacity.policy import Decision, PolicyState, decide
from neuron_serving.capacity.signals import (
    BATCH,
    CLASSES,
    NEAR_REAL_TIME,
    REAL_TIME,
    ClassSignals,
    Phase,
    Purpose,
    Signals,
    UnitSignals,
)
from neuron_serving.capacity.trace import Trace

_BOUNDS = np.array(histogram.LATENCY_BUCKETS)
_SQRT2 = math.sqrt(2.0)


@dataclass(frozen=True)
class SimConfig:
    dt_s: float = 1.0
    seed: int = 0
    output_tokens: int | None = None  # None: the calibration's (32)
    startup_s: float | None = None  # None: the calibration's (28.2 s)
    # After its last request a drained unit stops: startup-quick.json's
    # kill_to_torn_down_s was 0.4-0.5 s.
    stop_s: float = 0.5
    latency_window_s: float = 30.0  # the TTFT/ITL p99 signals' window
    # Time constant of the fleet's served rate that sets each unit's running count
    # (an exponential average; see _serve).
    concurrency_smoothing_s: float = 5.0
    # proxy/config.py CLASS_DEFAULTS: real-time 30 s, near-real-time 120 s queue
    # timeouts; batch waits in the runner's store (its deadline is hours).
    queue_timeout_s: tuple[float, float] = (30.0, 120.0)
    # Interactive requests queued or running at once, beyond which an arrival fails at
    # once (a client's in-flight cap, as `bench capacity`'s MAX_IN_FLIGHT; or the
    # proxy's queue bounds plus the units' slots). None: unbounded (only timeouts).
    max_in_flight: float | None = None
    # Units that share this many CPUs (this project's CPU test rig: `bench capacity`'s
    # units on 2 cores), each unit calibrated alone on one: with more ready units than
    # CPUs each runs at cpus/ready of its speed (its throughput curve scaled down, its
    # TTFT stretched). None: every unit has its own device, as on Trainium.
    host_cpus: float | None = None
    batch_unit_share: float = 0.75  # CLASS_DEFAULTS["batch"].unit_share
    timeline_every_s: float = 60.0
    # The warm pool (capacity/controller.py): spares kept, and how long a promoted
    # spare takes to be routable (the e2e test's decision -> routable on every replica).
    warm_units: int = 0
    promote_s: float = 1.0

    def __post_init__(self) -> None:
        if self.warm_units < 0 or self.promote_s < 0:
            raise ValueError("warm_units and promote_s must be >= 0")
        if self.dt_s <= 0 or self.latency_window_s < self.dt_s:
            raise ValueError("dt_s > 0 and latency_window_s >= dt_s")
        if self.concurrency_smoothing_s <= 0:
            raise ValueError("concurrency_smoothing_s must be > 0")
        if not 0 < self.batch_unit_share <= 1:
            raise ValueError("batch_unit_share must be in (0, 1]")


@dataclass
class FleetResult:
    label: str
    fixed_units: int | None  # None: autoscaled
    unit_seconds: float = 0.0
    units_min: int = 0
    units_max: int = 0
    requests: float = 0.0  # interactive (real-time + near-real-time)
    met_slo: float = 0.0  # interactive requests whose TTFT was under the SLO
    failed: float = 0.0  # interactive requests that timed out in the queue
    batch_requests: float = 0.0
    batch_served: float = 0.0
    batch_wait_s_sum: float = 0.0
    batch_backlog_end: float = 0.0
    scale_ups: int = 0
    scale_downs: int = 0
    units_added: int = 0
    units_removed: int = 0
    promotions: int = 0  # adds served from the warm pool
    holds: int = 0  # removals drained into the warm pool
    ttft_hist: list[float] = field(default_factory=list)
    # Every decision that changed the fleet, and (t, total req/s, paid units, ready)
    # every timeline_every_s.
    actions: list[Decision] = field(default_factory=list)
    timeline: list[tuple[float, float, int, int]] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def unit_hours(self) -> float:
        return self.unit_seconds / 3600

    @property
    def units_mean(self) -> float:
        return self.unit_seconds / self.duration_s if self.duration_s else 0.0

    @property
    def slo_attainment(self) -> float:
        return self.met_slo / self.requests if self.requests else 1.0

    @property
    def ttft_p99_s(self) -> float | None:
        return histogram.quantile(0.99, histogram.LATENCY_BUCKETS, self.ttft_hist)

    @property
    def scale_actions(self) -> int:
        return self.scale_ups + self.scale_downs

    def summary(self) -> dict:
        return {
            "fleet": self.label,
            "fixed_units": self.fixed_units,
            "slo_attainment": round(self.slo_attainment, 5),
            "ttft_p99_s": None if self.ttft_p99_s is None else round(self.ttft_p99_s, 4),
            "unit_hours": round(self.unit_hours, 2),
            "unit_seconds": round(self.unit_seconds),
            "units_mean": round(self.units_mean, 2),
            "units_min": self.units_min,
            "units_max": self.units_max,
            "scale_actions": self.scale_actions,
            "scale_ups": self.scale_ups,
            "scale_downs": self.scale_downs,
            "units_added": self.units_added,
            "units_removed": self.units_removed,
            "promotions": self.promotions,
            "holds": self.holds,
            "interactive_requests": round(self.requests),
            "failed": round(self.failed),
            "batch_requests": round(self.batch_requests),
            "batch_served": round(self.batch_served),
            "batch_mean_wait_s": round(self.batch_wait_s_sum / self.batch_served, 2)
            if self.batch_served
            else None,
            "batch_backlog_end": round(self.batch_backlog_end),
        }


class _Unit:
    __slots__ = ("unit_id", "phase", "since", "until", "purpose", "standby", "hold")

    def __init__(self, unit_id: str, phase: Phase, since: float, until: float,
                 purpose: Purpose, standby: bool = False) -> None:  # fmt: skip
        self.unit_id, self.phase, self.since, self.until = unit_id, phase, since, until
        self.purpose = purpose
        self.standby = standby  # a warm spare: billed, not shown to decide
        self.hold = False  # draining into the warm pool


class _Latency:
    """TTFT of served cohorts: the probability of meeting the SLO and the histogram
    mass, cached per (concurrency in quarters, wait in steps, slowdown in hundredths)."""

    def __init__(self, model: UnitModel, slo_s: float, dt_s: float) -> None:
        self.model, self.slo_s, self.dt_s = model, slo_s, dt_s
        self._cache: dict[tuple[int, int, int], tuple[float, np.ndarray]] = {}

    def __call__(self, c: float, wait_steps: int, slow: float = 1.0) -> tuple[float, np.ndarray]:
        """``slow``: the unit runs that many times slower than calibrated (host_cpus)."""
        key = (int(c * 4 + 0.5), wait_steps, int(slow * 100 + 0.5))
        hit = self._cache.get(key)
        if hit is None:
            mu, sigma = self.model.ttft_sigma(key[0] / 4)
            mu += math.log(key[2] / 100)
            wait = wait_steps * self.dt_s

            def cdf(x: np.ndarray) -> np.ndarray:
                z = (np.log(np.maximum(x - wait, 1e-12)) - mu) / (sigma * _SQRT2)
                return np.where(x > wait, 0.5 * np.vectorize(math.erfc)(-z), 0.0)

            at = cdf(_BOUNDS)
            mass = np.diff(np.concatenate(([0.0], at, [1.0])))
            hit = self._cache[key] = (float(cdf(np.array([self.slo_s]))[0]), mass)
        return hit


def units_for_rate(rate: float, model: UnitModel, cfg: PolicyConfig, tokens: int) -> int:
    """Units that carry ``rate`` requests/s at the policy's target utilisation."""
    per_unit = model.requests_per_s(cfg.target_utilization * model.max_num_seqs, tokens)
    return max(1, math.ceil(rate / per_unit - 1e-9))


def simulate(
    trace: Trace,
    policy: PolicyConfig,
    *,
    fixed_units: int | None = None,
    model: UnitModel = MEASURED,
    sim: SimConfig = SimConfig(),  # noqa: B008 (frozen)
    label: str = "",
) -> FleetResult:
    """Run one fleet over ``trace``: autoscaled by ``decide`` under ``policy``, or
    ``fixed_units`` throughout (the policy then only gives the SLO and the target)."""
    return _Run(trace, policy, fixed_units, model, sim, label).run()


class _Run:
    def __init__(self, trace: Trace, policy: PolicyConfig, fixed: int | None,
                 model: UnitModel, sim: SimConfig, label: str) -> None:  # fmt: skip
        self.trace, self.policy, self.model, self.sim = trace, policy, model, sim
        self.tokens = sim.output_tokens or model.output_tokens
        self.startup_s = model.startup_s if sim.startup_s is None else sim.startup_s
        self.latency = _Latency(model, policy.ttft_slo_s, sim.dt_s)
        # Requests one ready unit can start in a step: all its slots, batch its share.
        self.unit_room = model.throughput(model.max_num_seqs) * sim.dt_s / self.tokens
        self.unit_batch_room = (model.throughput(sim.batch_unit_share * model.max_num_seqs)
                                * sim.dt_s / self.tokens)  # fmt: skip
        rates = trace.rate_grid(sim.dt_s)
        self.arrivals = np.random.default_rng(sim.seed).poisson(rates * sim.dt_s).astype(float)
        self.total_rate = rates.sum(axis=1)
        self.result = FleetResult(label=label or ("autoscaled" if fixed is None else
                                                  f"fixed {fixed}"), fixed_units=fixed)  # fmt: skip
        first = units_for_rate(float(self.total_rate[0]), model, policy, self.tokens)
        n0 = fixed if fixed is not None else min(max(first, policy.min_units), policy.max_units)
        self.units: dict[str, _Unit] = {}
        self.pending: dict[str, _Unit] = {}  # starting or draining: what _advance_units checks
        self.ready = 0
        self.next_id = 0
        # The units' signals, rebuilt when a unit changes phase or the load changes.
        self.fleet_version = 0
        self.unit_signals: tuple[tuple[int, int], tuple[UnitSignals, ...]] = ((-1, -1), ())
        for _ in range(n0):
            self._add(0.0, Phase.READY, Purpose.INTERACTIVE)
        if fixed is None:  # a settled fleet: its warm pool full, within max_units
            for _ in range(min(sim.warm_units, policy.max_units - n0)):
                self._add(0.0, Phase.READY, Purpose.INTERACTIVE, standby=True)
        self.autoscaled = fixed is None
        self.state = PolicyState()
        # Queues: per class a deque of [arrival step, count]; totals kept beside.
        self.queues: list[deque[list[float]]] = [deque() for _ in CLASSES]
        self.queued = [0.0, 0.0, 0.0]
        self.active = [0.0, 0.0, 0.0]
        self.c = 0.0  # each ready unit's concurrency, this step
        self.smoothing = min(1.0, sim.dt_s / sim.concurrency_smoothing_s)
        self.rate = float(self.arrivals[0].sum()) / sim.dt_s  # requests started a second
        steps = len(self.total_rate)
        self.hist = np.zeros(len(_BOUNDS) + 1)
        self.cum = np.zeros((steps + 1, len(_BOUNDS) + 1))  # histogram after each step

    # ---- units -----------------------------------------------------------------------

    def _add(self, now: float, phase: Phase, purpose: Purpose, standby: bool = False) -> None:
        uid = f"unit-{self.next_id}"
        self.next_id += 1
        until = now if phase == Phase.READY else now + self.startup_s
        u = self.units[uid] = _Unit(uid, phase, now, until, purpose, standby)
        self.fleet_version += 1
        if phase != Phase.READY:
            self.pending[uid] = u
        elif not standby:
            self.ready += 1

    def _advance_units(self, now: float) -> None:
        for uid, u in list(self.pending.items()):
            if u.until > now:
                continue
            del self.pending[uid]
            self.fleet_version += 1
            if u.phase == Phase.STARTING:
                u.phase, u.since = Phase.READY, now
                self.ready += 0 if u.standby else 1
            elif u.hold:  # drained into the warm pool
                u.phase, u.since, u.standby, u.hold = Phase.READY, now, True, False
            else:
                del self.units[uid]

    def _apply(self, d: Decision, now: float) -> None:
        r = self.result
        if d.add:
            r.scale_ups += 1
            r.units_added += d.add
            purposes = [Purpose.INTERACTIVE] * d.add_interactive + [Purpose.BATCH] * d.add_batch
            for purpose in purposes:
                if not self._promote(now, purpose):
                    self._add(now, Phase.STARTING, purpose)
        spares = self._spares()
        if d.remove:
            r.scale_downs += 1
            r.units_removed += len(d.remove)
            # In flight on a drained unit: at most one service time at its concurrency.
            drain = self.model.service_s(self.c, self.tokens) + self.sim.stop_s
            for uid in d.remove:
                u = self.units[uid]
                if u.phase == Phase.STARTING:
                    del self.units[uid], self.pending[uid]  # stopped before it served
                    continue
                u.phase, u.since, u.until = Phase.DRAINING, now, now + drain
                self.ready -= 1
                self.pending[uid] = u
                if spares < self.sim.warm_units:
                    u.hold, spares = True, spares + 1
                    r.holds += 1
        if d.add or d.remove:
            self.fleet_version += 1
            r.actions.append(d)
        running = sum(1 for u in self.units.values()
                      if u.standby or u.hold or u.phase != Phase.DRAINING)  # fmt: skip
        if spares < self.sim.warm_units and running < self.policy.max_units:
            self._add(now, Phase.STARTING, Purpose.INTERACTIVE, standby=True)

    def _spares(self) -> int:
        return sum(1 for u in self.units.values() if u.standby or u.hold)

    def _promote(self, now: float, purpose: Purpose) -> bool:
        """A spare into rotation, warm first (routable promote_s later), else one still
        starting (it goes on starting); False when the pool is empty."""
        spares = [u for u in self.units.values() if u.standby]
        if not spares:
            return False
        u = min(spares, key=lambda x: x.phase != Phase.READY)
        u.standby, u.purpose = False, purpose
        if u.phase == Phase.READY:
            u.phase, u.since, u.until = Phase.STARTING, now, now + self.sim.promote_s
            self.pending[u.unit_id] = u
        self.fleet_version += 1
        self.result.promotions += 1
        return True

    # ---- one step --------------------------------------------------------------------

    def _serve(self, k: int, ready: int) -> None:
        """Start queued requests up to the ready units' capacity; account TTFT."""
        sim, model, r = self.sim, self.model, self.result
        served: list[tuple[int, int, float]] = []  # (class index, wait steps, count)
        # Units sharing too few CPUs run slower (host_cpus; 1 = as calibrated).
        speed = min(1.0, sim.host_cpus / ready) if sim.host_cpus and ready else 1.0
        if ready:
            room = ready * self.unit_room * speed
            batch_room = ready * self.unit_batch_room * speed
            for ci in range(3):
                q = self.queues[ci]
                cap = min(room, batch_room) if ci == 2 else room
                while q and cap > 1e-9:
                    cohort = q[0]
                    n = min(cohort[1], cap)
                    served.append((ci, k - int(cohort[0]), n))
                    cap -= n
                    room -= n
                    self.queued[ci] -= n
                    if n >= cohort[1] - 1e-9:
                        q.popleft()
                    else:
                        cohort[1] -= n
        total = sum(n for _, _, n in served)
        # A unit's running count follows its load over a few service times, not within
        # one step: one step's Poisson noise read through the flat top of the throughput
        # curve would swing a lone unit between a quarter and all of its slots. So the
        # rate is averaged (exponentially) before it is turned into a concurrency.
        self.rate += (total / sim.dt_s - self.rate) * self.smoothing
        self.c = c = (model.concurrency_for(self.rate * self.tokens / (ready * speed))
                      if ready and self.rate > 0 else 0.0)  # fmt: skip
        by_class = [0.0, 0.0, 0.0]
        by_wait: dict[int, float] = {}  # interactive requests served, by their wait
        for ci, wait, n in served:
            by_class[ci] += n
            if ci == 2:
                r.batch_served += n
                r.batch_wait_s_sum += n * wait * sim.dt_s
            else:
                by_wait[wait] = by_wait.get(wait, 0.0) + n
        for wait, n in by_wait.items():
            p, mass = self.latency(c, wait, 1.0 / speed)
            r.met_slo += n * p
            self.hist += n * mass
        # Little's law: the requests in the units, split by what each class started.
        self.active = [c * ready * b / total if total else 0.0 for b in by_class]

    def _expire(self, k: int) -> None:
        for ci, timeout in enumerate(self.sim.queue_timeout_s):
            q, oldest = self.queues[ci], k - timeout / self.sim.dt_s
            while q and q[0][0] < oldest:
                n = q.popleft()[1]
                self.queued[ci] -= n
                self.result.failed += n

    def _signals(self, k: int, now: float) -> Signals:
        sim, model = self.sim, self.model
        window = max(1, int(sim.latency_window_s / sim.dt_s))
        recent = self.cum[k + 1] - self.cum[max(0, k + 1 - window)]
        c = self.c
        # What a leader reports: whole requests; KV usage as if the pool were sized for
        # max_num_seqs sequences (not measured: an assumption, README.md).
        running = round(c)
        if self.unit_signals[0] != (self.fleet_version, running):
            kv = min(1.0, running / model.max_num_seqs)
            self.unit_signals = ((self.fleet_version, running), tuple(
                UnitSignals(unit_id=u.unit_id, phase=u.phase, purpose=u.purpose, since=u.since,
                            running=running if u.phase == Phase.READY else 0,
                            kv_usage=kv if u.phase == Phase.READY else 0.0,
                            max_num_seqs=model.max_num_seqs)
                for u in self.units.values()
                if not (u.standby or u.hold)))  # spares: not capacity (controller.py)  # fmt: skip
        units = self.unit_signals[1]
        classes = tuple(
            ClassSignals(
                name=name,
                queued=round(self.queued[ci]) if ci < 2 else 0,
                active=round(self.active[ci]),
                oldest_wait_s=(k - self.queues[ci][0][0]) * sim.dt_s
                if ci < 2 and self.queues[ci]
                else 0.0,
            )
            for ci, name in enumerate((REAL_TIME, NEAR_REAL_TIME, BATCH))
        )
        return Signals(
            now=now,
            classes=classes,
            units=units,
            ttft_p99_s=histogram.quantile(0.99, histogram.LATENCY_BUCKETS, recent),
            itl_p99_s=model.itl_p99(c) if c > 0 else None,
            batch_backlog=round(self.queued[2]),
        )

    def run(self) -> FleetResult:
        sim, r = self.sim, self.result
        dt = sim.dt_s
        steps = len(self.total_rate)
        tick = max(1, round(self.policy.tick_s / dt))
        every = max(1, round(sim.timeline_every_s / dt))
        r.duration_s = steps * dt
        r.units_min = r.units_max = len(self.units)
        for k in range(steps):
            now = k * dt
            self._advance_units(now)
            for ci in range(3):
                n = self.arrivals[k, ci]
                if n > 0 and ci < 2 and sim.max_in_flight is not None:
                    held = self.queued[0] + self.queued[1] + self.active[0] + self.active[1]
                    admitted = min(n, max(0.0, sim.max_in_flight - held))
                    r.failed += n - admitted
                    n = admitted
                if n > 0:
                    self.queues[ci].append([k, n])
                    self.queued[ci] += n
            r.requests += self.arrivals[k, 0] + self.arrivals[k, 1]
            r.batch_requests += self.arrivals[k, 2]
            self._expire(k)
            ready = self.ready
            self._serve(k, ready)
            self.cum[k + 1] = self.hist
            paid = len(self.units)
            r.unit_seconds += paid * dt
            r.units_min, r.units_max = min(r.units_min, paid), max(r.units_max, paid)
            if k % every == 0:
                r.timeline.append((now, float(self.total_rate[k]), paid, ready))
            if self.autoscaled and k % tick == 0:
                decision, self.state = decide(self._signals(k, now), self.state, self.policy)
                self._apply(decision, now)
        r.batch_backlog_end = self.queued[2]
        r.ttft_hist = [float(x) for x in self.hist]
        return r
