"""The pure decision function: hysteresis, cool-downs, panic, bounds, batch-first
scale-in, protected units, SLO breach. Units have 10 slots, so the default target
(0.5) is 5 concurrent requests a ready unit."""

from __future__ import annotations

import json

import pytest

from neuron_serving.capacity.config import PolicyConfig, policy_config_from_dict
from neuron_serving.capacity.policy import Decision, Held, Mode, PolicyState, Reason, decide
from neuron_serving.capacity.signals import Phase, Purpose

from .helpers import SLOTS, fleet, signals, unit

CFG = PolicyConfig(max_units=20, max_num_seqs=SLOTS)


def run(cfg: PolicyConfig, steps, state: PolicyState | None = None):
    """Feed (signals) one tick each; return every decision and the last state."""
    state = state or PolicyState()
    out: list[Decision] = []
    for s in steps:
        d, state = decide(s, state, cfg)
        out.append(d)
    return out, state


def steady(cfg: PolicyConfig, units, rt: int, until: float, **kw):
    """Ticks of constant load from 0 to ``until`` (exclusive), every tick_s."""
    n = int(until / cfg.tick_s)
    return [signals(i * cfg.tick_s, units, rt=rt, **kw) for i in range(n)]


def test_on_target_holds_and_the_dead_band_absorbs_10_percent() -> None:
    units = fleet(4)  # target 4 x 5 = 20
    for rt in (18, 20, 22):  # within +-10%
        decisions, _ = run(CFG, steady(CFG, units, rt, 200))
        assert {d.reason for d in decisions} == {Reason.HOLD}, rt
        assert all(d.add == 0 and not d.remove for d in decisions)
    # 25 is 25% over: ceil(25 / 5) = 5 units
    d = run(CFG, steady(CFG, units, 25, 2))[0][0]
    assert (d.reason, d.desired, d.add) == (Reason.SCALE_UP, 5, 1)


def test_dead_band_stops_flapping_around_a_boundary() -> None:
    # 4 units; load alternating 19/23 every tick: the stable mean (21) stays in band.
    units = fleet(4)
    steps = [signals(i * 2.0, units, rt=23 if i % 2 else 19) for i in range(300)]
    decisions, _ = run(CFG, steps)
    assert sum(d.add + len(d.remove) for d in decisions) == 0


def test_scale_up_cooldown() -> None:
    cfg = PolicyConfig(max_units=20, max_num_seqs=SLOTS, scale_up_cooldown_s=10)
    state = run(cfg, [signals(0, fleet(2), rt=15)])[1]  # -> 3 units at t=0
    d, _ = decide(signals(4, fleet(3), rt=40), state, cfg)  # wants more, 4 s later
    assert d.add == 0 and d.held == Held.SCALE_UP_COOLDOWN and d.desired > 3
    d, _ = decide(signals(10, fleet(3), rt=40), state, cfg)
    assert d.add > 0


def test_scale_down_waits_for_its_cooldown_after_any_action() -> None:
    cfg = PolicyConfig(max_units=20, max_num_seqs=SLOTS, scale_down_cooldown_s=120)
    d, state = decide(signals(0, fleet(2), rt=15), PolicyState(), cfg)
    assert d.add == 1  # scaled up at t=0
    # Load drops at once: 4 units' worth of capacity for 5 requests.
    steps = [signals(t, fleet(4), rt=5) for t in range(2, 200, 2)]
    decisions, _ = run(cfg, steps, state)
    first = next(d for d in decisions if d.remove)
    assert first.at >= 120
    assert all(d.held == Held.SCALE_DOWN_COOLDOWN for d in decisions if d.at < 120
               and d.desired < d.current)  # fmt: skip


def test_scale_down_at_most_halves_per_decision() -> None:
    d = run(CFG, steady(CFG, fleet(16), 1, 2))[0][0]
    assert d.reason == Reason.SCALE_DOWN and len(d.remove) == 8


