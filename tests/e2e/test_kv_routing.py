"""Exact KV-aware routing end to end: a real leader (vLLM 0.32 publishing its KV cache
events through the relay) behind a real proxy process, the official ``openai``
client.

The proxy computes a prompt's block hashes itself (its tokenizer, vLLM's hashing
rules) and looks them up in the index it builds from the leader's events; the
leader reports vLLM's own prefix cache hit for the request. So a prediction equal
to the reported hit, on a prompt whose blocks are cached, is the proxy's hashes
equal to the ones vLLM published for that prompt; and after the cache has been
filled with other prompts, a prediction of 0 equal to a reported 0 is the index
having followed the evictions (``BlockRemoved``).

The leader's KV cache is small (a few dozen 128-token blocks) so that eviction
takes a handful of prompts.

Then, in this order (the module's leader is shared, and replaced by the last test):
two proxy replicas in front of it and one more leader keep a conversation whose turns
alternate between them on one unit; batches the relay dropped for a proxy that
stopped reading come back by replay (the index stays exact); and a unit whose leader
is killed and started again on the same ports gets a new index from the new stream.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from neuron_serving.bench.common import metric_sum
from tests.e2e.leader_fixture import kill_leader, proxy_config, running_leader, running_proxy
from tests.e2e.triton_leader_helpers import LeaderEndpoints
from tests.procs import wait_for

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")

API_KEY = "e2e-kv-routing-key-0123456789"
KV_CACHE_BYTES = 6 << 20
LEADER_EXTRA = ["--kv-cache-bytes", str(KV_CACHE_BYTES)]
WORDS = "red green blue shoe cart price size brand sale ship coffee maker stock".split()
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Stack:
    """The module's leader (replaced by ``restart_leader``) and the proxy in front of it."""

    leader: LeaderEndpoints
    base: str
    model: Path
    tmp: Path
    keys: Path
    exits: ExitStack
    recreated: int = 0

    def restart_leader(self) -> None:
        """A new leader on the dead one's ports (what the proxy's config names, so the
        same unit; ``kill_leader`` first): a new engine with an empty cache."""
        self.recreated += 1
        tmp = self.tmp / f"leader-{self.recreated}"
        tmp.mkdir()
        leader = running_leader(self.model, tmp, extra=LEADER_EXTRA, ports_of=self.leader)
        self.leader = self.exits.enter_context(leader)


