"""The kv_aware policy's choices: the exact index's overlap against the units' load,
the approximate index for units (or requests) the exact one cannot serve, a reset
unit's lost overlap, and the prediction it records."""

from __future__ import annotations

import time

from proxy.config import RoutingConfig, UnitSpec
from proxy.registry import EngineLoad, UnitState, make_unit_state
from proxy.routing import PromptTokens, RouteRequest, make_policy
from proxy.routing.kv.blocks import DEFAULT_NONE_HASH_SEED, BlockHasher
from proxy.routing.kv.events import BlockStored, EventBatch
from proxy.routing.kv.fleet import KvFleet, KvMode
from proxy.routing.kv_aware import KvAwarePolicy, home_unit
from proxy.routing.prefix_index import block_hashes

BS = 16
HASHER = BlockHasher(BS, seed=DEFAULT_NONE_HASH_SEED)
PROMPT = list(range(1000, 1000 + 64 * BS))  # 64 blocks = 1024 tokens
TEXT = "a shop assistant's conversation " * 40


def units(*ids: str, running: int = 0, max_num_seqs: int = 16) -> list[UnitState]:
    out = []
    for i in ids:
        u = make_unit_state(UnitSpec(unit_id=i, leader_grpc="127.0.0.1:1"))
        u.engine_load = EngineLoad(running, 0, 0.0, max_num_seqs, time.monotonic())
        out.append(u)
    return out


def fleet_with(**held: int) -> KvFleet:
    """Units in exact mode holding the first ``n`` blocks of PROMPT."""
    fleet = KvFleet(1 << 16)
    for unit_id, n in held.items():
        fleet.start(unit_id, HASHER)
        stored = BlockStored(HASHER.block_hashes(PROMPT[: n * BS]), "GPU", 0)
        fleet.apply(unit_id, EventBatch(0, 0.0, [stored] if n else [], 0))
    return fleet


def policy(fleet: KvFleet | None, seed: int = 0, home_prefix_tokens: int = 0) -> KvAwarePolicy:
    """Home units off unless asked (``test_home_*`` below)."""
    cfg = RoutingConfig("kv_aware", block_chars=16, home_prefix_tokens=home_prefix_tokens)
    p = make_policy(cfg, seed=seed, kv=fleet)
    assert isinstance(p, KvAwarePolicy)
    return p


def req(tokens: list[int] | None = PROMPT, text: str = TEXT) -> RouteRequest:
    return RouteRequest("llm", text, None, None if tokens is None else PromptTokens(tokens))


def test_more_overlap_wins_and_the_prediction_is_recorded() -> None:
    a, b = units("a", "b")
    d = policy(fleet_with(a=48, b=8)).choose(req(), [a, b])
    assert d.unit is a and d.reason == "kv_overlap" and d.cached_tokens == 48 * BS


def test_unless_the_unit_is_much_more_loaded() -> None:
    # a holds 40 blocks more than b: 640 uncached tokens = 2.5 sequences (256 each).
    fleet = fleet_with(a=48, b=8)
    (a,), (b,) = units("a", running=2), units("b")
    assert policy(fleet).choose(req(), [a, b]).unit is a  # 2 sequences more: a
    a.engine_load = EngineLoad(3, 0, 0.0, 16, time.monotonic())  # 3 more: b
    d = policy(fleet).choose(req(), [a, b])
    assert d.unit is b and d.reason == "load_over_overlap" and d.cached_tokens == 8 * BS
    # This proxy's in-flight count there when it is higher (the report lags).
    a.engine_load = EngineLoad(0, 0, 0.0, 16, time.monotonic())
    a.in_flight = 3
    assert policy(fleet).choose(req(), [a, b]).unit is b
    # KV usage up to kv_usage_high (0.8) weighs nothing: the cache has room.
    a.in_flight = 0
    a.engine_load = EngineLoad(0, 0, 0.8, 16, time.monotonic())
    assert policy(fleet).choose(req(), [a, b]).unit is a
    # Above it, it rises to a whole batch at a full cache: 0.85 is 0.25 of that, 4 sequences.
    a.engine_load = EngineLoad(0, 0, 0.85, 16, time.monotonic())
    assert policy(fleet).choose(req(), [a, b]).unit is b


