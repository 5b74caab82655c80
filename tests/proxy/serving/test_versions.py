"""Checkpoint versions through the proxy: learned from the leader, named on every
response, pinnable, and never mixed within one request (migration stays on the
version that produced the first token)."""

import asyncio

from tests.proxy.conftest import ADMIN_TOKEN, read_sse, url
from tests.proxy.fakes import reference_completion, wait_until

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _fingerprints(chunks: list) -> list[str]:
    return [c["system_fingerprint"] for c in chunks if "system_fingerprint" in c]


async def _status_versions(s, proxy) -> dict[str, str]:
    async with s.get(url(proxy, "/status")) as r:
        return {u["unit_id"]: u["model_version"] for u in (await r.json())["units"]}


async def test_version_is_learned_from_the_leader_and_named_on_responses(fleet):
    u = await fleet.unit("u0")
    u.behavior.model_version = "v2"  # the config says v1; the leader knows better
    proxy = await fleet.proxy([u])
    s = fleet.session()
    await wait_until(lambda: proxy.registry.get("u0").model_version == "v2")
    assert await _status_versions(s, proxy) == {"u0": "v2"}

    body = {"model": "llm", "prompt": "red shoes", "max_tokens": 4, "ignore_eos": True}
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200
        assert r.headers["X-Model-Version"] == "v2"
        assert (await r.json())["system_fingerprint"] == "v2"  # the fake leader's, relayed
    async with s.post(url(proxy, "/v1/completions"), json={**body, "stream": True}) as r:
        assert r.headers["X-Model-Version"] == "v2"
        chunks = (await read_sse(r))[:-1]
    assert _fingerprints(chunks) == ["v2"]  # vLLM stamps the terminal chunk only
    triton = {"text_input": "red shoes", "parameters": {"max_tokens": 3}}
    async with s.post(url(proxy, "/v2/models/llm/generate"), json=triton) as r:
        assert r.headers["X-Model-Version"] == "v2"
        assert (await r.json())["model_version"] == "v2"


async def test_a_pinned_version_goes_only_to_its_units(fleet):
    a, b = await fleet.unit("a"), await fleet.unit("b")
    a.behavior.model_version, b.behavior.model_version = "v1", "v2"
    proxy = await fleet.proxy([a, b], routing={"policy": "round_robin"})
    await wait_until(lambda: proxy.registry.get("b").model_version == "v2")
    s = fleet.session()
    body = {"model": "llm", "prompt": "boots", "max_tokens": 2}
    for _ in range(4):
        async with s.post(
            url(proxy, "/v1/completions"), json=body, headers={"X-Model-Version": "v2"}
        ) as r:
            assert r.status == 200 and r.headers["X-Model-Version"] == "v2"
    assert len(a.behavior.prompts) == 0 and len(b.behavior.prompts) == 4

    async with s.post(
        url(proxy, "/v1/completions"), json=body, headers={"X-Model-Version": "v9"}
    ) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["code"] == "model_version_not_found" and "v9" in err["message"]

    # Pinned to a version whose every unit is draining: an outage (503), not a 404.
    async with s.post(url(proxy, "/admin/units/b/drain", admin=True), headers=AUTH) as r:
        assert r.status == 200
    async with s.post(
        url(proxy, "/v1/completions"), json=body, headers={"X-Model-Version": "v2"}
    ) as r:
        assert r.status == 503
        assert "version 'v2'" in (await r.json())["error"]["message"]


async def _stream_with_failover(fleet, spare_version: str):
    """Unit "a" (v1) dies mid-stream; the only other routable unit serves
    ``spare_version``. Returns the SSE events and the proxy."""
    a, spare = await fleet.unit("a"), await fleet.unit("spare")
    a.behavior.model_version, spare.behavior.model_version = "v1", spare_version
    a.behavior.kill_after_tokens = 6
    a.behavior.token_delay_s = spare.behavior.token_delay_s = 0.05
    proxy = await fleet.proxy([a, spare], routing={"policy": "round_robin"})
    await wait_until(lambda: proxy.registry.get("spare").model_version == spare_version)
    s = fleet.session()
    async with s.post(url(proxy, "/admin/units/spare/drain", admin=True), headers=AUTH) as r:
        assert r.status == 200
    body = {"model": "llm", "prompt": "hiking socks", "max_tokens": 12, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    async with s.post(url(proxy, "/v1/completions"), json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["X-Model-Version"] == "v1"
        # The first token came from "a"; now the spare may take traffic.
        async with s.post(url(proxy, "/admin/units/spare/undrain", admin=True), headers=AUTH) as u:
            assert u.status == 200
        events = await asyncio.wait_for(read_sse(r), 15)
    return events, spare, proxy


async def test_migration_stays_on_the_version_of_the_first_token(fleet):
    events, spare, _ = await _stream_with_failover(fleet, "v1")
    chunks = [e for e in events[:-1] if "choices" in e]
    assert _fingerprints(chunks) == ["v1"]  # the terminal chunk came from the spare, at v1
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == reference_completion("hiking socks", 12, ignore_eos=True)[0]
    assert len(spare.behavior.prompts) == 1  # the migrated continuation


async def test_no_migration_to_another_version_clean_error_instead(fleet):
    events, spare, proxy = await _stream_with_failover(fleet, "v2")
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and "version 'v1'" in events[-2]["error"]["message"]
    chunks = [e for e in events[:-2] if "choices" in e]
    assert chunks and _fingerprints(chunks) == []  # no terminal chunk: the stream broke
    assert spare.behavior.prompts == []  # never stitched onto v2
    # And the proxy keeps serving: a new request goes to the v2 unit.
    s = fleet.session()
    body = {"model": "llm", "prompt": "tents", "max_tokens": 2}
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200 and r.headers["X-Model-Version"] == "v2"
