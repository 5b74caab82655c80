"""bench capacity's pure pieces: the trace window and its scaling, seeded arrivals,
attainment per minute, unit-seconds from a timeline, scale-in windows and the
requests failed in them, scale-up decision to routable, the simulator comparison."""

from __future__ import annotations

import json

import pytest

from neuron_serving.bench import capacity as cap
from neuron_serving.capacity import trace as traces
from neuron_serving.capacity.simulator import units_for_rate

PROBE = {"levels": [
    {"concurrency": 1, "output_tok_s": 300.0, "ttft_p50_s": 0.02, "ttft_p99_s": 0.04,
     "itl_p99_s": 0.01},
    {"concurrency": 4, "output_tok_s": 800.0, "ttft_p50_s": 0.03, "ttft_p99_s": 0.06,
     "itl_p99_s": 0.015},
    {"concurrency": 16, "output_tok_s": 790.0, "ttft_p50_s": 0.08, "ttft_p99_s": 0.05,
     "itl_p99_s": 0.03},
    {"concurrency": 32, "output_tok_s": 1600.0, "ttft_p50_s": 0.3, "ttft_p99_s": 0.5,
     "itl_p99_s": 0.03},
]}  # fmt: skip


def test_window_cuts_and_sums_interactive_classes():
    spike = traces.load("spike")
    w = cap.window(spike, *cap.WINDOW)
    assert w.times[0] == 0 and w.duration_s == cap.WINDOW[1] - cap.WINDOW[0]
    assert set(w.rates) == {"real-time"}
    # 12:40: 1329 + 332 req/s at 45600 in the file; the event's plateau ~5x that.
    assert w.rates["real-time"][0] == pytest.approx(1329 + 332)
    assert 4.5 < w.peak_rate() / w.rates["real-time"][0] < 5.5
    with pytest.raises(ValueError):
        cap.window(spike, 80000, 90000)


def test_diurnal_trace_is_replayed_whole_and_named_apart():
    day = traces.load("diurnal")
    lo, hi = cap.WINDOWS["diurnal"]
    w = cap.window(day, lo, hi)
    assert w.duration_s == day.duration_s == 86400
    assert set(w.rates) == {"real-time"}  # the nightly batch class is not sent
    assert 0.4 < w.mean_rate() / w.peak_rate() < 0.6  # room for the saving target
    assert cap.result_name("spike", False) == "capacity"
    assert cap.result_name("diurnal", True) == "capacity-diurnal-quick"
    assert cap.main(True, None, False, None, trace="nope") == 2


def test_unit_model_from_probe_is_monotonic_and_sized_to_max_num_seqs():
    m = cap.unit_model(PROBE, 30.0)
    assert m.concurrency == (1.0, 4.0, 16.0) and m.max_num_seqs == cap.MAX_NUM_SEQS
    assert m.output_tok_s[2] > m.output_tok_s[1]  # a flat level is nudged up
    assert m.ttft_p99_s[2] >= m.ttft_p50_s[2] and m.startup_s == 30.0


def test_scaled_trace_peak_needs_three_units_and_base_one():
    m = cap.unit_model(PROBE, 30.0)
    policy, _ = cap.policy_for({"min_units": 1, "max_units": 3, "tick_s": 2.0})
    per_unit = m.requests_per_s(cap.TARGET_UTILIZATION * cap.MAX_NUM_SEQS, cap.RT_MAX_TOKENS)
    tr = cap.scaled_trace(per_unit, 240.0)
    assert tr.duration_s == pytest.approx(240.0)
    assert tr.peak_rate() == pytest.approx(cap.PEAK_UNITS * per_unit)
    assert units_for_rate(tr.peak_rate(), m, policy, cap.RT_MAX_TOKENS) == 3
    assert units_for_rate(tr.rates["real-time"][0], m, policy, cap.RT_MAX_TOKENS) == 1