def test_a_small_cache_half_full_does_not_outweigh_a_cached_system_prompt() -> None:
    """bench routing's case: 18-block caches, one running conversation holds 7 of them
    (39%); a unit holding the prompt's 48 blocks keeps it over an idle unit holding 8,
    where the full KV usage (6 sequences' worth at max_num_seqs 16) used to send it."""
    fleet = fleet_with(a=48, b=8)
    (a,), (b,) = units("a", running=1), units("b")
    a.engine_load = EngineLoad(1, 0, 7 / 18, 16, time.monotonic())
    d = policy(fleet).choose(req(), [a, b])
    assert d.unit is a and d.reason == "kv_overlap"


def test_a_fully_cached_prompt_predicts_all_but_its_last_block() -> None:
    a, b = units("a", "b")
    d = policy(fleet_with(a=64, b=0)).choose(req(), [a, b])
    # vLLM computes a prompt's last token: the last full block is never a hit.
    assert d.unit is a and d.cached_tokens == 63 * BS
    d = policy(fleet_with(a=64, b=0)).choose(req(PROMPT + [7]), [a, b])
    assert d.cached_tokens == 64 * BS


def test_ties_are_random_and_no_overlap_goes_by_load() -> None:
    seen = set()
    for seed in range(16):
        a, b, c = units("a", "b", "c")
        d = policy(fleet_with(a=0, b=0, c=0), seed).choose(req(), [a, b, c])
        assert d.reason == "no_overlap" and d.cached_tokens == 0
        seen.add(d.unit.unit_id)
    assert seen == {"a", "b", "c"}
    (a,), (b,) = units("a", running=1), units("b")
    assert policy(fleet_with(a=0, b=0)).choose(req(), [a, b]).unit is b


def test_without_events_or_token_ids_it_is_prefix_cache_aware() -> None:
    a, b = units("a", "b")
    for p, r in ((policy(None), req()), (policy(fleet_with(a=48, b=0)), req(None))):
        first = p.choose(r, [a, b])
        assert first.reason == "prefix_miss" and first.cached_tokens is None
        again = p.choose(r, [a, b])
        assert again.unit is first.unit and again.reason == "prefix_hit"
    assert not policy(None).needs_prompt_tokens([a, b])
    assert policy(fleet_with(a=0)).needs_prompt_tokens([a, b])


def test_an_approximate_unit_is_estimated_from_the_approximate_index() -> None:
    fleet = fleet_with(b=0)  # a: approximate (no KvInfo); b: exact, holds nothing
    p = policy(fleet)
    a, b = units("a", "b")
    p.approx.index.insert("a", block_hashes(TEXT, 16))  # this proxy sent TEXT to a before
    d = p.choose(req(), [a, b])
    assert d.unit is a and d.reason == "approx_overlap"
    assert d.cached_tokens is None  # no exact prediction for an approximate unit
    assert fleet.mode("a") is KvMode.APPROXIMATE and fleet.mode("b") is KvMode.EXACT


def test_a_reset_unit_loses_its_overlap() -> None:
    fleet = fleet_with(a=48, b=8)
    a, b = units("a", "b")
    p = policy(fleet)
    assert p.choose(req(text="x" * 200), [a, b]).unit is a
    # Its leader restarted: a new stream from seq 0 with an empty cache.
    fleet.start("a", HASHER)
    fleet.apply("a", EventBatch(0, 0.0, [], 0))
    d = p.choose(req(text="y" * 200), [a, b])
    assert d.unit is b and d.cached_tokens == 8 * BS
    # A reset mid-stream (events lost): partial, the exact overlap gone; only the
    # approximate index's estimate (what this proxy sent there) remains for it.
    fleet = fleet_with(a=48, b=8)
    p = policy(fleet)
    fleet.reset("a", 40)
    assert fleet.mode("a") is KvMode.PARTIAL
    d = p.choose(req(text="z" * 200), [a, b])
    assert d.unit is b and d.reason == "kv_overlap"


