"""The exact KV index in a running proxy: a chat's token ids computed from the model
directory (the demo checkpoint), the kv_aware policy sending it to the unit whose KV
events hold its blocks, and what ``/metrics`` (``proxy/routing/kv/metrics.py``) and ``/status``
show; a unit removed from the registry leaves the index."""

from __future__ import annotations

import pytest

from neuron_serving.openai_channel import KvInfo
from proxy.routing.kv.blocks import DEFAULT_NONE_HASH_SEED, BlockHasher
from proxy.tokens.prompt import ModelPrompts
from tests.proxy.conftest import url

pytestmark = pytest.mark.parametrize("fleet", ["channel"], indirect=True)

BS = 16
HASHER = BlockHasher(BS, seed=DEFAULT_NONE_HASH_SEED)
INFO = KvInfo(-1, BS, "sha256", DEFAULT_NONE_HASH_SEED, HASHER.none_hash, True, 1024)
CHAT = {
    "model": "llm",
    "max_tokens": 2,
    "messages": [
        {"role": "system", "content": "You are a shop assistant. " * 12},
        {"role": "user", "content": "Do you have running shoes in size 10?"},
    ],
}


async def test_kv_aware_routes_to_the_unit_holding_the_prompt(fleet, demo_model) -> None:
    from tests.proxy.routing.kv.vllm_events import payload, stored

    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    model = {"name": "llm", "model_dir": str(demo_model), "max_model_len": 2048}
    # No home units: u1 holds 64 of the prompt's ~130 tokens, not more than half of its
    # home prefix, so an empty home would win (kv_aware.py, "Home units").
    routing = {"policy": "kv_aware", "home_prefix_tokens": 0}
    proxy = await fleet.proxy([a, b], models=[model], routing=routing)
    assert proxy.kv_index is not None and proxy.kv_fleet is not None
    ids = ModelPrompts(demo_model, 2048).for_openai("chat/completions", CHAT)
    assert ids is not None and len(ids.token_ids) > 4 * BS
    # What the leaders' relays would deliver (InOrderKvSink's part is its own test's).
    for unit in ("u0", "u1"):
        proxy.kv_index.on_kv_info(unit, INFO)
    held = HASHER.block_hashes(ids.token_ids)[:4]
    proxy.kv_index.on_kv_events("u0", 0, payload())
    proxy.kv_index.on_kv_events(
        "u1", 0, payload(stored([int.from_bytes(h[-8:], "big") for h in held]))
    )
    s = fleet.session()
    for _ in range(3):
        async with s.post(url(proxy, "/v1/chat/completions"), json=CHAT) as r:
            assert r.status == 200
    assert (len(a.behavior.prompts), len(b.behavior.prompts)) == (0, 3)

    async with s.get(url(proxy, "/metrics")) as r:
        text = await r.text()
    for line in (
        'proxy_routing_decisions_total{policy="kv_aware",reason="kv_overlap"} 3.0',
        'proxy_kv_index_mode{mode="exact",unit="u1"} 1.0',
        'proxy_kv_index_mode{mode="approximate",unit="u1"} 0.0',
        'proxy_kv_index_blocks{unit="u1"} 4.0',
        'proxy_kv_event_batches_total{unit="u1"} 1.0',
        'proxy_kv_index_skipped_total{reason="dropped_at_cap",unit="u1"} 0.0',
        "proxy_kv_event_replays_requested_total 0.0",
    ):
        assert line in text, line
    async with s.get(url(proxy, "/status")) as r:
        units = {u["unit_id"]: u for u in (await r.json())["units"]}
    assert units["u1"]["kv"] == {
        "mode": "exact", "blocks": 4, "block_size": BS, "approximate_reason": None,
    }  # fmt: skip

    # A unit that leaves the registry leaves the index (one re-added under its id
    # starts over from its next KvInfo).
    proxy.registry.remove("u1")
    assert proxy.kv_fleet.describe("u1")["mode"] == "approximate"
    assert "u1" not in proxy.kv_index.units and proxy.kv_fleet.index.size("u1") == 0
    async with s.get(url(proxy, "/metrics")) as r:
        text = await r.text()
    assert 'unit="u1"' not in text.split("proxy_kv_index_mode", 1)[1].split("# HELP", 1)[0]


async def test_without_kv_events_the_units_are_approximate(fleet) -> None:
    a = await fleet.unit("u0")
    proxy = await fleet.proxy([a], routing={"policy": "kv_aware"})
    s = fleet.session()
    async with s.get(url(proxy, "/metrics")) as r:
        text = await r.text()
    assert 'proxy_kv_index_mode{mode="approximate",unit="u0"} 1.0' in text
    async with s.get(url(proxy, "/status")) as r:
        (unit,) = (await r.json())["units"]
    assert unit["kv"]["mode"] == "approximate" and unit["kv"]["approximate_reason"] is None
