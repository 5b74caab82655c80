"""`EcsActuator` against moto's ECS, EC2 and Cloud Map (the ECS tests' fixtures,
tests/neuron_serving/ecs/conftest.py, whose notes on what moto does not emulate apply),
with a fake registrar that records every proxy call in one log with ECS's StopTask
calls (the order of a scale-in), and once with two real proxy replicas on loopback."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from neuron_serving.capacity.actuator import ActuatorError
from neuron_serving.capacity.ecs_actuator import EcsActuator
from neuron_serving.capacity.signals import Phase, Purpose
from neuron_serving.deploy.ecs import EcsRecreator
from neuron_serving.deploy.source import Release
from neuron_serving.ecs import fleet
from neuron_serving.ecs.controller import CLAIM_DEPLOY, UnitController
from neuron_serving.ecs.discovery import LeaderDiscovery
from neuron_serving.ecs.launch import NodeLaunch, run_task_params
from neuron_serving.ecs.registrar import UnitEntry
from tests.neuron_serving.ecs import conftest as ecs_conftest
from tests.neuron_serving.ecs.conftest import ProxyThread
from tests.neuron_serving.ecs.test_controller import make_controller, running

aws = ecs_conftest.aws  # the ECS tests' fixtures: moto AWS, a real proxy on loopback
proxy = ecs_conftest.proxy

WAIT_S = 30.0


class FakeRegistrar:
    """Every proxy replica as one in-memory table; ``calls`` is shared with the ECS
    recorder. ``in_flight[unit]``: what the replicas report for it, one value per
    listing (the last one repeats)."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.calls = calls
        self.table: dict[str, dict[str, Any]] = {}
        self.in_flight: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.gate: threading.Event | None = None  # set: add() waits for it

    def units(self) -> set[str]:
        with self.lock:
            return set(self.table)

    def states(self) -> dict[str, UnitEntry]:
        with self.lock:
            out = {}
            for unit_id, entry in self.table.items():
                script = self.in_flight.get(unit_id) or [0]
                n = script.pop(0) if len(script) > 1 else script[0]
                out[unit_id] = UnitEntry(1, 1, entry["draining"], n)
            return out

    def add(self, unit: dict[str, Any], draining: bool = False) -> None:
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        with self.lock:
            self.calls.append(("add", unit["unit_id"]))
            self.table[unit["unit_id"]] = {"spec": unit, "draining": draining}

    def drain(self, unit_id: str) -> None:
        with self.lock:
            self.calls.append(("drain", unit_id))
            if unit_id in self.table:
                self.table[unit_id]["draining"] = True

    def undrain(self, unit_id: str) -> None:
        with self.lock:
            self.calls.append(("undrain", unit_id))
            if unit_id in self.table:
                self.table[unit_id]["draining"] = False

    def remove(self, unit_id: str) -> None:
        with self.lock:
            self.calls.append(("remove", unit_id))
            self.table.pop(unit_id, None)


class RecordingEcs:
    """The moto ECS client, StopTask calls logged as ("stop", task ARN)."""

    def __init__(self, ecs: Any, calls: list[tuple[str, str]]) -> None:
        self._ecs, self._calls = ecs, calls

    def stop_task(self, **kw: Any) -> Any:
        self._calls.append(("stop", kw["task"]))
        return self._ecs.stop_task(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ecs, name)


class Setup:
    def __init__(self, aws, units: int) -> None:
        self.aws = aws
        self.calls: list[tuple[str, str]] = []
        self.registrar = FakeRegistrar(self.calls)
        spec = aws.spec(units=units)
        self.ctl = UnitController(
            spec,
            RecordingEcs(aws.ecs, self.calls),
            discovery=LeaderDiscovery(aws.sd, spec),
            registrar=self.registrar,
            poll_s=0.01,
            sleep=lambda s: None,
        )
        assert self.ctl.reconcile().ok
        self.calls.clear()
        self.act = EcsActuator(self.ctl, drain_timeout_s=0.5, poll_s=0.01)

    def phases(self) -> dict[str, Phase]:
        return {u.unit_id: u.phase for u in self.act.units()}

    def tasks_of(self, unit_id: str) -> list[str]:
        view = fleet.units(self.aws.ecs, self.ctl.spec).get(unit_id)
        return [n.task_arn for n in view.tasks()] if view else []


def tags_of(aws, arns: list[str]) -> list[dict[str, str]]:
    tasks = aws.ecs.describe_tasks(cluster="trn", tasks=arns, include=["TAGS"])["tasks"]
    return [{t["key"]: t["value"] for t in task["tags"]} for task in tasks]


def test_units_are_the_controllers_view(aws):
    s = Setup(aws, units=2)
    units = s.act.units()
    assert [(u.unit_id, u.phase, u.purpose, u.mid_deploy, u.model) for u in units] == [
        ("llama-0", Phase.READY, Purpose.INTERACTIVE, False, "llm"),
        ("llama-1", Phase.READY, Purpose.INTERACTIVE, False, "llm"),
    ]
    assert s.ctl.wanted == {"llama-0", "llama-1"}  # taken over from what ECS runs
    s.registrar.drain("llama-0")  # drained by someone else (an operator)
    aws.ecs.stop_task(cluster="trn", task=s.tasks_of("llama-1")[1], reason="EFA error")
    assert s.phases() == {"llama-0": Phase.DRAINING, "llama-1": Phase.UNHEALTHY}