def test_session_affinity_still_pins_sessions() -> None:
    p = make_policy(RoutingConfig(policy="session_affinity"), kv=fleet_with(a=48, b=0))
    us = units("a", "b", "c")
    chosen = {p.choose(RouteRequest("llm", "x", s, PromptTokens(PROMPT)), us).unit.unit_id
              for s in ("s1",) * 5}  # fmt: skip
    assert len(chosen) == 1
    assert not p.needs_prompt_tokens(us)


def test_a_burst_after_a_burst_is_spread() -> None:
    """The local cluster's failover test, two proxy replicas in front of units a and b:
    8 short prompts (no overlap: the load decides), then the same 8 again. a's last
    report of the first burst said 4 running (2 from each proxy) and its 0 was still
    held by the leader's 100 ms push interval when the second burst came, after every
    stream had ended. With a report that outweighed the proxies' own (empty) view,
    all 8 went to b; counted against the ends since, a gets some."""
    fleet = fleet_with(a=0, b=0)
    short = PROMPT[:24]
    sent = {"a": 0, "b": 0}
    for seed in (1, 2):  # two proxy replicas, each with its own in-flight counts
        a, b = units("a", "b")
        a.in_flight = 2  # this proxy's share of the first burst there, when a reported 4
        a.set_engine_load(EngineLoad(4, 0, 0.002, 16, time.monotonic()))
        b.set_engine_load(EngineLoad(0, 0, 0.0, 16, time.monotonic()))
        a.in_flight = 0  # ... which then ended
        p = policy(fleet, seed)
        for _ in range(4):
            unit = p.choose(req(short), [a, b]).unit
            unit.in_flight += 1  # the dispatcher counts the attempt
            sent[unit.unit_id] += 1
    assert sent == {"a": 2, "b": 6}


def test_load_now_moves_the_report_by_this_proxys_starts_and_ends() -> None:
    (u,) = units("u")
    report = EngineLoad(5, 1, 0.1, 16, time.monotonic())
    u.in_flight = 3
    u.set_engine_load(report)
    u.in_flight = 2  # 2 ended, 1 started since the report
    assert u.load_now(report) == 5
    u.set_engine_load(report)  # the same report again (a unit announced) keeps its base
    assert u.load_now(report) == 5
    u.in_flight = 0
    assert u.load_now(report) == 3  # other proxies' sequences stay counted
    u.in_flight = 9
    assert u.load_now(report) == 12
    # Never below this proxy's own count there; one assigned directly: sequences().
    assert u.load_now(EngineLoad(0, 0, 0.0, 16, time.monotonic())) == u.sequences(None) == 9
    u.set_engine_load(None)
    assert u.engine_load is None and u.load_now(None) == 9


def test_with_the_cache_size_reported_the_kv_term_is_whether_the_prompt_fits() -> None:
    """Leaders report num_blocks: KV usage weighs only the sequences that must end
    before the prompt's uncached blocks fit (kv_aware.kv_wait)."""
    fleet = fleet_with(a=48, b=8)  # the prompt's uncached blocks: 16 on a, 56 on b
    (a,), (b,) = units("a"), units("b")
    b.engine_load = EngineLoad(0, 0, 0.0, 16, time.monotonic(), 100)
    # a 90% full with one sequence: 10 blocks free, 6 short; that sequence holds 90,
    # so 0.07 of it must end: a still wins by its cached prefix (2.5 sequences).
    a.engine_load = EngineLoad(1, 0, 0.9, 16, time.monotonic(), 100)
    assert policy(fleet).choose(req(), [a, b]).unit is a
    # a 95% full with 3 sequences of ~32 blocks: 1 + 3 + 11/31.7 = 4.35 against b's
    # 896 uncached tokens = 3.5 sequences: b.
    a.engine_load = EngineLoad(3, 0, 0.95, 16, time.monotonic(), 100)
    d = policy(fleet).choose(req(), [a, b])
    assert d.unit is b and d.reason == "load_over_overlap"


