"""`SupervisorRecreator` over the supervisor's real control socket, with a fake cluster
behind it: the `UnitRecreator` view of a local `up`, and its ready/failed rules."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from neuron_serving.deploy.recreator import RecreateError, StartupFailed
from neuron_serving.deploy.source import Release
from neuron_serving.deploy.supervisor import SupervisorRecreator
from neuron_serving.local.supervisor_api import SupervisorApiClient, SupervisorApiServer

TOKEN = "supervisor-recreator-token"
PIN = "ab" * 32


class FakeCluster:
    def __init__(self, model_dir: Path) -> None:
        self.unit = {
            "unit_id": "unit-0",
            "phase": "ready",
            "generation": 1,
            "restarts": 0,
            "model_dir": str(model_dir),
            "leader_http": "http://127.0.0.1:9",
            "last_failure": None,
        }
        self.recreated: list[Path] = []
        self.pins: list[str | None] = []

    def units_view(self) -> dict[str, Any]:
        return {"tp": 2, "device": "cpu", "units": [dict(self.unit)]}

    def recreate_unit(
        self, unit_id: str, model_dir: Path, manifest_sha256: str | None = None
    ) -> int:
        if unit_id != "unit-0":
            raise KeyError(unit_id)
        self.recreated.append(model_dir)
        self.pins.append(manifest_sha256)
        self.unit.update(phase="starting", generation=self.unit["generation"] + 1)
        return self.unit["generation"]


@pytest.fixture
def cluster(tmp_path: Path):
    cluster = FakeCluster(tmp_path)
    sock = Path(f"/tmp/ns-rec-{os.getpid()}.sock")  # Unix socket paths are short
    srv = SupervisorApiServer(cluster, sock, TOKEN)
    srv.start()
    yield cluster, SupervisorRecreator(SupervisorApiClient(sock, TOKEN, timeout_s=5), poll_s=0.01)
    srv.stop()


def test_fleet_recreate_and_ready(cluster, tmp_path: Path):
    fake, units = cluster
    state = units.fleet()
    assert (state.shape.tp, state.shape.device) == (2, "cpu")
    (unit,) = state.units.values()
    assert unit.ready and unit.location == str(tmp_path) and unit.generation == 1
    new = tmp_path / "v2"
    new.mkdir()
    generation = units.recreate("unit-0", Release("v2", str(new), None, PIN))
    assert generation == 2 and fake.recreated == [new.resolve()] and fake.pins == [PIN]
    with pytest.raises(StartupFailed, match="not ready within 0 s"):
        units.wait_ready("unit-0", generation, timeout_s=0.05)
    fake.unit["phase"] = "ready"
    units.wait_ready("unit-0", generation, timeout_s=5)
    with pytest.raises(RecreateError, match="no longer knows unit unit-9"):
        units.recreate("unit-9", Release("v2", str(new), None))


def test_a_restart_at_the_new_generation_is_a_startup_failure(cluster, tmp_path: Path):
    fake, units = cluster
    generation = units.recreate("unit-0", Release("v2", str(tmp_path), None))
    fake.unit.update(
        phase="backoff",
        restarts=1,
        last_failure={"reason": "leader exited with code 1", "log_tail": "a\nCheckpointMismatch"},
    )
    with pytest.raises(StartupFailed, match="leader exited with code 1\na\nCheckpointMismatch"):
        units.wait_ready("unit-0", generation, timeout_s=5)


def test_the_pin_reaches_every_unit_process(cluster, tmp_path: Path, monkeypatch):
    """The supervisor gives the deploy's pin to the leader and every follower (and keeps
    it for its own restarts of that unit); "" clears one inherited from `up`'s shell."""
    from neuron_serving.local import plan
    from neuron_serving.local.spec import ClusterSpec

    fake, units = cluster
    client = units.control
    with pytest.raises(Exception, match="64 lowercase hex"):
        client.recreate("unit-0", tmp_path, "not-a-digest")
    assert fake.pins == []
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.setenv("NEURON_SERVING_MODEL_MANIFEST_SHA256", "cd" * 32)
    spec = ClusterSpec(model_dir=tmp_path / "m", tp=3, run_dir=tmp_path / "run")
    token = tmp_path / "token"
    for pin, want in ((PIN, PIN), ("", None), (None, "cd" * 32)):
        procs = plan.unit_processes(spec, 0, token, tmp_path / "m", pin)
        assert len(procs) == 3
        assert [p.env.get("NEURON_SERVING_MODEL_MANIFEST_SHA256") for p in procs] == [want] * 3
