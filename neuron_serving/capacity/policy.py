"""The capacity decision: a pure function of (signals, state, config).

``decide`` reads no clock and does no I/O: the time is ``signals.now``, the memory of
past ticks is the ``PolicyState`` it was handed, and it returns the next state with
the ``Decision``. The controller and the simulator call the same function.

Rules, in the order they apply (README.md has the reasons and defaults):

1. Concurrency C = active + queued requests of the interactive classes; batch B =
   batch active + queued + the batch backlog. The active part is first mapped through
   the unit's throughput curve (config ``unit_curve``) to the count the same load
   would make with every unit at target (``_at_target``); with no curve it is
   unchanged, as in Knative. One sample per tick; the stable window's mean drives the
   count, the panic window's mean detects spikes.
2. Target tracking: a ready unit should carry T = target_utilization x max_num_seqs.
   Demand D = C_stable + the part of B_stable that fits under batch_max_units x T, so
   batch alone never asks for more than batch_max_units.
3. Stable mode: no change while D / (units x T) is within 1 +- dead_band (hysteresis);
   outside it the count becomes ceil(D / T), but a scale-down never goes below what
   the panic window's demand needs (a rising load is above its stable mean).
4. Panic: when ceil(C_panic / T) >= panic_threshold x ready units; the count becomes
   at least that and never goes down until a stable window passes without a trigger.
5. SLO breach (TTFT p99 over the SLO with real-time requests queued; ITL p99 over
   its SLO with ready units above target; KV usage over kv_usage_high with interactive
   requests queued): at least one more unit, unless one is already starting; never
   a scale-down during a breach, nor while interactive requests are queued.
6. Bounds min_units..max_units, then Knative's rate limits per decision.
7. Cool-downs: scale_up_cooldown_s between scale-ups; scale_down_cooldown_s from the
   last scale action to a scale-down, except that units added for batch may go after
   the shorter batch_scale_down_cooldown_s. Bound corrections skip cool-downs.
8. Scale-in picks units with ``scale_in.pick``: batch units first, never one mid-deploy,
   never the last ready unit of a model.
"""

from __future__ import annotations

import enum
import math

import msgspec

from neuron_serving.capacity import scale_in, windows
from neuron_serving.capacity.config import PolicyConfig
from neuron_serving.capacity.signals import (
    BATCH,
    REAL_TIME,
    Phase,
    Purpose,
    Signals,
    UnitSignals,
)

_EPS = 1e-9  # ceil(2.0000000001) must be 2: concurrency means are float sums


class Mode(enum.StrEnum):
    STABLE = "stable"
    PANIC = "panic"


class Reason(enum.StrEnum):
    """What set the desired count."""

    HOLD = "hold"  # demand within the dead band, or nothing to change
    SCALE_UP = "scale_up"  # the stable window above target
    PANIC = "panic"  # the panic window at panic_threshold x ready
    SLO_BREACH = "slo_breach"
    BATCH_BACKLOG = "batch_backlog"  # batch alone wants more (up to batch_max_units)
    SCALE_DOWN = "scale_down"
    BATCH_SCALE_DOWN = "batch_scale_down"  # only units added for batch go
    MIN_UNITS = "min_units"
    MAX_UNITS = "max_units"


class Held(enum.StrEnum):
    """Why a change the rules asked for did not happen (all of it) this tick."""

    NO = ""
    SCALE_UP_COOLDOWN = "scale_up_cooldown"
    SCALE_DOWN_COOLDOWN = "scale_down_cooldown"
    AT_MAX_UNITS = "at_max_units"
    PANIC = "panic"  # no scale-down in panic
    SLO_BREACH = "slo_breach"  # no scale-down during a breach
    QUEUED = "queued"  # no scale-down while interactive requests wait
    STARTING = "starting"  # a breach, but a unit is already starting
    PROTECTED = "protected"  # no unit may be taken (mid-deploy, last ready of a model)


