"""Failures: retries before the first response, request migration mid-stream
(token-exact resumption of OpenAI streams), 429/503."""

import asyncio
import time

import pytest

from tests.proxy.conftest import read_sse, url
from tests.proxy.fake_openai import WORD_ID, WORDS
from tests.proxy.fakes import next_word, reference_completion, wait_until

# Every test runs over both upstream transports (the fake leader serves both).
pytestmark = pytest.mark.parametrize("fleet", ["grpc", "channel"], indirect=True)


RR = {"routing": {"policy": "round_robin"}}  # u0 first: tests know where a request lands


def completion_text(events):
    return "".join(
        e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")
    )


async def test_retry_before_first_token_goes_to_another_unit(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.fail_next = 1
    proxy = await fleet.proxy([a, b], **RR)
    s = fleet.session()
    body = {"model": "llm", "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200
        assert (await r.json())["choices"][0]["text"] == reference_completion("hi", 4, True)[0]
    assert a.behavior.started == 1 and b.behavior.prompts == ["hi"]
    assert proxy.registry.get("u0").consecutive_errors == 1
    async with s.get(url(proxy, "/metrics")) as r:
        text = await r.text()
    assert 'proxy_retries_total{outcome="retried"} 1.0' in text
    assert 'proxy_upstream_attempts_total{outcome="unit_fault",unit="u0"} 1.0' in text


async def test_all_attempts_fail_gives_503_and_ejects(fleet):
    a = await fleet.unit("u0")
    a.behavior.fail_next = 100  # UNAVAILABLE (HTTP: 503) from the leader
    proxy = await fleet.proxy(
        [a], retry={"max_attempts": 3}, outlier={"consecutive_errors": 3, "panic_threshold_pct": 0}
    )
    s = fleet.session()
    async with s.post(url(proxy, "/v1/completions"), json={"model": "llm", "prompt": "x"}) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        err = (await r.json())["error"]
        assert err["code"] == "upstream_unavailable"
        assert "fake" not in err["message"], err  # the upstream's own text stays in the log
    assert a.behavior.started == 3
    unit = proxy.registry.get("u0")
    assert unit.ejections_total == 1 and unit.is_ejected(time.monotonic())
    async with s.post(url(proxy, "/v1/completions"), json={"model": "llm", "prompt": "x"}) as r:
        assert r.status == 503  # ejected, panic disabled: nothing routable
        assert (await r.json())["error"]["code"] == "no_routable_unit"


async def test_migration_mid_stream_continues_the_same_text(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.kill_after_tokens = 4  # the leader process dies after 4 tokens
    proxy = await fleet.proxy([a, b], **RR)
    s = fleet.session()
    prompt = "find me running shoes"
    body = {"model": "llm", "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200
        events = await read_sse(r)
    expected, _ = reference_completion(prompt, 12, ignore_eos=True)
    assert completion_text(events) == expected  # same as an uninterrupted run
    assert events[-1] == "[DONE]" and events[-2]["usage"] == {
        "prompt_tokens": len(prompt), "total_tokens": len(prompt) + 12, "completion_tokens": 12}  # fmt: skip
    assert [e for e in events if isinstance(e, dict) and "error" in e] == []
    assert (
        len({e["id"] for e in events[:-1]}) == 1 and len({e["created"] for e in events[:-1]}) == 1
    )
    four = expected.split()[:4]
    (resumed,) = b.behavior.envelopes  # fed the token ids, not text
    assert resumed["resume"] == {"prompt_token_ids": list(prompt.encode()),
                                 "output_token_ids": [WORD_ID + WORDS.index(w) for w in four]}  # fmt: skip
    assert resumed["body"] == {**body, "request_id": events[0]["id"].removeprefix("cmpl-")}
    assert b.behavior.prompts == [prompt + "".join(" " + w for w in four)]
    assert next_word(b.behavior.prompts[0]) == expected.split()[4]
    async with s.get(url(proxy, "/metrics")) as r:
        assert 'proxy_migrations_total{outcome="started"} 1.0' in await r.text()


async def test_migration_impossible_ends_with_sse_error_event(fleet):
    a = await fleet.unit("u0")
    a.behavior.kill_after_tokens = 3
    proxy = await fleet.proxy([a], outlier={"panic_threshold_pct": 0})
    s = fleet.session()
    body = {"model": "llm", "prompt": "p", "max_tokens": 10, "ignore_eos": True, "stream": True,
            "temperature": 0}  # fmt: skip
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200
        events = await asyncio.wait_for(read_sse(r), 10)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]  # vLLM's in-stream error format
    assert set(err) == {"message", "type", "param", "code"} and err["code"] >= 500, err
    assert len(completion_text(events).split()) == 3


async def test_no_routable_unit_is_503(fleet):
    a = await fleet.unit("u0")
    proxy = await fleet.proxy([a], outlier={"panic_threshold_pct": 0})
    a.behavior.model_ready = False
    await wait_until(lambda: not proxy.registry.get("u0").nodes_healthy())
    s = fleet.session()
    async with s.post(url(proxy, "/v1/completions"), json={"model": "llm", "prompt": "x"}) as r:
        assert r.status == 503
        err = (await r.json())["error"]
        assert err["code"] == "no_routable_unit" and "llm" in err["message"]
    assert a.behavior.started == 0


async def test_panic_routes_to_unhealthy_units(fleet):
    a = await fleet.unit("u0")
    proxy = await fleet.proxy([a], outlier={"panic_threshold_pct": 50})
    a.behavior.server_ready = False  # probes fail, but generation still works
    await wait_until(lambda: not proxy.registry.get("u0").nodes_healthy())
    s = fleet.session()
    async with s.post(url(proxy, "/v1/completions"), json={"model": "llm", "prompt": "x"}) as r:
        assert r.status == 200
    async with s.get(url(proxy, "/status")) as r:
        assert (await r.json())["panic_models"] == ["llm"]


async def test_admission_queue_full_is_429_with_retry_after(fleet):
    a = await fleet.unit("u0")
    a.behavior.token_delay_s = 0.05
    proxy = await fleet.proxy(
        [a],
        admission={
            "max_concurrent": 1,
            "queue_size": 0,
            "classes": {"real-time": {"retry_after_s": 2}},
        },
    )
    s = fleet.session()
    slow = {"model": "llm", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with s.post(url(proxy, "/v1/completions"), json=slow) as r1:
        await r1.content.readuntil(b"\n\n")  # holds the only slot
        async with s.post(
            url(proxy, "/v1/completions"), json={"model": "llm", "prompt": "y"}
        ) as r2:
            assert r2.status == 429
            assert r2.headers["Retry-After"] == "2"
            assert (await r2.json())["error"]["code"] == "rate_limit_exceeded"
    await wait_until(lambda: proxy.admission.active == 0)
    async with s.post(url(proxy, "/v1/completions"), json={"model": "llm", "prompt": "y"}) as r3:
        assert r3.status == 200


async def test_bad_request_reported_by_unit_is_400_and_not_retried(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.stream_error = b.behavior.stream_error = "prompt is longer than max_model_len"
    proxy = await fleet.proxy([a, b])
    s = fleet.session()
    async with s.post(url(proxy, "/v1/completions"), json={"model": "llm", "prompt": "x"}) as r:
        assert r.status == 400
        assert "max_model_len" in (await r.json())["error"]["message"]
    assert a.behavior.started + b.behavior.started == 1
    assert all(u.consecutive_errors == 0 for u in proxy.registry.units.values())


async def test_concurrent_streams_all_survive_a_unit_dying(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.token_delay_s = b.behavior.token_delay_s = 0.01
    a.behavior.kill_after_tokens = 5  # u0 dies while about half of the streams run on it
    proxy = await fleet.proxy([a, b], **RR)
    s = fleet.session()

    async def one(i: int) -> tuple[str, str]:
        prompt = f"customer {i} wants"
        body = {
            "model": "llm",
            "prompt": prompt,
            "max_tokens": 10,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        async with s.post(url(proxy, "/v1/completions"), json=body) as r:
            assert r.status == 200
            return prompt, completion_text(await read_sse(r))

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(16))), 20)
    for prompt, text in results:
        assert text == reference_completion(prompt, 10, ignore_eos=True)[0]
    migrated = [p for p in b.behavior.prompts if not p.endswith("wants")]  # prompt + ids so far
    assert migrated and all(p.split(" wants")[0].startswith("customer") for p in migrated)


async def test_unit_dying_between_last_token_and_finish_ends_with_length(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.finish_separately = True
    a.behavior.kill_after_tokens = 5  # all 5 tokens sent, then death before the finish
    proxy = await fleet.proxy([a, b], **RR)
    s = fleet.session()
    body = {"model": "llm", "prompt": "q", "max_tokens": 5, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        events = await read_sse(r)
    assert completion_text(events) == reference_completion("q", 5, ignore_eos=True)[0]
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 5
    assert len({e["id"] for e in events[:-1]}) == 1
    assert b.behavior.started == 0  # nothing left to resume: no request to u1
