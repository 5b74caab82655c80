"""A `neuron-serving up` cluster for e2e tests, and the streams and kills run against it.

Shared by the demo-model cluster (tests/e2e/test_local_cluster.py: 2 units of TP=2)
and the real-model one (tests/e2e/test_real_model.py). Every wait is bounded.
Streams are greedy with ``ignore_eos``, so an undisturbed run is the exact reference
a migrated stream must reproduce.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil
import pytest
import yaml

from neuron_serving.bench.common import metric_sum
from neuron_serving.faults.injector import Injector
from neuron_serving.faults.schedule import Fault
from neuron_serving.local.probe import get_json
from tests.procs import Proc, up_ports, wait_for

START_TIMEOUT_S = 900.0
RECREATE_TIMEOUT_S = 600.0
UNHEALTHY_BOUND_S = 3.0
UNHEALTHY_TOLERANCE_S = 1.0  # probe jitter and a loaded 2-core box
STREAMS = 8
MAX_TOKENS = 24
PROMPT = "Is this coffee maker in stock, and does it come in red?"


@dataclass
class Cluster:
    proc: Proc
    url: str
    run_dir: Path
    model: str
    api_key: str = ""  # the key `up` generated (run_dir/api-key), read once it is ready
    admin_token: str = ""  # run_dir/admin-token: each replica's own /status on its admin port
    seen_pids: set[int] = field(default_factory=set)

    def state(self) -> dict:
        return json.loads((self.run_dir / "supervisor.json").read_text())

    def unit_state(self, unit_id: str) -> dict:
        return next(u for u in self.state()["units"] if u["unit_id"] == unit_id)

    def replicas(self) -> list[dict]:
        """The proxy replicas in the state file (addresses, phase, processes)."""
        return self.state()["proxies"]

    def proxy_pids(self) -> list[int]:
        """The proxy replicas' running processes, remembered for the final check."""
        pids = [p["pid"] for r in self.replicas() for p in r["processes"] if p["running"]]
        self.seen_pids.update(pids)
        return pids

    def replica_status(self, replica: dict) -> dict | None:
        return get_json(f"{replica['admin_url']}/status", 2.0, token=self.admin_token)

    def proxy_unit(self, unit_id: str) -> dict | None:
        """The unit over every proxy replica: counts added up, and a state that is
        "routable" only if it is on every replica (each routes on its own); None when
        no replica answers."""
        seen = []
        for replica in self.replicas():
            status = self.replica_status(replica) or {"units": []}
            seen.append(next((u for u in status["units"] if u["unit_id"] == unit_id), None))
        if all(u is None for u in seen):
            return None
        states = [u["state"] if u else "unknown" for u in seen]
        known = [u for u in seen if u]
        return {
            "state": next((s for s in states if s != "routable"), "routable"),
            "in_flight": sum(u["in_flight"] for u in known),
            "requests_total": sum(u["requests_total"] for u in known),
        }

    def routable(self, unit_id: str) -> bool:
        u = self.proxy_unit(unit_id)
        return u is not None and u["state"] == "routable"

    def pid_of(self, unit_id: str, name: str) -> int:
        return next(p["pid"] for p in self.unit_state(unit_id)["processes"] if p["name"] == name)

    def unit_tree(self, unit_id: str) -> list[int]:
        """Every live process of a unit: each main process and its whole session."""
        pids = []
        for p in self.unit_state(unit_id)["processes"]:
            for q in psutil.process_iter(["pid"]):
                try:
                    if os.getsid(q.pid) == p["pid"]:
                        pids.append(q.pid)
                except OSError:
                    continue
        self.seen_pids.update(pids)
        return pids

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key,
                             timeout=120.0, max_retries=0)  # fmt: skip

    def log_tail(self) -> str:
        return "\n".join(self.proc.stdout().splitlines()[-40:])

    def inject(self, kind: str, target: str, duration_s: float = 0.0) -> int:
        """Apply one fault now (``neuron_serving/faults``: the injector the soak uses)
        to ``target`` (``unit-N/leader``, ``unit-N/follower-R``, ``proxy-J``); returns
        the pid it hit."""
        record = Injector(self.run_dir).apply(Fault(0.0, kind, target, duration_s))
        assert record.error is None and record.pid is not None, record.error
        self.seen_pids.add(record.pid)
        return record.pid

    def leader_metrics(self, unit_id: str) -> str:
        """``unit_id``'s leader's Prometheus text (the merged Triton + vLLM + ours
        exposition on its metrics port, the port after its gRPC one); "" when it does
        not answer."""
        config = yaml.safe_load((self.run_dir / "proxy-0.yaml").read_text())
        grpc = next(u["leader_grpc"] for u in config["units"] if u["unit_id"] == unit_id)
        host, port = grpc.rsplit(":", 1)
        try:
            with urllib.request.urlopen(f"http://{host}:{int(port) + 1}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return ""

    def proxy_metrics(self) -> str:
        """Every proxy replica's /metrics (admin port), concatenated."""
        out = []
        for replica in self.replicas():
            req = urllib.request.Request(f"{replica['admin_url']}/metrics")
            req.add_header("Authorization", f"Bearer {self.admin_token}")
            with urllib.request.urlopen(req, timeout=5) as r:
                out.append(r.read().decode())
        return "\n".join(out)


class AlertWatch:
    """The cluster's own Prometheus (`up` starts it), polled every half second: when
    each alert (by name and unit) was first seen firing, on this process's clock."""

    def __init__(self, c: Cluster) -> None:
        # `up` starts its Prometheus just after it says ready: its URL reaches the state
        # file with the next tick.
        try:
            wait_for(lambda: c.state().get("prometheus_url"), 60, interval=0.5,
                     what="the cluster's Prometheus in supervisor.json")  # fmt: skip
        except TimeoutError:
            pytest.fail("up started no Prometheus (is Debian's prometheus package installed?)")
        self.url = c.state()["prometheus_url"]
        self.firing: dict[tuple[str, str], float] = {}
        self.pending: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=5) as r:
                    alerts = json.loads(r.read())["data"]["alerts"]
            except (OSError, ValueError, KeyError):
                continue
            now = time.monotonic()
            for a in alerts:
                key = (a["labels"]["alertname"], a["labels"].get("unit", ""))
                seen = self.firing if a["state"] == "firing" else self.pending
                seen.setdefault(key, now)

    def wait_firing(self, name: str, unit: str, timeout_s: float) -> float:
        """When ``name`` for ``unit`` first fired (waiting up to ``timeout_s``)."""
        wait_for(lambda: (name, unit) in self.firing, timeout_s, interval=0.5,
                 what=f"alert {name} for {unit} firing")  # fmt: skip
        return self.firing[(name, unit)]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def exported_names(c: Cluster) -> dict[str, set[str]]:
    """Every endpoint the cluster's Prometheus scrapes (the file SD targets the
    supervisor writes), fetched now: the metric names each job exports, as sample names
    (a family without samples yet counts with its type's suffixes)."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count")}  # fmt: skip
    out: dict[str, set[str]] = {}
    targets = c.run_dir / "prometheus" / "targets"
    for path in sorted(targets.glob("*.json")):
        names = out.setdefault(path.stem, set())
        for group in json.loads(path.read_text()):
            for addr in group["targets"]:
                req = urllib.request.Request(f"http://{addr}/metrics")
                if path.stem in ("proxies", "supervisor"):
                    req.add_header("Authorization", f"Bearer {c.admin_token}")
                with urllib.request.urlopen(req, timeout=10) as r:
                    text = r.read().decode()
                for family in text_string_to_metric_families(text):
                    names.update(s.name for s in family.samples)
                    names.update(family.name + x for x in suffixes.get(family.type, ("",)))
    return out


def leader_requests(c: Cluster, unit_id: str) -> float:
    """Requests ``unit_id``'s leader has taken, every outcome: one per engine request."""
    return metric_sum(c.leader_metrics(unit_id), "neuron_serving_triton_requests_total")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_cluster(model: Path, tmp: Path, extra_args: list[str], name: str | None = None,
                  proxies: int = 1, units: int = 2, env: dict[str, str] | None = None):  # fmt: skip
    """Run `up` on ``model`` with ``proxies`` proxy replicas until it says ready and its
    ``units`` units (``extra_args`` must say ``--units`` when not 2) are routable on every
    replica; yield the cluster; stop it and check that no process it ever had is left.
    The units' port block has room for 2 units of TP=2 (4 of TP=1: units added later)."""
    unit_ids = [f"unit-{i}" for i in range(units)]
    port, admin, base = up_ports(max(2, units) * 20, proxies)
    run_dir = tmp / "run"
    args = ["up", "--model", str(model), "--port", str(port), "--admin-port",
            str(admin), "--proxies", str(proxies), "--base-port", str(base), "--run-dir",
            str(run_dir), "--prometheus-port", "0", "--scrape-interval", "2", *extra_args]  # fmt: skip
    proc = Proc("up", args, tmp, dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    c = Cluster(proc, f"http://127.0.0.1:{port}", run_dir, name or model.name)
    print("up:", " ".join(args), "logs in", run_dir)
    started = time.monotonic()
    try:
        deadline = started + START_TIMEOUT_S
        while "ready in" not in proc.stdout():
            if proc.popen.poll() is not None:
                pytest.fail(f"up exited {proc.popen.returncode}:\n{c.log_tail()}\n{proc.stderr()}")
            if time.monotonic() > deadline:
                pytest.fail(f"cluster not ready in {START_TIMEOUT_S:.0f} s:\n{c.log_tail()}")
            time.sleep(1.0)
        c.api_key = (run_dir / "api-key").read_text().strip()
        c.admin_token = (run_dir / "admin-token").read_text().strip()
        try:
            wait_for(lambda: all(c.routable(u) for u in unit_ids), 60, what="routable")
        except TimeoutError:
            status = [c.replica_status(r) for r in c.replicas()]
            pytest.fail(f"units not routable 60 s after `up` said ready: {status}\n{c.log_tail()}")
        print(f"cluster ready after {time.monotonic() - started:.1f} s")
        print(c.log_tail())
        for u in unit_ids:
            c.unit_tree(u)
        c.proxy_pids()
        yield c
    finally:
        proc.terminate(120)
        left = [pid for pid in c.seen_pids if alive(pid)]
        assert left == [], f"processes left behind: {left}"


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    error: BaseException | None = None


def stream(c: Cluster, out: StreamResult, max_tokens: int = MAX_TOKENS, tag: str = "") -> None:
    try:
        stream = c.client().chat.completions.create(
            model=c.model, stream=True, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "user", "content": tag + PROMPT}], extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices:
                out.text += chunk.choices[0].delta.content or ""
                out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
    except BaseException as e:  # noqa: BLE001 (recorded and asserted on)
        out.error = e