def test_poisson_arrivals_seeded_sorted_and_on_rate():
    tr = traces.Trace("t", "", (0.0, 100.0), {"real-time": (10.0, 30.0)})
    a = cap.poisson_arrivals(tr, seed=3)
    assert a == cap.poisson_arrivals(tr, seed=3) != cap.poisson_arrivals(tr, seed=4)
    assert a == sorted(a) and 0 <= a[0] and a[-1] < 100
    assert 1800 < len(a) < 2200  # mean rate 20/s over 100 s
    assert sum(1 for t in a if t < 50) < sum(1 for t in a if t >= 50)


def _req(at, ttft, error=None, start=0.0, end=1.0):
    return cap.Req(at=at, start=start, end=end, ttft=ttft, error=error)


def test_attainment_counts_failures_as_missed_and_per_minute():
    reqs = [_req(1, 0.2), _req(2, 1.5), _req(3, None, "timeout"), _req(61, 0.3), _req(62, 0.9)]
    assert cap.attainment(reqs, 1.0) == pytest.approx(3 / 5)
    assert cap.attainment([], 1.0) is None
    mins = cap.per_minute(reqs, 120.0, 1.0)
    assert [m["requests"] for m in mins] == [3, 2]
    assert [m["slo_attainment"] for m in mins] == [pytest.approx(1 / 3, abs=1e-4), 1.0]
    assert mins[0]["failed"] == 1 and mins[1]["ttft_p99_s"] == 0.9


def test_unit_seconds_integrates_the_step_timeline():
    tl = [(10.0, 1), (20.0, 3), (50.0, 2)]
    assert cap.unit_seconds(tl, 0.0, 60.0) == 20 * 1 + 30 * 3 + 10 * 2
    assert cap.unit_seconds(tl, 25.0, 55.0) == 25 * 3 + 5 * 2
    assert cap.unit_seconds([], 0.0, 10.0) == 0.0


def _unit(uid, running=True, **kw):
    return {"unit_id": uid, "running": running, "phase": kw.pop("phase", "ready"),
            "routable": True, "removing": False, "added": False, **kw}  # fmt: skip


def test_scale_in_windows_and_failures_inside_them():
    polls = [
        (100.0, 1000.0, [_unit("unit-0"), _unit("unit-1", added=True)]),
        (101.0, 1001.0, [_unit("unit-0"), _unit("unit-1", added=True, removing=True,
                                                 removing_since=1000.5, phase="draining")]),
        (102.0, 1002.0, [_unit("unit-0"), _unit("unit-1", running=False, removing=True)]),
        (103.0, 1003.0, [_unit("unit-0")]),
    ]  # fmt: skip
    (w,) = cap.scale_in_windows(polls, grace_s=1.0)
    assert w == (pytest.approx(100.5), 103.0)
    assert cap.overlaps(_req(0, None, "x", start=95.0, end=101.0), [w])
    assert not cap.overlaps(_req(0, None, "x", start=90.0, end=100.0), [w])
    tl = cap.unit_timeline(polls)
    assert [n for _, n, _ in tl] == [2, 2, 1, 1] and [r for _, _, r in tl] == [2, 1, 1, 1]
    # Drained into the warm pool: the window ends when it shows as a spare, running.
    held = [
        (100.0, 1000.0, [_unit("unit-0"), _unit("unit-1", added=True)]),
        (101.0, 1001.0, [_unit("unit-0"), _unit("unit-1", added=True, phase="draining",
                                                 standby=True, removing_since=1000.5)]),
        (102.0, 1002.0, [_unit("unit-0"), _unit("unit-1", added=True, standby=True,
                                                 warm=True, routable=False)]),
        (110.0, 1010.0, [_unit("unit-0"), _unit("unit-1", added=True, standby=True,
                                                 warm=True, routable=False)]),
    ]  # fmt: skip
    assert cap.scale_in_windows(held, grace_s=1.0) == [(pytest.approx(100.5), 103.0)]
    assert [n for _, n, _ in cap.unit_timeline(held)] == [2, 2, 2, 2]  # a spare is paid for
    # Promoted, then held again: a second drain, a second window.
    again = held + [
        (120.0, 1020.0, [_unit("unit-0"), _unit("unit-1", added=True)]),
        (130.0, 1030.0, [_unit("unit-0"), _unit("unit-1", added=True, phase="draining")]),
        (131.0, 1031.0, [_unit("unit-0"), _unit("unit-1", added=True, standby=True,
                                                 warm=True, routable=False)]),
    ]  # fmt: skip
    assert cap.scale_in_windows(again, grace_s=1.0) == [(pytest.approx(100.5), 103.0),
                                                        (130.0, 132.0)]  # fmt: skip


