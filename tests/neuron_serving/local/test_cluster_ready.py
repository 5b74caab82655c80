"""`up` says ready only once every proxy replica routes to every unit.

A unit group is ready when its leader's Triton model is (the supervisor's probe);
a proxy routes by its own probes, which see that later. A request sent in
between got `503 no routable unit ... (none has become ready yet)`: the two
failed requests of tests/e2e/test_deploy.py's first run, whose load starts right
after `up` printed "ready in". With replicas sharing the client port, any of them
may take that request, so each one's own ``/status`` (its admin port) must show
every unit routable. Here the groups are stubs that are ready at once and each
replica is a stub ``/status`` whose unit states the test sets, so the order of
events is the test's, not the scheduler's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from neuron_serving.local.cluster import ClusterSupervisor, StartupFailed
from neuron_serving.local.group_supervisor import GroupPhase
from neuron_serving.local.replicas import ProxyReplicas
from neuron_serving.local.spec import ClusterSpec
from neuron_serving.proxy_admin import AdminFanOut, Replica


@dataclass
class ReadyGroup:
    """What wait_ready and write_state read of a GroupSupervisor: ready, never failed."""

    group_id: str
    phase: GroupPhase = GroupPhase.READY
    restarts: int = 0
    failures: list[Any] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        return {"unit_id": self.group_id, "phase": self.phase.value}


class StubProxy:
    """GET /status with the unit states set by the test; counts the calls."""

    def __init__(self) -> None:
        self.states = {"unit-0": "unhealthy", "unit-1": "unhealthy"}
        self.calls = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                stub.calls += 1
                units = [{"unit_id": k, "state": v} for k, v in stub.states.items()]
                body = json.dumps({"units": units}).encode()
                self.send_response(200 if self.path == "/status" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def proxies() -> Iterator[list[StubProxy]]:
    stubs = [StubProxy(), StubProxy()]
    try:
        yield stubs
    finally:
        for p in stubs:
            p.close()


def ready_cluster(tmp_path: Path, proxies: list[StubProxy]) -> ClusterSupervisor:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = ClusterSpec(model, tmp_path / "run", units=2, tp=1, proxies=2, base_port=20000)
    spec.run_dir.mkdir()
    cluster = ClusterSupervisor(spec, on_event=lambda _msg: None)
    replicas = ProxyReplicas(spec, [Path("p0"), Path("p1")], "token", lambda _msg: None)
    replicas.groups = [ReadyGroup("proxy-0"), ReadyGroup("proxy-1")]  # type: ignore[list-item]
    replicas.admin = AdminFanOut(
        [Replica(f"proxy-{j}", p.url) for j, p in enumerate(proxies)], "token"
    )
    cluster.replicas = replicas
    cluster.units = [ReadyGroup("unit-0"), ReadyGroup("unit-1")]  # type: ignore[list-item]
    cluster.started_at = time.time()
    return cluster


def _wait_calls(proxy: StubProxy, n: int, deadline: float) -> None:
    calls = proxy.calls
    while proxy.calls < calls + n and time.monotonic() < deadline:
        time.sleep(0.05)


def test_ready_waits_until_every_replica_routes_to_every_unit(tmp_path, proxies):
    cluster = ready_cluster(tmp_path, proxies)
    took: list[float] = []
    waiter = threading.Thread(target=lambda: took.append(cluster.wait_ready(30)), daemon=True)
    waiter.start()
    # Every group is ready, no replica routes to anything yet: not ready.
    deadline = time.monotonic() + 10
    _wait_calls(proxies[0], 2, deadline)
    assert proxies[0].calls >= 2 and not took, "ready before a replica routed to any unit"
    proxies[0].states.update({"unit-0": "routable", "unit-1": "routable"})
    proxies[1].states["unit-1"] = "routable"
    _wait_calls(proxies[1], 2, deadline)
    assert not took, "ready while one replica routes to unit-1 only"
    proxies[1].states["unit-0"] = "routable"
    waiter.join(10)
    assert len(took) == 1


def test_a_replica_that_never_routes_fails_start_up_naming_it(tmp_path, proxies):
    cluster = ready_cluster(tmp_path, proxies)
    proxies[0].states.update({"unit-0": "routable", "unit-1": "routable"})
    with pytest.raises(StartupFailed, match="every proxy replica routing to every unit"):
        cluster.wait_ready(1.2)