def test_panic_on_a_spike_and_no_scale_down_until_a_stable_window_passes() -> None:
    cfg = CFG
    units = fleet(2)
    steps = steady(cfg, units, 10, 60)  # on target for a minute
    steps += [signals(60 + i * 2, units, rt=40) for i in range(3)]  # 4x in 6 s
    decisions, state = run(cfg, steps)
    spike = decisions[-1]
    assert spike.mode == Mode.PANIC and spike.reason == Reason.PANIC
    assert spike.panic_desired >= 2 * spike.ready and spike.desired >= spike.panic_desired
    # The spike ends at once: in panic nothing goes, even with 16 units idle.
    big = fleet(spike.units_after)
    calm = [signals(66 + i * 2, big, rt=5) for i in range(70)]
    after, _ = run(cfg, calm, state)
    in_panic = [d for d in after if d.mode == Mode.PANIC]
    assert in_panic and all(not d.remove for d in in_panic)
    assert any(d.held == Held.PANIC for d in in_panic)
    # Panic ends a stable window (60 s) after its last trigger, then scale-in may start.
    last_trigger = max(d.at for d in decisions + after
                       if d.panic_desired >= 2 * max(d.ready, 1))  # fmt: skip
    stable = [d for d in after if d.mode == Mode.STABLE]
    assert stable and min(d.at for d in stable) >= last_trigger + 60


def test_bounds() -> None:
    cfg = PolicyConfig(min_units=2, max_units=5, max_num_seqs=SLOTS)
    # Below min: up at once, whatever the cool-down.
    state = PolicyState(last_scale_up_at=0.0)
    d, _ = decide(signals(1, fleet(1), rt=0), state, cfg)
    assert (d.reason, d.add) == (Reason.MIN_UNITS, 1)
    # Demand for 10 units: capped at 5, and held there.
    d, _ = decide(signals(0, fleet(4), rt=50), PolicyState(), cfg)
    assert (d.desired, d.add, d.held) == (5, 1, Held.AT_MAX_UNITS)
    d, _ = decide(signals(0, fleet(5), rt=50), PolicyState(), cfg)
    assert (d.add, d.held) == (0, Held.AT_MAX_UNITS)
    # Idle: never below min.
    decisions, _ = run(cfg, steady(cfg, fleet(2), 0, 400))
    assert all(not d.remove for d in decisions)
    # Above max (the bound was lowered): down at once, cool-down or not.
    d, _ = decide(signals(1, fleet(8), rt=40), PolicyState(last_scale_up_at=0.0), cfg)
    assert d.reason == Reason.MAX_UNITS and len(d.remove) == 3


def test_slo_breach_forces_one_more_unit_even_inside_the_dead_band() -> None:
    units = fleet(4)
    d, _ = decide(signals(0, units, rt=20, rt_queued=1, ttft_p99_s=0.9), PolicyState(), CFG)
    assert (d.reason, d.add, d.breach) == (Reason.SLO_BREACH, 1, "ttft")
    # A slow tail without queued real-time work is not a breach.
    d, _ = decide(signals(0, units, rt=20, ttft_p99_s=0.9), PolicyState(), CFG)
    assert (d.add, d.breach) == (0, "")
    # A unit already starting is the help: no second one, and no scale-down either.
    starting = (*units, unit(9, Phase.STARTING))
    d, _ = decide(signals(0, starting, rt=1, rt_queued=1, ttft_p99_s=0.9), PolicyState(), CFG)
    assert d.add == 0 and not d.remove and d.held in (Held.STARTING, Held.SLO_BREACH)


def test_no_scale_down_while_interactive_requests_queue() -> None:
    decisions, _ = run(CFG, steady(CFG, fleet(8), 5, 300, rt_queued=1))
    assert all(not d.remove for d in decisions)
    assert any(d.held == Held.QUEUED for d in decisions)


def test_batch_alone_scales_only_to_its_ceiling() -> None:
    cfg = PolicyConfig(max_units=20, max_num_seqs=SLOTS, batch_max_units=4)
    d = run(cfg, steady(cfg, fleet(1), 0, 2, backlog=1000))[0][0]
    assert (d.reason, d.desired, d.add_batch, d.add_interactive) == (
        Reason.BATCH_BACKLOG, 4, 3, 0)  # fmt: skip
    # At the ceiling, batch asks for nothing more.
    d = run(cfg, steady(cfg, fleet(4), 0, 2, backlog=1000))[0][0]
    assert d.add == 0
    # Interactive demand above the ceiling is not capped by it.
    d = run(cfg, steady(cfg, fleet(4), 50, 2, backlog=1000))[0][0]
    assert d.desired == 10 and d.add_interactive == 6


