from collections import Counter

from proxy.config import RoutingConfig, UnitSpec
from proxy.registry import make_unit_state
from proxy.routing import RouteRequest, make_policy
from proxy.routing.prefix_index import PrefixIndex, block_hashes

SYSTEM = "You are a shopping assistant. " * 10  # 300 characters of shared prefix


def units(*ids: str):
    return [make_unit_state(UnitSpec(unit_id=i, leader_grpc="127.0.0.1:1")) for i in ids]


def req(prompt: str, session: str | None = None) -> RouteRequest:
    return RouteRequest("llm", prompt, session)


def test_block_hashes_chain_and_ignore_partial_block():
    a = block_hashes("abcdefgh", 4)
    b = block_hashes("abcdXXXXyz", 4)
    assert len(a) == 2 and len(b) == 2
    assert a[0] == b[0] and a[1] != b[1]  # the chain diverges at the first different block
    assert block_hashes("abc", 4) == []


def test_prefix_index_match_and_lru_keeps_shallow_blocks():
    idx = PrefixIndex(max_blocks=4)
    chain = block_hashes("a" * 12, 2)  # 6 blocks
    idx.insert("u", chain)
    assert idx.size("u") == 4
    assert idx.match_blocks("u", chain) == 4  # the deepest two were evicted first
    assert idx.match_blocks("u", block_hashes("a" * 4 + "b" * 8, 2)) == 2
    assert idx.match_blocks("other", chain) == 0


def test_cache_aware_follows_the_longest_prefix():
    policy = make_policy(RoutingConfig("prefix_cache_aware", block_chars=16), seed=1)
    a, b = units("a", "b")
    first = policy.choose(req(SYSTEM + "user: red shoes"), [a, b])
    assert first.reason == "prefix_miss"
    # Load the chosen unit a little: still below both thresholds, so the prefix wins.
    first.unit.in_flight = 3
    for turn in range(10):
        d = policy.choose(req(SYSTEM + f"user: question {turn}"), [a, b])
        assert d.unit is first.unit and d.reason == "prefix_hit"


def test_cache_aware_balances_when_both_thresholds_trip():
    policy = make_policy(
        RoutingConfig(
            "prefix_cache_aware", block_chars=16, balance_abs_threshold=4, balance_rel_threshold=2.0
        )
    )
    a, b = units("a", "b")
    policy.choose(req(SYSTEM), [a, b])
    owner, other = (a, b) if policy.index.size("a") else (b, a)
    owner.in_flight, other.in_flight = 30, 20  # gap 10 > 4 but 30 < 20 * 2: not imbalanced
    assert policy.choose(req(SYSTEM + "again"), [a, b]).unit is owner
    owner.in_flight, other.in_flight = 6, 1  # gap 5 > 4 and 6 > 1 * 2
    d = policy.choose(req(SYSTEM + "more"), [a, b])
    assert d.unit is other and d.reason == "imbalance"
    assert policy.index.size(other.unit_id) > 0  # the prefix is now cached there too


def test_cache_aware_random_tie_break_spreads_new_prefixes():
    seen = Counter()
    for seed in range(20):
        policy = make_policy(RoutingConfig("prefix_cache_aware", block_chars=8), seed=seed)
        seen[policy.choose(req("brand new prompt"), units("a", "b", "c")).unit.unit_id] += 1
    assert len(seen) == 3


def test_least_loaded_and_round_robin():
    a, b, c = units("a", "b", "c")
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert make_policy(RoutingConfig(policy="least_loaded")).choose(req("x"), [a, b, c]).unit is b
    rr = make_policy(RoutingConfig(policy="round_robin"))
    assert [rr.choose(req("x"), [c, a, b]).unit.unit_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_session_affinity_is_sticky_and_moves_only_lost_sessions():
    policy = make_policy(RoutingConfig(policy="session_affinity"))
    us = units("a", "b", "c")
    before = {s: policy.choose(req("x", s), us).unit.unit_id for s in map(str, range(60))}
    assert set(before.values()) == {"a", "b", "c"}
    assert all(policy.choose(req("y", s), us).unit.unit_id == u for s, u in before.items())
    without_b = [u for u in us if u.unit_id != "b"]
    after = {s: policy.choose(req("x", s), without_b).unit.unit_id for s in before}
    assert all(after[s] == before[s] for s in before if before[s] != "b")
    assert policy.choose(req("no session"), us).reason == "least_loaded"


async def test_proxy_keeps_a_shared_prefix_on_one_unit(fleet):
    from tests.proxy.conftest import url

    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    proxy = await fleet.proxy([a, b], routing={"block_chars": 16})
    s = fleet.session()

    async def chat(system: str, user: str) -> None:
        body = {"model": "llm", "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]}  # fmt: skip
        async with s.post(url(proxy, "/v1/chat/completions"), json=body) as r:
            assert r.status == 200

    for i in range(6):
        await chat(SYSTEM, f"question {i}")
    counts = sorted([len(a.behavior.prompts), len(b.behavior.prompts)])
    assert counts == [0, 6]
    # A different prefix goes to the unit with the emptier index, then stays there.
    for i in range(3):
        await chat("You answer questions about delivery times. " * 5, f"order {i}")
    assert sorted([len(a.behavior.prompts), len(b.behavior.prompts)]) == [3, 6]
    async with s.get(url(proxy, "/metrics")) as r:
        text = await r.text()
    assert (
        'proxy_routing_decisions_total{policy="prefix_cache_aware",reason="prefix_hit"} 7.0' in text
    )


def test_cache_aware_ignores_a_prefix_below_cache_threshold():
    policy = make_policy(
        RoutingConfig("prefix_cache_aware", block_chars=8, cache_threshold=0.5), seed=3
    )
    a, b = units("a", "b")
    owner = policy.choose(req("<s>[sys] " + "x" * 80), [a, b]).unit
    d = policy.choose(req("<s>[sys] " + "y" * 80), [a, b])  # one shared block of eleven
    assert d.reason == "prefix_miss" and d.unit is not owner  # the emptier index wins the tie
    d = policy.choose(req("<s>[sys] " + "x" * 40 + "z" * 40), [a, b])  # six of eleven
    assert d.reason == "prefix_hit" and d.unit is owner
