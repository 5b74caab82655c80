"""Adding and removing a unit of a running `neuron-serving up` (issue 21's local actuator),
end to end: `up --units 1 --tp 1` on the demo model, real processes, the capacity
controller's LocalActuator over the supervisor API socket.

One module-scoped cluster; the tests run in file order: add a unit -> it starts, is
registered with the proxy and becomes routable, and serves requests (it shows in
supervisor.json and `neuron-serving status`) -> with greedy streams in flight on it,
remove it -> every stream completes with no error (the removal waited for them: the
unit was drained, not killed under them), its processes are gone, the proxy no longer
lists it, and the last ready unit is refused. Every wait is bounded.

Then `up --autoscale --units-min 1 --units-max 3 --warm-units 1` (a second cluster,
short windows and cool-downs from --autoscale-config): the controller starts a warm
spare (unit-1: started, drained on the proxy); a load step of concurrent openai
streams makes it promote the spare, which is routable about a second after the
decision and serves, and start the next spare (unit-2, cold); the load stops (a
trickle goes on) and, the pool being full, the controller drains and removes a unit,
with no request failed and no stream migrated.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from neuron_serving.capacity.actuator import ActuatorError
from neuron_serving.capacity.local_actuator import LocalActuator
from neuron_serving.capacity.signals import Phase, Purpose
from neuron_serving.local.probe import get_json
from tests.e2e.local_cluster import (
    Cluster,
    alive,
    chat,
    check_streams,
    exported_names,
    start_cluster,
    start_streams,
)
from tests.procs import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ADD_TIMEOUT_S = 240.0  # a TP=1 unit of the demo model starts in about 30 s on 2 cores
REMOVE_TIMEOUT_S = 60.0
STREAMS = 6
STREAM_TOKENS = 200  # long enough to be in flight while the removal drains (max-model-len 256)


UNIT_ARGS = ["--tp", "1", "--max-model-len", "256", "--max-num-seqs", "16", "--enforce-eager"]
# Stops the manually scaled cluster early: the autoscaled one needs the two cores.
_STOPPERS: list = []


@pytest.fixture(scope="module")
def cluster(demo_model: Path, tmp_path_factory) -> Cluster:
    run = start_cluster(demo_model, tmp_path_factory.mktemp("local-scale"),
                        ["--units", "1", *UNIT_ARGS], units=1)  # fmt: skip
    c = next(run)
    _STOPPERS.append(lambda: next(run, None))  # runs its teardown (no process left) once
    yield c
    next(run, None)


@pytest.fixture(scope="module")
def actuator(cluster: Cluster) -> LocalActuator:
    return LocalActuator.for_run_dir(cluster.run_dir)


def _phase(act: LocalActuator, unit_id: str) -> Phase | None:
    return next((u.phase for u in act.units() if u.unit_id == unit_id), None)


def _admin_units(c: Cluster) -> set[str]:
    """The units every replica's admin API lists."""
    out: set[str] = set()
    for r in c.replicas():
        listing = get_json(f"{r['admin_url']}/admin/units", 2.0, token=c.admin_token)
        assert listing is not None, r
        out |= {u["unit_id"] for u in listing["units"]}
    return out


