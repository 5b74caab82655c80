"""The OpenAI front end relaying the leader's vLLM bytes (fake leader, both upstream
transports): byte-for-byte relay, vLLM's errors passed through and never retried,
retries before the first response, token-exact resumption with the chunk fix-ups,
the clean end of streams that cannot be resumed, and the other vLLM routes."""

import asyncio
import json

import pytest

from tests.proxy.conftest import read_sse, url
from tests.proxy.fake_openai import WORD_ID, WORDS, render_chat
from tests.proxy.fakes import reference_completion, wait_until
from tests.proxy.test_protocol import above_max

pytestmark = pytest.mark.parametrize("fleet", ["grpc", "channel"], indirect=True)

RR = {"routing": {"policy": "round_robin"}}  # u0 first: tests know where a request lands
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "red shoes?"}]


def chat_text(events) -> str:
    return "".join(
        c["delta"].get("content", "")
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
    )


async def test_a_stream_is_relayed_byte_for_byte(fleet):
    u = await fleet.unit("u0")
    proxy = await fleet.proxy([u])
    body = {"model": "llm", "messages": CHAT, "max_tokens": 6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with fleet.session().post(url(proxy, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = await r.read()
    assert raw == b"".join(u.behavior.openai_bodies) and raw.endswith(b"data: [DONE]\n\n")
    (envelope,) = u.behavior.envelopes
    # Resumable (any temperature): the token ids come along, for a migration.
    assert envelope == {"endpoint": "chat/completions", "token_ids": True, "resume": None,
                        "progress": True, "body": body}  # fmt: skip


async def test_a_non_200_answer_is_relayed_and_not_retried(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    proxy = await fleet.proxy([a, b], **RR)
    s = fleet.session()
    for stream in (False, True):
        body = {"model": "llm", "prompt": "x", "max_tokens": 0, "stream": stream}
        async with s.post(url(proxy, "/v1/completions"), json=body) as r:
            assert r.status == 400 and r.content_type == "application/json"
            raw = await r.read()
    assert [raw] == b.behavior.openai_bodies  # the second request went to u1, once
    assert len(a.behavior.envelopes) == len(b.behavior.envelopes) == 1
    assert all(u.consecutive_errors == 0 for u in proxy.registry.units.values())


async def test_retry_before_the_first_response(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.fail_next = 1
    proxy = await fleet.proxy([a, b], **RR)
    body = {"model": "llm", "prompt": "hi", "max_tokens": 4, "ignore_eos": True, "stream": True}
    async with fleet.session().post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200
        events = await read_sse(r)
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == reference_completion("hi", 4, ignore_eos=True)[0]
    assert a.behavior.openai_bodies == [] and len(b.behavior.envelopes) == 1


async def _chat_events(fleet, units, body) -> list:
    proxy = await fleet.proxy(units, **RR)
    async with fleet.session().post(url(proxy, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200
        return await asyncio.wait_for(read_sse(r), 15)


@pytest.mark.parametrize("failure", ["kill", "abort"])
async def test_resumed_chat_stream_equals_the_undisturbed_one(fleet, failure):
    """u0 dies after 4 tokens (``kill``), or its engine stops under the request and
    vLLM ends it with finish_reason "abort" (``abort``: a leader shutting down); u1
    continues from the token ids. The client's stream is the one an undisturbed unit
    gives: one id, the original created, one role chunk, usage of the whole request
    (continuous and final), and no "abort" anywhere."""
    body = {"model": "llm", "messages": CHAT, "max_tokens": 9, "ignore_eos": True,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    ref = await fleet.unit("ref")
    ref.behavior.created = 111
    expected = await _chat_events(fleet, [ref], body)

    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.created, b.behavior.created = 111, 222
    if failure == "kill":
        a.behavior.kill_after_tokens = 4
    else:
        a.behavior.abort_after_tokens = 4
    events = await _chat_events(fleet, [a, b], body)
    assert b'"abort"' not in json.dumps(events).encode()

    assert len({e["id"] for e in events[:-1]}) == 1
    strip = [{**e, "id": None} if isinstance(e, dict) else e for e in events]
    assert strip == [{**e, "id": None} if isinstance(e, dict) else e for e in expected]
    prompt = render_chat(CHAT)
    assert chat_text(events) == reference_completion(prompt, 9, ignore_eos=True)[0]
    assert events[-2]["usage"] == {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + 9,
                                   "completion_tokens": 9}  # fmt: skip
    (resumed,) = b.behavior.envelopes
    assert resumed["token_ids"] is True and resumed["resume"]["prompt_token_ids"] == list(
        prompt.encode()
    )
    assert [WORDS[i - WORD_ID] for i in resumed["resume"]["output_token_ids"]] == chat_text(
        events
    ).split()[:4]
    assert resumed["body"]["request_id"] == events[0]["id"].removeprefix("chatcmpl-")
    assert b"222" in b"".join(b.behavior.openai_bodies)  # u1's own created, rewritten


NOT_RESUMABLE = {
    "n > 1": {"temperature": 0, "n": 2},
    "required tool": {
        "temperature": 0,
        "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f"}}],
    },
    "structured output": {"temperature": 0, "response_format": {"type": "json_object"}},
    "penalties": {"temperature": 0, "frequency_penalty": 0.5},
}


@pytest.mark.parametrize("extra", NOT_RESUMABLE.values(), ids=NOT_RESUMABLE.keys())
async def test_a_stream_that_cannot_be_resumed_ends_with_an_error_event(fleet, extra):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.kill_after_tokens = 3
    body = {"model": "llm", "messages": CHAT, "max_tokens": 8, "ignore_eos": True,
            "stream": True, **extra}  # fmt: skip
    events = await _chat_events(fleet, [a, b], body)
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {
        "message": "the unit serving this stream failed and the request cannot be resumed "
        "exactly on another unit; the request can be retried",
        "type": "ServiceUnavailableError", "param": None, "code": 503}}  # fmt: skip
    assert len(chat_text(events).split()) == 3
    assert a.behavior.envelopes[0]["token_ids"] is False and b.behavior.envelopes == []


SAMPLED = {
    "sampling without a seed": {"temperature": 0.7},
    "seeded sampling": {"temperature": 0.8, "seed": 7},
    "default temperature": {},
}


@pytest.mark.parametrize("extra", SAMPLED.values(), ids=SAMPLED.keys())
async def test_a_sampled_stream_continues_on_another_unit(fleet, extra):
    """Sampled streams resume too: the next unit continues from the tokens the client
    has (a valid sample given them), with the same sampling parameters."""
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.kill_after_tokens = 3
    body = {"model": "llm", "messages": CHAT, "max_tokens": 8, "ignore_eos": True,
            "stream": True, **extra}  # fmt: skip
    events = await _chat_events(fleet, [a, b], body)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
    assert len(chat_text(events).split()) == 8
    (resumed,) = b.behavior.envelopes
    assert len(resumed["resume"]["output_token_ids"]) == 3
    assert {k: resumed["body"].get(k) for k in extra} == extra


async def test_a_tool_stream_continues_with_its_answer_replayed(fleet):
    """``tools`` (auto): the continuation asks the next leader to replay the answer so
    far through its tool parser (``resume.replay``), whose usage then counts it."""
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.kill_after_tokens = 3
    body = {"model": "llm", "messages": CHAT, "max_tokens": 8, "ignore_eos": True,
            "stream": True, "tools": [{"type": "function", "function": {"name": "f"}}]}  # fmt: skip
    events = await _chat_events(fleet, [a, b], body)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
    assert len(chat_text(events).split()) == 8
    (resumed,) = b.behavior.envelopes
    assert resumed["resume"]["replay"] is True and len(resumed["resume"]["output_token_ids"]) == 3


async def test_a_non_streamed_request_is_retried_whole(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.kill_after_tokens = 3
    proxy = await fleet.proxy([a, b], **RR)
    body = {"model": "llm", "prompt": "boots", "max_tokens": 6, "ignore_eos": True}
    async with fleet.session().post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200
        out = await r.json()
    assert out["choices"][0]["text"] == reference_completion("boots", 6, ignore_eos=True)[0]
    assert [e["resume"] for e in b.behavior.envelopes] == [None]
    assert out["usage"]["completion_tokens"] == 6


async def test_tokenize_detokenize_version_and_models(fleet):
    u = await fleet.unit("u0")
    proxy = await fleet.proxy([u], models=[{"name": "llm", "max_model_len": 2048}])
    s = fleet.session()
    async with s.post(url(proxy, "/tokenize"), json={"model": "llm", "prompt": "hi"}) as r:
        assert r.status == 200
        assert (await r.json())["tokens"] == [104, 105]
    async with s.post(url(proxy, "/detokenize"), json={"tokens": [104, 105]}) as r:
        assert r.status == 200 and (await r.json()) == {"prompt": "hi"}  # model defaults
    async with s.post(url(proxy, "/tokenize"), json={"model": "llm", "prompt": 3}) as r:
        assert r.status == 400  # the leader's answer
    async with s.post(url(proxy, "/tokenize"), json={"model": "other", "prompt": "x"}) as r:
        assert r.status == 404
    async with s.get(url(proxy, "/version")) as r:
        assert r.status == 200 and (await r.json()) == {"version": "fake"}
    assert [e["endpoint"] for e in u.behavior.envelopes] == [
        "tokenize", "detokenize", "tokenize", "version"]  # fmt: skip
    async with s.get(url(proxy, "/v1/models")) as r:
        (card,) = (await r.json())["data"]
    assert {k: card[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")} == {
        "id": "llm", "object": "model", "owned_by": "vllm", "root": "llm", "parent": None,
        "max_model_len": 2048}  # fmt: skip
    assert (
        isinstance(card["created"], int) and card["permission"][0]["object"] == "model_permission"
    )


@pytest.mark.parametrize(
    "endpoint, extra, param, got",
    [("chat/completions", {"messages": CHAT, "n": 5}, "n", 5),
     ("chat/completions", {"messages": CHAT, "n": 5, "stream": True}, "n", 5),
     ("completions", {"prompt": "x", "n": "6"}, "n", 6),
     ("completions", {"prompt": ["x", "y"], "n": 1, "best_of": 9}, "best_of", 9)],
)  # fmt: skip
async def test_n_above_the_maximum_is_a_400_before_any_slot_or_unit(
    fleet, endpoint, extra, param, got
):
    u = await fleet.unit("u0")
    proxy = await fleet.proxy([u], admission={"max_n": 4})
    s = fleet.session()
    body = {"model": "llm", "max_tokens": 2, **extra}
    async with s.post(url(proxy, f"/v1/{endpoint}"), json=body) as r:
        assert r.status == 400 and r.content_type == "application/json"
        assert await r.json() == above_max(param, got, 4)
    assert u.behavior.envelopes == []
    assert proxy.admission.snapshot()["real-time"]["dispatched"] == 0
    # At the maximum: served.
    ok = {"model": "llm", "messages": CHAT, "max_tokens": 2, "n": 4, "best_of": 4}
    async with s.post(url(proxy, "/v1/chat/completions"), json=ok) as r:
        assert r.status == 200
    assert [e["body"] for e in u.behavior.envelopes] == [ok]


async def _status(s, proxy, endpoint: str, body: dict) -> int:
    async with s.post(url(proxy, f"/v1/{endpoint}"), json=body) as r:
        await r.read()
        return r.status


@pytest.mark.parametrize(
    "endpoint, extra",
    [("chat/completions", {"messages": CHAT, "n": 2}),
     ("completions", {"prompt": "x", "best_of": 2}),
     # The fake serves one prompt a request (its 400); the proxy counts two sequences.
     ("completions", {"prompt": ["x", "y"]})],
)  # fmt: skip
async def test_a_request_of_several_sequences_waits_until_they_fit(fleet, endpoint, extra):
    """One unit of 2 slots, one taken: a request of 2 sequences waits in the proxy
    (not in the engine, beside a load it does not fit) and starts when the slot frees."""
    u = await fleet.unit("u0")
    proxy = await fleet.proxy([u], admission={"unit_max_in_flight": 2})
    u.behavior.gate = asyncio.Event()  # requests wait there before their first token
    s = fleet.session()
    single = {"model": "llm", "prompt": "hi", "max_tokens": 2}
    first = asyncio.create_task(_status(s, proxy, "completions", single))
    await wait_until(lambda: u.behavior.active == 1)
    wide = {"model": "llm", "max_tokens": 2, **extra}
    second = asyncio.create_task(_status(s, proxy, endpoint, wide))
    await wait_until(lambda: proxy.admission.queued == 1)
    await asyncio.sleep(0.05)
    assert [e["body"] for e in u.behavior.envelopes] == [single] and not second.done()
    u.behavior.gate.set()
    assert await first == 200
    assert await second == (400 if isinstance(extra.get("prompt"), list) else 200)
    assert [e["body"] for e in u.behavior.envelopes] == [single, wide]
