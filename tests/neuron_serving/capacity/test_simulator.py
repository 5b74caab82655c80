"""The fleet simulator: the shipped spike trace, determinism, start-up and draining."""

from __future__ import annotations

import pytest

from neuron_serving.capacity import trace
from neuron_serving.capacity.calibration import MEASURED
from neuron_serving.capacity.compare import compare, format_table
from neuron_serving.capacity.config import PolicyConfig
from neuron_serving.capacity.simulator import SimConfig, simulate

POLICY = PolicyConfig(max_units=200, batch_max_units=50, max_num_seqs=MEASURED.max_num_seqs,
                      unit_curve=MEASURED.curve())  # fmt: skip


def step_trace(low: float, high: float, at: float, end: float) -> trace.Trace:
    return trace.Trace(
        name="step",
        description="a step",
        times=(0.0, at, at + 1, end),
        rates={"real-time": (low, low, high, high)},
    )


@pytest.fixture(scope="module")
def spike() -> list:
    return compare(trace.load("spike"), POLICY).fleets


def test_autoscaled_beats_both_fixed_fleets_on_the_spike(spike) -> None:
    auto, average, peak = spike
    assert auto.unit_seconds < 0.5 * peak.unit_seconds
    assert auto.slo_attainment > average.slo_attainment + 0.1
    assert auto.slo_attainment >= peak.slo_attainment - 0.01  # within a point of the peak
    assert auto.units_max > average.units_max  # it followed the spike
    assert 0 < auto.scale_actions < 100
    assert peak.fixed_units == auto.units_min or peak.fixed_units > auto.units_min


def test_the_table_names_every_fleet(spike) -> None:
    from neuron_serving.capacity.compare import Comparison

    c = Comparison(trace.load("spike"), POLICY, MEASURED, SimConfig(), spike)
    text = format_table(c)
    for label in ("autoscaled", "fixed: average", "fixed: peak", "fewer unit-hours"):
        assert label in text


def test_deterministic_for_a_seed() -> None:
    t = trace.load("diurnal").scaled(rate=0.05)
    t = trace.Trace(t.name, t.description, t.times[:13], {c: r[:13] for c, r in t.rates.items()})
    a = simulate(t, POLICY, sim=SimConfig(seed=7)).summary()
    b = simulate(t, POLICY, sim=SimConfig(seed=7)).summary()
    c = simulate(t, POLICY, sim=SimConfig(seed=8)).summary()
    assert a == b
    assert a["interactive_requests"] != c["interactive_requests"]


def test_start_up_delay_and_draining_are_modelled() -> None:
    # 40% of a unit's target rate, then 4 units' worth from t=600 to t=1800: units come
    # 28.2 s after the decision; back down, they drain and go.
    low, high = MEASURED.requests_per_s(4, 32), 4 * MEASURED.requests_per_s(32, 32)
    t = trace.Trace("step", "up and down", (0.0, 600.0, 601.0, 1800.0, 1801.0, 3600.0),
                    {"real-time": (low, low, high, high, low, low)})  # fmt: skip
    r = simulate(t, POLICY)
    up = r.actions[0]
    assert up.add and 600 <= up.at <= 610
    ready = {t_: ready for t_, _, _, ready in r.timeline}
    paid = {t_: paid for t_, _, paid, _ in r.timeline}
    # The first unit added is paid for at once but ready only after its start-up.
    started = [d.at for d in r.actions if d.add]
    assert all(paid[600.0 + 60 * i] >= 1 for i in range(3))
    assert ready[600.0] == 1 and ready[660.0] > 1
    assert min(started) + MEASURED.startup_s <= 660
    # (The panic overshoot, queued requests counted as concurrency, is given back
    # while the load is high; what the step needs stays until it ends.)
    assert min(ready[t_] for t_ in ready if 720 <= t_ < 1800) >= 4
    down = [d for d in r.actions if d.remove]
    assert max(d.at for d in down) > 1800 and paid[3540.0] == ready[3540.0] == 1
    assert r.units_removed == r.units_added and r.failed == 0
    # Paid unit-seconds exceed ready unit-seconds by the start-ups (28.2 s each).
    ready_s = sum(ready.values()) * 60
    assert r.unit_seconds >= ready_s + r.units_added * (MEASURED.startup_s - 1) - 600


