"""`Rollout` against an in-process `UnitRecreator` and a small real HTTP server on
loopback that plays the proxy (/status, admin drain/undrain with its bearer token) and
each unit's leader (Triton generate, for the canaries)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from neuron_serving.checkpoint.compat import UnitShape
from neuron_serving.deploy.recreator import READY, FleetState, StartupFailed, UnitState
from neuron_serving.deploy.rollout import DeploySettings, ProxyAdmin, Rollout, merge_units
from neuron_serving.deploy.source import Release
from neuron_serving.proxy_admin import AdminFanOut, Replica
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint

TOKEN = "rollout-test-token"
SETTINGS = DeploySettings(drain_timeout_s=5, ready_timeout_s=5, canary_timeout_s=5)


class FakeUnits:
    """A `UnitRecreator` whose units start at once (or fail to, for chosen versions)."""

    def __init__(self, running: dict[str, Release], known: list[Release]) -> None:
        self.running = dict(running)
        self.generation = dict.fromkeys(running, 1)
        self.known = {r.location: r for r in known}
        self.fail_versions: set[str] = set()
        self.failed: set[str] = set()
        self.recreations: list[tuple[str, str]] = []
        self.not_ready: set[str] = set()
        self.base_url = ""  # the fake server's, for the leaders' URLs

    def fleet(self) -> FleetState:
        units = {
            u: UnitState(
                u,
                "starting" if u in self.not_ready else READY,
                self.generation[u],
                r.location,
                f"{self.base_url}/{u}",
            )
            for u, r in sorted(self.running.items())
        }
        return FleetState(UnitShape(2), units)

    def recreate(self, unit_id: str, release: Release) -> int:
        self.recreations.append((unit_id, release.version))
        self.running[unit_id] = release
        self.generation[unit_id] += 1
        self.failed.discard(unit_id)
        if release.version in self.fail_versions:
            self.failed.add(unit_id)
        return self.generation[unit_id]

    def wait_ready(self, unit_id: str, generation: int, timeout_s: float) -> None:
        assert self.generation[unit_id] == generation
        if unit_id in self.failed:
            raise StartupFailed("leader exited with code 1\nRuntimeError: no such shard")

    def release_at(self, location: str, label: str) -> Release:
        return self.known.get(location) or Release(label, location, None)


class FakeServer:
    """Proxy /status + admin API, and leaders at /<unit>/v2/models/llm/generate that
    answer the token ids ``served`` says the unit's version produces."""

    def __init__(self, units: FakeUnits, served: dict[str, list[int]]) -> None:
        self.units = units
        self.served = served
        self.drained: set[str] = set()
        self.admin_log: list[tuple[str, str]] = []
        self.max_drained = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        units.base_url = self.url

    async def _start(self) -> str:
        async def status(request: web.Request) -> web.Response:
            rows = [
                {
                    "unit_id": u,
                    "healthy": True,
                    "model_version": r.version,
                    "state": "draining" if u in self.drained else "routable",
                    "in_flight": 0,
                }
                for u, r in self.units.running.items()
            ]
            return web.json_response({"units": rows})

        async def admin(request: web.Request) -> web.Response:
            if request.headers.get("Authorization") != f"Bearer {TOKEN}":
                return web.json_response({"error": "bad token"}, status=401)
            unit_id, action = request.match_info["unit_id"], request.match_info["action"]
            if unit_id not in self.units.running:
                return web.json_response({"error": "unit_not_found"}, status=404)
            (self.drained.add if action == "drain" else self.drained.discard)(unit_id)
            self.max_drained = max(self.max_drained, len(self.drained))
            self.admin_log.append((action, unit_id))
            return web.json_response({"unit_id": unit_id})

        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            assert body["parameters"]["temperature"] == 0.0 and body["return_token_ids"]
            release = self.units.running[request.match_info["unit_id"]]
            return web.json_response({"token_ids": self.served[release.version]})

        app = web.Application()
        app.add_routes(
            [
                web.get("/status", status),
                web.post("/admin/units/{unit_id}/{action}", admin),
                web.post("/{unit_id}/v2/models/llm/generate", generate),
            ]
        )
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def releases(tmp_path: Path) -> dict[str, Release]:
    out = {}
    for v in ("v1", "v2"):
        manifest = make_checkpoint(tmp_path / v, tp=2, version=v)
        out[v] = Release(v, str(tmp_path / v), manifest)
    return out


@pytest.fixture
def cluster(releases) -> Iterator[tuple[FakeUnits, FakeServer]]:
    units = FakeUnits({u: releases["v1"] for u in ("u0", "u1", "u2")}, list(releases.values()))
    # The manifests' canary: prompt "hello" -> [5, 6, 7].
    server = FakeServer(units, {"v1": [5, 6, 7], "v2": [5, 6, 7]})
    try:
        yield units, server
    finally:
        server.stop()


def _rollout(server: FakeServer, units: FakeUnits, release: Release, **settings) -> Rollout:
    s = dataclasses.replace(SETTINGS, **settings)
    proxy = ProxyAdmin(AdminFanOut([Replica("proxy-0", server.url)], TOKEN))
    return Rollout(release, s, proxy, units, say=lambda msg: None)