def start_streams(c: Cluster, n: int, max_tokens: int = MAX_TOKENS):
    """``n`` concurrent streams, each prompt starting with its own number: with one
    shared prompt the proxy's prefix-aware routing sends them all to whichever unit
    served that prompt before (until the load gap passes its threshold), so whether
    the unit a test kills had any stream depended on timing. Unique prompts go to
    the least-loaded unit, which spreads them over both."""
    results = [StreamResult() for _ in range(n)]
    threads = [threading.Thread(target=stream, args=(c, r, max_tokens, f"{i}: "), daemon=True)
               for i, r in enumerate(results)]  # fmt: skip
    for t in threads:
        t.start()
    return results, threads


def undisturbed(c: Cluster) -> list[str]:
    """The text each of the ``STREAMS`` tagged streams gives when nothing fails (greedy,
    ignore_eos: the reference a migrated stream must reproduce byte for byte)."""
    results, threads = start_streams(c, STREAMS)
    check_streams(results, threads)
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.text for r in results]


def check_streams(results: list[StreamResult], threads: list[threading.Thread],
                   reference: list[str] | None = None) -> None:  # fmt: skip
    """Every stream ended (none hung); with ``reference``, every one completed with
    exactly the reference text (a unit's failure mid-stream was repaired by a
    token-exact migration: nothing lost, nothing repeated)."""
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    if reference is not None:
        for i, r in enumerate(results):
            assert r.error is None, f"stream {i} failed: {r.error}"
            assert r.finish_reason == "length", r
            assert r.text == reference[i], f"stream {i}: {r.text!r} != {reference[i]!r}"
    done = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    print(f"{len(done)} streams completed, {len(errors)} ended with an error: {errors}")
    for r in done:
        assert r.finish_reason in ("length", "stop"), r
    for e in errors:
        # A clean error: the proxy's SSE error event or an HTTP error, both in OpenAI's
        # format (the client raises APIError subclasses); never a timeout or a cut stream.
        assert isinstance(e, openai.APIError) and not isinstance(e, openai.APITimeoutError), e