@pytest.fixture(scope="module")
def stack(demo_model: Path, tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("kv-routing")
    keys = tmp / "api-keys.yaml"
    keys.write_text(f'tenants:\n  e2e:\n    keys: ["{API_KEY}"]\n')
    keys.chmod(0o600)
    with ExitStack() as exits:
        leader = exits.enter_context(running_leader(demo_model, tmp, extra=LEADER_EXTRA))
        config = _proxy_config([leader], demo_model, keys)
        base = exits.enter_context(running_proxy(config, tmp, name="proxy-kv"))
        yield Stack(leader, base, demo_model, tmp, keys, exits)


@pytest.fixture(scope="module")
def client(stack: Stack):
    with _openai(stack.base) as c:
        yield c


@pytest.fixture(scope="module")
def words(client) -> int:
    """Words of a ``_prompt`` of 3 full blocks and a bit (vLLM's CPU block size is
    128; the last prompt token is never served from cache), under max_model_len."""
    n = 40
    while _complete(client, _prompt(random.Random(0), n)) < 420:
        n += 40
        assert n < 2000, "the demo tokenizer gave no 420-token prompt"
    return n


def _proxy_config(leaders: list[LeaderEndpoints], model: Path, keys: Path) -> dict:
    return proxy_config(
        leaders, model, api_keys_file=str(keys), openai_channel=True,
        routing={"policy": "kv_aware"},
    )  # fmt: skip


def _openai(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=60, max_retries=0)


def _units(base: str) -> dict[str, dict]:
    """The units as /status shows them to an API key holder (the full view), by id."""
    req = urllib.request.Request(base + "/status", headers=AUTH)
    with urllib.request.urlopen(req, timeout=5.0) as r:
        return {u["unit_id"]: u for u in json.loads(r.read())["units"]}


def _unit(base: str) -> dict:
    """The module proxy's one unit."""
    (unit,) = _units(base).values()
    return unit


def _prompt(rng: random.Random, words: int) -> str:
    """``words`` random words; ``words * 3 // 4`` of the ``words`` fixture are 2 full
    blocks and a bit, safely under max_model_len whatever the draw."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _complete(client, prompt: str) -> int:
    """One completion; its prompt's token count."""
    r = client.completions.create(model="llm", prompt=prompt, max_tokens=1, temperature=0)
    return r.usage.prompt_tokens


def _prediction_counts(base: str) -> dict[str, int]:
    pc = _unit(base)["prefix_cache"] or {}
    return dict(pc.get("predictions") or {})


def test_the_proxys_hashes_equal_the_leaders_and_follow_evictions(stack, client, words) -> None:
    base = stack.base
    rng = random.Random(20)
    kv = _unit(base)["kv"]
    assert kv is not None and kv["mode"] == "exact", kv
    block = kv["block_size"]
    a = _prompt(rng, words)
    n = _complete(client, a)
    assert n < 512
    before = _prediction_counts(base)
    hits_before = _unit(base)["prefix_cache"]["cached_tokens"]
    # A's blocks are now cached: the proxy predicts, from the leader's own events,
    # exactly the hit vLLM reports (whole blocks before the last token). Hashes of
    # the proxy's that differed from vLLM's would predict 0: "under".
    _complete(client, a)
    after = _prediction_counts(base)
    assert after.get("exact", 0) == before.get("exact", 0) + 1, (before, after)
    hit = _unit(base)["prefix_cache"]["cached_tokens"] - hits_before
    assert hit == (n - 1) // block * block > 0, (hit, n, block)
    # Fill the small cache with other prompts: vLLM evicts A's blocks and says so,
    # and the index forgets them: A is predicted 0 and vLLM reports 0.
    stored = _unit(base)["kv"]["blocks"]
    for _ in range(40):
        _complete(client, _prompt(rng, words))
    kv = _unit(base)["kv"]
    assert kv["mode"] == "exact", kv
    # 40 prompts of 3 full blocks each were stored since; the index holds only what
    # the cache still holds (a few dozen blocks).
    assert kv["blocks"] < 40 * 3 // 2, (stored, kv)
    before = _prediction_counts(base)
    hits_before = _unit(base)["prefix_cache"]["cached_tokens"]
    _complete(client, a)
    after = _prediction_counts(base)
    pc = _unit(base)["prefix_cache"]
    assert pc["cached_tokens"] == hits_before, "A was still cached: the cache is not small"
    assert after.get("exact", 0) == before.get("exact", 0) + 1, (before, after)


# ---- two proxy replicas ------------------------------------------------------------------

SYSTEM = "You are the help desk of a hardware store. " + " ".join(
    f"Rule {i}: answer questions about aisle {i} politely." for i in range(1, 10)
)  # ~300 tokens: 2 full blocks, and room for TURNS turns under max_model_len
TURNS = 6


def _metric(base: str, name: str, **labels: str) -> float:
    """Sum of the proxy's samples of ``name`` whose labels include ``labels``."""
    req = urllib.request.Request(base + "/metrics", headers=AUTH)
    with urllib.request.urlopen(req, timeout=5.0) as r:
        return metric_sum(r.read().decode(), name, **labels)


def _leader_generate(leader: LeaderEndpoints, prompt: str) -> None:
    """One token straight from the leader's Triton HTTP generate (no proxy)."""
    body = {"text_input": prompt, "exclude_input_in_output": True,
            "parameters": {"temperature": 0, "max_tokens": 1}}  # fmt: skip
    req = urllib.request.Request(
        f"http://{leader.http}/v2/models/llm/generate", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _settled(bases: list[str]) -> bool:
    """Every replica sees every unit idle (the leader's own load report: nothing running,
    waiting or holding KV blocks; nothing of its own in flight) and has applied as many
    of each unit's KV event batches as the others."""
    views = [_units(b) for b in bases]
    for view in views:
        for u in view.values():
            load = u["engine_load"]
            if u["in_flight"] or load is None or load["running"] or load["waiting"]:
                return False
            if load["kv_usage"] != 0:
                return False
    batches = [
        {uid: _metric(b, "proxy_kv_event_batches_total", unit=uid) for uid in views[0]}
        for b in bases
    ]
    return all(b == batches[0] for b in batches)


def test_two_proxy_replicas_route_a_conversations_turns_to_one_unit(
    stack: Stack, words: int, demo_model: Path, tmp_path_factory
) -> None:
    """A chat whose turns alternate between two proxies (each resending the whole
    history) stays on the unit that served its first turn: replica B never saw that
    turn, so only the unit's own KV events can tell it where the history is cached."""
    tmp = tmp_path_factory.mktemp("kv-replicas")
    rng = random.Random(24)
    with ExitStack() as exits:
        other = exits.enter_context(running_leader(demo_model, tmp, extra=LEADER_EXTRA))
        leaders = [stack.leader, other]
        config = lambda: _proxy_config(leaders, demo_model, stack.keys)  # noqa: E731
        bases = [exits.enter_context(running_proxy(config(), tmp, name=f"proxy-{r}")) for r in "ab"]
        clients = [exits.enter_context(_openai(b)) for b in bases]
        # A batch from each leader (the new one's seq 0), so both replicas hold both
        # units' caches from empty: exact mode, the routing decision's prediction set.
        for leader in leaders:
            _leader_generate(leader, _prompt(rng, words * 3 // 4))
        try:
            wait_for(
                lambda: all(
                    u["upstream"] == "channel" and u["kv"]["mode"] == "exact"
                    for b in bases for u in _units(b).values()
                ),
                60, interval=0.2, what="both units exact in both replicas",
            )  # fmt: skip
        except TimeoutError:
            views = [{k: (u["upstream"], u["kv"]) for k, u in _units(b).items()} for b in bases]
            pytest.fail(f"both units not exact in both replicas: {views}")
        history = [{"role": "system", "content": SYSTEM}]
        served: list[str] = []
        for turn in range(TURNS):
            base, chat = bases[turn % 2], clients[turn % 2]
            # The user reads the answer before the next turn: the leaders have reported
            # their engines idle and both replicas have the turn's KV events.
            wait_for(lambda: _settled(bases), 30, interval=0.1, what="idle units in both replicas")
            before = _units(base)
            overlap = _metric(base, "proxy_routing_decisions_total", reason="kv_overlap")
            history.append({"role": "user", "content": f"Q{turn}: where are the nails?"})
            r = chat.chat.completions.create(
                model="llm", messages=history, max_tokens=4, temperature=0
            )
            history.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            after = _units(base)
            (unit,) = [
                u for u in after if after[u]["requests_total"] == before[u]["requests_total"] + 1
            ]
            served.append(unit)
            if turn == 0:
                assert r.usage.prompt_tokens >= 2 * 128, r.usage
                continue
            # The replica predicted, from the unit's events, exactly the history's blocks
            # vLLM then found in its cache, and routed on them.
            pc0, pc1 = before[unit]["prefix_cache"] or {}, after[unit]["prefix_cache"]
            hit = pc1["cached_tokens"] - pc0.get("cached_tokens", 0)
            exact = (pc1.get("predictions") or {}).get("exact", 0) - (
                pc0.get("predictions") or {}
            ).get("exact", 0)
            assert exact == 1 and hit >= 2 * 128, (turn, unit, pc0, pc1)
            assert (
                _metric(base, "proxy_routing_decisions_total", reason="kv_overlap") == overlap + 1
            )
        assert r.usage.prompt_tokens < 512 - 4, r.usage
        assert served == [served[0]] * TURNS, served


# ---- a gap in a unit's stream -------------------------------------------------------------

OVERFLOW = "a proxy is not reading its KV events"
# Bounds of the stop (this machine: ~7,300 batches, ~130 s of max_tokens=1 requests
# before the relay drops: ~4 MB of socket buffers, then its 4096-batch backlog).
OVERFLOW_WITHIN_S = 420.0


def _proxy_pid(stack: Stack) -> int:
    config = str(stack.tmp / "proxy-kv.json")
    (pid,) = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if config in (p.info["cmdline"] or ())
    ]
    return pid


def _log_from(leader: LeaderEndpoints, offset: int) -> str:
    with open(leader.proc.log, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _stable(read, settle_s: float = 1.0) -> bool:
    """``read()`` gives the same value twice ``settle_s`` apart."""
    first = read()
    time.sleep(settle_s)
    return read() == first


def test_batches_dropped_for_a_stopped_proxy_come_back_by_replay(
    stack: Stack, client, words
) -> None:
    """The proxy stops reading (SIGSTOP) while requests go to the leader directly: the
    channel's socket buffers fill, then the relay's per-connection backlog, then the
    relay drops that proxy's newer batches (its log says so). Resumed, the proxy gets
    what was held, sees the gap at the next batch and asks for a replay, which brings
    the dropped batches: no reset, still exact, and a prompt whose blocks were stored
    in a dropped batch is predicted exactly as cached."""
    base, leader = stack.base, stack.leader
    rng = random.Random(22)
    unit_id = _unit(base)["unit_id"]
    replays = _metric(base, "proxy_kv_event_replays_requested_total")
    resets = _metric(base, "proxy_kv_index_resets_total", unit=unit_id)
    log_at = leader.proc.log.stat().st_size
    last = _prompt(rng, words * 3 // 4)
    pid = _proxy_pid(stack)
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + OVERFLOW_WITHIN_S
        with ThreadPoolExecutor(4) as pool:
            while OVERFLOW not in _log_from(leader, log_at):
                assert time.monotonic() < deadline, "the relay never dropped a batch"
                batch = [_prompt(rng, words * 3 // 4) for _ in range(100)]
                list(pool.map(lambda p: _leader_generate(leader, p), batch))
            # More batches dropped, the last one storing `last`'s blocks.
            list(
                pool.map(
                    lambda p: _leader_generate(leader, p),
                    [_prompt(rng, words * 3 // 4) for _ in range(8)],
                )
            )
        _leader_generate(leader, last)
    finally:
        os.kill(pid, signal.SIGCONT)
    # The proxy reads what the socket and the backlog held (no gap in it) ...
    batches = lambda: _metric(base, "proxy_kv_event_batches_total", unit=unit_id)  # noqa: E731
    wait_for(lambda: _stable(batches), 60, what="the held batches applied")
    assert _metric(base, "proxy_kv_event_replays_requested_total") == replays
    # ... and the next batch (a 1-block prompt, evicting little) shows it the gap.
    _leader_generate(leader, _prompt(rng, words // 3))
    wait_for(
        lambda: _metric(base, "proxy_kv_event_replays_requested_total") > replays,
        30, interval=0.2, what="a replay asked for the gap",
    )  # fmt: skip
    wait_for(lambda: _stable(batches), 60, what="the replay applied")
    assert _metric(base, "proxy_kv_index_resets_total", unit=unit_id) == resets
    kv = _unit(base)["kv"]
    assert kv["mode"] == "exact", kv
    wait_for(lambda: _unit(base)["state"] == "routable", 30, what="the unit routable again")
    before = _prediction_counts(base)
    hits_before = _unit(base)["prefix_cache"]["cached_tokens"]
    n = _complete(client, last)
    after = _prediction_counts(base)
    hit = _unit(base)["prefix_cache"]["cached_tokens"] - hits_before
    assert hit == (n - 1) // kv["block_size"] * kv["block_size"] > 0, (hit, n)
    assert after.get("exact", 0) == before.get("exact", 0) + 1, (before, after)


# ---- a recreated unit ---------------------------------------------------------------------


def _hit(client, base: str, prompt: str) -> tuple[int, int, bool]:
    """Complete ``prompt``: (its prompt tokens, the cached tokens vLLM reported, whether
    the proxy's prediction was exactly that)."""
    before = _prediction_counts(base)
    hits_before = (_unit(base)["prefix_cache"] or {}).get("cached_tokens", 0)
    n = _complete(client, prompt)
    after = _prediction_counts(base)
    hit = _unit(base)["prefix_cache"]["cached_tokens"] - hits_before
    return n, hit, after.get("exact", 0) == before.get("exact", 0) + 1


def test_a_recreated_unit_starts_its_index_afresh(stack: Stack, client, words) -> None:
    """The unit's leader dies (SIGKILL of its tree) and a new one comes up on the same
    ports: the proxy drops the unit's index, builds it again from the new engine's
    stream (exact from its seq 0), and a prompt cached before is predicted 0, as the
    new engine reports."""
    base = stack.base
    rng = random.Random(23)
    a = _prompt(rng, words * 3 // 4)
    _complete(client, a)
    n, hit, exact = _hit(client, base, a)
    block = _unit(base)["kv"]["block_size"]
    assert exact and hit == (n - 1) // block * block > 0, (n, hit, exact)
    assert _unit(base)["kv"]["blocks"] > 0
    kill_leader(stack.leader)
    kv = wait_for(
        lambda: (kv := _unit(base)["kv"])["blocks"] == 0 and kv,
        30, interval=0.2, what="the dead unit's index dropped",
    )  # fmt: skip
    assert kv["mode"] != "exact", kv
    stack.restart_leader()
    wait_for(
        lambda: (u := _unit(base))["state"] == "routable" and u["upstream"] == "channel"
        and u["kv"]["block_size"] is not None,
        60, interval=0.2, what="the new leader's channel and KV stream",
    )  # fmt: skip
    # The new engine's first batch (seq 0) makes the index exact again.
    _complete(client, _prompt(rng, words * 3 // 4))
    wait_for(lambda: _unit(base)["kv"]["mode"] == "exact", 30, interval=0.2, what="exact mode")
    n, hit, exact = _hit(client, base, a)
    assert hit == 0 and exact, (n, hit, exact)  # predicted 0, reported 0
    n, hit, exact = _hit(client, base, a)
    assert exact and hit == (n - 1) // block * block > 0, (n, hit, exact)