def _results(report) -> dict[str, str]:
    return {o.unit_id: o.result for o in report.outcomes}


def test_rolling_deploy_moves_units_one_at_a_time(cluster, releases):
    units, server = cluster
    units.running["u2"] = releases["v2"]  # already there: skipped
    report = _rollout(server, units, releases["v2"]).run()
    assert report.ok, report.message
    assert _results(report) == {"u0": "upgraded", "u1": "upgraded", "u2": "skipped"}
    assert units.recreations == [("u0", "v2"), ("u1", "v2")]
    assert server.admin_log == [
        ("drain", "u0"), ("undrain", "u0"), ("drain", "u1"), ("undrain", "u1"),
    ]  # fmt: skip
    assert server.max_drained == 1 and not server.drained


def test_canary_mismatch_rolls_the_unit_back(cluster, releases):
    units, server = cluster
    server.served["v2"] = [5, 6, 8]  # v2 does not serve what was sharded
    report = _rollout(server, units, releases["v2"]).run()
    assert not report.ok and "u0: canary failed" in report.message
    assert "token 2 differs" in report.message
    assert _results(report) == {"u0": "rolled back", "u1": "pending", "u2": "pending"}
    assert units.recreations == [("u0", "v2"), ("u0", "v1")]  # v1's canaries pass again
    assert {r.version for r in units.running.values()} == {"v1"} and not server.drained


def test_startup_failure_rolls_back_every_moved_unit_newest_first(cluster, releases):
    units, server = cluster
    real_recreate = units.recreate

    def recreate(unit_id: str, release: Release) -> int:
        if unit_id == "u1" and release.version == "v2":
            units.fail_versions.add("v2")
        return real_recreate(unit_id, release)

    units.recreate = recreate  # type: ignore[method-assign]
    report = _rollout(server, units, releases["v2"]).run()
    assert not report.ok
    assert "u1: startup failed: leader exited with code 1" in report.message
    assert units.recreations == [("u0", "v2"), ("u1", "v2"), ("u1", "v1"), ("u0", "v1")]
    assert _results(report) == {"u0": "rolled back", "u1": "rolled back", "u2": "pending"}
    assert {r.version for r in units.running.values()} == {"v1"} and not server.drained


def test_refused_before_any_unit_is_touched(cluster, releases):
    units, server = cluster
    units.not_ready.add("u1")
    report = _rollout(server, units, releases["v2"]).run()
    assert not report.ok and report.message == "units not ready, deploy refused: u1 (starting)"
    units.not_ready.clear()
    report = _rollout(server, units, releases["v2"], max_unavailable=3).run()
    assert "would leave no unit of 3 serving" in report.message
    assert units.recreations == [] and server.admin_log == []


def test_every_proxy_replica_is_drained_and_readmitted(cluster, releases):
    units, server = cluster
    second = FakeServer(units, server.served)  # another replica (and the leaders now)
    try:
        admin = AdminFanOut([Replica("proxy-0", server.url), Replica("proxy-1", second.url)],
                            TOKEN)  # fmt: skip
        report = Rollout(releases["v2"], SETTINGS, ProxyAdmin(admin), units, lambda m: None).run()
        assert report.ok, report.message
        assert server.admin_log == second.admin_log == [
            ("drain", "u0"), ("undrain", "u0"), ("drain", "u1"), ("undrain", "u1"),
            ("drain", "u2"), ("undrain", "u2"),
        ]  # fmt: skip
    finally:
        second.stop()


def test_a_replica_that_does_not_answer_the_drain_is_said_and_blocks_the_admit(cluster, releases):
    units, server = cluster
    said: list[str] = []
    down = Replica("proxy-1", "http://127.0.0.1:9")
    admin = AdminFanOut([Replica("proxy-0", server.url), down], TOKEN, timeout_s=1)
    settings = dataclasses.replace(SETTINGS, proxy_timeout_s=1, rollback=False)
    report = Rollout(releases["v2"], settings, ProxyAdmin(admin), units, said.append).run()
    assert any(m.startswith("u0: drain not applied on proxy-1: no answer") for m in said)
    # Each replica routes on its own: one that cannot be seen is not known to serve v2.
    assert not report.ok and "u0: proxy failed" in report.message
    assert "not healthy at version v2 on every proxy replica" in report.message


def test_a_unit_is_routable_only_as_far_as_it_is_on_every_replica():
    row = {"unit_id": "u0", "state": "routable", "healthy": True, "model_version": "v2",
           "in_flight": 2}  # fmt: skip
    both = merge_units({"a": {"units": [row]}, "b": {"units": [{**row, "in_flight": 3}]}})
    assert both["u0"] == {**row, "in_flight": 5}
    draining = merge_units({"a": {"units": [row]}, "b": {"units": [{**row, "state": "draining"}]}})
    assert draining["u0"]["state"] == "draining"
    old = merge_units({"a": {"units": [row]}, "b": {"units": [{**row, "model_version": "v1"}]}})
    assert old["u0"]["model_version"] is None
    one_down = merge_units({"a": {"units": [row]}, "b": None})["u0"]
    assert (one_down["state"], one_down["healthy"], one_down["in_flight"]) == ("unknown", False, 2)