class PolicyState(msgspec.Struct, frozen=True, kw_only=True):
    """What ``decide`` remembers between ticks (it holds nothing itself)."""

    samples: tuple[windows.Sample, ...] = ()
    panic_since: float | None = None
    last_panic_trigger: float | None = None
    last_scale_up_at: float | None = None
    last_scale_down_at: float | None = None


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """One tick's decision with the signals behind it (for logs, metrics, /status)."""

    at: float
    mode: Mode
    reason: Reason
    held: Held
    # Units paid for now (starting + ready + unhealthy) and by phase.
    current: int
    ready: int
    starting: int
    draining: int
    desired: int  # what the rules ask for, within bounds
    add_interactive: int
    add_batch: int  # of the added units, those only batch asked for
    remove: tuple[str, ...]  # unit ids to drain, in order
    # The signals.
    target_per_unit: float
    concurrency: float  # interactive, this tick
    stable_concurrency: float
    panic_concurrency: float
    batch_concurrency: float  # stable window
    stable_desired: int
    panic_desired: int
    queued_real_time: int
    queued_interactive: int
    oldest_wait_s: float
    ttft_p99_s: float | None
    itl_p99_s: float | None
    kv_usage_mean: float
    batch_backlog: int
    breach: str  # "", "ttft", "itl" or "kv"

    @property
    def add(self) -> int:
        return self.add_interactive + self.add_batch

    @property
    def units_after(self) -> int:
        return self.current + self.add - len(self.remove)

    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def _since(now: float, then: float | None) -> float:
    return math.inf if then is None else now - then


class _Census:
    """One pass over the units: counts by phase and the ready units' load."""

    __slots__ = ("ready", "starting", "draining", "kv_sum", "load_sum", "slots")

    def __init__(self, units: tuple[UnitSignals, ...]) -> None:
        self.ready = self.starting = self.draining = self.slots = 0
        self.kv_sum = self.load_sum = 0.0
        ready, starting, draining = Phase.READY, Phase.STARTING, Phase.DRAINING
        slots: list[int] = []
        for u in units:
            phase = u.phase
            if phase == ready:
                self.ready += 1
                self.kv_sum += u.kv_usage
                self.load_sum += u.running + u.waiting
                slots.append(u.max_num_seqs)
            elif phase == starting:
                self.starting += 1
            elif phase == draining:
                self.draining += 1
        # The smallest reported: conservative when units differ.
        self.slots = min((s for s in slots if s > 0), default=0)


class _Want(msgspec.Struct, kw_only=True):
    """The rules' working answer, refined step by step inside ``decide``."""

    count: int
    reason: Reason = Reason.HOLD
    held: Held = Held.NO
    interactive: int = 0  # what interactive traffic alone asks for


