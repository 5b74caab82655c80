"""Adding and removing units of a running `up` (ClusterSupervisor.add_unit/remove_unit),
the supervisor API's POST /units and DELETE /units/{id}, and the capacity controller's
LocalActuator over it.

The unit groups are stubs whose phase the test sets, and each proxy replica is a stub
admin API (units, drain, /status with the in-flight counts the test sets) that logs
every call into one list with the groups' starts and stops, so the order of a removal
(drain on every replica -> in-flight 0 -> stop -> unregister -> forget) is asserted
from what happened, not from timing. tests/e2e/test_local_scale.py does the same on a
real cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from neuron_serving.capacity.actuator import ActuatorError
from neuron_serving.capacity.local_actuator import LocalActuator, unit_signals
from neuron_serving.capacity.signals import Phase, Purpose
from neuron_serving.local.cluster import ClusterSupervisor, read_state
from neuron_serving.local.group_supervisor import GroupPhase
from neuron_serving.local.process import ProcessSpec
from neuron_serving.local.proxy_config import unit_entry, write_proxy_config
from neuron_serving.local.replicas import ProxyReplicas
from neuron_serving.local.spec import ClusterSpec
from neuron_serving.local.supervisor_api import (
    SupervisorApiClient,
    SupervisorApiError,
    SupervisorApiServer,
)
from neuron_serving.ports import free_port_block
from neuron_serving.proxy_admin import AdminFanOut, Replica
from tests.procs import wait_for
from tests.proxy_thread import ADMIN_TOKEN, two_replicas

TOKEN = "scale-test-token"


class Log:
    """One ordered record of what the stub proxies and groups saw."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def add(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)

    def of(self, unit_id: str) -> list[str]:
        with self._lock:
            return [x for x in self.lines if unit_id in x]


@dataclass
class FakeGroup:
    """What the cluster reads and calls of a unit's GroupSupervisor."""

    group_id: str
    log: Log
    phase: GroupPhase = GroupPhase.READY
    generation: int = 1
    restarts: int = 0
    failures: list[Any] = field(default_factory=list)
    processes: list[ProcessSpec] = field(default_factory=list)
    started: bool = False

    def start(self) -> None:
        self.started, self.phase = True, GroupPhase.STARTING
        self.log.add(f"start {self.group_id}")

    def stop(self, join_timeout_s: float | None = None) -> None:
        self.log.add(f"stop {self.group_id}")
        self.phase = GroupPhase.STOPPED

    def recreate(self, processes: list[ProcessSpec] | None = None) -> int:
        self.phase = GroupPhase.STARTING
        return self.generation + 1

    def pids(self) -> list[int]:
        return []

    def snapshot(self) -> dict[str, Any]:
        return {"unit_id": self.group_id, "phase": str(self.phase), "generation": self.generation,
                "restarts": self.restarts, "launched_at": 1.0, "ready_at": 2.0,
                "first_ready_s": 1.0, "last_failure": None, "processes": []}  # fmt: skip


