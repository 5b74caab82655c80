"""Prefix cache hits, predicted against actual (proxy/routing/kv/accuracy.py): the definitions
on their own, then through the proxy against fake leaders that report
``cached_tokens`` (every transport), hostile reports included."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from proxy.registry import UnitState
from proxy.routing import RouteRequest, RoutingDecision
from proxy.routing.kv.accuracy import KvAccuracy, accuracy, check
from proxy.routing.round_robin import RoundRobinPolicy
from proxy.upstream.base import GenerationDelta
from tests.proxy.conftest import read_sse, url
from tests.proxy.fake_openai import encode, render_chat


@pytest.mark.parametrize(
    ("cached", "prompt_tokens", "outcome"),
    [
        (0, 10, "ok"),
        (10, 10, "ok"),
        (None, 10, "missing"),  # a leader older than the output, a resumed call
        (3, None, "missing"),
        (3.0, 10, "not_an_integer"),
        ("3", 10, "not_an_integer"),
        (True, 10, "not_an_integer"),
        ([3], 10, "not_an_integer"),
        (-1, 10, "negative"),
        (11, 10, "over_prompt"),
        (2**64, 10, "over_prompt"),
    ],
)
def test_a_report_is_used_only_when_it_is_a_count_within_the_prompt(
    cached, prompt_tokens, outcome
) -> None:
    assert check(cached, prompt_tokens) == outcome


def test_accuracy_is_one_minus_the_error_as_a_share_of_the_prompt() -> None:
    assert accuracy(256, 256, 300) == 1.0
    assert accuracy(256, 128, 512) == 0.75
    assert accuracy(0, 128, 512) == 0.75  # under or over by as much: the same
    assert accuracy(900, 0, 300) == 0.0  # never below 0
    assert accuracy(1, 0, 0) == 0.0  # an empty prompt counts as one token


def final(prompt_tokens: int | None, cached: object, status: int | None = None) -> GenerationDelta:
    return GenerationDelta("", "stop", prompt_tokens, 1, status=status, cached_tokens=cached)


def test_per_unit_figures_and_their_prometheus_families() -> None:
    registry = CollectorRegistry()
    kv = KvAccuracy(registry)
    kv.answered("a", final(512, 256), 256, False)  # exact
    kv.answered("a", final(512, 128), 256, False)  # over by 128: accuracy 0.75
    kv.answered("a", final(512, 384), None, False)  # no prediction
    kv.answered("a", final(512, -5), 0, False)  # hostile: ignored, counted
    kv.answered("a", final(512, 100), 0, True)  # answered by a migration: not comparable
    kv.answered("a", final(None, None, status=400), 0, False)  # vLLM's 400: no prompt ran
    kv.answered("b", final(100, None), 64, False)  # no report: nothing but "missing"
    a = kv.snapshot("a")
    assert a == {
        "reports": {"ok": 3, "missing": 0, "migrated": 1, "not_an_integer": 0, "negative": 1,
                    "over_prompt": 0},
        "prompt_tokens": 1536,
        "cached_tokens": 768,
        "hit_rate": 0.5,
        "predictions": {"exact": 1, "over": 1, "under": 0, "none": 1},
        "predicted_tokens": 512,
        "predicted_hits": 384,
        "exact_fraction": 0.5,
        "mean_accuracy": 0.875,
        "mean_abs_error_tokens": 64.0,
    }  # fmt: skip
    b = kv.snapshot("b")
    assert b["reports"]["missing"] == 1 and b["hit_rate"] is None and b["mean_accuracy"] is None
    assert kv.snapshot("never") is None

    def value(name: str, unit: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"unit": unit, **labels})

    assert value("proxy_prefix_cache_reports_total", "a", outcome="negative") == 1
    assert value("proxy_prefix_cache_queries_total", "a") == 1536
    assert value("proxy_prefix_cache_hits_total", "a") == 768
    assert value("proxy_prefix_cache_predictions_total", "a", result="over") == 1
    assert value("proxy_prefix_cache_predicted_tokens_total", "a") == 512
    assert value("proxy_prefix_cache_predicted_hits_total", "a") == 384
    errors = "proxy_prefix_cache_prediction_error_tokens"
    assert value(f"{errors}_bucket", "a", le="0.0") == 1  # the exact one
    assert value(f"{errors}_bucket", "a", le="64.0") == 1
    assert value(f"{errors}_bucket", "a", le="128.0") == 2
    assert value(f"{errors}_bucket", "a", le="+Inf") == value(f"{errors}_count", "a") == 2
    assert value(f"{errors}_sum", "a") == 128
    acc = "proxy_prefix_cache_prediction_accuracy"
    assert (
        value(f"{acc}_bucket", "a", le="0.75") == 1 and value(f"{acc}_bucket", "a", le="1.0") == 2
    )
    assert value(f"{acc}_sum", "a") / value(f"{acc}_count", "a") == 0.875
    assert value("proxy_prefix_cache_reports_total", "b", outcome="missing") == 1
    assert value(f"{errors}_count", "b") == 0


# ---- through the proxy ------------------------------------------------------------------


class Pinned(RoundRobinPolicy):
    """A routing policy for the test: the unit named ``unit`` when it is a candidate
    (else the first), with ``predicted`` as its prediction (the rest of the policy
    interface is round-robin's)."""

    name = "pinned"

    def __init__(self) -> None:
        super().__init__()
        self.unit = "u0"
        self.predicted: int | None = None

    def choose(self, req: RouteRequest, candidates: Sequence[UnitState]) -> RoutingDecision:
        unit = next((u for u in candidates if u.unit_id == self.unit), candidates[0])
        return RoutingDecision(unit, "pinned", self.predicted)


async def pinned_proxy(fleet, units):
    proxy = await fleet.proxy(units)
    policy = proxy.dispatcher.policy = Pinned()
    return proxy, policy


@pytest.mark.parametrize("fleet", ["grpc", "channel"], indirect=True)
async def test_each_request_records_its_units_hit_against_the_prediction(fleet):
    """Streamed or not, OpenAI or Triton's generate route: the serving unit's reported
    hit against the prediction for it; the client's bytes are the leader's, unchanged
    (the figure is not in them); no prediction and no report are counted apart, and
    calls that run no prompt are not counted."""
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.cached_tokens = 4
    proxy, policy = await pinned_proxy(fleet, [a, b])
    s = fleet.session()
    chat = {"model": "llm", "messages": [{"role": "user", "content": "red shoes?"}],
            "max_tokens": 3, "stream": True}  # fmt: skip
    policy.predicted = 4
    async with s.post(url(proxy, "/v1/chat/completions"), json=chat) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw == b"".join(a.behavior.openai_bodies) and b"cached" not in raw
    policy.predicted = None
    completion = {"model": "llm", "prompt": "blue cart", "max_tokens": 2}
    async with s.post(url(proxy, "/v1/completions"), json=completion) as r:
        assert r.status == 200 and "cached" not in await r.text()
    policy.predicted = 10
    triton = {"text_input": "size nine", "parameters": {"max_tokens": 2}}
    async with s.post(url(proxy, "/v2/models/llm/generate_stream"), json=triton) as r:
        assert r.status == 200
        await r.read()
    policy.predicted = 0
    async with s.post(url(proxy, "/v2/models/llm/generate"), json=triton) as r:
        assert r.status == 200 and "cached" not in await r.text()
    async with s.post(url(proxy, "/tokenize"), json={"model": "llm", "prompt": "x"}) as r:
        assert r.status == 200
    policy.unit = "u1"  # reports nothing
    async with s.post(url(proxy, "/v1/completions"), json=completion) as r:
        assert r.status == 200

    kv = proxy.metrics.kv_accuracy
    prompts = len(encode(render_chat(chat["messages"]))) + len("blue cart") + 2 * len("size nine")
    figures = kv.snapshot("u0")
    assert figures["reports"]["ok"] == 4 and sum(figures["reports"].values()) == 4
    assert figures["predictions"] == {"exact": 1, "over": 1, "under": 1, "none": 1}
    assert figures["prompt_tokens"] == prompts and figures["cached_tokens"] == 16
    assert (figures["predicted_tokens"], figures["predicted_hits"]) == (14, 12)
    assert figures["mean_abs_error_tokens"] == round((0 + 6 + 4) / 3, 4)
    assert kv.snapshot("u1")["reports"] == {**dict.fromkeys(figures["reports"], 0), "missing": 1}

    async with s.get(url(proxy, "/metrics")) as r:
        metrics = await r.text()
    assert 'proxy_prefix_cache_predictions_total{result="exact",unit="u0"} 1.0' in metrics
    assert 'proxy_prefix_cache_hits_total{unit="u0"} 16.0' in metrics
    assert 'proxy_prefix_cache_reports_total{outcome="missing",unit="u1"} 1.0' in metrics
    async with s.get(url(proxy, "/status")) as r:  # trusted: loopback, no client keys
        units = {u["unit_id"]: u for u in (await r.json())["units"]}
    assert units["u0"]["prefix_cache"] == figures


HOSTILE = {
    "grpc": [-1, 2**40, "many", 1.5],  # also BYTES and FP32 tensors
    "channel": [-1, 2**40],  # typed on the wire: a wrong type is a bad frame
}
OUTCOME = {int: "negative", str: "not_an_integer", float: "not_an_integer"}


@pytest.mark.parametrize("fleet", ["grpc", "channel"], indirect=True)
async def test_a_hostile_report_is_counted_and_the_answer_relayed(fleet):
    """A leader's garbage in ``cached_tokens`` (negative, beyond the prompt, a string,
    a float, a list) is ignored and counted by kind; the request is answered whole,
    never retried, and the unit is not blamed."""
    u = await fleet.unit("u0")
    proxy, policy = await pinned_proxy(fleet, [u])
    policy.predicted = 3
    s = fleet.session()
    for value in HOSTILE[fleet.protocol]:
        u.behavior.cached_tokens = value
        for path, body in (
            ("/v1/completions", {"model": "llm", "prompt": "hi", "max_tokens": 2, "stream": True}),
            ("/v2/models/llm/generate", {"text_input": "hi", "parameters": {"max_tokens": 2}}),
        ):
            async with s.post(url(proxy, path), json=body) as r:
                assert r.status == 200, await r.text()
                if path == "/v1/completions":
                    assert (await read_sse(r))[-1] == "[DONE]"
    reports = proxy.metrics.kv_accuracy.snapshot("u0")["reports"]
    expected = dict.fromkeys(reports, 0)
    for value in HOSTILE[fleet.protocol]:
        outcome = "over_prompt" if value == 2**40 else OUTCOME[type(value)]
        expected[outcome] += 2
    assert reports == expected
    assert proxy.metrics.kv_accuracy.snapshot("u0")["predictions"] == dict.fromkeys(
        ("exact", "over", "under", "none"), 0
    )
    assert len(u.behavior.prompts) == 2 * len(HOSTILE[fleet.protocol])  # none retried
    attempts = proxy.metrics.upstream_attempts
    assert attempts.labels("u0", "unit_fault")._value.get() == 0


@pytest.mark.parametrize("fleet", ["grpc", "channel"], indirect=True)
async def test_an_answer_after_a_migration_is_not_compared(fleet):
    """The unit a stream migrated to was sent the prompt plus what was generated: its
    hit is not about the routed prompt, so the answer counts as ``migrated`` only."""
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    a.behavior.kill_after_tokens = 2
    a.behavior.cached_tokens = b.behavior.cached_tokens = 1
    proxy, policy = await pinned_proxy(fleet, [a, b])
    policy.predicted = 1
    body = {"text_input": "hi", "parameters": {"max_tokens": 5, "ignore_eos": True}}
    async with fleet.session().post(url(proxy, "/v2/models/llm/generate"), json=body) as r:
        assert r.status == 200
    assert proxy.metrics.kv_accuracy.snapshot("u0") is None  # it never answered
    figures = proxy.metrics.kv_accuracy.snapshot("u1")
    assert figures["reports"]["migrated"] == 1 and figures["reports"]["ok"] == 0
    assert figures["prompt_tokens"] == 0