def test_scale_up_adds_a_unit_with_the_purpose_tag_and_registers_it_when_ready(aws):
    s = Setup(aws, units=1)
    s.registrar.gate = threading.Event()  # the proxies are slow to take it
    # It returns while the proxies hold the registration back: at once, not when ready.
    unit_id = s.act.add(Purpose.BATCH)
    assert unit_id == "llama-1"
    assert s.act.pending() == {"llama-1": "add"}
    new = next(u for u in s.act.units() if u.unit_id == "llama-1")
    assert (new.phase, new.purpose) == (Phase.STARTING, Purpose.BATCH)
    s.registrar.gate.set()
    s.act.wait(unit_id, WAIT_S)
    assert s.phases() == {"llama-0": Phase.READY, "llama-1": Phase.READY}
    assert ("add", "llama-1") in s.calls and s.act.pending() == {}
    arns = s.tasks_of("llama-1")
    assert len(arns) == 2  # the whole unit: every rank
    for tags in tags_of(aws, arns):
        assert tags["neuron-serving/purpose"] == "batch"
        assert tags["neuron-serving/unit"] == "llama-1"
    # The controller's own reconcile keeps the added unit (it is wanted) and adds nothing.
    report = s.ctl.reconcile()
    assert report.launched == [] and report.retired == [] and len(running(aws)) == 4
    assert {u.purpose for u in s.act.units() if u.unit_id == "llama-1"} == {Purpose.BATCH}


def test_reconcile_leaves_a_unit_being_added_alone(aws):
    s = Setup(aws, units=1)
    s.registrar.gate = threading.Event()
    unit_id = s.act.add()
    deadline = time.monotonic() + WAIT_S
    while len(s.tasks_of(unit_id)) < 2:  # launched, waiting to be registered
        assert time.monotonic() < deadline
        time.sleep(0.01)
    report = s.ctl.reconcile()
    assert report.launched == [] and report.replaced == [] and report.retired == []
    s.registrar.gate.set()
    s.act.wait(unit_id, WAIT_S)
    assert len(running(aws)) == 4  # no second launch of the same unit


def test_scale_down_drains_waits_then_stops_every_task(aws):
    s = Setup(aws, units=3)
    arns = s.tasks_of("llama-1")
    s.registrar.in_flight["llama-1"] = [2, 1, 0]
    s.act.remove("llama-1")
    assert ("drain", "llama-1") in s.calls  # drained before remove() returns
    s.act.wait("llama-1", WAIT_S)
    calls = [c for c in s.calls if c[1] in ("llama-1", *arns)]
    assert calls[:2] == [("drain", "llama-1"), ("remove", "llama-1")]
    assert sorted(calls[2:]) == sorted(("stop", a) for a in arns)  # every task of it
    assert s.registrar.in_flight["llama-1"] == [0]  # it waited for in-flight 0
    stopped = aws.ecs.describe_tasks(cluster="trn", tasks=arns)["tasks"]
    assert all(t["desiredStatus"] == "STOPPED" for t in stopped)
    assert s.phases() == {"llama-0": Phase.READY, "llama-2": Phase.READY}
    # Gone for good: the controller does not relaunch it, and its Cloud Map name went.
    assert s.ctl.reconcile().launched == [] and len(running(aws)) == 4
    assert "llama-1-leader" not in {x["Name"] for x in aws.sd.list_services()["Services"]}
    # The next unit added takes the free id again.
    assert s.act.add() == "llama-1"
    s.act.wait("llama-1", WAIT_S)


def test_refuses_the_last_ready_unit(aws):
    s = Setup(aws, units=2)
    s.act.remove("llama-1")
    s.act.wait("llama-1", WAIT_S)
    with pytest.raises(ActuatorError, match="last ready unit of llm"):
        s.act.remove("llama-0")
    with pytest.raises(ActuatorError, match="no such unit"):
        s.act.remove("llama-7")
    assert ("drain", "llama-0") not in s.calls and len(running(aws)) == 2


