"""`neuron-serving up` end to end: 2 units of TP=2 behind 2 proxy replicas (`--proxies 2`:
one client port, SO_REUSEPORT), real processes.

One module-scoped cluster (start-up is the expensive part on 2 cores; a second proxy
process costs little beside it); the tests run in file order and each leaves the
cluster serving for the next: stream -> SIGKILL a follower under load -> SIGKILL a
leader under load -> drain through both replicas, SIGKILL one under load -> a batch
across a replica's SIGKILL -> shutdown under load (last: it stops the cluster). Under each kill, 8 greedy streams must all
complete with exactly the text of an undisturbed run of the same 8 (token-exact
migration to the other unit). Every wait is bounded. The only timing
assertion is the issue's functional bound (a dead unit unhealthy in the proxy
within 3 s of the kill), asserted with tolerance and printed.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from neuron_serving.bench.common import metric_sum
from neuron_serving.bench.soak.clients import MIX
from neuron_serving.bench.soak.run import soak
from neuron_serving.faults.schedule import Fault, FaultSchedule
from neuron_serving.proxy_admin import AdminFanOut, Replica
from tests.e2e.local_cluster import (
    STREAMS,
    AlertWatch,
    Cluster,
    StreamResult,
    alive,
    chat,
    check_streams,
    exported_names,
    kill_under_load,
    start_cluster,
    start_streams,
    stream,
)
from tests.procs import leftover, wait_for

# Start-up of 2x TP=2 on a loaded 2-core box can take minutes; per-test waits are bounded below.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def cluster(demo_model: Path, tmp_path_factory) -> Cluster:
    yield from start_cluster(
        demo_model, tmp_path_factory.mktemp("local-cluster"),
        ["--max-model-len", "256", "--max-num-seqs", "16", "--enforce-eager"], proxies=2,
        env=STRAGGLER_ENV,
    )  # fmt: skip


# Slow-rank detection judged over 3 s windows, 3 in a row (the defaults: 10 s): the
# soak's throttles last 30-35 s.
STRAGGLER_ENV = {"NEURON_SERVING_STRAGGLER_WINDOW_S": "3", "NEURON_SERVING_STRAGGLER_WINDOWS": "3",
                 "NEURON_SERVING_STRAGGLER_MIN_STEPS": "10"}  # fmt: skip


class VerdictLog:
    """Every second, each unit's slow-rank verdicts as its leader exports them
    (``neuron_serving_rank_degraded``) and as the proxy shows them (node state
    "degraded" in /status), each with the time since the log started."""

    def __init__(self, cluster: Cluster, units: tuple[str, ...]) -> None:
        self.cluster, self.units = cluster, units
        self.t0 = time.monotonic()
        self.leader: list[tuple[float, str, int]] = []
        self.proxy: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            t = time.monotonic() - self.t0
            for u in self.units:
                text = self.cluster.leader_metrics(u)
                for rank in (0, 1):
                    if metric_sum(text, "neuron_serving_rank_degraded", peer_rank=str(rank)):
                        self.leader.append((t, u, rank))
            status = self.cluster.replica_status(self.cluster.replicas()[0]) or {"units": []}
            for unit in status["units"]:
                for n in unit["nodes"]:
                    if n["state"] == "degraded":
                        self.proxy.append((t, unit["unit_id"], n["rank"]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def first(self, log: list[tuple[float, str, int]], unit: str, rank: int) -> float | None:
        return next((t for t, u, r in log if (u, r) == (unit, rank)), None)


def test_openai_client_streams_a_chat_completion(cluster: Cluster) -> None:
    out = StreamResult()
    stream(cluster, out)
    assert out.error is None, out.error
    assert out.finish_reason == "length" and out.text
    models = [m.id for m in cluster.client().models.list()]
    assert models == [cluster.model]


def test_every_dashboard_query_reads_metrics_the_cluster_exports(cluster: Cluster) -> None:
    """After a request has gone through: each dashboard's metrics (but the autoscaler's,
    which this cluster does not run: tests/e2e/test_local_scale.py) are exported by the
    endpoints the cluster's Prometheus scrapes, and every job has its endpoints."""
    from neuron_serving.monitoring import dashboards

    names = exported_names(cluster)
    assert {job: len(n) > 0 for job, n in names.items()} == {
        "followers": True, "leaders": True, "proxies": True, "supervisor": True}  # fmt: skip
    everything = set().union(*names.values())
    for d in dashboards.DASHBOARDS:
        if d is dashboards.CAPACITY:
            continue
        assert dashboards.queried_metrics(d) - everything == set(), d.uid
    # The node metrics carry the same labels on every rank.
    assert {"neuron_serving_step_seconds_bucket", "neuron_serving_rank_degraded"} <= names[
        "leaders"
    ]
    assert "neuron_serving_collective_wait_seconds_sum" in names["followers"]


