"""`neuron-serving bench scrape` (diagnostic): what monitoring costs each process.

A `neuron-serving up` cluster (the demo model, one unit of TP=2, one proxy replica,
its Prometheus scraping every ``INTERVAL_S``) is started; then:

1. idle, ``IDLE_S`` seconds: each process's CPU (``cpu.cpu_by_name`` over `up`'s
   tree, by process label) while only Prometheus scrapes: the standing cost of
   monitoring, Prometheus's own included;
2. ``SCRAPES`` scrapes of every endpoint the Prometheus scrapes (its file SD targets),
   back to back: each process's CPU per scrape, net of the idle rate over the same
   wall time, and what that costs at the scrape interval (per scrape / interval).

No request is served meanwhile: the cost of rendering an exposition grows with its
series (a unit's label sets), not with traffic. Results in results/scrape.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from neuron_serving.bench.common import spread, write_result

INTERVAL_S = 5.0
IDLE_S = 60.0
SCRAPES = 200
READY_TIMEOUT_S = 900.0


def _targets(run_dir: Path) -> list[tuple[str, str]]:
    """(job, host:port) of every endpoint in the cluster's file SD targets."""
    out = []
    for path in sorted((run_dir / "prometheus" / "targets").glob("*.json")):
        for group in json.loads(path.read_text()):
            out += [(path.stem, addr) for addr in group["targets"]]
    return out


def _scrape(addr: str, job: str, token: str) -> int:
    req = urllib.request.Request(f"http://{addr}/metrics")
    if job in ("proxies", "supervisor"):
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return len(r.read())


def measure(up_pid: int, run_dir: Path, idle_s: float, scrapes: int) -> dict[str, Any]:
    from neuron_serving.bench.cpu import cpu_by_name

    token = (run_dir / "admin-token").read_text().strip()
    before, t0 = cpu_by_name(up_pid), time.monotonic()
    time.sleep(idle_s)
    after, wall = cpu_by_name(up_pid), time.monotonic() - t0
    idle_rate = {k: max(0.0, after.get(k, 0.0) - v) / wall for k, v in before.items()}
    per_job: dict[str, Any] = {}
    for job, addr in _targets(run_dir):
        before, t0 = cpu_by_name(up_pid), time.monotonic()
        sizes = [_scrape(addr, job, token) for _ in range(scrapes)]
        after, wall = cpu_by_name(up_pid), time.monotonic() - t0
        used = {k: max(0.0, after.get(k, 0.0) - v - idle_rate.get(k, 0.0) * wall) / scrapes
                for k, v in before.items()}  # fmt: skip
        busy = {k: round(v * 1e3, 3) for k, v in used.items() if v * 1e3 >= 0.01}
        per_job[f"{job} {addr}"] = {
            "bytes": spread([float(s) for s in sizes])["median"],
            "cpu_ms_per_scrape": busy,
            "cpu_ms_per_scrape_total": round(sum(busy.values()), 3),
            "core_share_at_interval": round(sum(used.values()) / INTERVAL_S, 5),
        }
    return {
        "idle_cpu_core_share": {k: round(v, 5) for k, v in sorted(idle_rate.items()) if v > 1e-4},
        "scrapes": per_job,
    }


def main(quick: bool, emit_json: bool) -> int:
    """``quick``: 20 s idle and 50 scrapes an endpoint instead of 60 s and 200."""
    from neuron_serving.models.demo import build_demo_model
    from neuron_serving.ports import free_port_block

    idle_s, scrapes = (20.0, 50) if quick else (IDLE_S, SCRAPES)
    with tempfile.TemporaryDirectory(prefix="ns-bench-scrape-") as tmp:
        work = Path(tmp)
        model = build_demo_model(work / "demo", seed=0)
        base = free_port_block(40)
        run_dir = work / "run"
        argv = [sys.executable, "-m", "neuron_serving.cli", "up", "--model", str(model),
                "--units", "1", "--tp", "2", "--port", str(base), "--admin-port",
                str(base + 1), "--base-port", str(base + 2), "--run-dir", str(run_dir),
                "--max-model-len", "256", "--enforce-eager", "--prometheus-port", "0",
                "--scrape-interval", f"{INTERVAL_S:g}"]  # fmt: skip
        log = open(work / "up.log", "wb")  # noqa: SIM115 (closed below)
        up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while b"prometheus: http" not in (work / "up.log").read_bytes():
                if up.poll() is not None or time.monotonic() > deadline:
                    tail = (work / "up.log").read_text(errors="replace")[-3000:]
                    print(f"up did not start with its Prometheus:\n{tail}", file=sys.stderr)
                    return 1
                time.sleep(1.0)
            time.sleep(3 * INTERVAL_S)  # targets written, a few scrapes done
            result = measure(up.pid, run_dir, idle_s, scrapes)
        finally:
            up.terminate()
            try:
                up.wait(timeout=180)
            except subprocess.TimeoutExpired:
                up.kill()
            log.close()
    result["workload"] = {"cluster": "up: demo model, 1 unit x TP=2, 1 proxy, Prometheus",
                          "interval_s": INTERVAL_S, "idle_s": idle_s,
                          "scrapes_per_endpoint": scrapes}  # fmt: skip
    path = write_result("scrape", result)
    for name, r in result["scrapes"].items():
        print(f"{name}: {r['bytes']:.0f} bytes, {r['cpu_ms_per_scrape_total']:.2f} ms CPU a "
              f"scrape ({r['cpu_ms_per_scrape']}), {100 * r['core_share_at_interval']:.3f}% of a "
              f"core at {INTERVAL_S:g} s", file=sys.stderr)  # fmt: skip
    print(f"idle (Prometheus scraping): {result['idle_cpu_core_share']}", file=sys.stderr)
    print(f"scrape -> {path}", file=sys.stderr)
    if emit_json:
        print(json.dumps({k: v["cpu_ms_per_scrape_total"] for k, v in result["scrapes"].items()}))
    return 0