def test_batch_units_are_the_first_given_back_and_sooner() -> None:
    cfg = PolicyConfig(max_units=20, max_num_seqs=SLOTS, batch_max_units=6,
                       scale_down_cooldown_s=120, batch_scale_down_cooldown_s=30)  # fmt: skip
    units = (*fleet(3, running=1),
             *(unit(10 + i, purpose=Purpose.BATCH, running=5) for i in range(3)))  # fmt: skip
    # The batch job is done; interactive load needs 2 units. 40 s after the last
    # scale-up: only batch units may go (their cool-down is 30 s), busiest or not.
    state = PolicyState(last_scale_up_at=0.0)
    decisions, _ = run(cfg, [signals(t, units, rt=8) for t in range(40, 100, 2)], state)
    first = next(d for d in decisions if d.remove)
    assert first.reason == Reason.BATCH_SCALE_DOWN
    assert set(first.remove) <= {"u10", "u11", "u12"} and first.at < 120


def test_decide_is_pure() -> None:
    s = signals(5, fleet(3), rt=40, ttft_p99_s=0.1)
    state = PolicyState(samples=((1.0, 3.0, 0.0),))
    a = decide(s, state, CFG)
    b = decide(s, state, CFG)
    assert a == b and state.samples == ((1.0, 3.0, 0.0),)


def test_decision_record_serialises() -> None:
    d, _ = decide(signals(0, fleet(2), rt=30, ttft_p99_s=0.2), PolicyState(), CFG)
    out = d.to_dict()
    assert out["reason"] == "panic" and out["mode"] == "panic" and out["ttft_p99_s"] == 0.2
    assert out["add_interactive"] == 4 and not out["remove"]
    json.dumps(out)  # a log line or a /status field as it is


def test_unit_curve_maps_running_to_target_load() -> None:
    # A unit that makes 80% of its throughput at 25% of its slots: 10 units each
    # running 1 of 10 slots (10%, so 32% of full throughput) need about 10 x 0.32 /
    # y(0.5) units at target, not 10 x 0.1 / 0.5 = 2.
    curve = ((0.25, 0.8), (1.0, 1.0))
    cfg = PolicyConfig(max_units=20, max_num_seqs=SLOTS, unit_curve=curve)
    d = run(cfg, steady(cfg, fleet(10), 10, 70))[0][-1]
    y_target = 0.8 + 0.2 * (0.5 - 0.25) / 0.75
    assert d.stable_desired == pytest.approx(10 * 0.32 / y_target, abs=1)
    plain = run(CFG, steady(CFG, fleet(10), 10, 70))[0][-1]
    assert plain.stable_desired == 2


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ({"max_units": 0}, "max_units"),
        ({"target_utilization": 1.5}, "target_utilization"),
        ({"panic_window_s": 90}, "panic_window_s"),
        ({"batch_max_units": 50}, "batch_max_units"),
        ({"dead_band": 1}, "dead_band"),
        ({"unit_curve": [[0.5, 0.9], [0.4, 1.0]]}, "unit_curve"),
        ({"scale_down_coldown_s": 1}, "unknown keys"),
    ],
)
def test_config_is_checked(raw: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        policy_config_from_dict(raw)


def test_config_defaults_are_valid() -> None:
    cfg = policy_config_from_dict({})
    assert cfg.stable_window_s == 60 and cfg.panic_window_s == 6
    assert cfg.target_per_unit(16) == 8


def test_ups_unit_curve_keeps_the_unit_a_linear_policy_would_take_away() -> None:
    """What `bench capacity --trace diurnal` measured before up had a curve: two units of
    16 slots, 8 requests running between them (100 req/s of 24-token streams, each unit
    at about 4 of its 16). Linear, that is one unit's work at target (0.5 x 16), so one
    goes after the cool-down, and the survivor gets more than its saturated
    throughput. Through up's curve it is still two units' work."""
    import msgspec

    from neuron_serving.capacity.calibration import UP_UNIT_CURVE

    units = tuple(msgspec.structs.replace(u, max_num_seqs=16) for u in fleet(2))
    for curve, removes in (((), True), (UP_UNIT_CURVE, False)):
        cfg = PolicyConfig(max_units=3, max_num_seqs=16, unit_curve=curve)
        decisions, _ = run(cfg, steady(cfg, units, 8, 300))
        assert any(d.remove for d in decisions) is removes, curve
        assert decisions[-1].stable_desired == (1 if removes else 2), curve
