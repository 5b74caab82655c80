"""`neuron-serving leader` end to end: real tritonserver, real vLLM, official tritonclient.

One leader for the whole module (startup costs 35-60 s on this machine kind). The
last test kills the EngineCore and checks the failure path, so it must stay last.
Every wait is bounded; no test asserts on wall-clock durations. The hostile tests
(issue 14, finding 1) attack the same leader's admin surface over HTTP and gRPC.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest

from neuron_serving.exitcodes import ExitCode
from neuron_serving.netaddr import is_loopback
from neuron_serving.triton.restricted import ADMIN_HEADER, GRPC_METADATA_PREFIX
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
# Known to the tests only so that they can show the restricted APIs work with it
# (without it a leader picks a random key nobody learns).
ADMIN_KEY = secrets.token_urlsafe(32)


@pytest.fixture(scope="module")
def leader(demo_model: Path, tmp_path_factory) -> LeaderEndpoints:
    tmp = tmp_path_factory.mktemp("leader")
    extra = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes", str(256 << 20),
             "--executor", EXECUTOR, "--drain", "1"]  # fmt: skip
    ldr = start_leader(
        demo_model, tmp, tp=1, extra=extra, env={"NEURON_SERVING_TRITON_ADMIN_KEY": ADMIN_KEY}
    )
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
    # model-config stays open: the proxy reads the served model_version from it.
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


# ---- hostile: Triton's admin surface (issue 14, finding 1) ------------------------------

# A Python-backend model.py runs in the stub at load: loading one is code execution.
_EVIL_MODEL = b"""
import pathlib
pathlib.Path(MARKER).write_text("owned")
class TritonPythonModel:
    def execute(self, requests):
        return []