def test_kv_wait() -> None:
    from proxy.routing.kv_aware import kv_wait

    load = EngineLoad(4, 0, 0.8, 16, 0.0, 100)  # 20 free, 20 blocks a sequence
    assert kv_wait(20, load) == 0.0
    assert abs(kv_wait(30, load) - 0.5) < 1e-9
    assert kv_wait(500, load) == 4.0  # never more than the running batch


HOME = 512  # RoutingConfig's default home_prefix_tokens (32 blocks of BS here)


def prompt(i: int) -> list[int]:
    """A prompt whose first HOME tokens are its own (``i``), the rest PROMPT's tail."""
    return [50_000 + i] * 8 + PROMPT[8:]


def test_home_is_one_unit_per_prefix_on_every_proxy_and_spreads_prefixes() -> None:
    homes = []
    for i in range(60):
        seen = set()
        for seed in range(4):  # four proxies (replicas), each its own random tie-break
            a, b, c = units("a", "b", "c")
            d = policy(fleet_with(a=0, b=0, c=0), seed, HOME).choose(req(prompt(i)), [a, b, c])
            assert d.reason == "no_overlap"
            seen.add(d.unit.unit_id)
        assert len(seen) == 1
        homes.append(seen.pop())
    assert all(homes.count(u) >= 10 for u in "abc")  # 60 prefixes over 3 units: ~20 each
    # Only the prefix's first HOME tokens count: another tail, the same home.
    a, b, c = units("a", "b", "c")
    tail = prompt(0)[:HOME] + [9] * 300
    assert home_unit(tail, None, HOME, [a, b, c]) == homes[0]
    # A cache salt is part of the key (salted prompts share no blocks with others).
    salted = {home_unit(prompt(0), f"s{i}", HOME, [a, b, c]) for i in range(30)}
    assert salted == {"a", "b", "c"}


def test_home_removing_a_unit_moves_only_the_prefixes_it_was_home_to() -> None:
    a, b, c = units("a", "b", "c")
    for i in range(60):
        before = home_unit(prompt(i), None, HOME, [a, b, c])
        after = home_unit(prompt(i), None, HOME, [a, c])
        assert after == before or before == "b"


def test_home_gives_way_to_load_beyond_the_home_prefixs_prefill() -> None:
    # 512 home tokens at 256 per sequence: a non-home unit pays 2 sequences more.
    a, b = units("a", "b")
    home = home_unit(PROMPT, None, HOME, [a, b])
    other = "b" if home == "a" else "a"
    for busier, expect in ((1, home), (3, other)):
        (h,) = units(home, running=busier)
        (o,) = units(other)
        d = policy(fleet_with(a=0, b=0), 0, HOME).choose(req(), [h, o])
        assert d.unit.unit_id == expect


def test_home_a_prefix_cached_away_from_home_is_used_there() -> None:
    a, b = units("a", "b")
    home = home_unit(PROMPT, None, HOME, [a, b])
    other = "b" if home == "a" else "a"
    d = policy(fleet_with(**{home: 0, other: 32}), 0, HOME).choose(req(), [a, b])
    assert d.unit.unit_id == other and d.reason == "kv_overlap"
    # Holding less than the home prefix, it pays for the rest of it: 8 of 32 blocks
    # (24 x 16 = 384 tokens, 1.5 sequences) cost more than the home's prefill of them.
    d = policy(fleet_with(**{home: 0, other: 8}), 0, HOME).choose(req(), [a, b])
    assert d.unit.unit_id == home and d.reason == "load_over_overlap"


def test_home_takes_any_integer_a_client_sends_as_token_ids() -> None:
    # A completions prompt's ids are the client's: out-of-range ones route (vLLM
    # answers them with a 400), they do not raise in the proxy.
    a, b = units("a", "b")
    for ids in ([-1, 5], [2**70, 3]):
        assert home_unit(ids, None, HOME, [a, b]) in {"a", "b"}
        assert policy(fleet_with(a=0, b=0), 0, HOME).choose(req(ids), [a, b]).unit in (a, b)
