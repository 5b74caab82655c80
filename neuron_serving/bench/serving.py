"""Serving benchmark: the Triton leader against vLLM's own OpenAI server.

Arms: "triton_http": `neuron-serving leader` (tritonserver + Python backend + vLLM
AsyncLLM, TP=1, unit executor) over Triton's HTTP ``generate_stream`` (SSE);
"vllm": ``python -m vllm.entrypoints.openai.api_server`` over ``/v1/completions``
(SSE); "triton": the same leader over gRPC ``ModelStreamInfer`` with tritonclient's
aio client (the proxy's path to a leader). Same model (demo), same engine settings
(``ENGINE``: max_model_len, KV cache bytes, max_num_seqs, prefix caching, seed,
vLLM's default compile and async scheduling), same CPU binding (vLLM's "auto": OMP
on core 0, core 1 left to the front end). Both servers run side by side, started
once; the idle one does no work (the leader's idle canary is pushed out of the run).

The target ratios compare "triton_http" with "vllm": the same transport (HTTP with
SSE framing) and the same client (aiohttp, vLLM's request function and its twin),
so the client's own CPU, which shares the two cores with both servers here, is
about the same in both arms (measured per arm: ``client_cpu_us_per_token``). The
gRPC arm is reported next to them with its own ratios, for information: its
client (tritonclient's gRPC aio stream) costs ~2-3x the CPU per token of either
aiohttp client, and on this machine that CPU comes out of the servers' share.

Load: ``requests`` prompts at ``CONCURRENCY`` (16) in flight, ``max_tokens`` output
tokens each (ignore_eos, greedy), every prompt unique (a leading counter) so no
arm gets prefix-cache hits the other did not. Arms alternate per repeat, order
flipped every repeat, after one warm-up round each.

Client: one load driver for every arm (``workload.py``: vLLM's own request
function for the vLLM arm, its twins for the Triton arms). Metrics:
``metrics.py``, vLLM's definitions; ITL = time between consecutive streamed
chunks of one request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuron_serving.bench.common import spread, write_result
from neuron_serving.bench.metrics import figure_keys
from neuron_serving.bench.workload import (
    CONCURRENCY,
    CPU_BIND,
    ENGINE,
    Arm,
    arms,
    run_load,
    start_bench_leader,
    start_bench_vllm,
)

TARGET_THROUGHPUT_RATIO = 0.9  # triton / vllm output tok/s, at least
TARGET_TTFT_P50_RATIO = 1.2  # triton / vllm TTFT p50, at most
# "triton_http" and "vllm" make the comparison (HTTP/SSE, aiohttp clients); "triton"
# (gRPC, tritonclient aio: the proxy's path to a leader) gets its own ratios, for
# information.
ARMS = ("triton_http", "vllm", "triton")
RATIO_ARM, INFO_ARM = "triton_http", "triton"


def load_workload(requests: int, max_tokens: int, repeats: int, model: str | None) -> dict:
    """The load every serving-style comparison sends (serving, serving_mn), as recorded."""
    return {"requests": requests, "max_tokens": max_tokens, "concurrency": CONCURRENCY,
            "ignore_eos": True, "temperature": 0.0, "repeats": repeats,
            "model": "demo" if model is None else model}  # fmt: skip


def print_repeat(r: int, repeats: int, run: dict[str, Any]) -> None:
    print(f"repeat {r + 1}/{repeats}: " + ", ".join(
        f"{a} {run[a]['output_tok_s']:.0f} tok/s TTFT p50 {run[a]['ttft_p50_ms']:.1f} ms"
        for a in run), file=sys.stderr, flush=True)  # fmt: skip


async def _measure(arm_list: list[Arm], repeats: int, requests: int, max_tokens: int) -> dict:
    extra = {"temperature": 0.0}
    ids = itertools.count()
    # Warm-up: one full round per arm (connections, every code path, and the batch
    # shapes the measured rounds will see: with 16 requests only, the first measured
    # Triton round of a quick run still paid a 4x TTFT for shapes seen the first time).
    for arm in arm_list:
        await run_load(arm, ids, requests, CONCURRENCY, max_tokens, extra)
    runs: list[dict[str, Any]] = []
    for r in range(repeats):
        order = arm_list if r % 2 == 0 else arm_list[::-1]
        run = {}
        for arm in order:
            run[arm.name] = await run_load(arm, ids, requests, CONCURRENCY, max_tokens, extra)
        runs.append(run)
        print_repeat(r, repeats, run)
    return {"runs": runs}


def aggregate(runs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per-arm spread of every figure over repeats, and the two target ratios
    (median over median, plus the spread of per-repeat ratios)."""
    names = [a for a in ARMS if a in runs[0]]
    keys = figure_keys() + ["client_cpu_us_per_token"]
    arms = {arm: {k: spread([run[arm][k] for run in runs if k in run[arm]]) for k in keys}
            for arm in names}  # fmt: skip

    def ratios(arm: str, prefix: str = "") -> dict[str, Any]:
        return {
            f"{prefix}throughput_ratio": arms[arm]["output_tok_s"]["median"]
            / arms["vllm"]["output_tok_s"]["median"],
            f"{prefix}throughput_ratio_per_repeat": spread(
                [run[arm]["output_tok_s"] / run["vllm"]["output_tok_s"] for run in runs]
            ),
            f"{prefix}ttft_p50_ratio": arms[arm]["ttft_p50_ms"]["median"]
            / arms["vllm"]["ttft_p50_ms"]["median"],
            f"{prefix}ttft_p50_ratio_per_repeat": spread(
                [run[arm]["ttft_p50_ms"] / run["vllm"]["ttft_p50_ms"] for run in runs]
            ),
        }

    main = ratios(RATIO_ARM)
    tput, ttft = main["throughput_ratio"], main["ttft_p50_ratio"]
    return {
        "arms": arms,
        "ratio_arm": RATIO_ARM,
        **main,
        **(ratios(INFO_ARM, "grpc_") if INFO_ARM in names else {}),
        "met": {
            "throughput_ratio": tput >= TARGET_THROUGHPUT_RATIO,
            "ttft_p50_ratio": ttft <= TARGET_TTFT_P50_RATIO,
        },
        "errors": sum(run[a]["failed"] for run in runs for a in names),
    }


