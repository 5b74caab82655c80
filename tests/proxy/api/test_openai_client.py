"""The official ``openai`` client against the proxy."""

import openai
import pytest

from tests.proxy.conftest import url
from tests.proxy.fakes import reference_completion


@pytest.fixture
async def client(fleet):
    a = await fleet.unit("u0")
    proxy = await fleet.proxy([a])
    c = openai.AsyncOpenAI(base_url=url(proxy, "/v1"), api_key="unused", max_retries=0, timeout=10)
    yield c, a
    await c.close()


async def test_streaming_chat_completion(client):
    c, unit = client
    stream = await c.chat.completions.create(
        model="llm",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a red shoe?"},
        ],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    (prompt,) = unit.behavior.prompts
    assert prompt == "<s>[system] be brief\n[user] a red shoe?\n[assistant]"
    assert text == reference_completion(prompt, 8, ignore_eos=True)[0]
    assert finish == "length" and usage.completion_tokens == 8


async def test_non_stream_completion_and_models(client):
    c, _ = client
    resp = await c.completions.create(model="llm", prompt="size nine", max_tokens=3)
    expected, reason = reference_completion("size nine", 3)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == reason
    models = await c.models.list()
    assert [m.id for m in models.data] == ["llm"]


async def test_errors_map_to_openai_exceptions(client):
    c, _ = client
    with pytest.raises(openai.NotFoundError):
        await c.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's 400 (the leader's), relayed
        await c.chat.completions.create(
            model="llm", messages=[{"role": "user", "content": "hi"}], max_tokens=0
        )
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == 400