def test_client_api_requires_the_generated_key(cluster: Cluster) -> None:
    import stat
    import urllib.error
    import urllib.request

    # Issue 14, finding 9: `up` generates a key, keeps it private, prints it in its examples.
    for name in ("api-key", "api-keys.yaml"):
        mode = stat.S_IMODE((cluster.run_dir / name).stat().st_mode)
        assert mode == 0o600, f"{name} has mode {mode:o}"
    assert f"Authorization: Bearer {cluster.api_key}" in cluster.proc.stdout()
    assert f'api_key="{cluster.api_key}"' in cluster.proc.stdout()
    # Without the key or with a wrong one: 401 in OpenAI's format, nothing generated.
    with pytest.raises(openai.AuthenticationError):
        cluster.client("wrong-key-0123456789abcdef").models.list()
    body = json.dumps({"model": cluster.model, "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{cluster.url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Bearer")
    assert "error" in json.loads(e.value.read())
    # With it, the same request works.
    chat(cluster)


def test_follower_sigkill_under_load(cluster: Cluster) -> None:
    """...and the cluster's own Prometheus fires the unit-down alert for it."""
    alerts = AlertWatch(cluster)
    try:
        killed = kill_under_load(cluster, "unit-0", "unit-1", "follower-1")
        fired = alerts.wait_firing("NeuronServingUnitNotRoutable", "unit-0", 120)
    finally:
        alerts.stop()
    print(f"NeuronServingUnitNotRoutable fired for unit-0 {fired - killed:.1f} s after the "
          "follower's SIGKILL")  # fmt: skip
    assert fired > killed


def test_leader_sigkill_under_load(cluster: Cluster) -> None:
    kill_under_load(cluster, "unit-1", "unit-0", "leader")


def test_status_command_shows_restarts(cluster: Cluster) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "neuron_serving.cli", "status", "--proxy", cluster.url,
         "--state", str(cluster.run_dir / "supervisor.json"), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    units = {u["unit_id"]: u for u in json.loads(out.stdout)["units"]}
    # At least the recreation each kill caused; on a loaded 2-core machine a unit
    # whose start Triton abandoned (the leader exits 4, see neuron_serving/triton)
    # is recreated once more, which is the designed recovery, not a failure.
    print("restarts:", {u: units[u]["restarts"] for u in units})
    assert units["unit-0"]["restarts"] >= 1 and units["unit-1"]["restarts"] >= 1
    assert units["unit-0"]["health"] == "routable"
    assert "follower-1 exited" in units["unit-0"]["last_failure"]
    assert [n["name"] for n in units["unit-0"]["nodes"]] == ["leader", "follower-1"]


def _unit_states(cluster: Cluster, unit_id: str) -> dict[str, str | None]:
    """The unit's state on each replica, from each one's own /status (None: no answer)."""
    out = {}
    for r in cluster.replicas():
        status = cluster.replica_status(r)
        units = {u["unit_id"]: u for u in (status or {}).get("units", [])}
        out[r["replica_id"]] = units[unit_id]["state"] if unit_id in units else None
    return out


def test_proxy_replicas_drain_together_and_one_sigkilled_loses_only_its_own(
    cluster: Cluster,
) -> None:
    """Issue 20. A drain through the fan-out client reaches both replicas. One replica is
    SIGKILLed under load: what it had in flight is lost, clients retry (the openai
    client's own retries, a fresh connection per request so the kernel spreads them over
    both replicas), every request gets its answer, the other replica goes on; `up`
    restarts the killed one, which comes back with the drain it had missed nothing of
    (given by its sibling before it is ready)."""
    replicas = cluster.replicas()
    assert [r["replica_id"] for r in replicas] == ["proxy-0", "proxy-1"]
    assert len({r["client_url"] for r in replicas}) == 1  # one client port
    admin = AdminFanOut([Replica(r["replica_id"], r["admin_url"]) for r in replicas],
                        cluster.admin_token)  # fmt: skip
    admin.drain("unit-0").check()
    assert _unit_states(cluster, "unit-0") == {"proxy-0": "draining", "proxy-1": "draining"}

    victim = replicas[0]
    (pid,) = [p["pid"] for p in victim["processes"] if p["running"]]
    cluster.seen_pids.add(pid)
    attempts: list[int] = []
    results: list[object] = []
    stop = threading.Event()

    def load() -> None:
        http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0),
                            event_hooks={"request": [lambda _r: attempts.append(1)]})  # fmt: skip
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.api_key,
                               timeout=120.0, max_retries=5, http_client=http)  # fmt: skip
        while not stop.is_set():
            try:
                r = client.chat.completions.create(
                    model=cluster.model, max_tokens=24, temperature=0,
                    messages=[{"role": "user", "content": "Do you ship to Canada?"}],
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                results.append(r.choices[0].finish_reason)
            except Exception as e:  # noqa: BLE001 (asserted on below)
                results.append(e)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()

    def victim_busy() -> bool:
        status = cluster.replica_status(victim) or {}
        return status.get("admission", {}).get("active", 0) > 0

    wait_for(victim_busy, 60, interval=0.02, what="requests in flight on proxy-0")
    assert cluster.inject("kill", victim["replica_id"]) == pid
    killed = time.monotonic()
    done_at_kill = len(results)

    def restarted() -> dict | None:
        r = cluster.replicas()[0]
        running = [p["pid"] for p in r["processes"] if p["running"]]
        return r if r["phase"] == "ready" and running and running != [pid] else None

    wait_for(lambda: restarted() is not None, 120, interval=0.2, what="proxy-0 restarted")
    print(f"proxy-0 SIGKILLed, ready again after {time.monotonic() - killed:.1f} s: "
          f"{restarted()['restarts']} restart(s)")  # fmt: skip
    cluster.proxy_pids()
    # It came back from its config (no unit drained) and was given its sibling's drain.
    assert _unit_states(cluster, "unit-0") == {"proxy-0": "draining", "proxy-1": "draining"}
    wait_for(lambda: len(results) >= done_at_kill + 8, 120, what="requests after the kill")
    stop.set()
    for t in threads:
        t.join(150)
    errors = [r for r in results if isinstance(r, Exception)]
    print(f"{len(results)} requests, {len(attempts)} attempts, errors: {errors}")
    assert errors == [] and all(r == "length" for r in results)
    assert len(attempts) > len(results), "no request was retried: the kill hit nothing"
    admin.undrain("unit-0").check()
    wait_for(lambda: cluster.routable("unit-0"), 30, what="unit-0 routable on both replicas")


def test_a_batch_survives_a_proxy_sigkill_with_every_line_exactly_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """2,000 lines through the official client's files and batches, run by both
    replicas from their shared SQLite store; one replica is SIGKILLed mid-batch, the
    other goes on, `up` restarts the killed one (same replica id: it takes its own leased
    lines back at once): every line's answer exactly once in the output file."""
    n = 2000
    lines = [
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": cluster.model,
                    "prompt": f"item {i}: ",
                    "max_tokens": 2,
                    "temperature": 0,
                },
            }
        )  # fmt: skip
        for i in range(n)
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    c = cluster.client()
    with path.open("rb") as f:
        upload = c.files.create(file=f, purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                             completion_window="24h")  # fmt: skip
    assert batch.request_counts.total == n

    def progress() -> int:
        try:
            return c.batches.retrieve(batch.id).request_counts.completed
        except openai.APIError:
            return -1  # the proxy is restarting

    wait_for(lambda: progress() >= 300, 600, interval=0.5, what="300 lines done")
    victim = cluster.replicas()[1]
    (pid,) = [p["pid"] for p in victim["processes"] if p["running"]]
    assert cluster.inject("kill", victim["replica_id"]) == pid
    done_at_kill = progress()
    print(f"{victim['replica_id']} SIGKILLed with {done_at_kill} of {n} lines done")
    wait_for(lambda: cluster.replicas()[1]["restarts"] > victim["restarts"], 60,
             interval=0.2, what="the replica's restart counted")  # fmt: skip
    wait_for(lambda: cluster.routable("unit-0") and cluster.routable("unit-1"), 120,
             interval=0.5, what="the restarted replica routing")  # fmt: skip
    cluster.proxy_pids()
    wait_for(lambda: c.batches.retrieve(batch.id).status in ("completed", "failed"), 900,
             interval=1.0, what="the batch finished")  # fmt: skip
    final = c.batches.retrieve(batch.id)
    assert final.status == "completed", final
    assert (final.request_counts.completed, final.request_counts.failed) == (n, 0)
    out = c.files.content(final.output_file_id).content.decode().splitlines()
    ids = [json.loads(x)["custom_id"] for x in out]
    assert len(ids) == n and set(ids) == {f"line-{i}" for i in range(n)}
    assert all(json.loads(x)["response"]["status_code"] == 200 for x in out)
    assert final.error_file_id is None
    for r in cluster.replicas():
        assert cluster.replica_status(r)["batches"]["active"] == []


