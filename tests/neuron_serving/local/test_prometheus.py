"""The local cluster's Prometheus, for real: Debian's binary scraping a real node
metrics endpoint found through the file SD targets, with the alert rules loaded; and
`up`'s plain message when the binary is missing."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
from pathlib import Path

from neuron_serving.local import prometheus as local_prometheus
from neuron_serving.local.prometheus import LocalPrometheus
from neuron_serving.monitoring import prometheus
from neuron_serving.monitoring.targets import FleetTargets, UnitTargets
from neuron_serving.unit.health_server import HealthServer
from neuron_serving.unit.node_metrics import NodeCollector
from neuron_serving.unit.node_status import NodeStatus
from proxy.config import HistoryConfig
from proxy.serving.history import PROMQL, PrometheusHistory
from tests.procs import free_port_block, wait_for


async def _history(url: str) -> dict:
    import aiohttp

    cfg = HistoryConfig(prometheus_url=url, interval_s=2, window_s=30)
    async with aiohttp.ClientSession() as session:
        return await PrometheusHistory(cfg).view(session)


def query(url: str, promql: str) -> list[dict]:
    q = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=5) as r:
        return json.loads(r.read())["data"]["result"]


def test_it_scrapes_a_node_found_through_the_targets_and_loads_the_rules(tmp_path: Path) -> None:
    assert prometheus.find_binary(), "`make install-test` installs Debian's prometheus package"
    status = NodeStatus("unit-7", 1, 2, host="h7")
    node = HealthServer(status, "127.0.0.1", free_port_block(), collector=NodeCollector(status))
    node.start()
    said: list[str] = []
    (tmp_path / "admin-token").write_text("t" * 43)
    # Scrapes every 2 s (timeout 1.6 s): a loaded 2-core machine may take over 1 s.
    prom = LocalPrometheus.start(tmp_path, "127.0.0.1", 0, 2.0, tmp_path / "admin-token",
                                 said.append)  # fmt: skip
    assert prom is not None
    try:
        # The node as a follower of unit-7 (its metrics on the health port + 1).
        unit = UnitTargets("unit-7", "127.0.0.1", "h7", "m", free_port_block(), (node.port + 1,))
        prom.refresh(FleetTargets([unit]))
        assert any("targets updated" in s for s in said), said

        def scraped() -> list[dict]:
            try:
                return query(prom.url, 'neuron_serving_steps_total{unit="unit-7"}')
            except OSError:
                return []

        wait_for(lambda: scraped() != [], 60, interval=0.5, what="the node's series")
        labels = scraped()[0]["metric"]
        assert {k: labels[k] for k in ("unit", "rank", "role", "host", "job")} == {
            "unit": "unit-7", "rank": "1", "role": "follower", "host": "h7",
            "job": "neuron-serving-followers"}  # fmt: skip
        # The leader endpoint listed does not answer: its `up` is 0, as NodeDown reads it.
        wait_for(lambda: query(prom.url, 'up{job="neuron-serving-leaders"} == 0') != [], 60,
                 interval=0.5, what="the dead leader's up == 0")  # fmt: skip
        with urllib.request.urlopen(f"{prom.url}/api/v1/rules", timeout=5) as r:
            groups = json.loads(r.read())["data"]["groups"]
        assert sum(len(g["rules"]) for g in groups) == 20
        # The proxy's dashboard history from this Prometheus: every series on one time
        # axis (empty here: no proxy is scraped).
        view = asyncio.run(_history(prom.url))
        assert view["source"] == "prometheus" and len(view["t"]) == 16
        assert set(PROMQL) <= set(view["series"])
        assert all(len(v) == 16 for v in view["series"].values())
    finally:
        prom.stop()
        node.stop()
    assert prom.process.poll() is not None


def test_a_prometheus_that_exits_is_said_and_started_again(tmp_path: Path, monkeypatch) -> None:
    assert prometheus.find_binary()
    said: list[str] = []
    (tmp_path / "admin-token").write_text("t" * 43)
    prom = LocalPrometheus.start(tmp_path, "127.0.0.1", 0, 1.0, tmp_path / "admin-token",
                                 said.append)  # fmt: skip
    assert prom is not None
    monkeypatch.setattr(local_prometheus, "RESTART_AFTER_S", 0.0)
    try:
        prom.process.kill_tree()
        wait_for(lambda: prom.process.poll() is not None, 10, what="prometheus gone")
        prom.refresh(FleetTargets())
        assert any("prometheus exited with code" in s for s in said), said
        prom.refresh(FleetTargets())  # RESTART_AFTER_S later: started again
        time.sleep(0.5)
        assert prom.process.poll() is None
    finally:
        prom.stop()


def test_without_the_binary_up_says_so_and_runs_on(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(prometheus, "find_binary", lambda name="prometheus": None)
    said: list[str] = []
    assert LocalPrometheus.start(tmp_path, "127.0.0.1", 0, 5.0, tmp_path / "t", said.append) is None
    assert "prometheus: not installed" in said[0] and "running without it" in said[0]


def test_a_taken_port_falls_back_to_a_free_one(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        got = local_prometheus.free_port("127.0.0.1", taken)
        assert got != taken and got > 0
    assert local_prometheus.free_port("127.0.0.1", 0) > 0