def test_scale_ups_from_the_decision_that_named_the_unit():
    polls = [
        (100.0, 1000.0, [_unit("unit-0")]),
        (105.0, 1005.0, [_unit("unit-0"), _unit("unit-1", added=True, phase="starting"),
                         _unit("unit-2", added=True, standby=True, warm=True)]),
        (140.0, 1040.0, [_unit("unit-0"), _unit("unit-1", added=True, routable_at=1033.0),
                         _unit("unit-2", added=True, routable_at=1039.0)]),
    ]  # fmt: skip
    decisions = [{"wall_time": 1003.0, "added": ["unit-1"], "removed": []},
                 {"wall_time": 1010.0, "added": [], "removed": []},
                 {"wall_time": 1038.5, "added": ["unit-2"], "removed": [],
                  "pool": {"promoted": ["unit-2"], "held": [], "filled": []}}]  # fmt: skip
    ups = cap.scale_ups(polls, decisions)
    assert ups == [
        {"unit_id": "unit-1", "decision": "capacity decision", "promoted": False,
         "was_warm": False, "decision_to_routable_s": 30.0},
        # A warm spare (first seen long before) promoted: timed from its promotion.
        {"unit_id": "unit-2", "decision": "capacity decision", "promoted": True,
         "was_warm": True, "decision_to_routable_s": 0.5},
    ]  # fmt: skip
    # Without the decision that named it: from its first appearance.
    assert cap.scale_ups(polls, decisions[:2])[1] == {
        "unit_id": "unit-2", "decision": "first seen", "promoted": False, "was_warm": False,
        "decision_to_routable_s": 34.0}  # fmt: skip
    assert cap.scale_actions(decisions) == {"decisions_acting": 2, "scale_ups": 2,
                                            "scale_downs": 0}  # fmt: skip

    # A unit started cold, held into the pool, promoted: one row per addition, each
    # timed to the routable_at that followed it (bench capacity --trace diurnal reported
    # -225 s when a second promotion was timed to the first's routable_at), each
    # promoted or not by its own decision. The polls go through the real Poller, from
    # supervisor.json-shaped units (it once dropped standby and warm).
    def sup(uid, **kw):
        return {"unit_id": uid, "phase": "ready", "routable": True, "added": True,
                "processes": [{"running": True}], **kw}  # fmt: skip

    states = [
        {"units": [sup("unit-0", added=False), sup("unit-1", phase="starting", routable=False)]},
        {"units": [sup("unit-0", added=False), sup("unit-1", routable_at=1030.0)]},
        {"units": [sup("unit-0", added=False), sup("unit-1", standby=True, warm=True,
                                                    routable=False)]},
        {"units": [sup("unit-0", added=False), sup("unit-1", routable_at=1200.03)]},
    ]  # fmt: skip

    class FakeRun:
        def state(self):
            return states.pop(0)

    poller = cap.Poller(FakeRun())
    for _ in range(4):
        poller.poll()
    cycle = [(float(i), 1000.0 + 100 * i, units) for i, (_, _, units) in enumerate(poller.polls)]
    twice = [{"wall_time": 1001.0, "added": ["unit-1"]},
             {"wall_time": 1200.0, "added": ["unit-1"], "pool": {"promoted": ["unit-1"]}}]  # fmt: skip
    rows = cap.scale_ups(cycle, twice)
    assert [(r["promoted"], r["was_warm"], r["decision_to_routable_s"]) for r in rows] == [
        (False, False, 29.0), (True, True, 0.03)]  # fmt: skip


