"""vLLM's OpenAI serving layer on a real in-process AsyncLLM (demo model), through
``openai_serving.py``: what the leader answers to an ``openai_request``.

One engine for the module (in-process EngineCore, eager, 512-token context), on the
same ``EngineThread`` the backend uses. Heavy: run under the shared lock.
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from neuron_serving.triton.engine_load import EngineLoadTracker
from neuron_serving.triton.engine_thread import EngineThread
from neuron_serving.triton.openai_envelope import OpenAIEnvelope, Resume
from neuron_serving.triton.openai_serving import SSE_DONE, OpenAIServing, SSEPuller

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SERVED = "demo"
TIMEOUT_S = 60.0
# Bounded values: on random weights a free string runs until max_tokens, and the
# test is about the grammar closing the JSON, not about what the model likes to say.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Berlin"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine_load() -> EngineLoadTracker:
    """The engine's load, as the backend tracks it for the OpenAI channel."""
    return EngineLoadTracker()


@pytest.fixture(scope="module")
def served(demo_model, engine_load):
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # EngineCore in this process
    kwargs = {
        "model": str(demo_model),
        "max_model_len": 512,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 << 20,
        "disable_log_stats": True,
        "seed": 0,
        # As every leader runs (unit/engine.py): the traffic class is the priority.
        "scheduling_policy": "priority",
        "max_num_seqs": 2,  # so that requests wait, and the priority decides
    }
    thread = EngineThread(kwargs, start_timeout_s=120.0, stat_loggers=[engine_load.stat_logger])
    try:
        thread.start()

        async def bind() -> None:
            engine_load.bind(thread.engine)

        thread.call(bind(), TIMEOUT_S)

        async def build() -> OpenAIServing:
            return OpenAIServing(thread.engine, SERVED, str(demo_model), "pythonic", "v7")

        yield thread, thread.call(build(), TIMEOUT_S)
    finally:
        thread.stop()
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def call(served, endpoint: str, body: dict, serving=None, **envelope):
    """(status, body bytes or the list of pulled response bodies, tap, ids per pull);
    ``serving``: another serving layer on the module's engine thread."""
    thread, default = served
    serving = serving or default

    async def run():
        result = await serving.handle(OpenAIEnvelope(endpoint, body, **envelope))
        if result.stream is None:
            return result.status, result.body, result.tap, []
        puller, pulls, ids = SSEPuller(result.stream, result.tap), [], []
        try:
            while not puller.done:
                pulls.append(await puller.pull())
                ids.append(result.tap.take_token_ids())
        finally:
            await puller.aclose()
        return result.status, pulls, result.tap, ids

    return thread.call(run(), TIMEOUT_S)


def events(pulls: list[str]) -> list[dict]:
    text = "".join(pulls)
    assert text.endswith(SSE_DONE)
    chunks = text.split("\n\n")
    assert chunks[-1] == "" and all(c.startswith("data: ") for c in chunks[:-1])
    return [json.loads(c[len("data: ") :]) for c in chunks[:-2]]


def test_streamed_chat_with_a_named_tool_follows_the_schema(served) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    status, pulls, tap, _ = call(
        served,
        "chat/completions",
        {
            "model": SERVED,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "stream": True,
            "max_tokens": 200,
            "temperature": 0,
        },
    )
    assert status == 200
    chunks = events(pulls)
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == SERVED for c in chunks)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = json.loads("".join(tc["function"].get("arguments") or "" for tc in calls))
    jsonschema.validate(arguments, WEATHER)  # the grammar forces it, even on random weights
    assert chunks[-1]["choices"][0]["finish_reason"] == tap.finish_reason == "stop"


def test_completion_with_logprobs_and_echo(served) -> None:
    status, body, tap, _ = call(
        served,
        "completions",
        {"model": SERVED, "prompt": "Hello world", "max_tokens": 4, "logprobs": 2, "echo": True},
        token_ids=True,
    )
    assert status == 200
    response = json.loads(body)
    choice = response["choices"][0]
    assert response["object"] == "text_completion" and response["model"] == SERVED
    assert response["system_fingerprint"] == "v7"  # the checkpoint version, vLLM's custom mode
    assert choice["text"].startswith("Hello world")
    logprobs = choice["logprobs"]
    # echo: the prompt's tokens (first without a logprob) and then the 4 generated
    n = len(tap.prompt_token_ids) + 4
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == n
    assert logprobs["token_logprobs"][0] is None
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"][1:])  # sampled + top 2
    assert response["usage"]["prompt_tokens"] == len(tap.prompt_token_ids)
    assert response["usage"]["completion_tokens"] == tap.completion_tokens == 4
    assert len(tap.take_token_ids()) == 4