def test_refuses_a_unit_mid_deploy(aws):
    s = Setup(aws, units=3)
    # `deploy --unit-spec` recreating llama-1: its new tasks carry the mid-deploy tag.
    recreator = EcsRecreator(s.ctl)
    generation = recreator.recreate("llama-1", Release("v1", "/models/llm", None))
    arns = s.tasks_of("llama-1")
    assert all("neuron-serving/mid-deploy" in t for t in tags_of(aws, arns))
    assert {u.unit_id for u in s.act.units() if u.mid_deploy} == {"llama-1"}
    with pytest.raises(ActuatorError, match="mid-deploy"):
        s.act.remove("llama-1")
    recreator.wait_ready("llama-1", generation, 60)  # ready: the deploy lets go of it
    assert not any("neuron-serving/mid-deploy" in t for t in tags_of(aws, arns))
    assert not any(u.mid_deploy for u in s.act.units())
    # A tag left by a deploy that died long ago does not protect a unit.
    aws.ecs.tag_resource(
        resourceArn=arns[0],
        tags=[{"key": "neuron-serving/mid-deploy", "value": str(int(time.time()) - 86400)}],
    )
    assert not any(u.mid_deploy for u in s.act.units())
    # The controller's own roll (`ecs deploy` of another version) holds llama-2.
    s.ctl.claim(["llama-2"], CLAIM_DEPLOY)
    assert {u.unit_id for u in s.act.units() if u.mid_deploy} == {"llama-2"}
    with pytest.raises(ActuatorError, match="mid-deploy"):
        s.act.remove("llama-2")
    assert not any(c[0] == "drain" for c in s.calls)


def test_requests_that_never_finish_abandon_the_scale_in(aws):
    s = Setup(aws, units=2)
    arns = s.tasks_of("llama-1")
    s.registrar.in_flight["llama-1"] = [3]  # a stuck stream: never 0
    s.act.remove("llama-1")
    assert s.phases()["llama-1"] == Phase.DRAINING
    # Bounded by drain_timeout_s (0.5 s): the error comes, well before WAIT_S.
    with pytest.raises(ActuatorError, match="3 request.s. still in flight on llama-1 after"):
        s.act.wait("llama-1", WAIT_S)
    assert [c for c in s.calls if c[1] == "llama-1"] == [
        ("drain", "llama-1"),
        ("undrain", "llama-1"),
    ]
    assert not any(c[0] == "stop" for c in s.calls)  # nothing stopped
    assert s.tasks_of("llama-1") == arns and s.phases()["llama-1"] == Phase.READY
    assert "llama-1" in s.ctl.wanted and s.act.failures[-1][:2] == ("llama-1", "remove")


def test_removing_a_unit_still_being_added_stops_it_unregistered(aws):
    s = Setup(aws, units=1)
    s.registrar.gate = threading.Event()
    unit_id = s.act.add()
    deadline = time.monotonic() + WAIT_S
    while len(s.tasks_of(unit_id)) < 2 and not s.registrar.gate.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # The add's thread is blocked registering it; remove() waits for that step, so
    # either it stops before registering or it drains what was registered.
    threading.Timer(0.2, s.registrar.gate.set).start()
    s.act.remove(unit_id)
    s.act.wait(unit_id, WAIT_S)
    assert s.tasks_of(unit_id) == [] and unit_id not in s.registrar.table
    assert len(running(aws)) == 2 and s.ctl.wanted == {"llama-0"}


def test_every_proxy_replica_drains_and_forgets_the_unit(aws, proxy, tmp_path):
    (tmp_path / "second").mkdir()
    second = ProxyThread(tmp_path / "second")
    try:
        ctl = make_controller(aws, proxy, second, units=2)
        assert ctl.reconcile().ok
        act = EcsActuator(ctl, drain_timeout_s=5, poll_s=0.01)
        assert [u.phase for u in act.units()] == [Phase.READY, Phase.READY]
        drained = []
        real_remove = ctl.registrar.remove

        def remove(unit_id: str) -> None:  # what each replica saw when the unit left
            drained.append(
                (proxy.units()[unit_id]["draining"], second.units()[unit_id]["draining"])
            )
            real_remove(unit_id)

        ctl.registrar.remove = remove
        act.remove("llama-1")
        act.wait("llama-1", WAIT_S)
        assert drained == [(True, True)]
        assert sorted(proxy.units()) == sorted(second.units()) == ["llama-0"]
        unit_id = act.add(Purpose.INTERACTIVE)
        act.wait(unit_id, WAIT_S)
        assert sorted(proxy.units()) == sorted(second.units()) == ["llama-0", "llama-1"]
        assert [u.phase for u in act.units()] == [Phase.READY, Phase.READY]
    finally:
        second.stop()


def test_extra_tags_never_replace_the_ones_that_find_the_unit(aws):
    spec = aws.spec()
    node = NodeLaunch("llama-0", 0, None, "llama-leader:1")
    params = run_task_params(spec, node, extra_tags={"purpose": "batch"})
    assert {"key": "neuron-serving/purpose", "value": "batch"} in params["tags"]
    with pytest.raises(ValueError, match="unit"):
        run_task_params(spec, node, extra_tags={"unit": "llama-9"})


def test_an_add_that_cannot_be_placed_is_given_up(aws):
    s = Setup(aws, units=3)  # 6 nodes on the 6 instances: no room for another unit
    unit_id = s.act.add()
    with pytest.raises(ActuatorError, match="RunTask placed no task"):
        s.act.wait(unit_id, WAIT_S)
    assert s.ctl.wanted == {"llama-0", "llama-1", "llama-2"}  # not retried forever
    assert [u.unit_id for u in s.act.units()] == ["llama-0", "llama-1", "llama-2"]
    assert s.ctl.reconcile().launched == [] and len(running(aws)) == 6
    assert s.act.failures[-1][:2] == (unit_id, "add")
