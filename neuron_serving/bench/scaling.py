"""Scaling: output tok/s and latency against concurrency through one Triton leader.

One `neuron-serving leader` (TP=1, unit executor, demo model, the serving
benchmark's engine settings) driven over gRPC streaming (the proxy's path) by the
serving benchmark's client, at concurrency 1, 2, 4, ..., 64 (``--quick``: 1, 4, 16,
64 and fewer requests). Each level sends ``max(MIN_REQUESTS, k x concurrency)``
unique prompts (no prefix-cache hits), ``max_tokens`` output tokens each
(ignore_eos, greedy), after a warm-up at the highest level. With several repeats
the level order alternates ascending/descending so drift hits every level alike.
Per level: output tok/s, TTFT p50/p99, TPOT p50, ITL p50/p99, E2EL p50 (vLLM's
definitions, see ``metrics.py``), each with its spread over repeats.

``bench all`` runs the sweep on the serving benchmark's leader once its comparison
is done (``after_serving``, handed to ``serving.main`` by the bench command), which
saves this benchmark's own startup.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from neuron_serving.bench.common import spread, write_result
from neuron_serving.bench.workload import (
    CPU_BIND,
    ENGINE,
    Arm,
    run_load,
    start_bench_leader,
    triton_grpc_stream,
)

LEVELS = (1, 2, 4, 8, 16, 32, 64)
QUICK_LEVELS = (1, 4, 16, 64)
MIN_REQUESTS = 8
KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms",
        "itl_p99_ms", "e2el_p50_ms")  # fmt: skip


def requests_at(concurrency: int, per_stream: int) -> int:
    return max(MIN_REQUESTS, per_stream * concurrency)


def level_order(levels: tuple[int, ...], repeat: int) -> list[int]:
    return list(levels) if repeat % 2 == 0 else list(reversed(levels))


async def _measure(arm: Arm, levels: tuple[int, ...], repeats: int, per_stream: int,
                   max_tokens: int, warm_up: bool = True) -> dict[int, list[dict[str, Any]]]:  # fmt: skip
    ids = itertools.count()
    extra = {"temperature": 0.0}
    top = max(levels)
    if warm_up:  # (a leader that has just served the serving benchmark is warm)
        await run_load(arm, ids, top, top, max_tokens, extra)
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in levels}
    for r in range(repeats):
        for c in level_order(levels, r):
            run = await run_load(arm, ids, requests_at(c, per_stream), c, max_tokens, extra)
            runs[c].append(run)
            print(f"repeat {r + 1}/{repeats} concurrency {c}: {run['output_tok_s']:.0f} tok/s, "
                  f"TTFT p50 {run['ttft_p50_ms']:.1f} ms p99 {run['ttft_p99_ms']:.1f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
    return runs


def aggregate(runs: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per level: every figure's spread over repeats, and errors."""
    return [{"concurrency": c, **{k: spread([r[k] for r in rs]) for k in KEYS},
             "failed": sum(r["failed"] for r in rs)}
            for c, rs in sorted(runs.items())]  # fmt: skip


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving.bench.stack import wait_ready
    from neuron_serving.models.demo import build_demo_model

    with tempfile.TemporaryDirectory(prefix="ns-bench-scaling-") as tmp:
        work = Path(tmp)
        model_dir = Path(model) if model else build_demo_model(work / "demo", seed=0)
        t0 = time.monotonic()
        leader = start_bench_leader(model_dir, work)
        try:
            wait_ready([leader])
            return measure(leader, quick, model, emit_json, repeats, time.monotonic() - t0)
        finally:
            leader.process.stop()


def measure(
    leader: Any, quick: bool, model: str | None, emit_json: bool, repeats: int | None,
    startup_s: float | None, note: str = "",
) -> int:  # fmt: skip
    """The sweep on a running leader (its own, or the serving benchmark's: ``note``)."""
    repeats = repeats or (1 if quick else 2)
    levels = QUICK_LEVELS if quick else LEVELS
    per_stream, max_tokens = (2, 32) if quick else (4, 64)
    load_before = os.getloadavg()
    arm = Arm("triton", leader.grpc, triton_grpc_stream, grpc=True)
    runs = asyncio.run(_measure(arm, levels, repeats, per_stream, max_tokens, warm_up=not note))
    rows = aggregate(runs)
    result = {
        "workload": {
            "levels": list(levels),
            "requests_per_level": {c: requests_at(c, per_stream) for c in levels},
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "repeats": repeats,
            "model": "demo" if model is None else model,
            "tp": 1,
            "engine": ENGINE,
            "cpu_bind": CPU_BIND,
            "protocol": "Triton gRPC ModelStreamInfer, one stream per request",
            "itl_definition": "time between consecutive streamed chunks of one request "
            "(vLLM benchmarks' ITL)",
        },
        "machine_load": {
            "load_avg_1m_start": load_before[0],
            "load_avg_1m_end": os.getloadavg()[0],
        },
        "startup_s": startup_s,
        "note": note,
        "levels": rows,
        "errors": sum(r["failed"] for r in rows),
        "runs": {str(c): rs for c, rs in runs.items()},
    }
    path = write_result("scaling" + ("-quick" if quick else ""), result)
    print("scaling: " + "; ".join(
        f"c={r['concurrency']} {r['output_tok_s']['median']:.0f} tok/s TTFT p50 "
        f"{r['ttft_p50_ms']['median']:.0f} p99 {r['ttft_p99_ms']['median']:.0f} ms" for r in rows)
        + f" -> {path}", file=sys.stderr)  # fmt: skip
    if emit_json:
        print(json.dumps({str(r["concurrency"]): {k: r[k]["median"] for k in KEYS} for r in rows}))
    return 0 if result["errors"] == 0 else 1


def after_serving(
    leader: Any, quick: bool, model: str | None, emit_json: bool, repeats: int | None
) -> int:
    """The sweep on the serving benchmark's leader, after its comparison (bench all)."""
    t0 = time.monotonic()
    rc = measure(
        leader, quick, model, emit_json, repeats, None,
        note="run by bench all on the serving benchmark's leader after its "
        "comparison (vLLM server stopped)",
    )  # fmt: skip
    print(f"scaling sweep: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return rc