def test_bad_field_is_vllms_400_and_unknown_fields_pass(served) -> None:
    status, body, _, _ = call(
        served, "completions", {"model": SERVED, "prompt": "x", "max_tokens": "abc"}
    )
    assert status == 400
    # Byte for byte what `vllm serve` answers (its validation_exception_handler).
    assert body == (
        b'{"error":{"message":"1 validation error:\\n  {\'type\': \'int_parsing\', '
        b"'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, unable to "
        b"parse string as an integer', 'input': 'abc'}\",\"type\":\"Bad Request\","
        b'"param":"body.max_tokens","code":400}}'
    )
    # A model validator's VLLMValidationError (not a pydantic error): vLLM's generic
    # exception handler's answer.
    messages = [{"role": "user", "content": "x"}]
    body = {"model": SERVED, "messages": messages, "stream_options": {"include_usage": True}}
    status, body, _, _ = call(served, "chat/completions", body)
    error = json.loads(body)["error"]
    assert status == 400 and (error["type"], error["param"]) == (
        "BadRequestError",
        "stream_options",
    )
    status, body, _, _ = call(
        served,
        "completions",
        {"model": SERVED, "prompt": "x", "max_tokens": 2, "no_such_field": {"a": 1}},
    )
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_a_grammar_the_engine_cannot_compile_is_the_requests_400(served) -> None:
    """vLLM's validation builds this schema's grammar, but EngineCore's xgrammar
    (0.2.8) fails to compile it (a string pattern repeated more than 128 times), ends
    the request with finish reason "error", and vLLM answers 500 "Internal server
    error". The leader answers the request's fault: a 400 with the compiler's message,
    streamed or not (a stream refused before its first event gets the status too),
    no unit fault, and the engine serves the next request."""
    pattern = "^(a|aa|aaa|aaaa){1,200}(b|bb){1,200}$"
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": pattern}},
        "required": ["s"],
    }
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    for stream in (False, True):
        status, raw, tap, _ = call(served, "chat/completions", {**body, "stream": stream})
        error = json.loads(raw)["error"]
        assert (status, error["type"], error["code"]) == (400, "BadRequestError", 400), raw
        assert error["message"].startswith("Failed to compile the structured output grammar: ")
        assert "Check failed" in error["message"]  # xgrammar's own words
        assert tap.fault is None
    # vLLM's frontend validation, in a stream: the same 400 as without one.
    bad_regex = {**body, "response_format": None, "structured_outputs": {"regex": "("}}
    status, raw, tap, _ = call(served, "chat/completions", {**bad_regex, "stream": True})
    assert status == 400 and json.loads(raw)["error"]["type"] == "BadRequestError", raw
    assert tap.fault is None
    status, raw, _, _ = call(served, "chat/completions", {**body, "response_format": None})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4, raw


def test_tokenize_equals_the_prompt_the_engine_received(served) -> None:
    messages = [
        {"role": "system", "content": "You are a shopping assistant."},
        {"role": "user", "content": "Do you have running shoes?"},
    ]
    status, body, _, _ = call(served, "tokenize", {"model": SERVED, "messages": messages})
    assert status == 200
    tokens = json.loads(body)["tokens"]
    status, _, tap, _ = call(
        served,
        "chat/completions",
        {"model": SERVED, "messages": messages, "max_tokens": 2},
        token_ids=True,
    )
    assert status == 200 and tap.prompt_token_ids == tokens
    assert tokens.count(tokens[0]) == 1, "one BOS"