class StubProxy:
    """A replica's admin API: units with their spec and drain state, /status with the
    health and in-flight counts the test sets. Every change is logged."""

    def __init__(self, name: str, log: Log, units: dict[str, dict[str, Any]]) -> None:
        self.name, self.log = name, log
        self.units = {k: {"spec": v, "draining": False} for k, v in units.items()}
        self.healthy: set[str] = set(units)
        self.in_flight: dict[str, int] = {}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: Any) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/status":
                    self._send(200, {"units": [stub.status_of(u) for u in list(stub.units)]})
                elif self.path == "/admin/units":
                    units = [{"unit_id": k, **v} for k, v in list(stub.units.items())]
                    self._send(200, {"units": units})
                else:
                    self._send(404, {})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/admin/units":
                    draining = body.pop("draining", False)
                    if body["unit_id"] in stub.units:
                        return self._send(409, {"error": "exists"})
                    stub.units[body["unit_id"]] = {"spec": body, "draining": draining}
                    stub.log.add(f"{stub.name} add {body['unit_id']}")
                    return self._send(201, {})
                m = re.fullmatch(r"/admin/units/([^/]+)/(drain|undrain)", self.path)
                if m and m.group(1) in stub.units:
                    stub.units[m.group(1)]["draining"] = m.group(2) == "drain"
                    stub.log.add(f"{stub.name} {m.group(2)} {m.group(1)}")
                    return self._send(200, {})
                self._send(404, {})

            def do_DELETE(self) -> None:  # noqa: N802
                unit_id = self.path.rsplit("/", 1)[1]
                if stub.units.pop(unit_id, None) is None:
                    return self._send(404, {})
                stub.log.add(f"{stub.name} delete {unit_id}")
                self._send(200, {})

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def status_of(self, unit_id: str) -> dict[str, Any]:
        entry = self.units[unit_id]
        state = "draining" if entry["draining"] else "routable"
        if unit_id not in self.healthy:
            state = "unhealthy"
        return {"unit_id": unit_id, "state": state, "in_flight": self.in_flight.get(unit_id, 0)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Rig:
    cluster: ClusterSupervisor
    proxies: list[StubProxy]
    log: Log
    groups: dict[str, FakeGroup]

    def make_ready(self, unit_id: str, proxies: list[StubProxy] | None = None) -> None:
        """The group is ready and the given replicas' probes see it healthy."""
        for p in self.proxies if proxies is None else proxies:
            p.healthy.add(unit_id)
        self.groups[unit_id].phase = GroupPhase.READY

    def view(self, unit_id: str) -> dict[str, Any] | None:
        units = self.cluster.units_view()["units"]
        return next((u for u in units if u["unit_id"] == unit_id), None)


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return model


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    base = free_port_block(60)
    spec = ClusterSpec(_model(tmp_path), tmp_path / "run", units=2, tp=1, proxies=2,
                       port=base, base_port=base + 10, drain_timeout_s=10.0)  # fmt: skip
    spec.run_dir.mkdir()
    log = Log()
    entries = {spec.unit_id(i): unit_entry(spec, i) for i in range(2)}
    proxies = [StubProxy(f"proxy-{j}", log, entries) for j in range(2)]
    cluster = ClusterSupervisor(spec, on_event=log.add)
    replicas = ProxyReplicas(spec, [Path("p0"), Path("p1")], TOKEN, log.add,
                             units=cluster.registered_units)  # fmt: skip
    replicas.admin = AdminFanOut([Replica(p.name, p.url) for p in proxies], TOKEN)
    for g in replicas.groups:
        g.phase = GroupPhase.READY
    cluster.replicas = replicas
    groups = {u: FakeGroup(u, log) for u in entries}

    def new_group(index: int, processes: list[ProcessSpec]) -> FakeGroup:
        g = FakeGroup(spec.unit_id(index), log, GroupPhase.STOPPED, processes=processes)
        groups[g.group_id] = g
        return g

    cluster._new_group = new_group  # type: ignore[method-assign]
    cluster.units = list(groups.values())  # type: ignore[assignment]
    cluster._registered = dict(entries)
    cluster._token_file = spec.run_dir / "unit-token"
    cluster.unit_models = {u: spec.model_dir for u in entries}
    cluster.started_at = time.time()
    cluster.serving.set()
    try:
        yield Rig(cluster, proxies, log, groups)
    finally:
        cluster.stopping.set()
        for p in proxies:
            p.close()


def test_an_added_unit_gets_its_block_and_is_routable_once_every_replica_routes_to_it(rig):
    c, spec = rig.cluster, rig.cluster.spec
    unit_id = c.add_unit("batch")
    assert unit_id == "unit-2"
    group = rig.groups[unit_id]
    assert group.started
    # Its own port block and the next CPUs of the round robin, as if `up` had started it.
    leader = group.processes[0]
    ports = spec.unit_ports(2)
    assert ports.base == spec.base_port + 2 * 10
    assert f"{ports.grpc}" in leader.argv and f"{ports.http}" in leader.argv
    assert leader.env["VLLM_CPU_OMP_THREADS_BIND"] == spec.unit_cpu_bind(2)
    assert leader.env["NEURON_SERVING_UNIT_ID"] == "unit-2"
    view = rig.view(unit_id)
    assert view["purpose"] == "batch" and view["added"] is True
    assert view["registered"] is False and view["routable"] is False
    assert view["leader_http"] == f"http://127.0.0.1:{ports.http}"

    # Not registered anywhere while starting.
    time.sleep(0.6)
    assert all(unit_id not in p.units for p in rig.proxies)
    # Ready: registered on both replicas with the spec the config would have given it.
    rig.make_ready(unit_id, proxies=[rig.proxies[0]])
    wait_for(lambda: all(unit_id in p.units for p in rig.proxies), 10, what="registered")
    for p in rig.proxies:
        assert p.units[unit_id] == {"spec": unit_entry(spec, 2), "draining": False}
    # Routable on one replica only: not counted routable.
    time.sleep(0.8)
    assert rig.view(unit_id)["routable"] is False
    rig.proxies[1].healthy.add(unit_id)
    wait_for(lambda: rig.view(unit_id)["routable"], 10, what="routable")
    # In supervisor.json (what `neuron-serving status` reads) with its purpose.
    state = read_state(spec.state_file)
    assert state is not None
    listed = {u["unit_id"]: u for u in state["units"]}
    assert listed[unit_id]["purpose"] == "batch" and listed[unit_id]["routable"] is True
    assert listed["unit-0"]["purpose"] == "interactive" and listed["unit-0"]["added"] is False


def test_removal_drains_waits_for_in_flight_stops_then_unregisters(rig):
    c = rig.cluster
    for p in rig.proxies:
        p.in_flight["unit-1"] = 2
    c.remove_unit("unit-1")
    assert rig.view("unit-1")["removing"] is True and rig.view("unit-1")["phase"] == "draining"
    wait_for(lambda: all(p.units["unit-1"]["draining"] for p in rig.proxies), 10, what="drained")
    time.sleep(0.5)
    assert "stop unit-1" not in rig.log.lines, "stopped with requests in flight"
    rig.proxies[0].in_flight["unit-1"] = 0
    time.sleep(0.5)
    assert "stop unit-1" not in rig.log.lines, "stopped with a request in flight on proxy-1"
    rig.proxies[1].in_flight["unit-1"] = 0
    wait_for(lambda: rig.view("unit-1") is None, 10, what="forgotten")
    steps = [x for x in rig.log.of("unit-1") if x.split()[0] in ("proxy-0", "proxy-1", "stop")]
    assert sorted(steps[:2]) == ["proxy-0 drain unit-1", "proxy-1 drain unit-1"]
    assert steps[2] == "stop unit-1"
    assert sorted(steps[3:]) == ["proxy-0 delete unit-1", "proxy-1 delete unit-1"]
    assert all("unit-1" not in p.units for p in rig.proxies)
    assert "unit-1" not in c.registered_units()

    def listed() -> list[str] | None:
        state = read_state(c.spec.state_file)
        return None if state is None else [u["unit_id"] for u in state["units"]]

    # The state file is rewritten every second: on a loaded host (the full suite) the
    # write after the removal can come a moment after the unit is forgotten.
    wait_for(lambda: listed() == ["unit-0"], 10, what=f"unit-1 off the state file: {listed()}")
    # The freed index is the next one added (its port block is reused).
    assert c.add_unit() == "unit-1"


def test_a_removal_that_times_out_still_stops_the_unit(rig, monkeypatch):
    c = rig.cluster
    monkeypatch.setattr(c, "spec", dataclasses.replace(c.spec, drain_timeout_s=0.5))
    rig.proxies[0].in_flight["unit-0"] = 1
    c.remove_unit("unit-0")
    wait_for(lambda: rig.view("unit-0") is None, 10, what="removed")
    assert any("1 request(s) in flight after 0 s" in x for x in rig.log.lines), rig.log.lines


def test_refusals(rig):
    c = rig.cluster
    with pytest.raises(KeyError):
        c.remove_unit("unit-9")
    with pytest.raises(ValueError, match="purpose"):
        c.add_unit("bulk")
    # A deploy's recreation in progress: refused until it is ready and admitted again.
    generation = c.recreate_unit("unit-0", c.spec.model_dir)
    for p in rig.proxies:
        p.units["unit-0"]["draining"] = True  # the deploy drained it first
    with pytest.raises(RuntimeError, match="mid-deploy"):
        c.remove_unit("unit-0")
    assert rig.view("unit-0")["mid_deploy"] is True
    rig.groups["unit-0"].generation, rig.groups["unit-0"].phase = generation, GroupPhase.READY
    with pytest.raises(RuntimeError, match="mid-deploy"):
        c.remove_unit("unit-0")  # ready, not admitted again yet
    for p in rig.proxies:
        p.units["unit-0"]["draining"] = False  # the deploy's undrain
    c._refresh_deploys()
    assert rig.view("unit-0")["mid_deploy"] is False
    # Drained by someone else on one replica (a deploy before its recreate call).
    rig.proxies[1].units["unit-1"]["draining"] = True
    with pytest.raises(RuntimeError, match="drained on proxy-1 by someone else"):
        c.remove_unit("unit-1")
    rig.proxies[1].units["unit-1"]["draining"] = False
    # The last ready unit: unit-1 is not ready, so unit-0 may not go.
    rig.groups["unit-1"].phase = GroupPhase.BACKOFF
    with pytest.raises(RuntimeError, match="last ready unit"):
        c.remove_unit("unit-0")
    assert not any(x.startswith(("stop", "proxy")) for x in rig.log.lines), rig.log.lines
    # unit-1 (not ready) may go; then unit-0 is the last unit.
    c.remove_unit("unit-1")
    c.remove_unit("unit-1")  # again: accepted, nothing more done
    with pytest.raises(RuntimeError, match="last unit"):
        c.remove_unit("unit-0")
    wait_for(lambda: rig.view("unit-1") is None, 10, what="unit-1 removed")
    assert rig.log.lines.count("stop unit-1") == 1
    # Shutting down: no change accepted.
    c.stopping.set()
    with pytest.raises(RuntimeError, match="shutting down"):
        c.add_unit()


def test_nothing_changes_before_the_cluster_is_ready(rig):
    rig.cluster.serving.clear()
    with pytest.raises(RuntimeError, match="still starting"):
        rig.cluster.add_unit()
    with pytest.raises(RuntimeError, match="still starting"):
        rig.cluster.remove_unit("unit-0")


def test_removing_a_starting_unit_never_registers_it(rig):
    c = rig.cluster
    unit_id = c.add_unit()
    c.remove_unit(unit_id)
    wait_for(lambda: rig.view(unit_id) is None, 10, what="removed")
    rig.make_ready(unit_id)  # too late: its admission ended with the removal
    time.sleep(0.6)
    assert all(unit_id not in p.units for p in rig.proxies)
    assert [x.split()[0] for x in rig.log.of(unit_id) if x.startswith(("proxy", "stop"))] == [
        "stop"
    ]


def test_concurrent_adds_get_distinct_units(rig):
    ids: list[str] = []
    threads = [threading.Thread(target=lambda: ids.append(rig.cluster.add_unit()))
               for _ in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(ids) == ["unit-2", "unit-3", "unit-4", "unit-5"]
    binds = {rig.cluster.spec.unit_cpu_bind(int(u[-1])) for u in ids}
    assert binds <= {str(c) for c in os.sched_getaffinity(0)}


def test_an_added_unit_survives_a_lone_replica_restart(rig):
    """A replica with no ready sibling is made alike the supervisor's registry: the
    added unit is given back, a removed one taken away, a removing one drained."""
    c = rig.cluster
    unit_id = c.add_unit()
    rig.make_ready(unit_id)
    wait_for(lambda: rig.view(unit_id)["routable"], 10, what="routable")
    with c._lock:
        c._registered.pop("unit-1")  # as if removed; unit-0 being removed
        c._info_of("unit-0").removing = True
    restarted = rig.proxies[0]
    spec = c.spec
    restarted.units = {u: {"spec": unit_entry(spec, i), "draining": False}
                       for i, u in enumerate(("unit-0", "unit-1"))}  # its config again  # fmt: skip
    replicas = c.replicas
    assert replicas is not None
    for g in replicas.groups:
        g.phase = GroupPhase.STARTING  # no ready sibling
    assert replicas._ready(0) is False
    assert replicas._ready(0) is True
    assert restarted.units == {
        "unit-0": {"spec": unit_entry(spec, 0), "draining": True},
        unit_id: {"spec": unit_entry(spec, 2), "draining": False},
    }
    assert any("given the supervisor's units" in x for x in rig.log.lines)


def test_a_restarted_replica_gets_an_added_unit_from_its_sibling(tmp_path):
    """Sibling sync (replicas.py) covers units added after the replicas started."""
    with two_replicas(tmp_path) as (live, restarted):
        spec = ClusterSpec(_model(tmp_path), tmp_path / "run", units=2, tp=1, proxies=2,
                           base_port=20000)  # fmt: skip
        replicas = ProxyReplicas(spec, [Path("p0"), Path("p1")], ADMIN_TOKEN, lambda _m: None)
        replicas.admin = AdminFanOut(
            [Replica("proxy-0", live.admin_url), Replica("proxy-1", restarted.admin_url)],
            ADMIN_TOKEN,
        )
        entry = {**unit_entry(spec, 2), "model": "llm"}
        AdminFanOut([Replica("proxy-0", live.admin_url)], ADMIN_TOKEN).add(entry).check((201,))
        replicas.groups[0].phase = GroupPhase.READY
        assert replicas._ready(1) is False
        assert replicas._ready(1) is True
        assert set(restarted.units()) == {"unit-0", "unit-1", "unit-2"}


def test_a_real_lone_replica_sigkilled_comes_back_with_the_added_unit(tmp_path):
    """One `neuron-serving proxy` process as `up` runs it: a unit added through the admin
    API (not in its config) and a configured unit removed; SIGKILLed, it restarts from
    its config and is made alike the supervisor's registry before it is ready."""
    base = free_port_block(30)
    spec = ClusterSpec(_model(tmp_path), tmp_path / "run", units=2, tp=1, port=base,
                       proxies=1, base_port=base + 2)  # fmt: skip
    spec.run_dir.mkdir()
    configs, token, _key = write_proxy_config(spec)
    registry = {"unit-0": unit_entry(spec, 0), "unit-1": unit_entry(spec, 1)}
    replicas = ProxyReplicas(spec, configs, token, lambda _m: None,
                             units=lambda: {u: {"spec": s, "draining": False}
                                            for u, s in registry.items()})  # fmt: skip
    replicas.start()
    try:
        group = replicas.groups[0]
        wait_for(lambda: group.phase == GroupPhase.READY, 60, what="replica ready")
        registry["unit-2"] = unit_entry(spec, 2)  # as add_unit and remove_unit do
        replicas.admin.add(unit_entry(spec, 2)).check((201,))
        del registry["unit-1"]
        replicas.admin.remove("unit-1").check()
        pid = group.procs[0].pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: group.phase == GroupPhase.READY and group.procs[0].pid != pid, 60,
                 what="restarted")  # fmt: skip
        units = replicas.admin.units()["proxy-0"]
        assert units is not None and set(units) == {"unit-0", "unit-2"}
    finally:
        replicas.stop()
    assert replicas.pids() == []


# ---- the supervisor API -------------------------------------------------------------


# ---- the warm pool -------------------------------------------------------------------


def test_a_warm_spare_is_registered_drained_and_promoted_by_an_undrain(rig):
    c = rig.cluster
    unit_id = c.add_unit(standby=True)
    view = rig.view(unit_id)
    assert view["standby"] is True and view["warm"] is False and view["routable"] is False
    rig.make_ready(unit_id)
    wait_for(lambda: rig.view(unit_id)["warm"], 10, what="warm")
    # Drained on every replica from its first registration: never routed to.
    for p in rig.proxies:
        assert p.units[unit_id] == {"spec": unit_entry(c.spec, 2), "draining": True}
    assert not any(f"undrain {unit_id}" in x for x in rig.log.lines)
    assert c.registered_units()[unit_id]["draining"] is True  # a lone restart keeps it so
    time.sleep(0.6)
    assert rig.view(unit_id)["routable"] is False
    # A spare is not "the last ready unit"'s rival, nor a deploy's target.
    with pytest.raises(RuntimeError, match="warm spare"):
        c.recreate_unit(unit_id, c.spec.model_dir)
    with pytest.raises(RuntimeError, match="not a warm spare"):
        c.promote_unit("unit-0")
    c.promote_unit(unit_id, "batch")
    assert sorted(x for x in rig.log.of(unit_id) if "undrain" in x) == [
        f"proxy-0 undrain {unit_id}", f"proxy-1 undrain {unit_id}"]  # fmt: skip
    wait_for(lambda: rig.view(unit_id)["routable"], 10, what="routable after promotion")
    view = rig.view(unit_id)
    assert view["standby"] is False and view["purpose"] == "batch"
    assert c.registered_units()[unit_id]["draining"] is False
    assert any("promoted" in x and unit_id in x for x in rig.log.lines)


def test_a_spare_promoted_while_starting_is_registered_undrained(rig):
    c = rig.cluster
    unit_id = c.add_unit(standby=True)
    c.promote_unit(unit_id)
    rig.make_ready(unit_id)
    wait_for(lambda: rig.view(unit_id)["routable"], 10, what="routable")
    for p in rig.proxies:
        assert p.units[unit_id]["draining"] is False


def test_hold_drains_waits_and_keeps_the_unit_running_as_a_spare(rig):
    c = rig.cluster
    for p in rig.proxies:
        p.in_flight["unit-1"] = 1
    c.hold_unit("unit-1")
    assert rig.view("unit-1")["phase"] == "draining" and rig.view("unit-1")["standby"]
    wait_for(lambda: all(p.units["unit-1"]["draining"] for p in rig.proxies), 10, what="drained")
    time.sleep(0.4)
    assert rig.view("unit-1")["warm"] is False  # a request still in flight
    with pytest.raises(RuntimeError, match="being drained into a spare"):
        c.remove_unit("unit-1")
    for p in rig.proxies:
        p.in_flight["unit-1"] = 0
    wait_for(lambda: rig.view("unit-1")["warm"], 10, what="warm")
    assert "stop unit-1" not in rig.log.lines and rig.view("unit-1")["phase"] == "ready"
    assert rig.view("unit-1")["routable"] is False
    # The last serving unit is never held; a spare can be removed (drained by us).
    with pytest.raises(RuntimeError, match="last ready unit"):
        c.hold_unit("unit-0")
    c.remove_unit("unit-1")
    wait_for(lambda: rig.view("unit-1") is None, 10, what="removed")
    assert "stop unit-1" in rig.log.lines


class FakeCluster:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.removed: list[str] = []
        self.refuse = ""

    def units_view(self) -> dict[str, Any]:
        return {"tp": 1, "served_model_name": "m", "units": [
            {"unit_id": "unit-0", "phase": "ready", "routable": True, "ready_at": 100.0},
            {"unit_id": "unit-1", "phase": "starting", "purpose": "batch", "added": True,
             "routable": False, "restarts": 0, "first_ready_s": None, "launched_at": 150.0},
        ]}  # fmt: skip

    def recreate_unit(self, unit_id: str, model_dir: Path, manifest_sha256: str | None = None):
        raise AssertionError("not called here")

    def add_unit(self, purpose: str = "interactive", standby: bool = False) -> str:
        if purpose not in ("interactive", "batch"):
            raise ValueError("purpose must be one of interactive, batch")
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.added.append("standby" if standby else purpose)
        return f"unit-{len(self.added) + 1}"

    def promote_unit(self, unit_id: str, purpose: str = "interactive") -> None:
        if unit_id not in ("unit-0", "unit-1"):
            raise KeyError(unit_id)
        if purpose not in ("interactive", "batch"):
            raise ValueError("purpose must be one of interactive, batch")
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.removed.append(f"promote {unit_id} {purpose}")

    def hold_unit(self, unit_id: str) -> None:
        if unit_id not in ("unit-0", "unit-1"):
            raise KeyError(unit_id)
        self.removed.append(f"hold {unit_id}")

    def remove_unit(self, unit_id: str) -> None:
        if unit_id not in ("unit-0", "unit-1"):
            raise KeyError(unit_id)
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.removed.append(unit_id)


@pytest.fixture
def api() -> Iterator[tuple[SupervisorApiServer, FakeCluster]]:
    cluster = FakeCluster()
    sock = Path(f"/tmp/ns-scale-{os.getpid()}.sock")
    srv = SupervisorApiServer(cluster, sock, TOKEN)
    srv.start()
    yield srv, cluster
    srv.stop()


def _raw(sock: Path, method: str, path: str, body: bytes | None, token: str = TOKEN):
    import http.client

    from neuron_serving.local.supervisor_api import _UnixConnection

    conn = _UnixConnection(sock, 5.0)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert isinstance(resp, http.client.HTTPResponse)
    return resp.status, data


def test_api_adds_and_removes(api):
    srv, cluster = api
    client = SupervisorApiClient(srv.socket_path, TOKEN, timeout_s=5)
    assert client.add_unit("batch") == "unit-2"
    assert client.add_unit() == "unit-3"
    client.remove_unit("unit-1")
    assert cluster.added == ["batch", "interactive"] and cluster.removed == ["unit-1"]
    status, body = _raw(srv.socket_path, "POST", "/units", None)  # no body: interactive
    assert status == 202 and json.loads(body)["unit_id"] == "unit-4"
    status, _ = _raw(srv.socket_path, "DELETE", "/units/unit-0", None)
    assert status == 202
    assert client.add_unit(standby=True) == "unit-5"
    client.promote_unit("unit-1", "batch")
    client.hold_unit("unit-0")
    assert cluster.added[-1] == "standby"
    assert cluster.removed[-2:] == ["promote unit-1 batch", "hold unit-0"]


def test_api_refuses_hostile_input_and_changes_nothing(api):
    srv, cluster = api
    sock = srv.socket_path
    cases = [
        (b"not json", 400),
        (b"[1, 2]", 400),
        (b'"batch"', 400),
        (b'{"purpose": "batch", "units": 5}', 400),  # unknown field
        (b'{"purpose": 7}', 400),
        (b'{"purpose": "bulk"}', 400),
        (b'{"purpose": "batch", "' + b"x" * 70000 + b'": 1}', 413),  # over 64 KiB
        (b'{"standby": "yes"}', 400),
        (b'{"standby": 1}', 400),
    ]
    for body, want in cases:
        status, _ = _raw(sock, "POST", "/units", body)
        assert status == want, body[:40]
    for body, want in [(b'{"purpose": "bulk"}', 400), (b'{"standby": true}', 400),
                       (b"[]", 400), (b"nope", 400)]:  # fmt: skip
        assert _raw(sock, "POST", "/units/unit-1/promote", body)[0] == want, body
    assert _raw(sock, "POST", "/units/unit-1/hold", b'{"purpose": "batch"}')[0] == 400
    assert _raw(sock, "POST", "/units/unit-9/promote", None)[0] == 404
    assert _raw(sock, "POST", "/units/unit-9/hold", None)[0] == 404
    assert _raw(sock, "POST", "/units/unit-1/promote", None, token="wrong")[0] == 401
    assert _raw(sock, "POST", "/units/unit-1/hold", None, token="wrong")[0] == 401
    assert _raw(sock, "POST", "/units", b"{}", token="wrong")[0] == 401
    assert _raw(sock, "DELETE", "/units/unit-0", None, token="wrong")[0] == 401
    assert _raw(sock, "DELETE", "/units/unit-9", None)[0] == 404
    assert _raw(sock, "DELETE", "/units/" + "u" * 3000, None)[0] == 404
    assert cluster.added == [] and cluster.removed == []
    cluster.refuse = "unit-0 is the last ready unit"
    client = SupervisorApiClient(sock, TOKEN, timeout_s=5)
    with pytest.raises(SupervisorApiError, match="409 unit-0 is the last ready unit"):
        client.remove_unit("unit-0")
    with pytest.raises(SupervisorApiError, match="409"):
        client.add_unit()


# ---- the LocalActuator --------------------------------------------------------------


def test_local_actuator_over_the_api(api):
    srv, cluster = api
    act = LocalActuator(SupervisorApiClient(srv.socket_path, TOKEN, timeout_s=5),
                        clock=lambda: 1000.0, wall_clock=lambda: 200.0)  # fmt: skip
    units = {u.unit_id: u for u in act.units()}
    assert units["unit-0"].phase == Phase.READY and units["unit-0"].since == 900.0
    assert units["unit-0"].purpose == Purpose.INTERACTIVE and units["unit-0"].model == "m"
    assert units["unit-1"].phase == Phase.STARTING and units["unit-1"].since == 950.0
    assert units["unit-1"].purpose == Purpose.BATCH
    assert act.add(Purpose.BATCH) == "unit-2"
    act.remove("unit-1")
    assert cluster.added == ["batch"] and cluster.removed == ["unit-1"]
    with pytest.raises(ActuatorError, match="remove unit-7: .*404"):
        act.remove("unit-7")
    cluster.refuse = "unit-0 is mid-deploy"
    with pytest.raises(ActuatorError, match="mid-deploy"):
        act.remove("unit-0")


def test_local_actuator_unreachable_is_an_actuator_error(tmp_path):
    (tmp_path / "admin-token").write_text("t\n")
    with pytest.raises(ActuatorError, match="unreachable"):
        LocalActuator.for_run_dir(tmp_path, timeout_s=1).units()
    with pytest.raises(ActuatorError, match="no admin token"):
        LocalActuator.for_run_dir(tmp_path / "none")


@pytest.mark.parametrize(
    ("view", "phase", "since"),
    [
        ({"phase": "ready", "routable": True, "ready_at": 90, "routable_at": 95}, Phase.READY, 95),
        ({"phase": "ready", "routable": False, "launched_at": 50}, Phase.STARTING, 50),
        ({"phase": "starting", "restarts": 0, "first_ready_s": None, "launched_at": 60},
         Phase.STARTING, 60),
        ({"phase": "starting", "restarts": 1, "launched_at": 60, "last_failure": {"at": 58}},
         Phase.UNHEALTHY, 58),
        ({"phase": "starting", "restarts": 0, "first_ready_s": 30.0, "launched_at": 70},
         Phase.UNHEALTHY, 70),  # failed after its first ready
        ({"phase": "backoff", "restarts": 2, "last_failure": {"at": 80}}, Phase.UNHEALTHY, 80),
        ({"phase": "starting", "mid_deploy": True, "first_ready_s": 30.0, "launched_at": 75},
         Phase.STARTING, 75),  # a deploy's recreation
        ({"phase": "draining", "removing": True, "removing_since": 97}, Phase.DRAINING, 97),
        ({"phase": "stopping", "removing": True, "removing_since": 97}, Phase.DRAINING, 97),
        # warm spares: promotable once warm; being drained into the pool
        ({"phase": "ready", "standby": True, "warm": True, "routable": False,
          "standby_since": 93, "launched_at": 40}, Phase.READY, 93),
        ({"phase": "ready", "standby": True, "warm": False, "routable": False,
          "launched_at": 40}, Phase.STARTING, 40),
        ({"phase": "starting", "standby": True, "restarts": 0, "launched_at": 41},
         Phase.STARTING, 41),
        ({"phase": "draining", "standby": True, "removing_since": 96}, Phase.DRAINING, 96),
    ],
)  # fmt: skip
def test_unit_signals_phases(view, phase, since):
    u = unit_signals({"unit_id": "unit-3", **view}, "m", now=1000.0, wall_now=100.0)
    assert (u.phase, u.since) == (phase, 900.0 + since)
    assert u.standby is bool(view.get("standby"))
    assert u.mid_deploy is bool(view.get("mid_deploy"))
