"""`up` says ready only once the proxy routes to every unit.

A unit group is ready when its leader's Triton model is (the supervisor's probe);
the proxy routes by its own probes, which see that later. A request sent in
between got `503 no routable unit ... (none has become ready yet)`: the two
failed requests of tests/e2e/test_deploy.py's first run, whose load starts right
after `up` printed "ready in". Here the groups are stubs that are ready at once and
the proxy is a stub ``/status`` whose unit states the test sets, so the order of
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
from neuron_serving.local.spec import ClusterSpec


@dataclass
class ReadyGroup:
    """What wait_ready and write_state read of a GroupSupervisor: ready, never failed."""

    group_id: str
    phase: GroupPhase = GroupPhase.READY
    restarts: int = 0
    failures: list[Any] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "phase": self.phase.value}


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
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def proxy() -> Iterator[StubProxy]:
    p = StubProxy()
    try:
        yield p
    finally:
        p.close()


def ready_cluster(tmp_path: Path, proxy: StubProxy) -> ClusterSupervisor:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = ClusterSpec(model, tmp_path / "run", units=2, tp=1, port=proxy.port, base_port=20000)
    spec.run_dir.mkdir()
    cluster = ClusterSupervisor(spec, on_event=lambda _msg: None)
    cluster.proxy = ReadyGroup("proxy")  # type: ignore[assignment]
    cluster.units = [ReadyGroup("unit-0"), ReadyGroup("unit-1")]  # type: ignore[list-item]
    cluster.started_at = time.time()
    return cluster


def test_ready_waits_until_the_proxy_routes_to_every_unit(tmp_path, proxy):
    cluster = ready_cluster(tmp_path, proxy)
    took: list[float] = []
    waiter = threading.Thread(target=lambda: took.append(cluster.wait_ready(30)), daemon=True)
    waiter.start()
    # Every group is ready, the proxy routes to nothing yet: not ready.
    deadline = time.monotonic() + 10
    while proxy.calls < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.calls >= 2 and not took, "ready before the proxy routed to any unit"
    proxy.states["unit-1"] = "routable"
    calls = proxy.calls
    while proxy.calls < calls + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not took, "ready while the proxy routes to unit-1 only"
    proxy.states["unit-0"] = "routable"
    waiter.join(10)
    assert len(took) == 1


def test_a_proxy_that_never_routes_fails_start_up_naming_it(tmp_path, proxy):
    cluster = ready_cluster(tmp_path, proxy)
    with pytest.raises(StartupFailed, match="the proxy routing to every unit"):
        cluster.wait_ready(1.2)