def stream_chat(served, max_tokens: int, **envelope):
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "Tell me about running shoes."}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "request_id": "resume-test",
        "return_token_ids": True,  # each chunk names the tokens its delta holds
    }
    status, pulls, tap, ids = call(served, "chat/completions", body, token_ids=True, **envelope)
    assert status == 200
    # (token ids, content) per chunk that carries a choice
    deltas = [
        (c["choices"][0].get("token_ids") or [], c["choices"][0]["delta"].get("content") or "")
        for c in events(pulls)
        if c["choices"]
    ]
    return deltas, tap, [i for batch in ids for i in batch]


def test_resume_continues_token_exactly(served) -> None:
    first, tap, ids = stream_chat(served, 24)
    assert len(ids) == 24 and [i for d, _ in first for i in d] == ids
    # Resume where a migration would: at the end of the first chunk that holds the
    # 10th token (the text streamed so far is whole chunks). Usually that is token 10;
    # a puller that fell behind on a loaded host merges tokens into one chunk (seen in
    # CI), which moves the cut a little.
    counts = [len(d) for d, _ in first]
    cut = next(k for k in range(len(first) + 1) if sum(counts[:k]) >= 10)
    done = sum(counts[:cut])
    assert 10 <= done < 24, counts
    head = "".join(t for _, t in first[:cut])
    text = "".join(t for _, t in first)

    resume = Resume(prompt_token_ids=tap.prompt_token_ids, output_token_ids=ids[:done])
    rest, rest_tap, rest_ids = stream_chat(served, 24, resume=resume)
    assert rest_ids == ids[done:], "generated ids differ from the undisturbed run"
    assert rest_tap.prompt_token_ids == tap.prompt_token_ids  # as rendered, before resume
    assert rest_tap.finish_reason == "length" and rest_tap.completion_tokens == 24 - done
    rest_text = "".join(t for _, t in rest)
    assert head + rest_text == text, (head, rest_text, text)


def test_the_tap_reports_vllms_prefix_cache_hit(served) -> None:
    """``EngineTap.cached_tokens`` (the leader's ``cached_tokens`` output) is what vLLM
    shows as ``usage.prompt_tokens_details.cached_tokens`` with
    ``enable_prompt_tokens_details`` (off by default, so the client's body says
    null): none on a prompt's first run, then its whole blocks up to the last
    token (vLLM recomputes a fully cached prompt's last token,
    vllm/v1/core/kv_cache_manager.py); batched prompts report none."""
    thread, serving = served
    block = thread.engine.vllm_config.cache_config.block_size
    prompt = "Cached tokens " + " ".join(f"item{i}" for i in range(90))
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    status, raw, tap, _ = call(served, "completions", body)
    assert status == 200 and tap.cached_tokens == 0, raw
    assert json.loads(raw)["usage"]["prompt_tokens_details"] is None
    n = json.loads(raw)["usage"]["prompt_tokens"]
    assert n > 2 * block, "the prompt must span blocks"
    serving.completion.enable_prompt_tokens_details = True  # vLLM's own figure, for once
    try:
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        status, pulls, tap, _ = call(served, "completions", stream)
    finally:
        serving.completion.enable_prompt_tokens_details = False
    usage = events(pulls)[-1]["usage"]
    assert status == 200 and tap.cached_tokens == (n - 1) // block * block
    assert usage["prompt_tokens_details"]["cached_tokens"] == tap.cached_tokens
    status, _, tap, _ = call(served, "completions", {**body, "prompt": [prompt, "x"]})
    assert status == 200 and tap.engine_requests == 2 and tap.cached_tokens is None


def test_version(served) -> None:
    status, body, _, _ = call(served, "version", {})
    assert status == 200 and set(json.loads(body)) == {"version"}