def test_a_fixed_fleet_too_small_fails_requests() -> None:
    per_unit = MEASURED.requests_per_s(64, 32)
    t = trace.Trace("over", "2x one unit's most", (0.0, 300.0),
                    {"real-time": (2 * per_unit, 2 * per_unit)})  # fmt: skip
    r = simulate(t, POLICY, fixed_units=1)
    assert r.failed > 0 and r.slo_attainment < 0.6 and r.unit_seconds == 300


def test_a_warm_spare_is_promoted_at_once_paid_for_and_refilled() -> None:
    # A small fleet (max 4) stepping from under one unit's target to about two: with one
    # spare the first added unit is ready promote_s after the decision, not a start-up
    # later; the spare is paid for the whole run; after the step a unit is drained into
    # the pool only while it is short.
    low, high = MEASURED.requests_per_s(8, 32), 2 * MEASURED.requests_per_s(28, 32)
    t = trace.Trace("step", "up and down", (0.0, 600.0, 601.0, 1800.0, 1801.0, 3600.0),
                    {"real-time": (low, low, high, high, low, low)})  # fmt: skip
    policy = PolicyConfig(max_units=4, max_num_seqs=MEASURED.max_num_seqs,
                          unit_curve=MEASURED.curve())  # fmt: skip
    sim = SimConfig(timeline_every_s=1.0)
    cold = simulate(t, policy, sim=sim)
    warm = simulate(t, policy, sim=SimConfig(timeline_every_s=1.0, warm_units=1, promote_s=1.0))
    ready_c = {t_: r for t_, _, _, r in cold.timeline}
    ready_w = {t_: r for t_, _, _, r in warm.timeline}
    up = next(d.at for d in warm.actions if d.add)
    assert 600 <= up <= 610 and warm.promotions >= 1
    assert ready_w[up + 2] == 2 and ready_c[up + 2] == 1  # promoted vs still starting
    # Paid: the spare from the first tick on (started cold, then kept).
    paid_w = {t_: p for t_, _, p, _ in warm.timeline}
    assert all(paid_w[t_] >= ready_w[t_] + 1 for t_ in (100.0, 300.0, 3500.0))
    assert warm.unit_seconds > cold.unit_seconds
    assert warm.slo_attainment >= cold.slo_attainment
    # compare() runs the warm fleet beside the cold one and says what it cost.
    c = compare(t, policy, sim=SimConfig(warm_units=1))
    assert [f.label for f in c.fleets][-1] == "autoscaled + 1 warm"
    assert "autoscaled + 1 warm vs autoscaled" in format_table(c)


def test_an_in_flight_cap_fails_arrivals_at_once_and_bounds_the_wait() -> None:
    per_unit = MEASURED.requests_per_s(64, 32)
    t = trace.Trace("over", "2x one unit's most", (0.0, 300.0),
                    {"real-time": (2 * per_unit, 2 * per_unit)})  # fmt: skip
    free = simulate(t, POLICY, fixed_units=1)
    capped = simulate(t, POLICY, fixed_units=1, sim=SimConfig(max_in_flight=256))
    # Beyond 256 queued or running an arrival fails unsent: more failures, sooner, and
    # the requests served waited behind at most 256.
    assert capped.failed > free.failed
    assert capped.ttft_p99_s is not None and free.ttft_p99_s is not None
    assert capped.ttft_p99_s < free.ttft_p99_s
    assert capped.requests == free.requests  # every arrival counted, failed or not


def test_units_sharing_too_few_cpus_run_slower() -> None:
    rate = 3 * MEASURED.requests_per_s(40, 32)  # 3 units at 40 of 64 slots each
    t = trace.Trace("flat", "3 units' worth", (0.0, 300.0), {"real-time": (rate, rate)})
    alone = simulate(t, POLICY, fixed_units=3)
    enough = simulate(t, POLICY, fixed_units=3, sim=SimConfig(host_cpus=3.0))
    shared = simulate(t, POLICY, fixed_units=3, sim=SimConfig(host_cpus=2.0))
    assert enough.summary() == alone.summary()  # a CPU each: as calibrated
    assert shared.ttft_p99_s is not None and alone.ttft_p99_s is not None
    assert shared.ttft_p99_s > alone.ttft_p99_s and shared.slo_attainment <= alone.slo_attainment