def test_a_soak_with_throttled_ranks_loses_fails_and_ejects_nothing(cluster: Cluster) -> None:
    """The soak (`bench soak`'s function) on this cluster: its mixed clients (streams
    greedy, sampled and with tools, structured, long, n, clients that leave or read
    slowly, a batch) while one rank of each unit in turn is throttled, stopped and
    continued five times a second for half a minute: slow, not dead. Nothing may be
    lost, fail, run twice, or take a unit out of rotation."""
    schedule = FaultSchedule(
        faults=[
            Fault(10.0, "throttle", "unit-0/follower-1", 35.0),
            Fault(50.0, "throttle", "unit-1/leader", 30.0),
        ]
    )  # fmt: skip
    restarts = {u: cluster.unit_state(u)["restarts"] for u in ("unit-0", "unit-1")}
    # Healthy units under full load are never flagged slow: through every test before
    # this one (streams, kills, a batch of 2000 lines across both units), no leader
    # logged a slow rank.
    logs = sorted((cluster.run_dir / "logs").glob("unit-*/leader.log"))
    flagged = [ln for p in logs for ln in p.read_text(errors="replace").splitlines()
               if " is slow: " in ln]  # fmt: skip
    assert len(logs) == 2 and flagged == [], flagged
    verdicts = VerdictLog(cluster, ("unit-0", "unit-1"))
    alerts = AlertWatch(cluster)
    # max-model-len 256 here: the long answers are 200 tokens.
    try:
        result = soak(cluster.url, cluster.api_key, cluster.run_dir, cluster.model, schedule,
                      duration=90.0, seed=1, clients=4, long_tokens=200)  # fmt: skip
    finally:
        verdicts.stop()
        alerts.stop()
    print({k: result[k] for k in ("requests", "statuses", "by_kind", "fault_delays_s")})
    # The throttled rank is found slow while it is throttled (the soak's clock starts
    # about when the log's does), in the leader's metrics and on the proxy. The other
    # unit's ranks may be flagged meanwhile: on 2 cores its follower shares a core with
    # the throttled one, whose stops and starts (5 a second) slow it for real.
    print("degraded (s, unit, rank): leader", verdicts.leader, "proxy", verdicts.proxy)
    found = verdicts.first(verdicts.leader, "unit-0", 1)
    # When within the throttle depends on the load of a 2-core machine (28 and 38 s
    # after it began in two runs): flagged after it began, never before.
    assert found is not None and found > 10.0, verdicts.leader
    assert verdicts.first(verdicts.proxy, "unit-0", 1) is not None, verdicts.proxy
    assert [v for v in verdicts.leader if v[1] == "unit-0" and v[2] == 0] == []
    # ...and the cluster's Prometheus fired the alert for it.
    fired = alerts.firing.get(("NeuronServingRankDegraded", "unit-0"))
    assert fired is not None, (alerts.firing, alerts.pending)
    print(f"NeuronServingRankDegraded fired for unit-0 {fired - verdicts.t0 - 10.0:.1f} s "
          "after its follower's throttle began")  # fmt: skip
    print(
        f"unit-0 rank 1 found slow {found - 10.0:.1f} s after its throttle began; unit-1 "
        f"rank 0 {(verdicts.first(verdicts.leader, 'unit-1', 0) or 0) - 50.0:.1f} s after"
    )
    assert [f["error"] for f in result["faults"]] == [None, None], result["faults"]
    assert all(v == 0 for v in result["zero_counts"].values()), (
        result["zero_counts"], result["false_ejections"], result["unexpected"][:5],
    )  # fmt: skip
    # Every kind of request was sent and completed at least once.
    completed = {k for k, v in result["by_kind"].items() if v.get("completed")}
    assert completed >= set(MIX) - {"disconnect"}, result["by_kind"]
    # No unit was recreated: a slow rank is not a failed one.
    assert {u: cluster.unit_state(u)["restarts"] for u in restarts} == restarts


