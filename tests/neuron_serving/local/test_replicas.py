"""`up`'s proxy replicas (neuron_serving/local/replicas.py): a restarted replica is ready
only once it has a ready sibling's units and drain states, against real proxies on
loopback (their groups' phases set by the test), then with real replica processes
supervised as `up` runs them (a second each to start here)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_serving.local.group_supervisor import GroupPhase
from neuron_serving.local.probe import http_status
from neuron_serving.local.proxy_config import write_proxy_config
from neuron_serving.local.replicas import ProxyReplicas
from neuron_serving.local.spec import ClusterSpec
from neuron_serving.ports import free_port_block
from neuron_serving.proxy_admin import AdminFanOut, Replica
from neuron_serving.triton.launcher import free_port
from tests.procs import wait_for
from tests.proxy_thread import ADMIN_TOKEN, ProxyThread, two_replicas


@pytest.fixture
def proxies(tmp_path: Path) -> Iterator[list[ProxyThread]]:
    with two_replicas(tmp_path) as started:
        yield started


def replicas_of(tmp_path: Path, proxies: list[ProxyThread], events: list[str]) -> ProxyReplicas:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({}))
    spec = ClusterSpec(model, tmp_path / "run", units=2, tp=1, proxies=2, base_port=20000)
    replicas = ProxyReplicas(spec, [Path("p0"), Path("p1")], ADMIN_TOKEN, events.append)
    urls = [p.admin_url for p in proxies]
    replicas.admin = AdminFanOut(
        [Replica(f"proxy-{j}", u) for j, u in enumerate(urls)], ADMIN_TOKEN
    )
    return replicas


def test_a_restarted_replica_is_ready_once_alike_its_ready_sibling(tmp_path, proxies):
    live, restarted = proxies
    events: list[str] = []
    replicas = replicas_of(tmp_path, proxies, events)
    replicas.admin.drain("unit-0").check()
    restarted.call(_undrain(restarted, "unit-0"))  # it came back from its config
    replicas.groups[0].phase = GroupPhase.READY
    assert replicas._ready(1) is False  # made alike now, confirmed by the next probe
    assert events == ["proxy-1 given proxy-0's units and drain states: "
                      "POST /admin/units/unit-0/drain"]  # fmt: skip
    assert restarted.drained() == live.drained() == {"unit-0"}
    assert replicas._ready(1) is True


def test_with_no_ready_sibling_a_replica_is_ready_as_configured(tmp_path, proxies):
    replicas = replicas_of(tmp_path, proxies, [])
    replicas.admin.drain("unit-1").check()
    assert replicas._ready(0) is True and replicas._ready(1) is True  # none is READY yet
    assert proxies[0].drained() == {"unit-1"}


def test_a_replica_that_does_not_answer_is_not_ready(tmp_path, proxies):
    replicas = replicas_of(tmp_path, proxies, [])
    replicas.admin = AdminFanOut(
        [Replica("proxy-0", proxies[0].admin_url),
         Replica("proxy-1", f"http://127.0.0.1:{free_port()}")], ADMIN_TOKEN,
    )  # fmt: skip
    assert replicas._ready(1) is False
    replicas.groups[0].phase = GroupPhase.READY
    assert replicas._ready(1) is False


def test_the_state_file_lists_every_replicas_addresses(tmp_path, proxies):
    replicas = replicas_of(tmp_path, proxies, [])
    snap = replicas.snapshot()
    assert [(s["replica_id"], s["client_url"]) for s in snap] == [
        ("proxy-0", replicas.spec.proxy_url), ("proxy-1", replicas.spec.proxy_url),
    ]  # fmt: skip
    assert [s["admin_url"] for s in snap] == [p.admin_url for p in proxies]
    assert snap[0]["phase"] == "stopped" and "unit_id" not in snap[0]


async def _undrain(proxy: ProxyThread, unit_id: str) -> None:
    proxy.server.registry.set_draining(unit_id, False)


def test_real_replicas_share_the_port_and_a_sigkilled_one_comes_back_drained(tmp_path):
    """Two `neuron-serving proxy` processes as `up` runs them (units whose leaders nothing
    answers for: only the replicas are under test): both bind the one client port; a
    drain through the fan-out reaches both; one is SIGKILLed, the other keeps answering
    on the port, and the restarted one is ready only with the drain applied."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = free_port_block(30)
    spec = ClusterSpec(model, tmp_path / "run", units=2, tp=1, port=base, proxies=2,
                       base_port=base + 3)  # fmt: skip
    spec.run_dir.mkdir()
    configs, token, _key = write_proxy_config(spec)
    events: list[str] = []
    replicas = ProxyReplicas(spec, configs, token, events.append)
    replicas.start()
    try:
        wait_for(lambda: all(g.phase == GroupPhase.READY for g in replicas.groups), 60,
                 what="both replicas ready")  # fmt: skip
        replicas.admin.drain("unit-0").check()
        first = replicas.groups[0]
        pid = first.procs[0].pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: first.phase != GroupPhase.READY, 10, interval=0.02, what="noticed")
        for _ in range(10):  # a fresh connection each: none goes to the dead socket
            assert http_status(f"{spec.proxy_url}/healthz", 2.0) == 200
        wait_for(lambda: first.phase == GroupPhase.READY and first.procs[0].pid != pid, 60,
                 what="proxy-0 restarted")  # fmt: skip
        caught_up = "proxy-0 given proxy-1's units and drain states: POST /admin/units/unit-0/drain"
        assert caught_up in events
        drained = {r: {u for u, e in units.items() if e["draining"]}
                   for r, units in replicas.admin.units().items()}  # fmt: skip
        assert drained == {"proxy-0": {"unit-0"}, "proxy-1": {"unit-0"}}
        # One CI run saw 2 (the restarted replica failed once more); say why if again.
        snap = replicas.snapshot()[0]
        why = [f"{f.process} exited {f.returncode}: {f.reason}\n{f.log_tail[-2000:]}"
               for f in replicas.groups[0].failures]  # fmt: skip
        # A string, not a tuple: pytest prints a message string whole, a tuple's repr cut.
        assert snap["restarts"] == 1, "\n".join([f"restarts: {snap['restarts']}", *why, *events])
    finally:
        replicas.stop()
    assert replicas.pids() == []