def test_the_engines_load_report_follows_a_stream(served, engine_load) -> None:
    """vLLM's scheduler stats reach the tracker (running while a request streams,
    idle once it ended), and vLLM's own Prometheus logger is still there next to ours
    (a custom logger must not replace it: the leader serves vLLM's metrics)."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    thread, serving = served
    body = {"model": SERVED, "prompt": "Catalogue item", "max_tokens": 12, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    during: list = []

    async def run() -> None:
        result = await serving.handle(OpenAIEnvelope("completions", body))
        puller = SSEPuller(result.stream, result.tap)
        try:
            while not puller.done:
                await puller.pull()
                during.append(engine_load.snapshot())
        finally:
            await puller.aclose()

    thread.call(run(), TIMEOUT_S)
    assert max(snapshot[0] for snapshot in during) >= 1, during  # running
    *idle, num_blocks, degraded = engine_load.snapshot()
    assert idle == [0, 0, 0.0, 2] and degraded == ()  # max_num_seqs: the fixture's
    assert num_blocks > 0  # the engine's KV cache size, from its vLLM config
    loggers = thread.engine.logger_manager.stat_loggers
    assert any(isinstance(logger, PrometheusStatLogger) for logger in loggers)


def test_the_envelopes_priority_reaches_the_engine_not_the_clients() -> None:
    """The traffic class: what vLLM's serving layer passes as ``priority`` (the
    client's body field) is replaced by the envelope's, the proxy's. A recording
    engine stands in for AsyncLLM: this is about the keyword the tee forwards."""
    import asyncio

    from neuron_serving.triton.openai_serving import _TAP, EngineTap, TeeEngineClient

    class RecordingEngine:
        def __init__(self) -> None:
            self.kwargs: list[dict] = []

        async def generate(self, prompt, sampling_params, request_id, **kwargs):
            self.kwargs.append(kwargs)
            return
            yield  # an async generator with nothing to say

    class Params:
        output_kind = None
        max_tokens = 4
        min_tokens = 0

    async def call(tap: EngineTap | None) -> None:
        _TAP.set(tap)
        gen = TeeEngineClient(engine).generate({"prompt_token_ids": [1, 2]}, Params(), "r",
                                               priority=-100)  # fmt: skip
        assert [o async for o in gen] == []

    engine = RecordingEngine()
    asyncio.run(call(EngineTap(priority=2)))
    asyncio.run(call(EngineTap()))
    asyncio.run(call(None))  # not an OpenAI request of ours: untouched
    assert [k["priority"] for k in engine.kwargs] == [2, 0, -100]
    env = OpenAIEnvelope("completions", {"prompt": "x"}, priority=1)
    assert env.priority == 1


def test_a_real_time_request_overtakes_a_batch_backlog(served) -> None:
    """The class reaches the scheduler: four batch requests (priority 2) fill an
    engine of two sequences (two running, two waiting) before one real-time request
    (priority 0) arrives. It is scheduled before the two batch requests that were
    waiting ahead of it, so it finishes before them; first come, first served, it
    would finish last."""
    import asyncio

    thread, serving = served
    body = {"model": SERVED, "prompt": "Catalogue item", "temperature": 0, "ignore_eos": True}
    done: list[str] = []

    async def one(name: str, priority: int, max_tokens: int) -> None:
        env = OpenAIEnvelope("completions", {**body, "max_tokens": max_tokens}, priority=priority)
        result = await serving.handle(env)
        assert result.status == 200, result.body
        done.append(name)

    async def run() -> None:
        batch = [asyncio.ensure_future(one(f"batch{i}", 2, 300)) for i in range(4)]
        # Only once all four are in the engine (2 running, 2 waiting): a real-time
        # request that got there first would finish early without any priority.
        async with asyncio.timeout(TIMEOUT_S):
            while thread.engine.get_num_unfinished_requests() < 4:
                await asyncio.sleep(0.01)
        assert not done, "the backlog finished before the real-time request came"
        await asyncio.gather(one("real-time", 0, 8), *batch)

    thread.call(run(), TIMEOUT_S)
    assert done.index("real-time") < min(done.index("batch2"), done.index("batch3")), done


TOOL_CALL = '[get_stock(sku="A1", qty=2)]'
STOCK_TOOL = {"type": "function", "function": {
    "name": "get_stock", "description": "Units of an article in stock.",
    "parameters": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}}}}}  # fmt: skip


class ScriptedEngine:
    """The real AsyncLLM for everything but ``generate``, which answers ``text``'s tokens
    one output each (DELTA), as if the engine sampled them: the model decides nothing
    here, so the tool parser gets a tool call on random weights. A resumed request
    (its prompt holds ``base`` tokens plus the ones generated so far) gets the rest."""

    def __init__(self, engine, text: str, base: int | None = None) -> None:
        self._engine = engine
        self.ids = engine.get_tokenizer().encode(text, add_special_tokens=False)
        self.base = base

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, prompt, sampling_params, request_id: str, **kwargs):
        import asyncio

        from vllm.outputs import CompletionOutput, RequestOutput

        tokenizer = self._engine.get_tokenizer()
        prompt_ids = list(prompt["prompt_token_ids"])
        if self.base is None:
            self.base = len(prompt_ids)
        done = len(prompt_ids) - self.base
        for k, tok in enumerate(self.ids[done:]):
            last = done + k + 1 == len(self.ids)
            out = CompletionOutput(0, tokenizer.decode([tok]), [tok], None, None,
                                   finish_reason="stop" if last else None)  # fmt: skip
            yield RequestOutput(request_id, None, prompt_ids, None, [out], last)
            await asyncio.sleep(0)


def _tool_stream(served, engine: ScriptedEngine, resume: Resume | None = None):
    """A streamed chat with tools (vLLM's pythonic parser) through a serving layer on
    ``engine``: (events, tap, ids per pull)."""
    thread, _ = served

    async def build() -> OpenAIServing:
        return OpenAIServing(engine, SERVED, engine._engine.model_config.model, "pythonic")

    serving = thread.call(build(), TIMEOUT_S)
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Is A1 in stock?"}],
            "tools": [STOCK_TOOL], "stream": True, "max_tokens": 64, "temperature": 0.7,
            "stream_options": {"include_usage": True}}  # fmt: skip

    status, pulls, tap, ids = call(served, "chat/completions", body, serving, token_ids=True,
                                   resume=resume)  # fmt: skip
    assert status == 200, pulls
    return pulls, tap, ids


def _tool_calls(chunks: list[dict]) -> tuple[list[tuple[str, str]], str | None, str]:
    """What a client makes of a stream's chunks: the tool calls (name, arguments) as
    OpenAI's streaming format accumulates them, the finish reason, the content."""
    calls: dict[int, list[str]] = {}
    finish, content = None, ""
    for c in chunks:
        for choice in c["choices"]:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], ["", ""])
                fn = tc.get("function") or {}
                call[0] += fn.get("name") or ""
                call[1] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish, content


