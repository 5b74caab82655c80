"""`neuron-serving bench serving_mn`: our TP=2 unit behind Triton against ``vllm
serve`` in vLLM's own multi-node mode, two "nodes" on loopback.

Systems (``twonode.py``): ``unit`` (`neuron-serving leader --tp 2` and a follower,
requests over Triton's HTTP ``generate_stream``, SSE) and ``vllm_mn`` (``vllm serve
--nnodes 2``, node 1 ``--headless``, requests over ``/v1/completions``, SSE). Rank 0
on core 0, rank 1 on core 1; the front ends (Triton and its backend stub, vLLM's API
server and engine core) float. Same model, same engine settings (``ENGINE``: the
serving benchmark's, eager on both sides so that a start costs seconds, not a
compile), same client and load as ``bench serving`` (``workload.py``: 16 in flight,
unique prompts, greedy, ignore_eos).

Unlike ``bench serving``, the two deployments do not run side by side: each uses both
cores with one rank per core, and an idle one is not idle (vLLM's node-0 worker polls
its shared-memory queue). So each repeat starts each system afresh, in an order
flipped every repeat, warms it up with one full round and measures one round, then
stops it. The ratio is ours over theirs per repeat (``serving.aggregate``: the
``throughput_ratio`` and ``ttft_p50_ratio`` of arm ``triton_http`` over ``vllm``).
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

from neuron_serving.bench.common import write_result
from neuron_serving.bench.serving import aggregate, load_workload, print_repeat
from neuron_serving.bench.twonode import CPU_BIND, SYSTEMS, Deployment, TwoNodeEngine, start
from neuron_serving.bench.workload import CONCURRENCY, Arm
from neuron_serving.bench.workload import ENGINE as SERVING_ENGINE

ENGINE = TwoNodeEngine(
    max_model_len=SERVING_ENGINE["max_model_len"],
    kv_cache_bytes=SERVING_ENGINE["kv_cache_bytes"],
    max_num_seqs=SERVING_ENGINE["max_num_seqs"],
    seed=SERVING_ENGINE["seed"],
)
# The arm names of bench serving, so that its aggregate and report apply unchanged.
ARM_OF = {"unit": "triton_http", "vllm_mn": "vllm"}


def arm(dep: Deployment) -> Arm:
    from vllm.benchmarks.lib.endpoint_request_func import async_request_openai_completions

    from neuron_serving.bench.workload import triton_generate_stream

    func = triton_generate_stream if dep.system == "unit" else async_request_openai_completions
    return Arm(ARM_OF[dep.system], dep.base + dep.request_path, func)


async def _round(a: Arm, ids: itertools.count, requests: int, max_tokens: int) -> dict[str, Any]:
    from neuron_serving.bench.workload import run_load

    extra = {"temperature": 0.0}
    await run_load(a, ids, requests, CONCURRENCY, max_tokens, extra)  # warm-up
    return await run_load(a, ids, requests, CONCURRENCY, max_tokens, extra)


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving.models.demo import build_demo_model

    repeats = repeats or (2 if quick else 3)
    requests, max_tokens = (64, 64) if quick else (128, 128)
    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    startup: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    ids = itertools.count()
    with tempfile.TemporaryDirectory(prefix="ns-bench-serving-mn-") as tmp:
        root = Path(tmp)
        model_dir = Path(model) if model else build_demo_model(root / "demo", seed=0)
        for r in range(repeats):
            run: dict[str, Any] = {}
            for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                t0 = time.monotonic()
                dep = start(system, model_dir, root / f"{system}-{r}", ENGINE)
                try:
                    dep.wait_ready()
                    startup[system].append(round(time.monotonic() - t0, 1))
                    run[ARM_OF[system]] = asyncio.run(_round(arm(dep), ids, requests, max_tokens))
                except (RuntimeError, TimeoutError) as e:
                    raise RuntimeError(f"{e}\n{json.dumps(dep.tail(), indent=1)}") from e
                finally:
                    dep.stop()
            runs.append(run)
            print_repeat(r, repeats, run)
    agg = aggregate(runs)
    result = {
        "workload": {
            **load_workload(requests, max_tokens, repeats, model),
            "warmup_requests_per_start": requests,
            "tp": 2,
            "nodes": 2,
            "engine": ENGINE.vllm_kwargs(),
            "cpu_bind": CPU_BIND,
            "systems": {
                "triton_http": "neuron-serving leader --tp 2 + follower --rank 1; HTTP "
                "/v2/models/llm/generate_stream, SSE",
                "vllm": "vllm serve --nnodes 2 (node 1 --headless); HTTP /v1/completions, SSE",
            },
            "order": "each repeat starts each system afresh, order flipped every repeat",
        },
        "machine_load": {"load_avg_1m_start": load_before[0], "load_avg_1m_end": os.getloadavg()[0]},
        "startup_s": {ARM_OF[s]: v for s, v in startup.items()},
        **agg,
        "runs": runs,
    }  # fmt: skip
    path = write_result("serving_mn" + ("-quick" if quick else ""), result)
    t, v = agg["arms"]["triton_http"], agg["arms"]["vllm"]
    pr = agg["throughput_ratio_per_repeat"]
    print(f"serving_mn: unit {t['output_tok_s']['median']:.0f} tok/s vs vllm multi-node "
          f"{v['output_tok_s']['median']:.0f} tok/s -> ratio {agg['throughput_ratio']:.2f} "
          f"(per repeat {pr['min']:.2f}..{pr['max']:.2f}); TTFT p50 "
          f"{t['ttft_p50_ms']['median']:.1f} vs {v['ttft_p50_ms']['median']:.1f} ms -> "
          f"{agg['ttft_p50_ratio']:.2f}x -> {path}", file=sys.stderr)  # fmt: skip
    if emit_json:
        print(json.dumps({k: agg[k] for k in ("throughput_ratio", "ttft_p50_ratio")}))
    return 0 if agg["errors"] == 0 else 1