"""
_EVIL_CONFIG = json.dumps({"name": "llm", "backend": "python", "max_batch_size": 0})


def _evil_files(marker: Path) -> dict[str, bytes]:
    return {"file:1/model.py": _EVIL_MODEL.replace(b"MARKER", repr(str(marker)).encode())}


def _http(leader: LeaderEndpoints, method: str, path: str, body: object = None,
          headers: dict[str, str] | None = None) -> tuple[int, str]:  # fmt: skip
    host, port = leader.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def _admin_requests(marker: Path) -> list[tuple[str, str, object]]:
    """Every restricted HTTP API group, read and write; the load carries a model.py."""
    files = {k: base64.b64encode(v).decode() for k, v in _evil_files(marker).items()}
    return [
        ("POST", "/v2/repository/models/llm/unload", {}),
        ("POST", "/v2/repository/models/llm/load",
         {"parameters": {"config": _EVIL_CONFIG, **files}}),
        ("POST", "/v2/repository/index", {}),
        ("GET", "/v2/logging", None),
        ("POST", "/v2/logging", {"log_verbose_level": 1, "log_file": "/tmp/triton-owned.log"}),
        ("GET", "/v2/trace/setting", None),
        ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}),
        ("GET", "/v2/models/llm/trace/setting", None),
        ("GET", "/v2/models/stats", None),
        ("GET", "/v2/models/llm/stats", None),
        ("GET", "/v2/systemsharedmemory/status", None),
        ("POST", "/v2/systemsharedmemory/region/owned/register",
         {"key": "/dev/shm/owned", "offset": 0, "byte_size": 1 << 30}),
        ("POST", "/v2/systemsharedmemory/unregister", {}),
        ("GET", "/v2/cudasharedmemory/status", None),
        ("GET", "/v2", None),  # server metadata: version and extensions
        ("GET", "/v2/models/llm", None),  # model metadata
    ]  # fmt: skip


def _triton_tree(leader: LeaderEndpoints) -> dict[str, psutil.Process]:
    """The leader's own process, tritonserver and the backend stub (not EngineCore:
    the unit executor's ports are tests/e2e/test_unit.py's)."""
    root = psutil.Process(leader.proc.pid)
    procs = {"leader": root}
    for p in root.children(recursive=True):
        name = p.name()
        if name == "tritonserver":
            procs["tritonserver"] = p
        elif "triton_python_backend_stub" in name or "triton_python_backend_stub" in " ".join(
            p.cmdline()[:1]
        ):
            procs["stub"] = p
    assert {"tritonserver", "stub"} <= procs.keys(), procs
    return procs


def _usage(p: psutil.Process) -> tuple[int, int]:
    return p.memory_info().rss, p.num_threads()


async def _still_serves(leader: LeaderEndpoints, client) -> None:
    assert leader.model_ready(), leader.log_tail()
    good = await generate(client, PROMPT, stream=True, params={"max_tokens": 4, "temperature": 0})
    assert good.error is None and good.completion_tokens == 4, good.error
    code, body = _http(leader, "POST", "/v2/models/llm/generate",
                       {"text_input": PROMPT, "parameters": {"max_tokens": 2}})  # fmt: skip
    assert code == 200 and json.loads(body)["completion_tokens"] == 2, body


async def test_http_admin_apis_are_refused_without_the_key(
    leader: LeaderEndpoints, client, tmp_path: Path
) -> None:
    marker = tmp_path / "owned"
    triton = _triton_tree(leader)["tritonserver"]
    rss0, threads0 = _usage(triton)
    rounds = 20
    for _ in range(rounds):
        for method, path, body in _admin_requests(marker):
            for headers in ({}, {ADMIN_HEADER: "wrong-" + ADMIN_KEY[6:]}):
                code, text = _http(leader, method, path, body, headers)
                assert code == 403, f"{method} {path} with {list(headers)}: {code} {text[:300]}"
                assert "restricted" in text.lower() or ADMIN_HEADER in text, text[:300]
    rss1, threads1 = _usage(triton)
    n = rounds * len(_admin_requests(marker)) * 2
    print(f"{n} refused admin requests: tritonserver rss {rss0 >> 20} -> {rss1 >> 20} MiB, "
          f"threads {threads0} -> {threads1}")  # fmt: skip
    assert rss1 - rss0 < 64 << 20, f"tritonserver grew {(rss1 - rss0) >> 20} MiB over {n}"
    assert threads1 <= threads0 + 4, f"tritonserver threads {threads0} -> {threads1} over {n}"
    assert not marker.exists(), "the load API ran a client-supplied model.py"
    logs = leader.proc.stderr() + leader.proc.stdout()
    assert ADMIN_KEY not in logs, "the admin key is in the leader's log"
    await _still_serves(leader, client)
    # The key opens them (read-only calls): the refusals above are the restriction.
    code, text = _http(leader, "POST", "/v2/repository/index", {}, {ADMIN_HEADER: ADMIN_KEY})
    assert code == 200 and '"llm"' in text, (code, text[:300])
    code, text = _http(leader, "GET", "/v2/models/llm/stats", None, {ADMIN_HEADER: ADMIN_KEY})
    assert code == 200 and "inference_stats" in text, (code, text[:300])


def test_grpc_admin_apis_are_refused_without_the_key(leader: LeaderEndpoints, tmp_path: Path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    marker = tmp_path / "owned"
    c = grpcclient.InferenceServerClient(leader.grpc)
    wrong = {GRPC_METADATA_PREFIX + ADMIN_HEADER: "wrong-" + ADMIN_KEY[6:]}
    attacks = {
        "unload_model": lambda h: c.unload_model("llm", headers=h),
        "load_model": lambda h: c.load_model(
            "pwned", headers=h, config=_EVIL_CONFIG.replace('"llm"', '"pwned"'),
            files=_evil_files(marker)),
        "get_model_repository_index": lambda h: c.get_model_repository_index(headers=h),
        "get_inference_statistics": lambda h: c.get_inference_statistics("llm", headers=h),
        "get_log_settings": lambda h: c.get_log_settings(headers=h),
        "update_log_settings": lambda h: c.update_log_settings({"log_verbose_level": 1}, headers=h),
        "get_trace_settings": lambda h: c.get_trace_settings(headers=h),
        "update_trace_settings": lambda h: c.update_trace_settings(
            settings={"trace_rate": "1"}, headers=h),
        "get_system_shared_memory_status": lambda h: c.get_system_shared_memory_status(headers=h),
        "register_system_shared_memory": lambda h: c.register_system_shared_memory(
            "owned", "/owned", 1 << 30, headers=h),
        "get_cuda_shared_memory_status": lambda h: c.get_cuda_shared_memory_status(headers=h),
        "get_server_metadata": lambda h: c.get_server_metadata(headers=h),
        "get_model_metadata": lambda h: c.get_model_metadata("llm", headers=h),
    }  # fmt: skip
    try:
        for name, call in attacks.items():
            for headers in (None, wrong):
                with pytest.raises(InferenceServerException) as e:
                    call(headers)
                msg = str(e.value)
                assert "restricted" in msg.lower() or ADMIN_HEADER in msg, f"{name}: {msg}"
        assert not marker.exists(), "the load RPC ran a client-supplied model.py"
        assert c.is_model_ready("llm")
        key = {GRPC_METADATA_PREFIX + ADMIN_HEADER: ADMIN_KEY}
        index = c.get_model_repository_index(headers=key, as_json=True)
        assert [m["name"] for m in index["models"]] == ["llm"], index
    finally:
        c.close()


def test_the_openai_channel_refuses_strangers(leader: LeaderEndpoints) -> None:
    """The leader's OpenAI channel, at the port its model config announces: a peer
    that sends a wrong proof, or a frame instead of one, is dropped unparsed; one that
    proves the token gets the leader's own proof back (mutual)."""
    from neuron_serving import openai_channel as oc

    config = json.loads(get(f"http://{leader.http}/v2/models/llm/config")[1])
    port = int(config["parameters"][oc.CONFIG_PARAMETER]["string_value"])
    for attack in (b"\x00" * oc.PROOF_BYTES, oc.frame(b"\x91\x92\xa4open\x01")):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            hello = _recv_exactly(s, oc.HELLO_BYTES)
            assert hello.startswith(oc.MAGIC)
            s.sendall(attack + b"x" * 1000)
            assert s.recv(4096) == b"", "the leader answered a peer that did not prove the token"
    token = oc.resolve_token()  # the same user's default token file, as the leader's
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        proof, leader_nonce, proxy_nonce = oc.prove(token, _recv_exactly(s, oc.HELLO_BYTES))
        s.sendall(proof)
        oc.check_leader(token, leader_nonce, proxy_nonce, _recv_exactly(s, oc.MAC_BYTES))


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, f"connection closed after {len(data)} of {n} bytes"
        data += chunk
    return data


async def test_model_still_serves_after_the_attacks(leader: LeaderEndpoints, client) -> None:
    await _still_serves(leader, client)


def test_triton_binds_only_the_configured_host(leader: LeaderEndpoints) -> None:
    """--host 127.0.0.1: HTTP, gRPC, Triton's own metrics, the merger and vLLM's metrics
    server listen on loopback only, nothing on 0.0.0.0 or ::."""
    listening = {}
    for role, p in _triton_tree(leader).items():
        for conn in p.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening[f"{role}:{conn.laddr.port}"] = conn.laddr.ip
    wanted = {int(a.rsplit(":", 1)[1]) for a in (leader.http, leader.grpc, leader.metrics)}
    assert wanted <= {int(k.rsplit(":", 1)[1]) for k in listening}, listening
    # gRPC listens on an IPv6 socket bound to ::ffff:127.0.0.1: still loopback only.
    exposed = {k: ip for k, ip in listening.items() if not is_loopback(ip)}
    assert not exposed, f"listening beyond loopback: {exposed} (all: {listening})"


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
    assert rc == ExitCode.UNIT_FAILED, leader.log_tail()
    assert leftover([leader.proc]) == []
