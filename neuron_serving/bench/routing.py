"""Routing: prefix-cache-aware against round-robin and least-loaded, on 2 real units.

Two TP=1 leaders (tritonserver + vLLM with prefix caching, demo model; one core
each) behind one `neuron-serving proxy`, restarted per policy so its prefix index
starts empty. Workload (seeded): a shopping assistant's system prompt of ~450
tokens shared by every session, many multi-turn chat sessions (each turn resends
the whole history, the assistant's previous answers included), a fixed number of
sessions in flight, turns of a session in order. Each policy gets its own store
name at the very start of the system prompt, so vLLM's (hash-chained) prefix cache
holds nothing from an earlier policy: every policy starts cold.

Reported per policy: the prefix-cache hit rate from vLLM's own counters
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``, prompt tokens,
both units, delta over the policy's run), TTFT p50/p99 (client side, OpenAI
streaming), throughput, and the load spread (max/min requests per unit, from the
proxy's ``/status``). Target for prefix-aware: hit rate >= 0.8 with spread <= 1.5.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from neuron_serving.bench.common import percentile, write_result
from neuron_serving.bench.sse import StreamTiming, timed_stream
from neuron_serving.bench.stack import (
    Leader,
    metric,
    proxy_config,
    start_leader,
    start_proxy,
    wait_leaders,
)

TARGET_HIT_RATE = 0.8
TARGET_SPREAD = 1.5
MAX_MODEL_LEN = 1024
# (label, routing config). "prefix_cache_aware" runs with the proxy's defaults; the
# "-abs4" variant lowers balance_abs_threshold to 4 in-flight requests, for the case
# where a fleet's concurrency per unit is far below the default's 32.
POLICIES: list[tuple[str, dict[str, Any]]] = [
    ("prefix_cache_aware", {"policy": "prefix_cache_aware"}),
    ("prefix_cache_aware-abs4", {"policy": "prefix_cache_aware", "balance_abs_threshold": 4}),
    ("round_robin", {"policy": "round_robin"}),
    ("least_loaded", {"policy": "least_loaded"}),
]
STORES = ["Northwind Outfitters", "Alpine Trail Supply", "Harbor & Pine", "Summit Gear Co"]
SYSTEM = (
    "You are the shopping assistant of {store}, an outdoor equipment store with shops in "
    "Seattle, Denver and Boston and a web shop. Answer in two or three short sentences. "
    "Policies: free shipping on orders over 50 dollars; returns within 60 days with the "
    "receipt; price matching against local stores; members get 10 percent off and early "
    "access to sales. Departments: running shoes (road and trail, sizes 5 to 15, wide "
    "fits), hiking boots, tents (one to six people, three and four season), sleeping bags "
    "(rated from minus 20 to 50 degrees), backpacks (daypacks to 85 liters), rain jackets, "
    "insulated jackets, base layers, socks, climbing gear, kayaks and paddles, bikes and "
    "helmets, camp kitchens and stoves, water filters, headlamps and navigation. Never "
    "invent stock levels: when asked, say you will check the inventory. Recommend at most "
    "two products at a time, with their price, and ask one follow-up question about the "
    "customer's trip, size or budget. Be friendly and brief."
)
QUESTIONS = [
    "Do you have trail running shoes in size {n}?", "What tent would you suggest for {n} people?",
    "I need a rain jacket for a hike next week, budget {n}0 dollars.",
    "Which sleeping bag is warm enough for {n} degrees?", "Is there a {n}0 liter backpack on sale?",
    "Can I return boots I bought {n} weeks ago?", "Do members get free shipping on {n} items?",
    "What stove works for a group of {n}?", "Do you price match a jacket at {n}9 dollars?",
    "Which headlamp lasts {n} nights?", "Are there wide fit hiking boots in size {n}?",
    "What water filter do you have for a {n} day trip?",
]  # fmt: skip


def _sessions(n: int, turns: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[rng.choice(QUESTIONS).format(n=rng.randint(2, 9)) for _ in range(turns)]
            for _ in range(n)]  # fmt: skip


async def _session(
    s: aiohttp.ClientSession, url: str, system: str, questions: list[str], max_tokens: int,
    sid: int,
) -> list[StreamTiming]:  # fmt: skip
    messages = [{"role": "system", "content": system}]
    out = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        body = {"model": "llm", "messages": messages, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        t = await timed_stream(s, url, body, headers={"x-session-id": str(sid)})
        out.append(t)
        if t.error:
            break
        messages.append({"role": "assistant", "content": t.text})
    return out


async def _workload(url: str, system: str, sessions: list[list[str]], concurrency: int,
                    max_tokens: int) -> tuple[list[StreamTiming], float]:  # fmt: skip
    gate = asyncio.Semaphore(concurrency)

    async def one(sid: int, qs: list[str]) -> list[StreamTiming]:
        async with gate:
            return await _session(s, url, system, qs, max_tokens, sid)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, qs) for i, qs in enumerate(sessions)))
        wall = time.perf_counter() - start
    return [t for r in results for t in r], wall


def _cache(leaders: list[Leader]) -> list[tuple[float, float]]:
    return [(metric(ldr.metrics, "vllm:prefix_cache_hits_total"),
             metric(ldr.metrics, "vllm:prefix_cache_queries_total")) for ldr in leaders]  # fmt: skip


def _policy_run(label: str, routing: dict[str, Any], store: str, leaders: list[Leader],
                model_dir: Path, work: Path, sessions: list[list[str]], concurrency: int,
                max_tokens: int) -> dict[str, Any]:  # fmt: skip
    proxy = start_proxy(proxy_config(leaders, model_dir, MAX_MODEL_LEN, routing=routing), work,
                        name=f"proxy-{label}")  # fmt: skip
    try:
        before = _cache(leaders)
        url = f"{proxy.base}/v1/chat/completions"
        timings, wall = asyncio.run(
            _workload(url, SYSTEM.format(store=store), sessions, concurrency, max_tokens)
        )
        after = _cache(leaders)
        per_unit = {u["unit_id"]: u["requests_total"] for u in proxy.status()["units"]}
    finally:
        proxy.process.stop()
    hits = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    queries = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    ok = [t for t in timings if not t.error]
    ttft = [t.ttft_s for t in ok]
    counts = list(per_unit.values())
    load_spread = max(counts) / min(counts) if min(counts) > 0 else None  # None: a unit got 0
    return {
        "routing": routing,
        "hit_rate": sum(hits) / sum(queries) if sum(queries) else None,
        "hit_rate_per_unit": [h / q if q else None for h, q in zip(hits, queries, strict=True)],
        "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "requests": len(timings), "errors": len(timings) - len(ok),
        "first_error": next((t.error for t in timings if t.error), ""),
        "wall_s": wall, "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(t.chunks for t in ok) / wall,
        "requests_per_unit": per_unit, "load_spread": load_spread,
    }  # fmt: skip


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving.models.demo import build_demo_model

    n_sessions, turns, concurrency = (32, 4, 8) if quick else (96, 6, 16)
    max_tokens = 8 if quick else 16
    sessions = _sessions(n_sessions, turns, seed=0)
    results: dict[str, Any] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ns-bench-routing-") as tmp:
        work = Path(tmp)
        model_dir = Path(model) if model else build_demo_model(work / "demo", seed=0)
        # One core each: two leaders binding the same core would halve both.
        leaders = [start_leader(model_dir, work, f"leader-{i}", cpu_bind=str(i),
                                max_model_len=MAX_MODEL_LEN) for i in range(2)]  # fmt: skip
        try:
            wait_leaders(leaders)
            for (label, routing), store in zip(POLICIES, STORES, strict=True):
                results[label] = r = _policy_run(label, routing, store, leaders, model_dir, work,
                                                 sessions, concurrency, max_tokens)  # fmt: skip
                print(f"{label}: hit rate {r['hit_rate']:.3f}, spread {r['load_spread']}, "
                      f"TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms, "
                      f"{r['requests_per_s']:.2f} req/s, per unit {r['requests_per_unit']}",
                      file=sys.stderr, flush=True)  # fmt: skip
        finally:
            for ldr in leaders:
                ldr.process.stop()
    pa = results["prefix_cache_aware"]
    met = (pa["hit_rate"] or 0) >= TARGET_HIT_RATE and (
        pa["load_spread"] is not None and pa["load_spread"] <= TARGET_SPREAD
    )
    result = {
        "workload": {
            "units": 2,
            "tp": 1,
            "sessions": n_sessions,
            "turns": turns,
            "concurrent_sessions": concurrency,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "system_prompt_chars": len(SYSTEM.format(store=STORES[0])),
            "model": "demo" if model is None else model,
            "seed": 0,
            "cpu_bind": ["0", "1"],
            "api": "OpenAI chat completions, streamed",
        },  # fmt: skip
        # On a shared 2-core machine other work shifts TTFT and throughput (not hit rates).
        "machine_load": {
            "load_avg_1m_start": load_before[0],
            "load_avg_1m_end": os.getloadavg()[0],
        },  # fmt: skip
        "policies": results,
        "targets": {"hit_rate": TARGET_HIT_RATE, "load_spread": TARGET_SPREAD},
        "met_by_prefix_cache_aware_defaults": met,
        "note": "load_spread null means one unit received no request (spread infinite)",
    }
    path = write_result("routing" + ("-quick" if quick else ""), result)
    print(f"routing -> {path}", file=sys.stderr)
    if emit_json:
        print(json.dumps({k: {"hit_rate": v["hit_rate"], "load_spread": v["load_spread"]}
                          for k, v in results.items()}))  # fmt: skip
    return 0 if all(r["errors"] == 0 for r in results.values()) else 1