def main(
    quick: bool, model: str | None, emit_json: bool, repeats: int | None = None,
    on_leader: Callable[[Any], int] | None = None,
) -> int:  # fmt: skip
    """``on_leader`` (bench all: the scaling sweep, ``scaling.after_serving``): run on
    this leader after the comparison, with the vLLM server stopped, saving another
    benchmark's own startup; its return code is or'ed into this one's."""
    from neuron_serving.bench.stack import wait_ready
    from neuron_serving.models.demo import build_demo_model

    leader_rc = 0
    repeats = repeats or (3 if quick else 5)
    requests, max_tokens = (64, 64) if quick else (128, 128)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ns-bench-serving-") as tmp:
        work = Path(tmp)
        model_dir = Path(model) if model else build_demo_model(work / "demo", seed=0)
        t0 = time.monotonic()
        leader = start_bench_leader(model_dir, work)
        vllm = start_bench_vllm(model_dir, work)
        try:
            wait_ready([leader, vllm])
            startup_s = time.monotonic() - t0
            print(f"servers ready in {startup_s:.0f} s", file=sys.stderr, flush=True)
            t1 = time.monotonic()
            arm_list = arms(leader, vllm.base)
            data = asyncio.run(_measure(arm_list, repeats, requests, max_tokens))
            measure_s = time.monotonic() - t1
            if on_leader is not None:
                vllm.process.stop()
                leader_rc = on_leader(leader)
        finally:
            t2 = time.monotonic()
            leader.process.stop()
            vllm.process.stop()
            print(f"servers stopped in {time.monotonic() - t2:.0f} s", file=sys.stderr)
    runs = data["runs"]
    agg = aggregate(runs)
    result = {
        "workload": {
            **load_workload(requests, max_tokens, repeats, model),
            "warmup_requests_per_arm": requests,
            "tp": 1,
            "engine": ENGINE,
            "cpu_bind": CPU_BIND,
            "leader_executor": "unit",
            "protocols": {
                "triton_http": "HTTP /v2/models/llm/generate_stream, SSE (the ratios)",
                "vllm": "HTTP /v1/completions, SSE (OpenAI)",
                "triton": "gRPC ModelStreamInfer, one stream per request, tritonclient aio "
                "(the proxy's path; grpc_* ratios, information)",
            },
            "client": "one load driver; vLLM's async_request_openai_completions for vllm, "
            "its twins for Triton gRPC streaming and generate_stream",
            "itl_definition": "time between consecutive streamed chunks of one request "
            "(vLLM benchmarks' ITL)",
        },
        "machine_load": {
            "load_avg_1m_start": load_before[0],
            "load_avg_1m_end": os.getloadavg()[0],
        },
        "startup_both_s": startup_s,
        "measure_s": measure_s,
        **agg,
        "targets": {
            "throughput_ratio": TARGET_THROUGHPUT_RATIO,
            "ttft_p50_ratio": TARGET_TTFT_P50_RATIO,
        },  # fmt: skip
        "runs": runs,
    }
    path = write_result("serving" + ("-quick" if quick else ""), result)
    t, v = agg["arms"][RATIO_ARM], agg["arms"]["vllm"]
    pr = agg["throughput_ratio_per_repeat"]
    print(f"serving: {RATIO_ARM} {t['output_tok_s']['median']:.0f} tok/s vs vllm "
          f"{v['output_tok_s']['median']:.0f} tok/s -> ratio {agg['throughput_ratio']:.2f} "
          f"(per repeat {pr['min']:.2f}..{pr['max']:.2f}; target >= {TARGET_THROUGHPUT_RATIO}); "
          f"TTFT p50 {t['ttft_p50_ms']['median']:.1f} vs {v['ttft_p50_ms']['median']:.1f} ms -> "
          f"{agg['ttft_p50_ratio']:.2f}x (target <= {TARGET_TTFT_P50_RATIO}); ITL p50 "
          f"{t['itl_p50_ms']['median']:.2f} vs {v['itl_p50_ms']['median']:.2f} ms -> {path}",
          file=sys.stderr)  # fmt: skip
    if emit_json:
        print(json.dumps({k: agg[k] for k in ("throughput_ratio", "ttft_p50_ratio", "met")}))
    return (0 if agg["errors"] == 0 else 1) | leader_rc