def decide(signals: Signals, state: PolicyState, cfg: PolicyConfig) -> tuple[Decision, PolicyState]:
    now = signals.now
    units = signals.units
    census = _Census(units)
    ready, starting, draining = census.ready, census.starting, census.draining
    current = len(units) - draining

    # 1. samples and windows
    target = cfg.target_per_unit(census.slots or None)
    interactive = [c for c in signals.classes if c.name != BATCH]
    b = signals.klass(BATCH)
    active_i = sum(c.active for c in interactive)
    scale = _at_target(cfg, active_i + b.active, ready, target / cfg.target_utilization)
    conc = active_i * scale + sum(c.queued for c in interactive)
    batch = b.active * scale + b.queued + signals.batch_backlog
    samples = windows.push(state.samples, (now, conc, batch), cfg.stable_window_s)
    stable_c, stable_b = windows.mean(samples, now, cfg.stable_window_s)
    panic_c, _ = windows.mean(samples, now, cfg.panic_window_s)
    stable_want, panic_want = _ceil(stable_c / target), _ceil(panic_c / target)

    # 4. panic mode first: it changes how 2-3 apply
    panic_since, last_trigger = state.panic_since, state.last_panic_trigger
    if panic_want >= cfg.panic_threshold * max(ready, 1):
        last_trigger = now
        panic_since = now if panic_since is None else panic_since
    elif panic_since is not None and _since(now, last_trigger) >= cfg.stable_window_s:
        panic_since = None
    mode = Mode.PANIC if panic_since is not None else Mode.STABLE

    # 2-3. target tracking (batch only up to its ceiling) with the dead band
    demand = stable_c + min(stable_b, max(0.0, cfg.batch_max_units * target - stable_c))
    want = _Want(count=current, interactive=stable_want)
    if mode == Mode.PANIC:
        want.interactive = max(stable_want, panic_want)
        if max(want.interactive, _ceil(demand / target)) > current:
            want.count, want.reason = max(want.interactive, _ceil(demand / target)), Reason.PANIC
        elif _ceil(demand / target) < current:
            want.held = Held.PANIC  # the stable window would scale down: not in panic
    elif current == 0 or abs(demand / (current * target) - 1) > cfg.dead_band + _EPS:
        want.count = _ceil(demand / target)
        if want.count > current:
            want.reason = Reason.SCALE_UP if stable_want > current else Reason.BATCH_BACKLOG
        elif want.count < current:
            # Never below what the panic window needs: a load still rising is above its
            # stable mean, and a unit given back now would be started again in seconds.
            panic_demand = panic_c + min(stable_b, max(0.0, cfg.batch_max_units * target - panic_c))
            want.count = min(current, max(want.count, _ceil(panic_demand / target)))
            want.reason = Reason.SCALE_DOWN if want.count < current else Reason.HOLD

    # 5. SLO breach, and when a scale-down must wait
    rt_queued = signals.klass(REAL_TIME).queued
    queued = sum(c.queued for c in interactive)
    kv_mean = census.kv_sum / ready if ready else 0.0
    load_mean = census.load_sum / ready if ready else 0.0
    breach = _breach(signals, cfg, rt_queued, queued, kv_mean, load_mean, target, bool(ready))
    if breach:
        # One more unit unless one is already on its way: the breach is a floor, the
        # windows size the step.
        floor = current + (0 if starting else 1)
        if want.count < floor:
            want.count, want.reason, want.interactive = floor, Reason.SLO_BREACH, floor
        if starting and want.count <= current:
            want.held = Held.STARTING
    if want.count < current:
        for cond, why in ((mode == Mode.PANIC, Held.PANIC), (bool(breach), Held.SLO_BREACH),
                          (queued > 0, Held.QUEUED)):  # fmt: skip
            if cond:
                want.count, want.reason, want.held = current, Reason.HOLD, why
                break

    # 6. bounds (corrections skip cool-downs), then the rate limits
    bound = _bound(want, current, ready, cfg)

    # 7-8. cool-downs, then which units
    add = 0
    remove: tuple[str, ...] = ()
    up_at, down_at = state.last_scale_up_at, state.last_scale_down_at
    if want.count > current:
        if bound or _since(now, up_at) >= cfg.scale_up_cooldown_s:
            add, up_at = want.count - current, now
        else:
            want.held = Held.SCALE_UP_COOLDOWN
    elif want.count < current:
        remove = _scale_in(want, signals, current, bound, up_at, down_at, cfg)
        if remove:
            down_at = now

    add_interactive = min(add, max(0, want.interactive - current))
    decision = Decision(
        at=now,
        mode=mode,
        reason=want.reason,
        held=want.held,
        current=current,
        ready=ready,
        starting=starting,
        draining=draining,
        desired=want.count,
        add_interactive=add_interactive,
        add_batch=add - add_interactive,
        remove=remove,
        target_per_unit=target,
        concurrency=conc,
        stable_concurrency=stable_c,
        panic_concurrency=panic_c,
        batch_concurrency=stable_b,
        stable_desired=stable_want,
        panic_desired=panic_want,
        queued_real_time=rt_queued,
        queued_interactive=queued,
        oldest_wait_s=max((c.oldest_wait_s for c in interactive if c.queued), default=0.0),
        ttft_p99_s=signals.ttft_p99_s,
        itl_p99_s=signals.itl_p99_s,
        kv_usage_mean=kv_mean,
        batch_backlog=signals.batch_backlog,
        breach=breach,
    )
    new_state = PolicyState(
        samples=samples,
        panic_since=panic_since,
        last_panic_trigger=last_trigger,
        last_scale_up_at=up_at,
        last_scale_down_at=down_at,
    )
    return decision, new_state


