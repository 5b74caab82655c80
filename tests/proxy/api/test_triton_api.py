"""Triton's generate / generate_stream through the proxy."""

import json

import pytest

from proxy.traffic_class import TrafficClass
from tests.proxy.conftest import url
from tests.proxy.fakes import reference_completion
from tests.proxy.tokens.test_tokenizer import model_dir


@pytest.mark.parametrize("failure", ["kill", "abort"])
async def test_generate_and_generate_stream(fleet, failure):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    # The stream below is migrated to u1: u0 dies after 2 tokens, or its engine stops
    # under the request (vLLM's finish_reason "abort", never shown to the client).
    if failure == "kill":
        a.behavior.kill_after_tokens = 2
    else:
        a.behavior.abort_after_tokens = 2
    proxy = await fleet.proxy([a, b], routing={"policy": "round_robin"})
    s = fleet.session()
    body = {"text_input": "blue", "parameters": {"max_tokens": 6, "ignore_eos": True}}
    async with s.post(url(proxy, "/v2/models/llm/generate_stream"), json=body) as r:
        assert r.status == 200
        events = [json.loads(b[len("data: ") :]) for b in (await r.text()).split("\n\n") if b]
    expected, _ = reference_completion("blue", 6, ignore_eos=True)
    assert (
        "".join(e["text_output"] for e in events) == "blue" + expected
    )  # input included by default
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 6
    assert all(e["model_name"] == "llm" for e in events)

    body = {"text_input": "size", "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 4, "ignore_eos": True})}  # fmt: skip
    async with s.post(url(proxy, "/v2/models/llm/generate"), json=body) as r:
        assert r.status == 200
        out = await r.json()
    assert out["text_output"] == reference_completion("size", 4, ignore_eos=True)[0]


async def test_generate_errors_are_triton_shaped(fleet):
    a = await fleet.unit("u0")
    proxy = await fleet.proxy([a])
    s = fleet.session()
    for path, body, status in (
        ("/v2/models/nope/generate", {"text_input": "x"}, 404),
        ("/v2/models/llm/generate", {"text_input": ""}, 400),
        ("/v2/models/llm/generate", {"text_input": "x", "parameters": {"max_tokens": 0}}, 400),
        ("/v2/models/llm/generate", {"text_input": "x", "parameters": {"beam_width": 2}}, 400),
        ("/v2/models/llm/generate", {"text_input": "x", "sampling_parameters": "{bad"}, 400),
        ("/v2/models/llm/generate_stream", {"text_input": "x", "bogus": 1}, 400),
        # A client's priority: an integer in [0, 16) as the leader's input (then ignored),
        # never a sampling parameter.
        ("/v2/models/llm/generate", {"text_input": "x", "priority": -1}, 400),
        ("/v2/models/llm/generate", {"text_input": "x", "priority": "high"}, 400),
        ("/v2/models/llm/generate", {"text_input": "x", "parameters": {"priority": 0}}, 400),
        (
            "/v2/models/llm/generate",
            {"text_input": "x", "sampling_parameters": '{"priority": 1}'},
            400,
        ),
    ):
        async with s.post(url(proxy, path), json=body) as r:
            assert r.status == status, body
            err = await r.json()
            assert isinstance(err["error"], str) and err["error"]
    assert a.behavior.prompts == []  # all refused before any unit saw them


async def test_prompt_length_is_checked_as_the_leader_counts(fleet, tmp_path):
    """The prompt's tokens with the BOS the leader's encode adds, plus max_tokens, must
    fit max_model_len: else a 400 in Triton's format naming the numbers, and the unit
    never sees the request. Long prompts are counted on a thread, with the same answer."""
    u = await fleet.unit("u0")
    d = model_dir(tmp_path, {"[UNK]": 0, "<s>": 1, "a": 2})
    proxy = await fleet.proxy([u], models=[{"name": "llm", "model_dir": d, "max_model_len": 32}])
    s = fleet.session()
    gen = url(proxy, "/v2/models/llm/generate")
    # 30 words + BOS = 31 tokens: one more token fits exactly, two do not.
    fits = {"text_input": "a " * 30, "parameters": {"max_tokens": 1}}
    async with s.post(gen, json=fits) as r:
        assert r.status == 200, await r.text()
    for path, prompt, max_tokens, n in (
        ("generate", "a " * 30, 2, 31),
        ("generate_stream", "a " * 30, 2, 31),
        ("generate", "a " * 16, None, 17),  # the default max_tokens (16) counts too
        ("generate", "a " * 2500, 1, 2501),  # over 4096 characters: counted on a thread
    ):
        params = {} if max_tokens is None else {"max_tokens": max_tokens}
        body = {"text_input": prompt, "parameters": params}
        async with s.post(url(proxy, f"/v2/models/llm/{path}"), json=body) as r:
            assert r.status == 400, (path, n)
            err = await r.json()
        assert set(err) == {"error"}
        assert f"maximum context length is 32 tokens; the prompt has {n} tokens" in err["error"]
        assert f"max_tokens is {max_tokens or 16}" in err["error"]
    assert u.behavior.prompts == [fits["text_input"]]


@pytest.mark.parametrize("fleet", ["grpc", "channel"], indirect=True)
async def test_the_class_reaches_the_leader_as_the_priority_input(fleet):
    """The generate route's traffic class is what the leader gets as its ``priority``
    input (vLLM's request priority), over each transport; a client's own ``priority``
    is ignored (the class decides: it cannot raise itself), and a migrated stream's
    next attempt carries the class too."""
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.kill_after_tokens = 2  # the batch stream below moves to u1 mid-way
    proxy = await fleet.proxy([a, b], routing={"policy": "round_robin"})
    s = fleet.session()
    gen = url(proxy, "/v2/models/llm/generate_stream")
    body = {
        "text_input": "blue",
        "priority": 0,
        "parameters": {"max_tokens": 5, "ignore_eos": True},
    }
    async with s.post(gen, json=body, headers={"X-Traffic-Class": "batch"}) as r:
        assert r.status == 200, await r.text()
        events = [json.loads(e[len("data: ") :]) for e in (await r.text()).split("\n\n") if e]
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 5
    assert a.behavior.priorities == b.behavior.priorities == [int(TrafficClass.BATCH)]
    # Real-time (no header) and near-real-time, on the unit left.
    body = {"text_input": "size", "priority": 9, "parameters": {"max_tokens": 2}}
    for header, expected in (
        (None, TrafficClass.REAL_TIME),
        ("near-real-time", TrafficClass.NEAR_REAL_TIME),
    ):
        headers = {} if header is None else {"X-Traffic-Class": header}
        async with s.post(url(proxy, "/v2/models/llm/generate"), json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
        assert b.behavior.priorities[-1] == int(expected)
