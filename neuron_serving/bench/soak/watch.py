"""What the soak reads off the cluster while it runs, every ``INTERVAL_S``.

- Counters, reset-aware (a recreated leader or proxy replica starts again from 0;
  the rise before it is kept): per unit, the requests its leader took
  (``neuron_serving_triton_requests_total``, every outcome: one per engine request)
  and the attempts the proxies sent it (``/status`` ``requests_total``: counted when
  an attempt starts, over every replica); the proxies' migrations, retries and
  ejections. The soak reads once more right before each fault, so a proxy replica
  killed under its streams has had them counted.
- Events: each proxy replica's ``/status`` events (``ejected``, ``node unhealthy``),
  with their times, once each.
- Processes: RSS and open files of every process of the cluster's tree, so the
  report can show what grew over the run.

A counter's rise between the last read and a kill is not seen: the duplicate count
(leader requests beyond the proxies' attempts) is exact only up to that.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from neuron_serving.bench.common import metric_sum

INTERVAL_S = 2.0


def _get(url: str, token: str | None = None, timeout: float = 3.0) -> str | None:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return None


@dataclass
class Counter:
    """A monotonic total over a series whose source may restart at 0."""

    total: float = 0.0
    last: float | None = None

    def read(self, value: float) -> None:
        if self.last is not None:
            self.total += value - self.last if value >= self.last else value
        self.last = value


@dataclass
class Watch:
    run_dir: Path
    admin_token: str
    units: list[str]
    leader_requests: dict[str, Counter] = field(default_factory=dict)
    attempts: dict[str, Counter] = field(default_factory=dict)  # key: replica/unit
    proxy_counters: dict[str, Counter] = field(default_factory=dict)  # key: replica/name
    events: dict[tuple, dict[str, Any]] = field(default_factory=dict)
    processes: dict[int, dict[str, Any]] = field(default_factory=dict)
    reads: int = 0

    def state(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "supervisor.json").read_text())

    def leader_metrics_url(self, unit_id: str) -> str:
        config = yaml.safe_load((self.run_dir / "proxy-0.yaml").read_text())
        grpc = next(u["leader_grpc"] for u in config["units"] if u["unit_id"] == unit_id)
        host, port = grpc.rsplit(":", 1)
        return f"http://{host}:{int(port) + 1}/metrics"

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(INTERVAL_S):
            self.read()

    def read(self) -> None:
        self.reads += 1
        for unit in self.units:
            text = _get(self.leader_metrics_url(unit))
            if text is not None:
                value = metric_sum(text, "neuron_serving_triton_requests_total")
                self.leader_requests.setdefault(unit, Counter()).read(value)
        try:
            state = self.state()
        except (OSError, ValueError):
            return
        for replica in state.get("proxies", []):
            rid, admin = replica["replica_id"], replica["admin_url"]
            text = _get(f"{admin}/metrics", self.admin_token)
            if text is not None:
                for name, labels in (("proxy_migrations_total", {"outcome": "started"}),
                                     ("proxy_migrations_total", {"outcome": "not_resumable"}),
                                     ("proxy_retries_total", {"outcome": "retried"}),
                                     ("proxy_ejections_total", {})):  # fmt: skip
                    key = f"{rid}/{name}/{','.join(labels.values())}"
                    self.proxy_counters.setdefault(key, Counter()).read(
                        metric_sum(text, name, **labels)
                    )
            status = _get(f"{admin}/status", self.admin_token)
            if status is not None:
                body = json.loads(status)
                # Attempts as the proxy counts them when they start (a replica killed
                # under its streams has started them all; none has ended).
                for u in body.get("units", []):
                    if u.get("unit_id") in self.units:
                        key = f"{rid}/{u['unit_id']}"
                        self.attempts.setdefault(key, Counter()).read(u.get("requests_total", 0))
                for e in body.get("events", []):
                    self.events.setdefault((rid, e["at"], e["unit_id"], e["kind"]), {
                        "replica": rid, **e})  # fmt: skip
        self._sample_processes(state)

    def whole(self) -> bool:
        """Every unit is routable on every proxy replica (the fleet has recovered)."""
        try:
            replicas = self.state().get("proxies", [])
        except (OSError, ValueError):
            return False
        for replica in replicas:
            status = _get(f"{replica['admin_url']}/status", self.admin_token)
            if status is None:
                return False
            states = {u["unit_id"]: u["state"] for u in json.loads(status).get("units", [])}
            if any(states.get(u) != "routable" for u in self.units):
                return False
        return bool(replicas)

    def _sample_processes(self, state: dict[str, Any]) -> None:
        roots = [(g.get("unit_id") or g.get("replica_id"), p)
                 for g in [*state.get("units", []), *state.get("proxies", [])]
                 for p in g.get("processes", []) if p.get("running")]  # fmt: skip
        now = time.time()
        for owner, p in roots:
            try:
                root = psutil.Process(p["pid"])
                members = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for m in members:
                try:
                    with m.oneshot():
                        rss, fds, name = m.memory_info().rss, m.num_fds(), m.name()
                except psutil.Error:
                    continue
                rec = self.processes.setdefault(m.pid, {
                    "owner": f"{owner}/{p['name']}", "name": name, "first_at": now,
                    "first_rss_mb": rss / 2**20, "first_fds": fds})  # fmt: skip
                rec.update(last_at=now, last_rss_mb=rss / 2**20, last_fds=fds)

    # ---- figures ----------------------------------------------------------------------

    def totals(self, direct: dict[str, float] | None = None) -> dict[str, Any]:
        """The counters over the run; ``direct``: engine requests sent to a unit's leader
        on purpose, not through a proxy (a rollout's canaries)."""
        attempts = {u: sum(c.total for k, c in self.attempts.items() if k.endswith(f"/{u}"))
                    for u in self.units}  # fmt: skip
        direct = direct or {}
        leader = {u: self.leader_requests.get(u, Counter()).total - direct.get(u, 0.0)
                  for u in self.units}  # fmt: skip

        def proxy(name: str, label: str = "") -> float:
            return sum(c.total for k, c in self.proxy_counters.items()
                       if k.split("/", 1)[1] == f"{name}/{label}")  # fmt: skip

        return {
            "leader_requests": leader,  # less the direct ones
            "direct_requests": direct,
            "proxy_attempts": attempts,
            # Engine requests no proxy attempt accounts for: run twice (must be 0).
            "duplicated_engine_work": {u: max(0.0, leader[u] - attempts[u]) for u in self.units},
            "migrations": proxy("proxy_migrations_total", "started"),
            "not_resumable": proxy("proxy_migrations_total", "not_resumable"),
            "retries": proxy("proxy_retries_total", "retried"),
            "ejections": proxy("proxy_ejections_total"),
            "reads": self.reads,
        }

    def growth(self, min_lived_s: float) -> list[dict[str, Any]]:
        """Processes that lived at least ``min_lived_s``: RSS and open files first and last."""
        out = []
        for pid, r in sorted(self.processes.items()):
            if r["last_at"] - r["first_at"] >= min_lived_s:
                out.append({"pid": pid, "owner": r["owner"], "name": r["name"],
                            "lived_s": round(r["last_at"] - r["first_at"]),
                            "rss_mb": [round(r["first_rss_mb"], 1), round(r["last_rss_mb"], 1)],
                            "fds": [r["first_fds"], r["last_fds"]]})  # fmt: skip
        return out
