"""The capacity controller's loop: scripted signals, a fake actuator."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from neuron_serving.capacity.actuator import ActuatorError
from neuron_serving.capacity.config import PolicyConfig
from neuron_serving.capacity.controller import CapacityController, ControllerConfig
from neuron_serving.capacity.reader import ReaderError
from neuron_serving.capacity.signals import Phase, Purpose, Signals, UnitSignals
from tests.neuron_serving.capacity.helpers import fleet, signals, unit

FAST = PolicyConfig(min_units=1, max_units=3, tick_s=1, stable_window_s=4, panic_window_s=2,
                    scale_up_cooldown_s=0, scale_down_cooldown_s=0)  # fmt: skip


class FakeActuator:
    def __init__(self, fail_add: int = 0, fail_remove: int = 0) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_add, self.fail_remove = fail_add, fail_remove
        self.n = 0

    def units(self):
        return []

    def add(self, purpose: Purpose = Purpose.INTERACTIVE, standby: bool = False) -> str:
        if self.fail_add:
            self.fail_add -= 1
            raise ActuatorError("add a unit: no room for another unit")
        self.n += 1
        self.calls.append(("add", "standby" if standby else str(purpose)))
        return f"new-{self.n}"

    def remove(self, unit_id: str) -> None:
        if self.fail_remove:
            self.fail_remove -= 1
            raise ActuatorError(f"remove {unit_id}: the last ready unit")
        self.calls.append(("remove", unit_id))

    def promote(self, unit_id: str, purpose: Purpose = Purpose.INTERACTIVE) -> None:
        self.calls.append(("promote", unit_id))

    def hold(self, unit_id: str) -> None:
        self.calls.append(("hold", unit_id))


class Script:
    """The reader: hands out the scripted signals in turn (an exception is raised)."""

    def __init__(self, items: list[Signals | Exception]) -> None:
        self.items = list(items)

    def read(self) -> Signals:
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


def controller(script, actuator, cfg=FAST, **kw):
    lines: list[str] = []
    c = CapacityController(Script(script), actuator, cfg, log_line=lines.append, **kw)
    return c, lines


def metric(c: CapacityController, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(c.render_metrics().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_acts_on_each_decision_and_logs_it_with_its_signals() -> None:
    one = fleet(1)
    busy = signals(0, one, rt=30)  # 30 concurrent on one unit of target 5: panic
    act = FakeActuator()
    c, lines = controller([busy], act, ControllerConfig(policy=FAST, max_adds_per_tick=2))
    record = c.tick()
    assert record is not None and record["action"] == "add"
    assert record["reason"] == "panic" and record["desired"] == 3
    assert act.calls == [("add", "interactive"), ("add", "interactive")]  # 3 - 1 units
    assert record["added"] == ["new-1", "new-2"] and record["errors"] == []
    logged = json.loads(lines[-1])
    assert logged["event"] == "capacity_decision" and logged["concurrency"] == 30
    assert logged["reason"] == "panic" and logged["added"] == ["new-1", "new-2"]
    assert metric(c, "capacity_desired_units") == 3
    assert metric(c, "capacity_decisions_total", action="add", reason="panic") == 1
    assert metric(c, "capacity_units", phase="ready") == 1


def test_adds_per_tick_are_bounded() -> None:
    act = FakeActuator()
    c, _ = controller([signals(0, fleet(1), rt=30)], act,
                      ControllerConfig(policy=FAST, max_adds_per_tick=1))  # fmt: skip
    record = c.tick()
    assert record["desired"] == 3 and record["added"] == ["new-1"] and len(act.calls) == 1


def test_drains_the_unit_the_decision_names() -> None:
    units = (unit(0, since=1.0), unit(1, since=5.0))
    script = [signals(t, units) for t in range(6)]  # idle: one unit is too many
    act = FakeActuator()
    c, _ = controller(script, act)
    records = [c.tick() for _ in range(6)]
    removes = [r for r in records if r["action"] == "remove"]
    assert removes and removes[0]["reason"] == "scale_down"
    assert act.calls[0] == ("remove", "u1")  # the newest of two idle units


def test_survives_actuator_and_reader_errors_and_counts_them() -> None:
    busy = signals(0, fleet(1), rt=30)
    idle = signals(10, (unit(0), unit(1)))  # past the windows: the spike is forgotten
    act = FakeActuator(fail_add=5, fail_remove=5)
    c, lines = controller(
        [busy, ReaderError("no proxy replica answered /status"), idle, RuntimeError("bug")], act
    )
    r1 = c.tick()
    assert r1["action"] == "add" and r1["added"] == [] and len(r1["errors"]) == 2
    assert "no room" in r1["errors"][0]
    assert c.tick() is None  # no signals: skipped
    r3 = c.tick()
    assert r3["action"] == "remove" and r3["removed"] == [] and "last ready" in r3["errors"][0]
    assert c.tick() is None
    st = c.status()
    assert (st["actuator_errors"], st["read_errors"], st["ticks"]) == (3, 2, 2)
    assert "bug" in st["last_error"]
    assert metric(c, "capacity_actuator_errors_total", op="add") == 2
    assert metric(c, "capacity_actuator_errors_total", op="remove") == 1
    assert metric(c, "capacity_read_errors_total") == 2
    assert [json.loads(x)["event"] for x in lines] == [
        "capacity_decision", "capacity_error", "capacity_decision", "capacity_error"
    ]  # fmt: skip


def test_keeps_the_last_n_decisions_and_reports_status() -> None:
    script = [signals(t, fleet(1), rt=3) for t in range(8)]
    policy = dataclasses.replace(FAST, unit_curve=((0.25, 0.6), (1.0, 1.0)))
    c, _ = controller(script, FakeActuator(), ControllerConfig(policy=policy, decisions_kept=5))
    assert c.status()["desired"] is None and c.status()["decisions"] == []
    for _ in range(8):
        c.tick()
    st = c.status(last=3)
    assert len(c.decisions) == 5 and [d["at"] for d in st["decisions"]] == [5, 6, 7]
    assert st["desired"] == 1 and st["current"] == 1 and st["reason"] == "hold"
    assert st["last_action"] is None and (st["min_units"], st["max_units"]) == (1, 3)
    # The policy's shape as bench capacity's simulator reads it back.
    assert st["unit_curve"] == [[0.25, 0.6], [1.0, 1.0]]
    assert st["target_utilization"] == FAST.target_utilization
    json.dumps(st)  # supervisor.json


def test_the_thread_ticks_on_its_period_and_outlives_a_failing_reader() -> None:
    class Flaky:
        def __init__(self) -> None:
            self.n = 0
            self.done = threading.Event()

        def read(self) -> Signals:
            self.n += 1
            if self.n >= 5:
                self.done.set()
            if self.n % 2:
                raise RuntimeError("flaky")
            return signals(time.monotonic(), (unit(0, phase=Phase.READY),))

    reader = Flaky()
    cfg = PolicyConfig(tick_s=0.05, stable_window_s=1, panic_window_s=0.1)
    c = CapacityController(reader, FakeActuator(), cfg, log_line=lambda _line: None)
    c.start()
    try:
        assert reader.done.wait(5)
    finally:
        c.stop(5)
    assert not c._thread.is_alive()
    assert c.read_errors >= 3 and c.ticks >= 2


def test_config_from_one_mapping_with_flag_overrides() -> None:
    cfg = ControllerConfig.from_dict(
        {"tick_s": 1, "stable_window_s": 10, "panic_window_s": 3, "latency_window_s": 10,
         "max_units": 5},
        min_units=1, max_units=2,
    )  # fmt: skip
    assert (cfg.policy.tick_s, cfg.policy.max_units, cfg.latency_window_s) == (1, 2, 10)
    with pytest.raises(ValueError, match="unknown keys"):
        ControllerConfig.from_dict({"stable_windw_s": 3})
    with pytest.raises(ValueError, match="decisions_kept"):
        ControllerConfig.from_dict({"decisions_kept": 0})


# ---- the warm pool ------------------------------------------------------------------


def spare(i: int, phase: Phase = Phase.READY) -> UnitSignals:
    return msgspec.structs.replace(unit(i, phase), standby=True)


POOL = ControllerConfig(policy=FAST, warm_units=1, max_adds_per_tick=2)


def test_a_scale_up_promotes_the_warm_spare_first_then_starts_cold_units() -> None:
    act = FakeActuator()
    c, _ = controller([signals(0, (*fleet(1), spare(5)), rt=30)], act, POOL)
    record = c.tick()
    assert record["desired"] == 3  # the spare is not capacity: 1 serving unit, panic
    assert act.calls[:2] == [("promote", "u5"), ("add", "interactive")]
    assert record["pool"]["promoted"] == ["u5"] and record["added"] == ["u5", "new-1"]
    # 3 serving units now = max_units: no room left for a new spare.
    assert record["pool"]["filled"] == [] and len(act.calls) == 2
    assert metric(c, "capacity_pool_actions_total", op="promote") == 1


def test_a_spare_still_starting_is_promoted_before_a_cold_start() -> None:
    act = FakeActuator()
    pool = ControllerConfig(policy=FAST, warm_units=1, max_adds_per_tick=1)
    c, _ = controller([signals(0, (*fleet(1), spare(5, Phase.STARTING)), rt=30)], act, pool)
    c.tick()
    assert act.calls[0] == ("promote", "u5")


def test_the_pool_is_filled_within_max_units_one_spare_a_tick() -> None:
    act = FakeActuator()
    cfg = ControllerConfig(policy=FAST, warm_units=2)
    c, _ = controller([signals(0, fleet(1), rt=5), signals(1, (*fleet(1), spare(7)), rt=5),
                       signals(2, (*fleet(1), spare(7), spare(8)), rt=5)], act, cfg)  # fmt: skip
    r = c.tick()
    assert act.calls == [("add", "standby")] and r["action"] == "hold"
    assert r["pool"]["filled"] == ["new-1"] and c.status()["spares"] == 1
    c.tick()
    assert act.calls[-1] == ("add", "standby")
    c.tick()  # 1 serving + 2 spares = 3 = max_units, and the pool is full
    assert len(act.calls) == 2
    assert metric(c, "capacity_units", phase="standby") == 2


def test_a_scale_down_keeps_the_drained_unit_as_the_spare_while_the_pool_is_short() -> None:
    units = (unit(0, since=1.0), unit(1, since=5.0))
    act = FakeActuator()
    c, _ = controller([signals(t, units) for t in range(6)], act, POOL)
    records = [c.tick() for _ in range(6)]
    held = [r for r in records if r["action"] == "remove"]
    assert held and held[0]["pool"]["held"] == ["u1"]
    assert ("hold", "u1") in act.calls and not any(op == "remove" for op, _ in act.calls)
    # With the spare held, nothing is filled on that tick.
    assert held[0]["pool"]["filled"] == []


def test_a_full_pool_lets_a_scale_down_remove_the_unit() -> None:
    units = (unit(0, since=1.0), unit(1, since=5.0), spare(2))
    act = FakeActuator()
    c, _ = controller([signals(t, units) for t in range(6)], act, POOL)
    for _ in range(6):
        c.tick()
    assert ("remove", "u1") in act.calls and not any(op == "hold" for op, _ in act.calls)
    assert not any(u == "u2" for _, u in act.calls)  # a spare is never a scale-in choice


def test_warm_units_must_leave_room_for_a_serving_unit() -> None:
    with pytest.raises(ValueError, match="warm_units"):
        ControllerConfig(policy=FAST, warm_units=3)
