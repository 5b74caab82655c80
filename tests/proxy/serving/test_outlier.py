from proxy.config import OutlierConfig, UnitSpec
from proxy.registry import make_unit_state
from proxy.serving.outlier import OutlierDetector, unroutable_reason


def unit(uid: str, healthy: bool = True, draining: bool = False, started: bool = True):
    u = make_unit_state(UnitSpec(unit_id=uid, leader_grpc="127.0.0.1:1"))
    for n in u.nodes:
        n.healthy = healthy
        n.initial = not started  # started: every node has passed a probe once
    u.draining = draining
    return u


def test_ejection_time_grows_and_is_capped():
    det = OutlierDetector(
        OutlierConfig(consecutive_errors=2, base_ejection_s=10, max_ejection_s=25)
    )
    u = unit("a")
    now = 1000.0
    durations = []
    for _ in range(4):
        assert not det.record_error(u, now)
        assert det.record_error(u, now)  # the second consecutive error ejects
        assert u.is_ejected(now)
        durations.append(u.ejected_until - now)
        now = u.ejected_until  # back in, and fails again right away
        assert not u.is_ejected(now)
    assert durations == [10, 20, 25, 25]
    assert u.ejections_total == 4


def test_success_resets_consecutive_errors_and_errors_while_ejected_do_not_count():
    det = OutlierDetector(
        OutlierConfig(consecutive_errors=3, base_ejection_s=10, max_ejection_s=100)
    )
    u = unit("a")
    det.record_error(u, 0)
    det.record_error(u, 0)
    det.record_success(u, 0)
    assert not det.record_error(u, 0) and not u.is_ejected(0)
    det.record_error(u, 0)
    assert det.record_error(u, 0)
    assert not det.record_error(u, 5) and u.consecutive_errors == 0  # in-flight stragglers


def test_times_ejected_decays_after_a_quiet_period():
    det = OutlierDetector(
        OutlierConfig(consecutive_errors=1, base_ejection_s=10, max_ejection_s=30)
    )
    u = unit("a")
    det.record_error(u, 0)  # ejected until 10
    det.record_error(u, 10)  # x2: until 30
    assert u.times_ejected == 2
    det.record_success(u, 30 + 30 * 2)  # two quiet max-ejection periods
    assert u.times_ejected == 0
    det.record_error(u, 100)
    assert u.ejected_until - 100 == 10  # starts from the base again


def test_panic_threshold_routes_to_all_non_draining_units():
    det = OutlierDetector(OutlierConfig(panic_threshold_pct=50))
    a, b, c, d = (
        unit("a"),
        unit("b", healthy=False),
        unit("c", healthy=False),
        unit("d", draining=True),
    )
    e = det.eligible([a, b, c, d], now=0)
    assert e.panic and {u.unit_id for u in e.units} == {"a", "b", "c"}  # 1/3 < 50%: panic
    e = det.eligible([a, b, d], now=0)
    assert not e.panic and [u.unit_id for u in e.units] == ["a"]  # 1/2 is not below 50%
    a.ejected_until = 10
    e = det.eligible([a, b], now=0)
    assert e.panic and len(e.units) == 2  # ejection counts as unroutable too
    assert det.eligible([d], now=0).units == []  # draining is never overridden


def test_panic_disabled_means_no_units():
    det = OutlierDetector(OutlierConfig(panic_threshold_pct=0))
    e = det.eligible([unit("a", healthy=False)], now=0)
    assert e.units == [] and not e.panic


def test_panic_never_routes_to_units_that_have_not_started():
    det = OutlierDetector(OutlierConfig(panic_threshold_pct=50))
    starting = unit("s", healthy=False, started=False)
    assert det.eligible([starting], now=0).units == []  # 503 + Retry-After, not a refused connect
    was_up = unit("b", healthy=False)
    e = det.eligible([starting, was_up], now=0)
    assert e.panic and [u.unit_id for u in e.units] == ["b"]


def test_unroutable_reason_names_each_units_state_and_never_guesses():
    now = 0.0
    ejected = unit("e", healthy=True)
    ejected.ejected_until = 10
    # A model with no unit at all is not "starting" (a configured model whose units
    # were removed, or a unit being re-registered).
    assert unroutable_reason([], now) == "no unit is registered for it"
    # Only units that never passed a probe: a cold model, the one case for that wording.
    assert unroutable_reason([unit("s", started=False)] * 2, now) == "none has become ready yet"
    # A unit that served and is out now is counted by its state, never as not ready;
    # draining wins over the rest, as in /status.
    drained_starting = [unit("d", draining=True, started=False), unit("s", started=False)]
    assert unroutable_reason(drained_starting, now) == "units: 1 draining, 1 not ready yet"
    out = [unit("d", draining=True), unit("b", healthy=False), ejected]
    assert unroutable_reason(out, now) == "units: 1 draining, 1 ejected, 1 unhealthy"
