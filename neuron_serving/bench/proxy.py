"""Proxy overhead: TTFT and ITL through the proxy against straight to the leader.

One real TP=1 unit (`neuron-serving leader`: tritonserver + vLLM, demo model) and
two `neuron-serving proxy` processes in front of it, one per upstream transport:
"proxy" reaches the leader over its OpenAI channel (the default), "proxy_grpc" over
Triton's gRPC ``ModelStreamInfer`` (``openai_channel: false``). Every
arm uses the same client and protocol, Triton's HTTP ``generate_stream`` (the proxy
serves it too, through its admission, routing and upstream), so the difference to
"direct" is the proxy hop alone. Per repeat: 64 concurrent streams per arm, arms
in a rotating order so drift on a shared machine hits all alike.
Every prompt starts with a unique number, so neither arm gets prefix-cache hits
the other did not. A sequential pass (one stream at a time, arms interleaved
request by request) measures the hop without queueing noise.

TTFT and ITL as in ``sse.py`` (ITL = time between consecutive output chunks of
one request, vLLM's definition). Added TTFT = proxy minus direct, per repeat,
p50 and p99; targets: p50 <= 1 ms, p99 <= 5 ms.

Throughput pass: ``THROUGHPUT_STREAMS`` (16) streams in flight, the serving
benchmark's load driver (``workload.run_load``), arms ``direct`` (the leader's
generate_stream), ``proxy`` (the same through the default proxy) and ``proxy_openai``
(OpenAI ``/v1/completions`` through the same proxy: vLLM's OpenAI layer on the leader,
bytes relayed), rotating order per repeat; ratio proxy / direct output tok/s
(target >= 0.95) and, for information, proxy_openai / direct.

The A/B difference also counts what the proxy's presence does to the engine on a
shared 2-core machine and when the last request of a 64-request burst reaches vLLM.
So each proxy batch also reads the proxy's own account of its hop, per request:
``proxy_added_time_to_first_token_seconds`` (TTFT at the proxy minus the unit's
time from request written to first response read; Envoy's downstream minus
upstream time), p50/p99 from the histogram's buckets as PromQL's
``histogram_quantile`` would give them, and the proxy process's CPU (user +
system, all threads) per streamed token. The top-level figures are the default
(channel) upstream's; ``grpc_upstream`` holds the same figures for the gRPC one.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from neuron_serving.bench.common import percentile, spread, write_result
from neuron_serving.bench.metrics import histogram_quantile
from neuron_serving.bench.sse import StreamTiming, timed_stream
from neuron_serving.bench.stack import (
    histogram,
    proxy_config,
    start_leader,
    start_proxy,
    wait_leaders,
)

# Throughput through the proxy at THROUGHPUT_STREAMS streams, against straight to
# the leader (the same generate_stream API and client): at least this ratio.
TARGET_THROUGHPUT_RATIO = 0.95
THROUGHPUT_STREAMS = 16
TARGET_ADDED_TTFT_P50_MS = 1.0
TARGET_ADDED_TTFT_P99_MS = 5.0
STREAMS = 64
MAX_MODEL_LEN = 512
HOP = "proxy_added_time_to_first_token_seconds"
PROMPT = "is a customer asking whether the trail running shoes come in size 10 and in blue"


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


async def _batch(
    session: aiohttp.ClientSession, url: str, n: int, max_tokens: int, ids: itertools.count
) -> list[StreamTiming]:
    body = {"parameters": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            "exclude_input_in_output": True, "stream": True}  # fmt: skip
    return await asyncio.gather(
        *(timed_stream(session, url, {**body, "text_input": f"{next(ids)} {PROMPT}"})
          for _ in range(n))
    )  # fmt: skip


def _summary(timings: list[StreamTiming]) -> dict[str, Any]:
    ttft = [t.ttft_s for t in timings if not t.error]
    itl = [x for t in timings if not t.error for x in t.itl_s]
    return {"ttft_p50_ms": _ms(ttft, 50), "ttft_p99_ms": _ms(ttft, 99),
            "itl_p50_ms": _ms(itl, 50), "itl_p99_ms": _ms(itl, 99),
            "requests": len(timings), "errors": sum(1 for t in timings if t.error),
            "first_error": next((t.error for t in timings if t.error), "")}  # fmt: skip


@dataclass(frozen=True)
class ProxyArm:
    addr: str  # the proxy's client port, also where its /metrics are
    pid: int


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def _proxy_batch(
    s: aiohttp.ClientSession, url: str, proxy: ProxyArm, n: int, max_tokens: int,
    ids: itertools.count,
) -> tuple[list[StreamTiming], dict[str, float]]:  # fmt: skip
    """A proxy-arm batch, the proxy's own hop time over it (p50/p99, ms) and its CPU
    per streamed token (us)."""
    before, cpu0 = await asyncio.to_thread(histogram, proxy.addr, HOP), _cpu_s(proxy.pid)
    timings = await _batch(s, url, n, max_tokens, ids)
    cpu1, after = _cpu_s(proxy.pid), await asyncio.to_thread(histogram, proxy.addr, HOP)
    tokens = max_tokens * sum(1 for t in timings if not t.error) or 1
    figures = {f"hop_p{q}_ms": histogram_quantile(before, after, q) * 1e3 for q in (50, 99)}
    figures["proxy_cpu_us_per_token"] = (cpu1 - cpu0) / tokens * 1e6
    return timings, figures


async def _run(
    urls: dict[str, str], proxies: dict[str, ProxyArm], repeats: int, max_tokens: int,
    sequential: int,
) -> dict:  # fmt: skip
    ids = itertools.count()
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=0)  # 64 streams per arm must not queue in the client
    names = list(urls)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s:
        for url in urls.values():  # warm-up: connections, Triton and vLLM code paths
            await _batch(s, url, 16, max_tokens, ids)
        runs: list[dict[str, Any]] = []
        for r in range(repeats):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate
            run: dict[str, Any] = {}
            for arm in order:
                if arm in proxies:
                    timings, figures = await _proxy_batch(s, urls[arm], proxies[arm], STREAMS,
                                                          max_tokens, ids)  # fmt: skip
                    run[arm] = {**_summary(timings), **figures}
                else:
                    run[arm] = _summary(await _batch(s, urls[arm], STREAMS, max_tokens, ids))
            runs.append(run)
            print(f"repeat {r + 1}/{repeats}: TTFT p50 " + ", ".join(
                f"{a} {run[a]['ttft_p50_ms']:.1f} ms" for a in names), file=sys.stderr, flush=True)  # fmt: skip
        seq: dict[str, list[StreamTiming]] = {a: [] for a in names}
        seq_before = {
            a: await asyncio.to_thread(histogram, p.addr, HOP) for a, p in proxies.items()
        }
        for i in range(sequential):
            for arm in names[i % len(names) :] + names[: i % len(names)]:
                seq[arm] += await _batch(s, urls[arm], 1, max_tokens, ids)
        seq_after = {a: await asyncio.to_thread(histogram, p.addr, HOP) for a, p in proxies.items()}
    summary = {arm: _summary(t) for arm, t in seq.items()}
    for arm in proxies:
        for q in (50, 99):
            hop = histogram_quantile(seq_before[arm], seq_after[arm], q)
            summary[arm][f"hop_p{q}_ms"] = hop * 1e3
    return {"runs": runs, "sequential": summary}


async def _throughput(leader_http: str, proxy_base: str, repeats: int,
                      max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """Output tok/s per arm per repeat at THROUGHPUT_STREAMS streams, and the ratios."""
    from neuron_serving.bench.workload import Arm, proxy_arm, run_load, triton_generate_stream

    arms = [Arm("direct", f"http://{leader_http}/v2/models/llm/generate_stream",
                triton_generate_stream),
            Arm("proxy", f"{proxy_base}/v2/models/llm/generate_stream", triton_generate_stream),
            proxy_arm(proxy_base)]  # fmt: skip
    ids, extra, n = itertools.count(1 << 30), {"temperature": 0.0}, 4 * THROUGHPUT_STREAMS
    for arm in arms:  # warm-up
        await run_load(arm, ids, n, THROUGHPUT_STREAMS, max_tokens, extra)
    runs: list[dict[str, float]] = []
    for r in range(repeats):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        runs.append({a.name: (await run_load(a, ids, n, THROUGHPUT_STREAMS, max_tokens, extra))[
            "output_tok_s"] for a in order})  # fmt: skip
    ratio = spread([run["proxy"] / run["direct"] for run in runs])
    return {
        "streams": THROUGHPUT_STREAMS, "requests_per_arm": n,
        "output_tok_s": {a.name: spread([run[a.name] for run in runs]) for a in arms},
        "ratio_per_repeat": ratio, "ratio": ratio["median"],
        "openai_ratio_per_repeat": spread([run["proxy_openai"] / run["direct"] for run in runs]),
        "target": TARGET_THROUGHPUT_RATIO, "met": ratio["median"] >= TARGET_THROUGHPUT_RATIO,
        "runs": runs,
    }  # fmt: skip


def _added(runs: list[dict], key: str, arm: str = "proxy") -> dict[str, float]:
    return spread([run[arm][key] - run["direct"][key] for run in runs])


def _upstream_figures(runs: list[dict], seq: dict[str, Any], arm: str) -> dict[str, Any]:
    return {
        "added_ttft_p50_ms": _added(runs, "ttft_p50_ms", arm),
        "added_ttft_p99_ms": _added(runs, "ttft_p99_ms", arm),
        "proxy_hop_ttft_p50_ms": spread([run[arm]["hop_p50_ms"] for run in runs]),
        "proxy_hop_ttft_p99_ms": spread([run[arm]["hop_p99_ms"] for run in runs]),
        "proxy_cpu_us_per_token": spread([run[arm]["proxy_cpu_us_per_token"] for run in runs]),
        "sequential_added_ttft_p50_ms": seq[arm]["ttft_p50_ms"] - seq["direct"]["ttft_p50_ms"],
        "sequential_hop_p50_ms": seq[arm]["hop_p50_ms"],
    }


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving.models.demo import build_demo_model

    repeats = repeats or (3 if quick else 7)
    max_tokens = 16 if quick else 32
    sequential = 16 if quick else 64
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ns-bench-proxy-") as tmp:
        work = Path(tmp)
        model_dir = Path(model) if model else build_demo_model(work / "demo", seed=0)
        leader = start_leader(model_dir, work, "leader", cpu_bind="0", max_model_len=MAX_MODEL_LEN)
        try:
            wait_leaders([leader])
            started = []
            try:
                for name, channel in (("proxy", True), ("proxy_grpc", False)):
                    cfg = proxy_config([leader], model_dir, MAX_MODEL_LEN,
                                       openai_channel=channel)  # fmt: skip
                    started.append((name, start_proxy(cfg, work, name=name)))
                urls = {"direct": f"http://{leader.http}/v2/models/llm/generate_stream"}
                proxies = {}
                for name, proxy in started:
                    urls[name] = f"{proxy.base}/v2/models/llm/generate_stream"
                    proxies[name] = ProxyArm(proxy.base.removeprefix("http://"),
                                             proxy.process.popen.pid)  # fmt: skip
                data = asyncio.run(_run(urls, proxies, repeats, max_tokens, sequential))
                grpc_proxy = dict(started)["proxy"]
                throughput = asyncio.run(
                    _throughput(leader.http, grpc_proxy.base, repeats, 4 * max_tokens)
                )
            finally:
                for _, proxy in started:
                    proxy.process.stop()
        finally:
            leader.process.stop()
    runs = data["runs"]
    # On a shared 2-core machine other work shifts every latency; record how busy it was.
    load = {"load_avg_1m_start": load_before[0], "load_avg_1m_end": os.getloadavg()[0]}
    arms = {arm: {k: spread([run[arm][k] for run in runs])
                  for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}
            for arm in runs[0]}  # fmt: skip
    add50, add99 = _added(runs, "ttft_p50_ms"), _added(runs, "ttft_p99_ms")
    hop50 = spread([run["proxy"]["hop_p50_ms"] for run in runs])
    hop99 = spread([run["proxy"]["hop_p99_ms"] for run in runs])
    seq = data["sequential"]
    result = {
        "workload": {
            "streams": STREAMS,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "repeats": repeats,
            "sequential_requests_per_arm": sequential,
            "protocol": "Triton HTTP generate_stream, same aiohttp client in every arm",
            "upstreams": {
                "proxy": "the leader's OpenAI channel (default)",
                "proxy_grpc": "Triton gRPC ModelStreamInfer (openai_channel: false)",
            },
            "model": "demo" if model is None else model,
            "tp": 1,
            "leader_cpu_bind": "0",
            "itl_definition": "time between consecutive output chunks of one request "
            "(vLLM benchmark_serving ITL)",
        },  # fmt: skip
        "machine_load": load,
        "added_ttft_p50_ms": add50,
        "added_ttft_p99_ms": add99,
        # The proxy's own account of its hop (see the module docstring).
        "proxy_hop_ttft_p50_ms": hop50,
        "proxy_hop_ttft_p99_ms": hop99,
        "added_itl_p50_ms": _added(runs, "itl_p50_ms"),
        "added_itl_p99_ms": _added(runs, "itl_p99_ms"),
        "proxy_cpu_us_per_token": spread([run["proxy"]["proxy_cpu_us_per_token"] for run in runs]),
        "grpc_upstream": _upstream_figures(runs, seq, "proxy_grpc"),
        "throughput": throughput,
        "arms": arms,
        "sequential": {
            **seq,
            "added_ttft_p50_ms": seq["proxy"]["ttft_p50_ms"] - seq["direct"]["ttft_p50_ms"],
            "added_ttft_p99_ms": seq["proxy"]["ttft_p99_ms"] - seq["direct"]["ttft_p99_ms"],
        },  # fmt: skip
        "targets": {
            "added_ttft_p50_ms": TARGET_ADDED_TTFT_P50_MS,
            "added_ttft_p99_ms": TARGET_ADDED_TTFT_P99_MS,
        },  # fmt: skip
        "met": {
            "added_ttft_p50": add50["median"] <= TARGET_ADDED_TTFT_P50_MS,
            "added_ttft_p99": add99["median"] <= TARGET_ADDED_TTFT_P99_MS,
            "proxy_hop_ttft_p50": hop50["median"] <= TARGET_ADDED_TTFT_P50_MS,
            "proxy_hop_ttft_p99": hop99["median"] <= TARGET_ADDED_TTFT_P99_MS,
            "throughput_ratio": throughput["met"],
        },  # fmt: skip
        "errors": sum(run[a]["errors"] for run in runs for a in run),
        "runs": runs,
    }
    path = write_result("proxy" + ("-quick" if quick else ""), result)
    print(f"proxy: added TTFT p50 {add50['median']:+.2f} ms ({add50['min']:+.2f}..{add50['max']:+.2f}),"
          f" p99 {add99['median']:+.2f} ms ({add99['min']:+.2f}..{add99['max']:+.2f}) at {STREAMS} "
          f"streams (targets <= {TARGET_ADDED_TTFT_P50_MS} / {TARGET_ADDED_TTFT_P99_MS} ms); "
          f"proxy's own hop p50 {hop50['median']:.2f} ms, p99 {hop99['median']:.2f} ms; "
          f"sequential added TTFT p50 {result['sequential']['added_ttft_p50_ms']:+.2f} ms "
          f"(hop p50 {seq['proxy']['hop_p50_ms']:.2f} ms); "
          f"ITL p50 direct {arms['direct']['itl_p50_ms']['median']:.2f} ms, proxy "
          f"{arms['proxy']['itl_p50_ms']['median']:.2f} ms -> {path}", file=sys.stderr)  # fmt: skip
    h = result["grpc_upstream"]
    print(f"proxy, Triton gRPC upstream: added TTFT p50 {h['added_ttft_p50_ms']['median']:+.2f} ms, p99 "
          f"{h['added_ttft_p99_ms']['median']:+.2f} ms; own hop p50 "
          f"{h['proxy_hop_ttft_p50_ms']['median']:.2f} ms, p99 "
          f"{h['proxy_hop_ttft_p99_ms']['median']:.2f} ms; sequential added TTFT p50 "
          f"{h['sequential_added_ttft_p50_ms']:+.2f} ms; proxy CPU per token "
          f"{h['proxy_cpu_us_per_token']['median']:.0f} us (channel "
          f"{result['proxy_cpu_us_per_token']['median']:.0f} us)", file=sys.stderr)  # fmt: skip
    tp = throughput
    print(f"proxy throughput at {THROUGHPUT_STREAMS} streams: proxy / direct {tp['ratio']:.2f} "
          f"(per repeat {tp['ratio_per_repeat']['min']:.2f}..{tp['ratio_per_repeat']['max']:.2f}; "
          f"target >= {TARGET_THROUGHPUT_RATIO}); OpenAI through the proxy / direct "
          f"{tp['openai_ratio_per_repeat']['median']:.2f}", file=sys.stderr)  # fmt: skip
    if emit_json:
        import json

        keys = ("added_ttft_p50_ms", "added_ttft_p99_ms", "proxy_hop_ttft_p50_ms",
                "proxy_hop_ttft_p99_ms", "met")  # fmt: skip
        print(json.dumps({k: result[k] for k in keys}))
    return 0 if result["errors"] == 0 else 1