def test_a_tool_call_stream_resumes_through_the_parser(served) -> None:
    """A tool-call stream cut at any chunk and resumed with ``replay`` gives the client
    the tool call the undisturbed stream gives: the new leader's parser reads the
    answer so far first (its chunks are not sent), then the rest. Usage counts the
    whole answer, against the original prompt."""
    thread, _ = served
    real = thread.engine
    pulls, tap, ids = _tool_stream(served, ScriptedEngine(real, TOOL_CALL))
    whole = events(pulls)
    calls, finish, content = _tool_calls(whole)
    assert calls == [("get_stock", json.dumps({"sku": "A1", "qty": 2}))] and finish == "tool_calls"
    assert content == "" and whole[-1]["usage"]["completion_tokens"] == len(
        ScriptedEngine(real, TOOL_CALL).ids
    )
    flat = [i for batch in ids for i in batch]
    base = len(tap.prompt_token_ids)
    for cut in range(1, len(pulls) - 1):
        done = sum(len(batch) for batch in ids[:cut])
        if not 0 < done < len(flat):
            continue
        head = [json.loads(p[len("data: ") :]) for p in "".join(pulls[:cut]).split("\n\n") if p]
        resume = Resume(prompt_token_ids=tap.prompt_token_ids, output_token_ids=flat[:done],
                        replay=True)  # fmt: skip
        rest_pulls, _, rest_ids = _tool_stream(
            served, ScriptedEngine(real, TOOL_CALL, base), resume
        )
        rest = [
            c
            for c in events(rest_pulls)
            if not any("role" in (ch.get("delta") or {}) for ch in c["choices"])
        ]  # the proxy drops it
        assert [i for batch in rest_ids for i in batch] == flat[done:], cut
        assert _tool_calls(head + rest) == (calls, "tool_calls", ""), (cut, head, rest)
        usage = rest[-1]["usage"]
        assert usage["prompt_tokens"] == base and usage["completion_tokens"] == len(flat), cut