def test_compare_sim_and_verdicts():
    measured = {"autoscaled": {"requests": 10, "ttft_p50_s": 0.1, "ttft_p99_s": 1.0,
                               "units_mean": 2.0, "units_max": 3, "slo_attainment": 0.95,
                               "unit_seconds": 400.0, "failed_during_scale_in": 0,
                               "scale_in_windows": [[1, 2]]},
                "fixed_peak": {"requests": 10, "ttft_p50_s": 0.1, "ttft_p99_s": 0.5,
                               "units_mean": 3.0, "units_max": 3, "slo_attainment": 0.99,
                               "unit_seconds": 720.0}}  # fmt: skip
    predicted = {"autoscaled": {"ttft_p50_s": 0.15, "ttft_p99_s": 3.0, "units_mean": 2.2,
                                "units_max": 3},
                 "fixed_peak": {"ttft_p50_s": 0.1, "ttft_p99_s": 0.6, "units_mean": 3.0,
                                "units_max": 3}}  # fmt: skip
    cmp = cap.compare_sim(measured, predicted)
    assert cmp["autoscaled"]["ttft_p99_s"]["ratio"] == 3.0
    assert not cmp["autoscaled"]["within_tolerance"] and cmp["fixed_peak"]["within_tolerance"]
    v = cap.verdicts(measured)
    assert v["slo_points_autoscaled_minus_peak"] == -4.0
    assert v["unit_seconds_saving_vs_peak"] == pytest.approx(1 - 400 / 720, abs=1e-4)
    assert v["met"] == {"slo_within_5_points": True, "unit_seconds_30pct_fewer": True,
                        "zero_failed_during_scale_in": True}  # fmt: skip


def test_resimulate_redoes_the_predictions_of_a_saved_result(tmp_path, capsys):
    levels = [(1, 17.9, 0.0062, 0.0085), (4, 53.4, 0.0113, 0.017), (16, 80.0, 0.1225, 0.1965),
              (32, 80.0, 0.3187, 0.4091)]  # fmt: skip
    probe = {"levels": [{"concurrency": c, "streams_per_s": s, "output_tok_s": s * 24,
                         "ttft_p50_s": p50, "ttft_p99_s": p99, "itl_p99_s": 0.005, "errors": 0}
                        for c, s, p50, p99 in levels],
             "saturated_streams_per_s": 80.0, "window_s": 8.0}  # fmt: skip
    arm = {"requests": 100, "ttft_p50_s": 0.05, "ttft_p99_s": 3.0, "units_mean": 2.4,
           "units_max": 3, "slo_attainment": 0.7, "decision_to_routable_s": [40.0]}  # fmt: skip
    saved = {"probe": probe, "trace": {"per_unit_rps_at_target": 59.8, "duration_s": 240.0},
             "arms": {"autoscaled": arm, "fixed_min": {**arm, "units_mean": 1.0, "units_max": 1}}}  # fmt: skip
    path = tmp_path / "capacity-quick.json"
    path.write_text(json.dumps(saved))
    assert cap.resimulate(str(path)) == 0
    sim = json.loads(path.read_text())["simulator"]
    assert sim["startup_s"] == 40.0 and sim["max_in_flight"] == cap.MAX_IN_FLIGHT
    assert set(sim["predicted"]) == {"autoscaled", "autoscaled_warm", "fixed_peak", "fixed_min"}
    assert set(sim["vs_measured"]) == {"autoscaled", "fixed_min"}  # the arms measured
    assert "autoscaled: within tolerance" in capsys.readouterr().out
    # The start-up sweep: one row per start-up time; a slower start never predicts a
    # better SLO, and the sweep's slowest start misses the SLO target on this spike.
    sweep = sim["startup_sweep"]
    assert [r["startup_s"] for r in sweep] == list(cap.STARTUP_SWEEP_S)
    pts = [r["slo_points_minus_peak"] for r in sweep]
    assert all(b <= a + 0.5 for a, b in zip(pts, pts[1:], strict=False)), pts
    assert sweep[-1]["targets_met"] is False and pts[-1] < -5
    path.write_text(json.dumps({"arms": {}}))
    assert cap.resimulate(str(path)) == 1