def test_shutdown_under_load_leaves_nothing(cluster: Cluster) -> None:
    for u in ("unit-0", "unit-1"):
        cluster.unit_tree(u)
    cluster.proxy_pids()
    results, threads = start_streams(cluster, STREAMS)
    wait_for(lambda: sum((cluster.proxy_unit(u) or {}).get("in_flight", 0)
                         for u in ("unit-0", "unit-1")) > 0, 60, interval=0.05,
             what="streams in flight")  # fmt: skip
    t = time.monotonic()
    cluster.proc.signal(signal.SIGTERM)
    rc = cluster.proc.wait(180)
    print(f"up exited {rc} {time.monotonic() - t:.1f} s after SIGTERM")
    print("\n".join(cluster.proc.stdout().splitlines()[-8:]))
    assert rc == 0, cluster.proc.stderr()
    check_streams(results, threads)
    # Draining let in-flight streams finish: none was cut by the shutdown. A stream
    # that reached the proxy after draining began was refused up front with a clean
    # 503 ("stop admitting"), never cut mid-way.
    errors = [r.error for r in results if r.error is not None]
    assert all("503" in str(e) and "no routable unit" in str(e) for e in errors), errors
    assert len(errors) < len(results), errors
    assert leftover([cluster.proc]) == []
    left = [pid for pid in cluster.seen_pids if alive(pid)]
    assert left == [], left
