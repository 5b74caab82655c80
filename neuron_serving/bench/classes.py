"""`neuron-serving bench classes`: real-time chat beside a batch backlog, three ways,
with two reference arms.

One `neuron-serving up` cluster (2 units of --tp ranks, default 1; see TP), one run,
arms in this order in every repeat, so drift hits every arm alike across repeats:

- capacities (once, first): a closed loop twice as deep as the fleet's running batch
  (units x max_num_seqs) for WINDOW seconds, of batch-shaped requests (the fleet's
  saturated output tokens/s, C) and of real-time chat streams (saturated streams/s,
  R; streams cost the proxy and the client more per token than whole answers);
- (a) real-time alone: chat streams arriving as a Poisson process at R/2 (half the
  fleet), for WINDOW seconds; time to first token per request;
- (b) classes: the same real-time arrivals while a Batch API batch (submitted through
  /v1/files and /v1/batches, class batch) large enough to outlast the window runs;
  batch output tokens/s in the window from its request_counts;
- (c) naive: the same real-time arrivals while the same batch work is sent as
  ordinary requests (class real-time, so first come, first served in the proxy and in
  the engine) by a closed loop as deep as the Batch API's lines in flight;
- (f) the host's sensitivity: the same real-time arrivals beside one process per CPU
  that spins a Python loop at SCHED_IDLE, the lowest CPU priority Linux has, and does
  no serving work; with the CPU the spinners got. Not a target's arm: what any other
  runnable work costs real-time on this host, at the lowest priority there is;
- (a2) real-time alone again, last: not a target's arm but the measurement's own
  spread. A p99 is the slowest 1% of one window's requests, and the ratio of two
  windows of the same arm (a2 over a) says how far a ratio moves with nothing changed.

Targets (issue 19): real-time TTFT p99 in (b) within 1.1x of (a), (c) beside it;
batch tokens/s in (b) at least 80% of the capacity real-time leaves idle, measured
as the fleet's saturated throughput minus real-time's share of it: the batch
tokens/s of arm (c), where batch work saturates the fleet beside the same real-time
load, which is served whole (the estimate C x (1 - real-time's share of R) is
reported beside it); no real-time request shed or refused while batch work waits
(the proxy's per-class counters, client errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import psutil

from neuron_serving.bench.cluster import UpRun
from neuron_serving.bench.common import percentile, publish, spread

# Units of one rank each by default. Two TP=2 units on this 2-core box put a rank of
# each unit on every core, and vLLM's shared-memory all-reduce waits by polling, so
# one unit's ranks stall the other's: steps of 0.5-1 s at half load, real-time TTFT
# p99 alone 30x its p50 (devices/README.md, "CPU all-reduce").
# That noise is the engines', not flow control's, and it swamped the p99 ratio this
# benchmark exists to measure; --tp 2 still runs the multi-rank shape.
TP = 1
RT_MAX_TOKENS = 24
BATCH_MAX_TOKENS = 32
WORDS = "red green blue shoe cart price size brand sale ship coffee maker stock".split()


def _prompt(rng: random.Random, n: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Load:
    def __init__(self, url: str, key: str, model: str) -> None:
        self.url, self.model = url, model
        self.headers = {"Authorization": f"Bearer {key}"}
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Load:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600, sock_read=300),
            connector=aiohttp.TCPConnector(limit=0),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    async def chat(self, rng: random.Random) -> tuple[float | None, str | None]:
        """One real-time chat stream: (TTFT s, error)."""
        assert self.session is not None
        body = {"model": self.model, "stream": True, "max_tokens": RT_MAX_TOKENS,
                "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": _prompt(rng)}]}  # fmt: skip
        t0 = time.monotonic()
        try:
            async with self.session.post(f"{self.url}/v1/chat/completions", json=body,
                                         headers=self.headers) as r:  # fmt: skip
                if r.status != 200:
                    return None, f"{r.status}: {(await r.text())[:200]}"
                ttft = None
                async for line in r.content:
                    if ttft is None and line.startswith(b"data: {") and b'"content"' in line:
                        ttft = time.monotonic() - t0
                return ttft, None if ttft is not None else "no token"
        except (aiohttp.ClientError, TimeoutError) as e:
            return None, f"{type(e).__name__}: {e}"

    async def completion(self, rng: random.Random) -> int:
        """One batch-shaped request as an ordinary one; its completion tokens."""
        assert self.session is not None
        body = {"model": self.model, "prompt": _prompt(rng), "max_tokens": BATCH_MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        try:
            async with self.session.post(f"{self.url}/v1/completions", json=body,
                                         headers=self.headers) as r:  # fmt: skip
                if r.status != 200:
                    await r.read()
                    await asyncio.sleep(0.2)
                    return 0
                return (await r.json())["usage"]["completion_tokens"]
        except (aiohttp.ClientError, TimeoutError):
            await asyncio.sleep(0.2)
            return 0

    async def chat_tokens(self, rng: random.Random) -> int:
        ttft, error = await self.chat(rng)
        if error is not None:
            await asyncio.sleep(0.2)
        return RT_MAX_TOKENS if error is None else 0

    async def closed_loop(
        self, depth: int, stop: asyncio.Event, out: list[tuple[float, int]], chat: bool = False
    ):
        rng = random.Random(7)
        call = self.chat_tokens if chat else self.completion

        async def worker() -> None:
            while not stop.is_set():
                n = await call(rng)
                out.append((time.monotonic(), n))

        await asyncio.gather(*(worker() for _ in range(depth)))

    async def poisson(
        self, rate: float, window_s: float, seed: int
    ) -> list[tuple[float | None, str | None]]:
        rng = random.Random(seed)
        tasks = []
        end = time.monotonic() + window_s
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(self.chat(random.Random(rng.random()))))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))

    # ---- the Batch API ----------------------------------------------------------------

    async def submit_batch(self, lines: int, seed: int) -> str:
        assert self.session is not None
        rng = random.Random(seed)
        data = "".join(
            json.dumps(
                {
                    "custom_id": f"l{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {
                        "model": self.model,
                        "prompt": _prompt(rng),
                        "max_tokens": BATCH_MAX_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                }
            )
            + "\n"  # fmt: skip
            for i in range(lines)
        ).encode()
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename="bench.jsonl")
        async with self.session.post(f"{self.url}/v1/files", data=form, headers=self.headers) as r:
            r.raise_for_status()
            fid = (await r.json())["id"]
        body = {"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}
        async with self.session.post(f"{self.url}/v1/batches", json=body,
                                     headers=self.headers) as r:  # fmt: skip
            r.raise_for_status()
            return (await r.json())["id"]

    async def batch(self, bid: str) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.get(f"{self.url}/v1/batches/{bid}", headers=self.headers) as r:
            return await r.json()

    async def cancel(self, bid: str) -> None:
        assert self.session is not None
        async with self.session.post(f"{self.url}/v1/batches/{bid}/cancel",
                                     headers=self.headers) as r:  # fmt: skip
            await r.read()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and (await self.batch(bid))["status"] not in (
            "cancelled",
            "completed",
            "failed",
        ):
            await asyncio.sleep(1.0)

    async def all_routable(self, timeout_s: float = 900.0) -> None:
        """Every arm starts on the whole fleet: a unit being recreated (see the
        result's unit_restarts) is waited for, not measured around."""
        assert self.session is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            async with self.session.get(f"{self.url}/status", headers=self.headers) as r:
                units = (await r.json())["units"]
            if units and all(u["state"] == "routable" for u in units):
                return
            await asyncio.sleep(1.0)
        raise TimeoutError("units not all routable")

    async def max_num_seqs(self) -> int | None:
        """The largest max_num_seqs the units' engines have reported to the proxy."""
        assert self.session is not None
        async with self.session.get(f"{self.url}/status", headers=self.headers) as r:
            units = (await r.json())["units"]
        seqs = [(u["engine_load"] or {}).get("max_num_seqs") or 0 for u in units]
        return max(seqs, default=0) or None

    async def classes(self) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.get(f"{self.url}/status", headers=self.headers) as r:
            return (await r.json())["admission"]["classes"]


# Spins until its parent (the bench) is gone, so a bench killed by a signal leaves no
# spinner behind; the bench lowers it to SCHED_IDLE right after it starts.
_IDLE_SPIN = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


@contextlib.contextmanager
def idle_spinners(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` processes spinning at SCHED_IDLE while the block runs; killed after it.
    Setting the policy from here raises if the host refuses it, rather than leaving
    the arm to measure real-time alone under another name."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _IDLE_SPIN, str(os.getpid())]))
            os.sched_setscheduler(procs[-1].pid, os.SCHED_IDLE, os.sched_param(0))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def busy_and_total(times: Any) -> tuple[float, float]:
    """(busy, total) CPU seconds of ``psutil.cpu_times()``: busy is user + nice + system
    + irq + softirq; idle, iowait and steal (the hypervisor running something else)
    count in the total only; guest time is already inside user and nice."""
    busy = times.user + times.nice + times.system + times.irq + times.softirq
    return busy, busy + times.idle + times.iowait + times.steal


class HostCpu:
    """The host's CPU busy fraction over a span (every process: the servers', the
    client's, a spinner's), to say how much of the box an arm used."""

    def __init__(self) -> None:
        self.start = busy_and_total(psutil.cpu_times())

    def busy(self) -> float:
        busy, total = busy_and_total(psutil.cpu_times())
        return round((busy - self.start[0]) / max(1e-9, total - self.start[1]), 3)


def process_cpu_s(procs: list[subprocess.Popen[bytes]]) -> float:
    """CPU seconds (user + system) these processes have used."""
    return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)


def _rt_summary(results: list[tuple[float | None, str | None]], window_s: float) -> dict[str, Any]:
    ttfts = [t for t, e in results if e is None and t is not None]
    errors = [e for _, e in results if e is not None]
    return {
        "requests": len(results),
        "errors": len(errors),
        "error_samples": errors[:3],
        "ttft_p50_s": round(percentile(ttfts, 50), 4),
        "ttft_p99_s": round(percentile(ttfts, 99), 4),
        "rt_tokens_per_s": round(len(ttfts) * RT_MAX_TOKENS / window_s, 1),
    }


def _tokens_in(done: list[tuple[float, int]], t0: float, t1: float) -> int:
    return sum(n for t, n in done if t0 <= t <= t1)


async def _run(run: UpRun, quick: bool, repeats: int) -> dict[str, Any]:
    state = run.state()
    model = state["served_model_name"]
    units = len(state["units"])
    seqs = 16  # fallback until the leaders have reported their max_num_seqs (below)
    window = 30.0 if quick else 90.0
    async with Load(run.url, run.api_key(), model) as load:
        # Warm-up: compile paths, caches.
        await asyncio.gather(*(load.chat(random.Random(i)) for i in range(8)))
        # The engines' running-batch bound as the leaders report it (up's --max-num-seqs).
        seqs = await load.max_num_seqs() or seqs

        # Capacities: the fleet saturated with batch-shaped work (C, tokens/s), and
        # with real-time chat streams (requests/s): real-time then arrives at half the
        # latter, and leaves (1 - its share) of C to batch work.
        async def saturated(chat: bool) -> float:
            await load.all_routable()
            stop = asyncio.Event()
            done: list[tuple[float, int]] = []
            # Twice the fleet's running batch: a request spends part of its life outside
            # its engine (in the client, in the proxy, relaying its answer), so a loop
            # only as deep as units x max_num_seqs leaves every engine short of full.
            # Flow control holds the excess in the proxy.
            task = asyncio.create_task(load.closed_loop(2 * units * seqs, stop, done, chat=chat))
            await asyncio.sleep(5.0)
            t0 = time.monotonic()
            await asyncio.sleep(window)
            t1 = time.monotonic()
            stop.set()
            await task
            if chat:
                return sum(1 for t, n in done if t0 <= t <= t1 and n) / (t1 - t0)
            return _tokens_in(done, t0, t1) / (t1 - t0)

        capacity = await saturated(chat=False)
        rt_capacity = await saturated(chat=True)
        rate = 0.5 * rt_capacity
        print(f"capacity {capacity:.0f} tok/s (batch-shaped), {rt_capacity:.1f} chat streams/s;"
              f" real-time at {rate:.2f} req/s", file=sys.stderr)  # fmt: skip
        before = await load.classes()
        arms: dict[str, list[dict[str, Any]]] = {"a": [], "b": [], "c": [], "f": [], "a2": []}
        for rep in range(repeats):
            await load.all_routable()
            # (a) real-time alone
            cpu = HostCpu()
            res = await load.poisson(rate, window, seed=100 + rep)
            arms["a"].append({**_rt_summary(res, window), "host_cpu_busy": cpu.busy()})
            print(f"rep {rep} (a) {arms['a'][-1]}", file=sys.stderr, flush=True)
            await load.all_routable()
            # (b) real-time + a Batch API batch
            lines = int(1.5 * capacity * (window + 20) / BATCH_MAX_TOKENS)
            bid = await load.submit_batch(lines, seed=rep)
            while (await load.batch(bid))["request_counts"]["completed"] < 10:
                await asyncio.sleep(0.5)
            c0, t0 = (await load.batch(bid))["request_counts"]["completed"], time.monotonic()
            cpu = HostCpu()
            res = await load.poisson(rate, window, seed=100 + rep)
            c1, t1 = (await load.batch(bid))["request_counts"]["completed"], time.monotonic()
            busy = cpu.busy()
            await load.cancel(bid)
            summary = {**_rt_summary(res, window), "host_cpu_busy": busy}
            summary["batch_tokens_per_s"] = round((c1 - c0) * BATCH_MAX_TOKENS / (t1 - t0), 1)
            summary["batch_lines"] = lines
            arms["b"].append(summary)
            print(f"rep {rep} (b) {summary}", file=sys.stderr, flush=True)
            await load.all_routable()
            # (c) naive: the batch work as ordinary requests, first come first served
            stop = asyncio.Event()
            done: list[tuple[float, int]] = []
            loop_task = asyncio.create_task(load.closed_loop(64, stop, done))
            await asyncio.sleep(5.0)
            t0, cpu = time.monotonic(), HostCpu()
            res = await load.poisson(rate, window, seed=100 + rep)
            t1, busy = time.monotonic(), cpu.busy()
            stop.set()
            await loop_task
            summary = {**_rt_summary(res, window), "host_cpu_busy": busy}
            summary["batch_tokens_per_s"] = round(_tokens_in(done, t0, t1) / (t1 - t0), 1)
            arms["c"].append(summary)
            print(f"rep {rep} (c) {summary}", file=sys.stderr, flush=True)
            await load.all_routable()
            # (f) what other runnable work costs real-time here, at the lowest priority
            with idle_spinners(os.cpu_count() or 1) as spinners:
                await asyncio.sleep(1.0)
                cpu, spun = HostCpu(), process_cpu_s(spinners)
                t0 = time.monotonic()
                res = await load.poisson(rate, window, seed=100 + rep)
                busy = cpu.busy()
                spun = (process_cpu_s(spinners) - spun) / (time.monotonic() - t0)
            arms["f"].append({**_rt_summary(res, window), "host_cpu_busy": busy,
                              "spinners_cpus_used": round(spun, 3)})  # fmt: skip
            print(f"rep {rep} (f) {arms['f'][-1]}", file=sys.stderr, flush=True)
            await load.all_routable()
            # (a2) real-time alone again: the spread of the p99 ratio itself
            cpu = HostCpu()
            res = await load.poisson(rate, window, seed=100 + rep)
            arms["a2"].append({**_rt_summary(res, window), "host_cpu_busy": cpu.busy()})
            print(f"rep {rep} (a2) {arms['a2'][-1]}", file=sys.stderr, flush=True)
        after = await load.classes()
    rt_rejected = {k: after["real-time"][k] - before["real-time"][k]
                   for k in ("shed", "refused", "deadline_misses")}  # fmt: skip
    p99 = {arm: [r["ttft_p99_s"] for r in rs] for arm, rs in arms.items()}
    ratio_b = [b / a for a, b in zip(p99["a"], p99["b"], strict=True)]
    ratio_c = [c / a for a, c in zip(p99["a"], p99["c"], strict=True)]
    ratio_f = [f / a for a, f in zip(p99["a"], p99["f"], strict=True)]
    ratio_a2 = [a2 / a for a, a2 in zip(p99["a"], p99["a2"], strict=True)]
    # What real-time leaves idle, measured: the fleet saturated with batch work while
    # the same real-time load runs beside it and is served whole (arm (c): first come
    # first served, so nothing holds batch back) = the saturated throughput minus
    # what real-time takes of it, in the same repeat. The verdict's denominator.
    idle = [c["batch_tokens_per_s"] for c in arms["c"]]
    batch_share = [b["batch_tokens_per_s"] / i for b, i in zip(arms["b"], idle, strict=True)]
    # Estimated, for information: C times the share of R real-time does not use. It
    # overstates the idle capacity on CPU engines, whose step has a large fixed cost:
    # real-time at half its saturated rate runs in smaller steps and so takes more
    # than half of the engines' time.
    estimated = [capacity * (1 - a["requests"] / window / rt_capacity) for a in arms["a"]]
    share_est = [b["batch_tokens_per_s"] / i for b, i in zip(arms["b"], estimated, strict=True)]
    return {
        "window_s": window,
        "repeats": repeats,
        "units": units,
        "capacity_tokens_per_s": round(capacity, 1),
        "rt_capacity_req_per_s": round(rt_capacity, 2),
        "idle_capacity_tokens_per_s": [round(i, 1) for i in idle],
        "estimated_idle_capacity_tokens_per_s": [round(i, 1) for i in estimated],
        "rt_rate_req_per_s": round(rate, 3),
        "arms": arms,
        "rt_ttft_p99_ratio_b_over_a": spread(ratio_b),
        "rt_ttft_p99_ratio_c_over_a": spread(ratio_c),
        "rt_ttft_p99_ratio_f_over_a": spread(ratio_f),
        "rt_ttft_p99_ratio_a2_over_a": spread(ratio_a2),
        "batch_share_of_idle_capacity_b": spread(batch_share),
        "batch_share_of_estimated_idle_capacity_b": spread(share_est),
        "rt_rejected_by_flow_control": rt_rejected,
        "rt_client_errors_b": sum(b["errors"] for b in arms["b"]),
        "targets": {
            "rt_ttft_p99_ratio_b_over_a": "<= 1.1",
            "batch_share_of_idle_capacity_b": ">= 0.8",
            "rt_rejected_by_flow_control": "all 0",
        },  # fmt: skip
    }


def main(
    quick: bool,
    model: str | None,
    emit_json: bool,
    repeats: int | None,
    tp: int = TP,
    admission: str | None = None,
) -> int:
    extra = ["--model", model] if model else []
    if admission is not None:
        extra += ["--admission", admission]
    run = UpRun("ns-bench-classes-", [*extra, "--tp", str(tp)])
    rc = 0
    result: dict[str, Any] = {"command": shlex.join(run.args[2:]), "log": str(run.log_path),
                              "tp": tp, "admission": admission}  # fmt: skip
    try:
        result["ready_s"] = round(run.wait_ready(), 1)
        result.update(asyncio.run(_run(run, quick, repeats or 2)))
        # A unit recreated during an arm skews it: reported, never hidden.
        result["unit_restarts"] = {u["unit_id"]: u["restarts"] for u in run.state()["units"]}
    except Exception as e:  # noqa: BLE001 (reported in the result)
        result["error"] = f"{type(e).__name__}: {e}"
        rc = 1
    finally:
        result["leftover_processes"] = run.stop()
    result["quick"] = quick
    publish("classes-quick" if quick else "classes", result,
            ("rt_ttft_p99_ratio_b_over_a", "rt_ttft_p99_ratio_c_over_a",
             "rt_ttft_p99_ratio_f_over_a", "rt_ttft_p99_ratio_a2_over_a",
             "batch_share_of_idle_capacity_b", "rt_rejected_by_flow_control"), emit_json)  # fmt: skip
    return rc