def chat(c: Cluster, max_tokens: int = 4) -> str:
    r = c.client().chat.completions.create(
        model=c.model, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": "Do you ship to Canada?"}],
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop")
    return r.choices[0].message.content or ""


def kill_under_load(c: Cluster, unit: str, other: str, victim: str) -> float:
    """SIGKILL ``victim`` of ``unit`` under load, check every stream and the unit's
    recreation; the kill's time (time.monotonic())."""
    old_tree = c.unit_tree(unit)
    restarts = c.unit_state(unit)["restarts"]
    other_before = c.proxy_unit(other)["requests_total"]
    pid = c.pid_of(unit, victim)
    reference = undisturbed(c)
    results, threads = start_streams(c, STREAMS)
    wait_for(lambda: (c.proxy_unit(unit) or {}).get("in_flight", 0) > 0, 60,
             interval=0.05, what=f"streams on {unit}")  # fmt: skip
    assert c.inject("kill", f"{unit}/{victim}") == pid
    killed = time.monotonic()
    wait_for(lambda: not c.routable(unit), 30, interval=0.05, what=f"{unit} unhealthy")
    unhealthy_s = time.monotonic() - killed
    print(f"{victim} of {unit} SIGKILLed: proxy marked {unit} unhealthy after {unhealthy_s:.2f} s")
    assert unhealthy_s <= UNHEALTHY_BOUND_S + UNHEALTHY_TOLERANCE_S

    # New requests keep succeeding (on the other unit) while this one is down.
    for _ in range(3):
        chat(c)
    check_streams(results, threads, reference)
    assert c.proxy_unit(other)["requests_total"] > other_before

    # The whole unit is recreated (new processes, restart counted) and routable again.
    t = time.monotonic()
    wait_for(lambda: c.unit_state(unit)["restarts"] == restarts + 1, 60, what="restart counted")
    failure = c.unit_state(unit)["last_failure"]
    print(f"{unit} last failure: {failure['reason']}")
    wait_for(lambda: c.unit_state(unit)["phase"] == "ready" and c.routable(unit),
             RECREATE_TIMEOUT_S, interval=1.0, what=f"{unit} recreated and routable")  # fmt: skip
    print(f"{unit} routable again {time.monotonic() - killed:.1f} s after the kill "
          f"(recreation took {time.monotonic() - t:.1f} s after the restart was counted)")  # fmt: skip
    return killed
    new_tree = c.unit_tree(unit)
    assert c.pid_of(unit, victim) != pid
    # No orphan: every process of the old incarnation is gone from the process table.
    survivors = [p for p in old_tree if alive(p) and p not in new_tree]
    assert survivors == [], survivors
    chat(c)