def _at_target(cfg: PolicyConfig, active: int, ready: int, slots: float) -> float:
    """How many requests at target one running request stands for.

    Each ready unit runs c = active / ready and makes y(c) of its full throughput; at
    target it would make y(T) running T. The same load therefore needs
    ready x y(c) / y(T) units at T each: the active count scaled by
    (T / c) x (y(c) / y(T)). 1 without a curve (y linear) and with nothing running."""
    if not cfg.unit_curve or active <= 0 or ready <= 0:
        return 1.0
    x, xt = active / ready / slots, cfg.target_utilization
    return (xt / x) * cfg.throughput_fraction(x) / cfg.throughput_fraction(xt)


def _breach(
    signals: Signals,
    cfg: PolicyConfig,
    rt_queued: int,
    queued: int,
    kv_mean: float,
    load_mean: float,
    target: float,
    any_ready: bool,
) -> str:
    """Which SLO is breached, or "": TTFT needs real-time requests queued (a slow tail
    without a queue is not fixed by more units), ITL needs units above target, KV
    pressure needs interactive requests queued."""
    if signals.ttft_p99_s is not None and signals.ttft_p99_s > cfg.ttft_slo_s and rt_queued:
        return "ttft"
    if (cfg.itl_slo_s is not None and signals.itl_p99_s is not None
            and signals.itl_p99_s > cfg.itl_slo_s and load_mean > target):  # fmt: skip
        return "itl"
    if any_ready and kv_mean >= cfg.kv_usage_high and queued:
        return "kv"
    return ""


def _bound(want: _Want, current: int, ready: int, cfg: PolicyConfig) -> bool:
    """Apply min/max units and the per-decision rate limits to ``want``; True when the
    fleet is outside its bounds (the correction then skips cool-downs)."""
    if current < cfg.min_units:
        want.count, want.reason = max(want.count, cfg.min_units), Reason.MIN_UNITS
        want.interactive = max(want.interactive, cfg.min_units)
        return True
    if current > cfg.max_units:
        want.count, want.reason = min(want.count, cfg.max_units), Reason.MAX_UNITS
        return True
    if want.count > cfg.max_units:
        want.count, want.held = cfg.max_units, Held.AT_MAX_UNITS
    want.count = max(want.count, cfg.min_units)
    want.count = min(want.count, math.ceil(max(ready, 1) * cfg.max_scale_up_rate))
    want.count = max(want.count, math.ceil(current / cfg.max_scale_down_rate))
    if want.count == current and want.reason != Reason.HOLD and want.held == Held.NO:
        want.reason = Reason.HOLD
    return False


def _scale_in(
    want: _Want,
    signals: Signals,
    current: int,
    bound: bool,
    up_at: float | None,
    down_at: float | None,
    cfg: PolicyConfig,
) -> tuple[str, ...]:
    """The units to drain now (maybe fewer than asked, maybe none), updating
    ``want``'s reason and held."""
    now = signals.now
    victims = scale_in.pick(signals.units, current - want.count)
    if not victims:
        want.held = Held.PROTECTED
        return ()
    if not bound:
        quiet = min(_since(now, up_at), _since(now, down_at))
        if quiet < cfg.scale_down_cooldown_s:
            # Only units added for batch may go early; the order puts them first.
            batch = {u.unit_id for u in signals.units if u.purpose == Purpose.BATCH}
            early = tuple(v for v in victims if v in batch)
            if not early or quiet < cfg.batch_scale_down_cooldown_s:
                want.held = Held.SCALE_DOWN_COOLDOWN
                return ()
            victims = early
            want.held = Held.SCALE_DOWN_COOLDOWN if len(early) < current - want.count else want.held
        if scale_in.all_batch(signals.units, victims):
            want.reason = Reason.BATCH_SCALE_DOWN
    if len(victims) < current - want.count and want.held == Held.NO:
        want.held = Held.PROTECTED
    return victims
