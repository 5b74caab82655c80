"""`neuron-serving bench soak`: a real cluster under mixed traffic and faults.

The cluster: `neuron-serving up` (2 units of TP=2 on the demo model by default, 2
proxy replicas, the progress and silence settings of production). Its users:
``clients.py`` (streams greedy and sampled, with tools, structured outputs, long
non-streamed completions, ``n``, clients that leave and clients that read slowly) and
one Batch API batch. Its faults: a seeded schedule (``neuron_serving/faults``), or
``--faults FILE``. While it runs, ``watch.py`` reads the leaders' and proxies'
counters, the proxies' events and every process's RSS and open files.

What it reports (``bench/results/soak.json``, ``soak-quick.json`` with ``--quick``):
per kind of request, how many completed, were left on purpose, ended with a
retriable error, with another 5xx or 4xx, and were **lost** (must be 0); engine
requests beyond the proxies' attempts (**duplicated engine work**, must be 0);
**false ejections** (a unit ejected or a node marked unhealthy with no kill or stop on
that unit then or in the ``RECOVERY_S`` before, nor a rollout: a throttled rank is
slow, not dead, and excuses nothing: must be 0); the faults as applied; the
processes' growth; TTFT and ITL p50/p99 per window (and a plot, ``soak.png``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuron_serving.bench.cluster import UpRun
from neuron_serving.bench.common import RESULTS_DIR, git_commit, percentile, publish
from neuron_serving.bench.soak.clients import MIX, THINK_S, Clients, Outcome
from neuron_serving.bench.soak.rollout import deploy, prepare_versions
from neuron_serving.bench.soak.watch import Watch
from neuron_serving.faults.injector import Injector
from neuron_serving.faults.schedule import Fault, FaultSchedule, generate, load
from neuron_serving.local.cache import demo_model_dir

DURATION_S = 1800.0
QUICK_DURATION_S = 300.0
CLIENTS = 6
UNITS, TP, PROXIES = 2, 2, 2
# After a fault on a unit ends, how long its ejection or unhealthy nodes are the
# fault's doing, and how long the next fault waits for the fleet to be whole. A
# unit recreated while the others serve shares their 2 cores here and starts several
# times slower than on an idle host (bench/README.md, "soak").
RECOVERY_S = 300.0
WINDOW_S = 30.0
# A request still open this long after the clients were told to stop is lost.
DRAIN_S = 240.0
BATCH_LINES = 24
# When the checkpoint rollout starts, as a fraction of the run.
ROLLOUT_AT = 0.4


def main(
    quick: bool, model: str | None, emit_json: bool, repeats: int | None = None, *,
    duration_s: float | None = None, seed: int = 0, faults_file: str | None = None,
) -> int:  # fmt: skip
    duration = duration_s or (QUICK_DURATION_S if quick else DURATION_S)
    schedule = load(faults_file) if faults_file else generate(seed, duration, UNITS, TP, PROXIES)
    args = ["--units", str(UNITS), "--tp", str(TP), "--proxies", str(PROXIES),
            "--max-model-len", "2048", "--max-num-seqs", "16"]  # fmt: skip
    # The cluster serves a sharded v1; v2 is rolled out mid-run (rollout.py).
    versions = Path(tempfile.mkdtemp(prefix="ns-bench-soak-versions-"))
    first = prepare_versions(model or str(demo_model_dir()), TP, versions)
    args += ["--model", str(first)]
    run = UpRun("ns-bench-soak-", args)
    result: dict[str, Any] = {"command": " ".join(run.args[2:]), "log": str(run.log_path),
                              "duration_s": duration, "seed": seed, "quick": quick,
                              "schedule": [f.describe() for f in schedule.faults]}  # fmt: skip
    rc = 0
    try:
        result["ready_s"] = round(run.wait_ready(), 1)
        state = run.state()
        result.update(soak(run.url, run.api_key(), run.run_dir, state["served_model_name"],
                           schedule, duration, seed,
                           rollout=lambda: deploy(run.url, run.run_dir, versions),
                           rollout_at_s=duration * ROLLOUT_AT))  # fmt: skip
        rc = 1 if any(result["zero_counts"].values()) else 0
    except Exception as e:  # noqa: BLE001 (reported in the result)
        result["error"] = f"{type(e).__name__}: {e}"
        rc = 1
    finally:
        result["leftover_processes"] = run.stop()
        shutil.rmtree(versions, ignore_errors=True)
    name = "soak-quick" if quick else "soak"
    result["plot"] = _plot(result, RESULTS_DIR / f"{name}.png")
    publish(name, result, ("zero_counts",), emit_json)
    return rc


def soak(
    url: str, api_key: str, run_dir: Path, model: str, schedule: FaultSchedule,
    duration: float, seed: int, clients: int = CLIENTS, long_tokens: int = 1500,
    mix: dict[str, int] | None = None, rollout: Callable[[], dict[str, Any]] | None = None,
    rollout_at_s: float = 0.0, think_s: float = THINK_S,
) -> dict[str, Any]:  # fmt: skip
    """Run the clients, the batch and the schedule against the running cluster of
    ``run_dir`` (`up`'s) for ``duration`` seconds; the counts and figures (the module
    docstring). ``rollout``, if given, runs at ``rollout_at_s`` between two faults
    (a deploy under traffic: it must fail nothing). The e2e soak calls this on a
    cluster the tests share."""
    watch = Watch(run_dir, (run_dir / "admin-token").read_text().strip(),
                  [u["unit_id"] for u in json.loads((run_dir / "supervisor.json").read_text())
                   ["units"]])  # fmt: skip
    stop = threading.Event()
    injector = Injector(run_dir)
    t0 = time.monotonic()
    windows: list[tuple[str | None, float, float]] = []  # (unit or None: a proxy, start, end)
    # Where units are drained and recreated on purpose: (None: any unit, start, end).
    deploys: list[tuple[str | None, float, float]] = []
    rolled: list[dict[str, Any]] = []
    delays: list[float] = []  # how long each fault waited for the fleet to recover

    def fault_active() -> bool:
        now = time.monotonic() - t0
        return any(s - 5 <= now <= e + RECOVERY_S for _, s, e in windows)

    users = Clients(url, api_key, model, seed, long_tokens=long_tokens, think_s=think_s,
                    fault_active=fault_active, mix=dict(mix or MIX), t0=t0)  # fmt: skip
    watch.read()
    watcher = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    watcher.start()
    threads = users.run(clients, stop)
    batch = _Batch(url, api_key, model)
    batch.submit()
    events: list[tuple[float, Fault | None]] = [(f.at_s, f) for f in schedule.faults]
    if rollout is not None:
        events.append((rollout_at_s, None))  # None: the rollout
    events.sort(key=lambda e: e[0])
    try:
        for at_s, fault in events:
            if stop.wait(max(0.0, t0 + at_s - time.monotonic())):
                break
            if at_s >= duration:
                break
            # One fault at a time: the next waits for the fleet to be whole again, so a
            # schedule never turns into an outage of every unit (which would be the
            # schedule's doing, not the fleet's).
            waited = time.monotonic()
            while not watch.whole() and time.monotonic() - waited < RECOVERY_S:
                if stop.wait(1.0):
                    break
            delays.append(round(time.monotonic() - waited, 1))
            if time.monotonic() - t0 >= duration:
                break  # recovery took the rest of the run: the fault is not applied
            watch.read()  # the counters right before the fault (a proxy kill loses none)
            now = time.monotonic() - t0
            if fault is None:
                assert rollout is not None
                rolled.append({"at_s": round(now, 1), **rollout()})
                deploys.append((None, now, time.monotonic() - t0))
                continue
            if fault.kind != "throttle":
                # A throttled rank is slow, not dead: it excuses no ejection and no error.
                windows.append((fault.unit, now, now + fault.duration_s))
            injector.apply(fault)
        stop.wait(max(0.0, t0 + duration - time.monotonic()))
    finally:
        stop.set()
        injector.close()
    drained = time.monotonic()
    for t in threads:
        t.join(max(0.1, drained + DRAIN_S - time.monotonic()))
    still_open = sum(t.is_alive() for t in threads)
    batch_result = batch.wait(120.0)
    watch.read()
    outcomes = list(users.outcomes)
    direct = Tally[str]()
    for r in rolled:
        direct.update(r.get("canary_requests", {}))
    totals = watch.totals(dict(direct))
    false = _false_ejections(watch, windows + deploys, t0)
    by_kind = {k: dict(Tally(o.status for o in outcomes if o.kind == k)) for k in users.mix}
    statuses = Tally(o.status for o in outcomes)
    return {
        "requests": len(outcomes),
        "by_kind": by_kind,
        "statuses": dict(statuses),
        "zero_counts": {
            "lost": statuses.get("lost", 0) + still_open,
            "duplicated_engine_work_total": sum(totals["duplicated_engine_work"].values()),
            "false_ejections": len(false),
            "error_5xx": statuses.get("error_5xx", 0),
            "error_4xx": statuses.get("error_4xx", 0),
            # A batch line is answered once, whatever fails meanwhile.
            "batch_lines_failed": batch_result.get("failed") or 0,
            "batch_lines_unfinished": BATCH_LINES - (batch_result.get("completed") or 0)
            - (batch_result.get("failed") or 0),
            # Asked for, and either not run (the run ended first) or not successful.
            "rollouts_failed": int(rollout is not None and not any(r["rc"] == 0 for r in rolled)),
        },
        "rollouts": rolled,
        "unexpected": [o.__dict__ | {"itl_s": None} for o in outcomes
                       if o.status in ("lost", "error_5xx", "error_4xx")][:50],  # fmt: skip
        "counters": totals,
        "false_ejections": false,
        "faults": [r.to_dict() for r in injector.applied],
        "fault_delays_s": delays,
        "batch": batch_result,
        "growth": watch.growth(min_lived_s=duration * 0.8),
        "windows": _latency_windows(outcomes),
        "long_completion_s": sorted(round(o.end - o.start, 1) for o in outcomes
                                    if o.kind == "completion_long" and o.status == "completed"),
    }  # fmt: skip


def _false_ejections(watch: Watch, windows: list, t0: float) -> list[dict[str, Any]]:
    """Ejections and unhealthy nodes of a unit with no fault on it then or in the
    ``RECOVERY_S`` before (a proxy replica's kill counts for every unit: a restarted
    replica probes every node afresh)."""
    wall0 = time.time() - (time.monotonic() - t0)
    out = []
    for e in watch.events.values():
        if e["kind"] not in ("ejected", "node unhealthy"):
            continue
        at = e["at"] - wall0
        if at < 0:
            continue
        excused = any((unit is None or unit == e["unit_id"]) and s - 5 <= at <= end + RECOVERY_S
                      for unit, s, end in windows)  # fmt: skip
        if not excused:
            out.append({**e, "at_s": round(at, 1)})
    return out


def _latency_windows(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    out = []
    end = max((o.end for o in outcomes), default=0.0)
    t = 0.0
    while t < end:
        streams = [o for o in outcomes if t <= o.start < t + WINDOW_S and o.itl_s]
        ttft = [o.ttft_s for o in streams if o.ttft_s is not None]
        itl = [x for o in streams for x in o.itl_s]
        out.append({"t_s": t, "streams": len(streams),
                    "ttft_p50_s": percentile(ttft, 50) if ttft else None,
                    "ttft_p99_s": percentile(ttft, 99) if ttft else None,
                    "itl_p50_s": percentile(itl, 50) if itl else None,
                    "itl_p99_s": percentile(itl, 99) if itl else None})  # fmt: skip
        t += WINDOW_S
    return out


def _plot(result: dict[str, Any], path: Path) -> str | None:
    windows = result.get("windows")
    if not windows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ts = [w["t_s"] / 60 for w in windows]
    for ax, metric in zip(axes, ("ttft", "itl"), strict=True):
        for q, style in (("p50", "-"), ("p99", "--")):
            ys = [w[f"{metric}_{q}_s"] for w in windows]
            ax.plot(ts, [y if y is not None else float("nan") for y in ys], style,
                    label=f"{metric.upper()} {q}")  # fmt: skip
        ax.set_yscale("log")
        ax.set_ylabel("seconds")
        ax.legend(loc="upper left")
        for f in result.get("faults", []):
            ax.axvline(f["at_s"] / 60, color="red", alpha=0.4)
        for r in result.get("rollouts", []):
            ax.axvspan(r["at_s"] / 60, (r["at_s"] + r["s"]) / 60, color="blue", alpha=0.1)
    axes[0].set_title(f"soak ({git_commit()}): faults in red, the rollout in blue")
    axes[1].set_xlabel("minutes")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path.relative_to(path.parents[2]))


class _Batch:
    """One Batch API batch through the proxy: submitted at the start, polled at the end."""

    def __init__(self, url: str, key: str, model: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=60, max_retries=2)
        self.model = model
        self.id: str | None = None
        self.error: str | None = None

    def submit(self) -> None:
        import json

        lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST",
                             "url": "/v1/chat/completions",
                             "body": {"model": self.model, "max_tokens": 32, "temperature": 0.7,
                                      "messages": [{"role": "user",
                                                    "content": f"{i}: what tents do you sell?"}]}})
                 for i in range(BATCH_LINES)]  # fmt: skip
        try:
            f = self.client.files.create(file=("soak.jsonl", "\n".join(lines).encode()),
                                         purpose="batch")  # fmt: skip
            self.id = self.client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id
        except Exception as e:  # noqa: BLE001 (reported)
            self.error = f"{type(e).__name__}: {e}"

    def wait(self, timeout_s: float) -> dict[str, Any]:
        if self.id is None:
            return {"error": self.error}
        end = time.monotonic() + timeout_s
        b = None
        while time.monotonic() < end:
            try:
                b = self.client.batches.retrieve(self.id)
            except Exception as e:  # noqa: BLE001 - a proxy replica being recreated
                self.error = f"{type(e).__name__}: {e}"
                time.sleep(2)
                continue
            if b.status in ("completed", "failed", "cancelled", "expired"):
                break
            time.sleep(2)
        if b is None:
            return {"error": self.error}
        counts = b.request_counts
        return {"status": b.status, "lines": BATCH_LINES,
                "completed": counts.completed if counts else None,
                "failed": counts.failed if counts else None}  # fmt: skip
