"""`neuron-serving leader` end to end: real tritonserver, real vLLM, official tritonclient.

One leader for the whole module (startup costs 35-60 s on this machine kind). The
last test kills the EngineCore and checks the failure path, so it must stay last.
Every wait is bounded; no test asserts on wall-clock durations.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest

from neuron_serving.triton import reaper
from neuron_serving.triton.launcher import EXIT_UNIT_FAILED, free_port

pytestmark = pytest.mark.e2e

# "unit" = the project's UnitExecutor (TP=1: no followers); "uni" = vLLM's own.
EXECUTOR = "unit"
MAX_MODEL_LEN = 512
READY_TIMEOUT_S = 300.0
PROMPT = "Do you have running shoes in size 10?"


@dataclass
class Leader:
    proc: subprocess.Popen
    http: str
    grpc: str
    metrics: str
    log: Path
    model: Path
    tree: dict[int, psutil.Process]

    def remember_tree(self) -> None:
        for p in reaper.descendants(self.proc.pid):
            self.tree[p.pid] = p

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


@pytest.fixture(scope="module")
def leader(demo_model: Path, tmp_path_factory) -> Leader:
    tmp = tmp_path_factory.mktemp("leader")
    http, grpc, metrics, control = (free_port() for _ in range(4))
    log = tmp / "leader.log"
    cmd = [
        sys.executable, "-m", "neuron_serving.cli", "leader",
        "--model", str(demo_model), "--tp", "1", "--control-port", str(control),
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes", str(256 << 20),
        "--executor", EXECUTOR, "--run-dir", str(tmp / "run"), "--drain", "1",
    ]  # fmt: skip
    print("leader:", " ".join(cmd), "log:", log)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    ldr = Leader(proc, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}", log,
                 demo_model, {})  # fmt: skip
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            ldr.remember_tree()
            if proc.poll() is not None:
                pytest.fail(f"leader exited with {proc.returncode}:\n{ldr.log_tail()}")
            if _get(f"http://{ldr.http}/v2/models/llm/ready")[0] == 200:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"leader not ready in {READY_TIMEOUT_S} s:\n{ldr.log_tail()}")
            time.sleep(0.5)
        ldr.remember_tree()
        yield ldr
    finally:
        ldr.remember_tree()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait(timeout=10)
            assert rc == 0, f"leader exited {rc} on SIGTERM:\n{ldr.log_tail()}"
        _assert_no_orphans(ldr)


def _assert_no_orphans(ldr: Leader) -> None:
    deadline = time.monotonic() + 30
    alive: list[psutil.Process] = []
    while time.monotonic() < deadline:
        alive = [p for p in ldr.tree.values() if _alive(p)]
        if not alive:
            return
        time.sleep(0.2)
    names = [(p.pid, p.name()) for p in alive]
    for p in alive:
        p.kill()
    pytest.fail(f"processes left behind: {names}")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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
                reply.prompt_tokens = int(result.as_numpy("prompt_tokens")[0])
                reply.completion_tokens = int(result.as_numpy("completion_tokens")[0])
                reply.finish_reason = result.as_numpy("finish_reason")[0].decode()
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
async def client(leader: Leader):
    import tritonclient.grpc.aio as grpcclient

    c = grpcclient.InferenceServerClient(leader.grpc)
    yield c
    await c.close()


def _metric(leader: Leader, name: str, **labels: str) -> float:
    total = 0.0
    for line in _get(f"http://{leader.metrics}/metrics")[1].splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- tests ----------------------------------------------------------------------------


def test_health_endpoints(leader: Leader) -> None:
    import tritonclient.http as httpclient

    c = httpclient.InferenceServerClient(leader.http)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("llm")
    config = c.get_model_config("llm")
    assert config["model_transaction_policy"]["decoupled"] is True
    assert config["max_batch_size"] == 0


async def test_stream_concatenates_to_non_stream(leader: Leader, client) -> None:
    from transformers import AutoTokenizer

    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    full = await generate(client, PROMPT, stream=False, params=params)
    streamed = await generate(client, PROMPT, stream=True, params=params)
    assert full.error is None and streamed.error is None, (full.error, streamed.error)
    assert len(full.texts) == 1 and len(streamed.texts) > 1
    assert streamed.text == full.text
    n_prompt = len(AutoTokenizer.from_pretrained(leader.model).encode(PROMPT))
    assert full.prompt_tokens == streamed.prompt_tokens == n_prompt
    assert full.completion_tokens == streamed.completion_tokens == 24
    assert full.finish_reason == streamed.finish_reason == "length"
    # Without exclude_input_in_output, the non-streaming text starts with the prompt.
    with_input = await generate(client, PROMPT, stream=False, params=params, exclude=False)
    assert with_input.text == PROMPT + full.text


async def test_http_generate_endpoints(leader: Leader) -> None:
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


async def test_concurrent_streams_and_cancellation(leader: Leader, client) -> None:
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
    leader: Leader, client, prompt, params, fragment
) -> None:
    for stream in (False, True):
        bad = await generate(client, prompt, stream=stream, params=params)
        assert bad.error is not None and fragment in bad.error, bad.error
    good = await generate(client, PROMPT, stream=False, params={"max_tokens": 2, "temperature": 0})
    assert good.error is None and good.completion_tokens == 2


def test_metrics_port_has_triton_and_vllm_metrics(leader: Leader) -> None:
    status, text = _get(f"http://{leader.metrics}/metrics")
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
    ):
        assert name in text, name


def test_engine_death_turns_readiness_off_and_leader_exits(leader: Leader) -> None:
    """Keep last: destroys the module's leader."""
    leader.remember_tree()
    engine = [
        p for p in leader.tree.values() if _alive(p) and "EngineCore" in " ".join(p.cmdline())
    ]
    assert engine, [p.cmdline() for p in leader.tree.values()]
    engine[0].kill()
    deadline = time.monotonic() + 60
    while (
        time.monotonic() < deadline and _get(f"http://{leader.http}/v2/models/llm/ready")[0] == 200
    ):
        time.sleep(0.2)
    assert _get(f"http://{leader.http}/v2/models/llm/ready")[0] != 200
    rc = leader.proc.wait(timeout=90)
    assert rc == EXIT_UNIT_FAILED, leader.log_tail()
    _assert_no_orphans(leader)