def _migrations(c: Cluster) -> float:
    """Mid-stream migrations over every replica (any outcome), from its admin /metrics:
    a stream cut by its unit's stop is migrated to another unit and still completes, so
    only this counter tells a drained removal from a killed one."""
    total = 0.0
    for r in c.replicas():
        req = urllib.request.Request(
            f"{r['admin_url']}/metrics", headers={"Authorization": f"Bearer {c.admin_token}"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("proxy_migrations_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_an_added_unit_becomes_routable_and_serves(cluster: Cluster, actuator) -> None:
    t0 = time.monotonic()
    unit_id = actuator.add(Purpose.BATCH)
    assert unit_id == "unit-1"
    assert _phase(actuator, unit_id) == Phase.STARTING
    assert not cluster.routable(unit_id)
    wait_for(lambda: _phase(actuator, unit_id) == Phase.READY, ADD_TIMEOUT_S, interval=0.5,
             what=f"{unit_id} ready and routable")  # fmt: skip
    took = time.monotonic() - t0
    print(f"{unit_id}: add -> routable on every proxy replica in {took:.1f} s")
    # READY in the actuator means every replica's /status shows it routable.
    assert cluster.routable(unit_id)
    assert unit_id in _admin_units(cluster)
    state = cluster.unit_state(unit_id)
    assert state["purpose"] == "batch" and state["added"] is True and state["phase"] == "ready"
    cluster.unit_tree(unit_id)  # remembered for the final no-process-left check
    # `neuron-serving status` shows it, merged from the proxy and supervisor.json.
    out = subprocess.run(
        [sys.executable, "-m", "neuron_serving.cli", "status", "--proxy", cluster.url,
         "--state", str(cluster.run_dir / "supervisor.json"), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {r["unit_id"]: r for r in json.loads(out.stdout)["units"]}
    assert rows[unit_id]["phase"] == "ready" and rows[unit_id]["health"] == "routable"
    # It serves: concurrent streams spread over both units.
    before = cluster.proxy_unit(unit_id)["requests_total"]
    for _ in range(5):
        results, threads = start_streams(cluster, 4, max_tokens=8)
        check_streams(results, threads)
        assert all(r.error is None for r in results), [r.error for r in results]
        if cluster.proxy_unit(unit_id)["requests_total"] > before:
            break
    assert cluster.proxy_unit(unit_id)["requests_total"] > before, "no request reached it"


def test_removal_under_streaming_load_loses_no_request(cluster: Cluster, actuator) -> None:
    unit_id = "unit-1"
    tree = cluster.unit_tree(unit_id)
    assert tree
    migrations = _migrations(cluster)
    started = time.monotonic()
    results, threads = start_streams(cluster, STREAMS, max_tokens=STREAM_TOKENS)
    wait_for(lambda: (cluster.proxy_unit(unit_id) or {}).get("in_flight", 0) > 0, 60,
             interval=0.05, what=f"streams on {unit_id}")  # fmt: skip
    on_it = cluster.proxy_unit(unit_id)["in_flight"]
    t0 = time.monotonic()
    actuator.remove(unit_id)
    assert _phase(actuator, unit_id) == Phase.DRAINING
    # Drained: no new request goes to it while it finishes what it has.
    wait_for(lambda: (cluster.proxy_unit(unit_id) or {}).get("state") == "draining", 10,
             interval=0.05, what=f"{unit_id} draining")  # fmt: skip
    chat(cluster)  # served by unit-0
    check_streams(results, threads)
    print(f"{STREAMS} streams of {STREAM_TOKENS} tokens took {time.monotonic() - started:.1f} s")
    errors = [r.error for r in results if r.error is not None]
    assert errors == [], errors
    assert all(r.finish_reason == "length" for r in results), results
    wait_for(lambda: _phase(actuator, unit_id) is None, REMOVE_TIMEOUT_S, interval=0.2,
             what=f"{unit_id} removed")  # fmt: skip
    print(f"{unit_id} removed {time.monotonic() - t0:.1f} s after the call, {on_it} stream(s) "
          f"on it at the time")  # fmt: skip
    log = cluster.proc.stdout()
    print("\n".join(line for line in log.splitlines() if unit_id in line))
    assert f"{unit_id} drained in" in log, cluster.log_tail()
    assert "going on anyway" not in log
    # Nothing was cut and moved: the streams on it finished there before it stopped.
    assert _migrations(cluster) == migrations
    # Its processes are gone, the proxy no longer lists it, the other unit serves.
    left = [p for p in tree if alive(p)]
    assert left == [], left
    assert cluster.proxy_unit(unit_id) is None
    assert unit_id not in _admin_units(cluster)
    assert [u["unit_id"] for u in cluster.state()["units"]] == ["unit-0"]
    chat(cluster)
    # unit-0 is now the last ready unit: refused, and nothing changes.
    with pytest.raises(ActuatorError, match="last"):
        actuator.remove("unit-0")
    assert cluster.routable("unit-0")


# The autoscaled cluster: decide every second on short windows (policy defaults are
# 60 s / 6 s, cool-downs 10 s / 120 s), so a load step and its end show within a minute;
# one warm spare.
AUTOSCALE_CONFIG = {
    "tick_s": 1.0, "stable_window_s": 8.0, "panic_window_s": 2.0,
    "scale_up_cooldown_s": 5.0, "scale_down_cooldown_s": 10.0, "latency_window_s": 10.0,
    "warm_units": 1,
}  # fmt: skip
LOAD_STREAMS = 12  # 12 concurrent on units of target 8 (0.5 x max_num_seqs 16): 2 units
LOAD_TOKENS = 48
SCALE_UP_DECISION_S = 30.0
SCALE_DOWN_S = 90.0


@pytest.fixture(scope="module")
def autoscaled(demo_model: Path, tmp_path_factory) -> Cluster:
    while _STOPPERS:
        _STOPPERS.pop()()
    tmp = tmp_path_factory.mktemp("autoscale")
    config = tmp / "capacity.yaml"
    config.write_text(json.dumps(AUTOSCALE_CONFIG))  # JSON is YAML
    yield from start_cluster(
        demo_model, tmp,
        ["--autoscale", "--units-min", "1", "--units-max", "3", "--autoscale-config",
         str(config), *UNIT_ARGS], units=1,
    )  # fmt: skip


class Load:
    """``n`` workers, each streaming one greedy request after another until stopped;
    every outcome counted (the client never retries: an error is an error)."""

    def __init__(self, c: Cluster, n: int, tag: str) -> None:
        self.c, self.stop = c, threading.Event()
        self.ok = 0
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._work, args=(f"{tag}{i}: ",), daemon=True)
                        for i in range(n)]  # fmt: skip
        for t in self.threads:
            t.start()

    def _work(self, tag: str) -> None:
        client = self.c.client()
        while not self.stop.is_set():
            try:
                out = client.chat.completions.create(
                    model=self.c.model, stream=True, max_tokens=LOAD_TOKENS, temperature=0,
                    messages=[{"role": "user", "content": tag + "Is this kettle in stock?"}],
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                finish = None
                for chunk in out:
                    if chunk.choices:
                        finish = chunk.choices[0].finish_reason or finish
                assert finish == "length", finish
                with self.lock:
                    self.ok += 1
            except (openai.OpenAIError, AssertionError) as e:
                with self.lock:
                    self.errors.append(e)
                time.sleep(0.5)

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads), "a load stream hung"


def _units(c: Cluster) -> list[str]:
    return [u["unit_id"] for u in c.state()["units"]]


def _serving(c: Cluster) -> list[str]:
    """Units that are not warm spares (being drained into the pool counts as a spare)."""
    return [u["unit_id"] for u in c.state()["units"] if not u.get("standby")]


def _promotion(c: Cluster) -> dict | None:
    """The last recorded decision that promoted a spare."""
    decisions = (c.state().get("capacity") or {}).get("decisions") or []
    return next((d for d in reversed(decisions) if (d.get("pool") or {}).get("promoted")), None)


def _warm(c: Cluster) -> list[str]:
    return [u["unit_id"] for u in c.state()["units"] if u.get("standby") and u.get("warm")]


def _last_action(c: Cluster) -> dict | None:
    return (c.state().get("capacity") or {}).get("last_action")


def test_autoscale_promotes_a_warm_spare_under_load_and_removes_a_unit_after(
    autoscaled: Cluster,
) -> None:
    c = autoscaled
    assert _serving(c) == ["unit-0"]
    # The first ticks start the spare (cold, while idle); it is drained on every replica.
    wait_for(lambda: _warm(c) == ["unit-1"], ADD_TIMEOUT_S, interval=0.5,
             what="the warm spare unit-1 started and held")  # fmt: skip
    cap = c.state()["capacity"]
    assert (cap["min_units"], cap["max_units"], cap["desired"]) == (1, 3, 1), cap
    assert cap["warm_units"] == 1 and _serving(c) == ["unit-0"]
    assert not c.routable("unit-1") and c.proxy_unit("unit-1")["state"] == "draining"
    migrations = _migrations(c)
    t0 = time.monotonic()
    load = Load(c, LOAD_STREAMS, "step ")
    try:
        # The unit shows as serving in the state file's units a moment before the
        # decision that promoted it is recorded in its capacity section: wait for both.
        wait_for(lambda: "unit-1" in _serving(c) and _promotion(c) is not None,
                 SCALE_UP_DECISION_S, interval=0.2,
                 what="the controller promoting the spare under load")  # fmt: skip
        decided = time.monotonic() - t0
        promote = _promotion(c)
        assert promote["pool"]["promoted"] == ["unit-1"], promote
        assert promote["reason"] in ("panic", "scale_up"), promote
        wait_for(lambda: c.unit_state("unit-1")["routable"] and c.routable("unit-1"),
                 60, interval=0.2, what="unit-1 routable")  # fmt: skip
        routable_at = c.unit_state("unit-1")["routable_at"]
        promote_s = routable_at - promote["wall_time"]
        wait_for(lambda: (c.proxy_unit("unit-1") or {}).get("requests_total", 0) > 0, 60,
                 interval=0.2, what="unit-1 serving")  # fmt: skip
        serving = time.monotonic() - t0
        # The pool refills: the next spare starts (3 units = max_units).
        wait_for(lambda: "unit-2" in _units(c), 30, interval=0.5, what="the next spare")
    finally:
        load.end()
    print(f"load step of {LOAD_STREAMS} streams: spare promoted {decided:.1f} s after it began, "
          f"decision -> routable on every replica in {promote_s:.2f} s, serving at "
          f"{serving:.1f} s; {load.ok} requests")  # fmt: skip
    assert load.errors == [], load.errors[:3]
    # The load ends; one stream goes on, through the scale-in. The pool is full (unit-2),
    # so the drained unit is removed, not held.
    t1 = time.monotonic()
    trickle = Load(c, 1, "trickle ")
    try:
        wait_for(lambda: len(_serving(c)) == 1 and len(_units(c)) == 2, SCALE_DOWN_S + 60,
                 interval=0.5, what="a unit drained and removed after the load")  # fmt: skip
        removed_s = time.monotonic() - t1
        time.sleep(2.0)  # the trickle on the unit that stayed
    finally:
        trickle.end()
    cap = c.state()["capacity"]
    # Every decision is a JSON line with its signals (the state file keeps the last 10).
    lines = (c.run_dir / "logs" / "capacity" / "decisions.log").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    down = [d for d in records if d.get("removed")]
    assert down, records[-5:]
    removed = down[-1]["removed"]
    print(f"load stopped -> {removed} removed in {removed_s:.1f} s; trickle {trickle.ok} "
          f"requests; last decisions: {[(d['reason'], d['desired']) for d in cap['decisions']]}")  # fmt: skip
    assert len(removed) == 1 and down[-1]["reason"] == "scale_down", down[-1]
    assert down[-1]["pool"]["held"] == [], down[-1]
    assert trickle.errors == [] and trickle.ok > 0, trickle.errors[:3]
    log = c.proc.stdout()
    print("\n".join(line for line in log.splitlines() if "capacity" in line or "unit-" in line))
    assert f"{removed[0]} drained in" in log and "going on anyway" not in log
    assert _migrations(c) == migrations  # drained, not cut: nothing moved mid-stream
    assert cap["actuator_errors"] == 0 and cap["read_errors"] == 0, cap["last_error"]
    # `status` shows the controller.
    reasons = {d.get("reason") for d in records}
    assert {"hold", "scale_down"} <= reasons and reasons & {"panic", "scale_up"}, reasons
    cmd = [sys.executable, "-m", "neuron_serving.cli", "status", "--proxy", c.url,
           "--state", str(c.run_dir / "supervisor.json"), "--width", "80"]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    line = next(x for x in text.stdout.splitlines() if x.startswith("autoscale 1..3:"))
    assert len(line) <= 80, line
    js = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    view = json.loads(js.stdout)["capacity"]
    assert view["current"] == 1 and view["decisions"] and view["warm_units"] == 1, view
    # The controller's own endpoint: its metrics, with the admin token only.
    req = urllib.request.Request(f"{view['metrics_url']}/metrics",
                                 headers={"Authorization": f"Bearer {c.admin_token}"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    assert 'capacity_pool_actions_total{op="promote"} 1.0' in text, text[-2000:]
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(f"{view['metrics_url']}/metrics", timeout=10)
    # The capacity dashboard's metrics are what this cluster's Prometheus scrapes.
    from neuron_serving.monitoring import dashboards

    exported = set().union(*exported_names(c).values())
    assert dashboards.queried_metrics(dashboards.CAPACITY) - exported == set()
