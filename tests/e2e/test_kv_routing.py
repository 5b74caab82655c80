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
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.leader_fixture import proxy_config, running_leader, running_proxy
from tests.e2e.triton_leader_helpers import LeaderEndpoints

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")

API_KEY = "e2e-kv-routing-key-0123456789"
KV_CACHE_BYTES = 6 << 20
WORDS = "red green blue shoe cart price size brand sale ship coffee maker stock".split()
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def stack(demo_model: Path, tmp_path_factory) -> Iterator[tuple[LeaderEndpoints, str]]:
    tmp = tmp_path_factory.mktemp("kv-routing")
    keys = tmp / "api-keys.yaml"
    keys.write_text(f'tenants:\n  e2e:\n    keys: ["{API_KEY}"]\n')
    keys.chmod(0o600)
    extra = ["--kv-cache-bytes", str(KV_CACHE_BYTES)]
    with running_leader(demo_model, tmp, extra=extra) as leader:
        config = proxy_config(
            [leader], demo_model, api_keys_file=str(keys), openai_channel=True,
            upstream_protocol="grpc", routing={"policy": "kv_aware"},
        )  # fmt: skip
        with running_proxy(config, tmp, name="proxy-kv") as base:
            yield leader, base


@pytest.fixture(scope="module")
def client(stack):
    _, base = stack
    with openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=60, max_retries=0) as c:
        yield c


def _unit(base: str) -> dict:
    """The unit as /status shows it to an API key holder (the full view)."""
    req = urllib.request.Request(base + "/status", headers=AUTH)
    with urllib.request.urlopen(req, timeout=5.0) as r:
        (unit,) = json.loads(r.read())["units"]
    return unit


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _complete(client, prompt: str) -> int:
    """One completion; its prompt's token count."""
    r = client.completions.create(model="llm", prompt=prompt, max_tokens=1, temperature=0)
    return r.usage.prompt_tokens


def _prediction_counts(base: str) -> dict[str, int]:
    pc = _unit(base)["prefix_cache"] or {}
    return dict(pc.get("predictions") or {})


def test_the_proxys_hashes_equal_the_leaders_and_follow_evictions(stack, client) -> None:
    _, base = stack
    rng = random.Random(20)
    # A prompt of 3 full blocks and a bit (vLLM's CPU block size is 128; the last
    # prompt token is never served from cache).
    words = 40
    while _complete(client, _prompt(random.Random(0), words)) < 420:
        words += 40
        assert words < 2000, "the demo tokenizer gave no 420-token prompt"
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
