"""`neuron-serving leader` end to end: real tritonserver, real vLLM, official tritonclient.

One leader for the whole module (startup costs 35-60 s on this machine kind). The
last test kills the EngineCore and checks the failure path, so it must stay last.
Every wait is bounded; no test asserts on wall-clock durations.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest

from neuron_serving.triton.launcher import EXIT_UNIT_FAILED
from tests.e2e.triton_leader_helpers import (
    LeaderEndpoints,
    get,
    metric,
    start_leader,
    wait_ready,
)
from tests.procs import leftover

pytestmark = pytest.mark.e2e

# "unit" = the project's UnitExecutor (TP=1: no followers); "uni" = vLLM's own.
EXECUTOR = "unit"
MAX_MODEL_LEN = 512
PROMPT = "Do you have running shoes in size 10?"


@pytest.fixture(scope="module")
def leader(demo_model: Path, tmp_path_factory) -> LeaderEndpoints:
    tmp = tmp_path_factory.mktemp("leader")
    extra = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes", str(256 << 20),
             "--executor", EXECUTOR, "--drain", "1"]  # fmt: skip
    ldr = start_leader(demo_model, tmp, tp=1, extra=extra)
    try:
        wait_ready(ldr)
        yield ldr
        if ldr.proc.popen.poll() is None:
            ldr.proc.signal(signal.SIGTERM)
            rc = ldr.proc.wait(timeout=90)
            assert rc == 0, f"leader exited {rc} on SIGTERM:\n{ldr.log_tail()}"
        # tritonserver, the backend stub and EngineCore all stay in the leader's session.
        assert leftover([ldr.proc]) == []
    finally:
        ldr.proc.stop()


# ---- gRPC helpers -------------------------------------------------------------------


def _inputs(prompt: bytes | str, *, stream: bool, params: dict | str | None, exclude: bool = True):
    import tritonclient.grpc.aio as grpcclient

    text = prompt.encode() if isinstance(prompt, str) else prompt
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([text], dtype=np.object_))
    flags = {"stream": stream, "exclude_input_in_output": exclude}
    for name, value in flags.items():
        t = grpcclient.InferInput(name, [1], "BOOL")
        t.set_data_from_numpy(np.array([value], dtype=bool))
        inputs.append(t)
    if params is not None:
        raw = params if isinstance(params, str) else json.dumps(params)
        t = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        t.set_data_from_numpy(np.array([raw.encode()], dtype=np.object_))
        inputs.append(t)
    return inputs


@dataclass
class Reply:
    texts: list[str]
    finish_reason: str = ""
    prompt_tokens: int = -1
    completion_tokens: int = -1
    error: str | None = None
    cancelled: bool = False  # set by the caller when it cancelled the gRPC stream
    responses: int = 0
    with_counts: int = 0  # responses that carried counts and a finish reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def _request_stream(inputs, done: asyncio.Event) -> AsyncIterator[dict]:
    yield {"model_name": "llm", "inputs": inputs}
    await done.wait()  # keep the stream open until every response arrived


async def generate(
    client, prompt: bytes | str, *, stream: bool, params: dict | str | None, exclude: bool = True,
    on_response=None,
) -> Reply:  # fmt: skip
    """One request over gRPC ModelStreamInfer; returns when the last response arrived."""
    done = asyncio.Event()
    reply = Reply([])
    it = client.stream_infer(_request_stream(_inputs(prompt, stream=stream, params=params,
                                                     exclude=exclude), done))  # fmt: skip
    try:
        async with asyncio.timeout(120):
            async for result, error in it:
                if error is not None:
                    reply.error = str(error)
                    break
                reply.texts.append(result.as_numpy("text_output")[0].decode())
                reply.responses += 1
                # Counts and the finish reason come with the first and last responses.
                if (counts := result.as_numpy("completion_tokens")) is not None:
                    reply.prompt_tokens = int(result.as_numpy("prompt_tokens")[0])
                    reply.completion_tokens = int(counts[0])
                    reply.finish_reason = result.as_numpy("finish_reason")[0].decode()
                    reply.with_counts += 1
                if on_response is not None:
                    on_response(reply, it)
                if reply.finish_reason:
                    break
    except asyncio.CancelledError:
        # grpc.aio raises CancelledError into the reader after call.cancel(); only
        # swallow the cancellation this request asked for.
        if not reply.cancelled:
            raise
    finally:
        done.set()
    return reply


@pytest.fixture
async def client(leader: LeaderEndpoints):
    import tritonclient.grpc.aio as grpcclient

    c = grpcclient.InferenceServerClient(leader.grpc)
    yield c
    await c.close()


def _metric(leader: LeaderEndpoints, name: str, **labels: str) -> float:
    return metric(leader.metrics, name, **labels)


# ---- tests ----------------------------------------------------------------------------


def test_health_endpoints(leader: LeaderEndpoints) -> None:
    import tritonclient.http as httpclient

    c = httpclient.InferenceServerClient(leader.http)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("llm")
    config = c.get_model_config("llm")
    assert config["model_transaction_policy"]["decoupled"] is True
    assert config["max_batch_size"] == 0


async def test_stream_concatenates_to_non_stream(
    leader: LeaderEndpoints, client, demo_model: Path
) -> None:
    from transformers import AutoTokenizer

    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    full = await generate(client, PROMPT, stream=False, params=params)
    streamed = await generate(client, PROMPT, stream=True, params=params)
    assert full.error is None and streamed.error is None, (full.error, streamed.error)
    assert len(full.texts) == 1 and len(streamed.texts) > 1
    assert streamed.text == full.text
    n_prompt = len(AutoTokenizer.from_pretrained(demo_model).encode(PROMPT))
    assert full.prompt_tokens == streamed.prompt_tokens == n_prompt
    assert full.completion_tokens == streamed.completion_tokens == 24
    assert full.finish_reason == streamed.finish_reason == "length"
    assert streamed.with_counts == 2  # the first and the last response; text alone between
    # Without exclude_input_in_output, the non-streaming text starts with the prompt.
    with_input = await generate(client, PROMPT, stream=False, params=params, exclude=False)
    assert with_input.text == PROMPT + full.text


async def test_http_generate_endpoints(leader: LeaderEndpoints) -> None:
    import aiohttp

    body = {"text_input": PROMPT, "exclude_input_in_output": True,
            "parameters": {"temperature": 0, "max_tokens": 8, "ignore_eos": True}}  # fmt: skip
    base = f"http://{leader.http}/v2/models/llm"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(f"{base}/generate", json=body) as r:
            assert r.status == 200
            full = await r.json()
        async with s.post(f"{base}/generate_stream", json={**body, "stream": True}) as r:
            assert r.status == 200
            events = [json.loads(line[5:]) for line in (await r.text()).splitlines()
                      if line.startswith("data:")]  # fmt: skip
        async with s.post(f"{base}/generate", json={**body, "parameters": {"max_tokens": 0}}) as r:
            assert r.status == 400
            assert "'max_tokens' must be between 1 and" in (await r.json())["error"]
    assert full["completion_tokens"] == 8 and full["finish_reason"] == "length"
    assert "".join(e["text_output"] for e in events) == full["text_output"]
    assert events[-1]["completion_tokens"] == 8


async def test_concurrent_streams_and_cancellation(leader: LeaderEndpoints, client) -> None:
    generated_before = _metric(leader, "vllm:generation_tokens_total")
    cancelled_before = _metric(leader, "neuron_serving_triton_requests_total", outcome="cancelled")
    params = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
    victim_max = MAX_MODEL_LEN - 32
    cancelled = asyncio.Event()

    def cancel_after_two(reply: Reply, it) -> None:
        if len(reply.texts) == 2:
            reply.cancelled = True
            it.cancel()
            cancelled.set()

    victim = asyncio.create_task(
        generate(client, "Where is my package?", stream=True,
                 params={**params, "max_tokens": victim_max}, on_response=cancel_after_two)
    )  # fmt: skip
    others = [
        generate(client, f"Question {i}: {PROMPT}", stream=True, params=params) for i in range(15)
    ]
    replies = await asyncio.gather(*others)
    for r in replies:
        assert r.error is None and r.completion_tokens == 32 and r.finish_reason == "length"
    async with asyncio.timeout(60):
        await cancelled.wait()
        v = await victim
    assert v.cancelled and v.finish_reason == "" and v.completion_tokens < victim_max

    # vLLM aborted it: the engine is idle with no KV blocks held, and it generated
    # far fewer tokens for the victim than its max_tokens. (vLLM 0.32 does not count
    # front-end aborts in vllm:request_success_total{finished_reason="abort"}.)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ours = _metric(leader, "neuron_serving_triton_requests_total", outcome="cancelled")
        running = _metric(leader, "vllm:num_requests_running")
        if ours > cancelled_before and running == 0:
            break
        await asyncio.sleep(0.5)
    assert ours == cancelled_before + 1
    assert running == 0 and _metric(leader, "vllm:kv_cache_usage_perc") == 0
    victim_tokens = _metric(leader, "vllm:generation_tokens_total") - generated_before - 15 * 32
    assert 2 <= victim_tokens < victim_max


async def test_http_stream_disconnect_aborts_request(leader: LeaderEndpoints) -> None:
    """A client that drops an HTTP generate_stream connection cancels the request too."""
    import aiohttp

    cancelled_before = _metric(leader, "neuron_serving_triton_requests_total", outcome="cancelled")
    body = {"text_input": "Where is my package?", "stream": True,
            "parameters": {"max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True}}  # fmt: skip
    url = f"http://{leader.http}/v2/models/llm/generate_stream"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        r = await s.post(url, json=body)
        events = 0
        async for line in r.content:
            events += line.startswith(b"data:")
            if events == 2:
                break
        r.close()  # drop the connection mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ours = _metric(leader, "neuron_serving_triton_requests_total", outcome="cancelled")
        if ours > cancelled_before and _metric(leader, "vllm:num_requests_running") == 0:
            break
        await asyncio.sleep(0.5)
    assert ours == cancelled_before + 1
    assert _metric(leader, "vllm:num_requests_running") == 0


BAD_INPUTS = [
    ("invalid-json", PROMPT, "{max_tokens: 5", "not valid JSON"),
    ("unknown-key", PROMPT, {"max_token": 5}, "unknown sampling parameter(s) ['max_token']"),
    ("wrong-type", PROMPT, {"temperature": "hot"}, "'temperature' must be number"),
    ("zero-max-tokens", PROMPT, {"max_tokens": 0}, "'max_tokens' must be between 1 and"),
    ("negative-max-tokens", PROMPT, {"max_tokens": -5}, "'max_tokens' must be between 1 and"),
    ("huge-max-tokens", PROMPT, {"max_tokens": 10**9}, "'max_tokens' must be between 1 and"),
    ("prompt-too-long", "shoes " * 2000, {"max_tokens": 4}, f"max_model_len is {MAX_MODEL_LEN}"),
    ("empty-prompt", "", None, "text_input is empty"),
    ("invalid-utf8", b"caf\xc3\x28 shoes", None, "text_input is not valid UTF-8"),
]


@pytest.mark.parametrize(
    ("prompt", "params", "fragment"), [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
async def test_bad_input_gets_clear_error_and_server_keeps_serving(
    leader: LeaderEndpoints, client, prompt, params, fragment
) -> None:
    for stream in (False, True):
        bad = await generate(client, prompt, stream=stream, params=params)
        assert bad.error is not None and fragment in bad.error, bad.error
    good = await generate(client, PROMPT, stream=False, params={"max_tokens": 2, "temperature": 0})
    assert good.error is None and good.completion_tokens == 2


def test_metrics_port_has_triton_and_vllm_metrics(leader: LeaderEndpoints) -> None:
    status, text = get(f"http://{leader.metrics}/metrics")
    assert status == 200
    for name in (
        "nv_inference_request_success",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "neuron_serving_triton_unit_ready",
        # from the unit executor's node health server (EngineCore process)
        "neuron_serving_node_state",
        "neuron_serving_steps_total",
    ):
        assert name in text, name


def test_engine_death_turns_readiness_off_and_leader_exits(leader: LeaderEndpoints) -> None:
    """Keep last: destroys the module's leader."""
    engine = [
        p for p in psutil.Process(leader.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline())
    ]  # fmt: skip
    assert engine, leader.log_tail()
    engine[0].kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and leader.model_ready():
        time.sleep(0.2)
    assert not leader.model_ready()
    rc = leader.proc.wait(timeout=90)
    assert rc == EXIT_UNIT_FAILED, leader.log_tail()
    assert leftover([leader.proc]) == []
