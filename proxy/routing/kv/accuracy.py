"""Prefix cache hits, predicted against actual (issue 20), per unit.

For every generation request the proxy answers, two figures about the prompt's
prefix cache hit on the unit that served it:

- predicted: ``Job.predicted_cached_tokens``, what the routing policy expected the
  unit to hold (the exact KV index's leading blocks x block size; None: the policy
  could not tell);
- actual: the ``cached_tokens`` the unit's leader sent with the final response, its
  vLLM's ``RequestOutput.num_cached_tokens`` (neuron_serving/triton/README.md).

Definitions, for a request whose leader reported P prompt tokens and A cached tokens,
predicted p:

- the report is used (outcome ``ok``) when A is an integer with 0 <= A <= P. Anything
  else is ignored and counted by its outcome: ``missing`` (no A or no P: a leader
  older than the output, a resumed OpenAI call, batched prompts), ``not_an_integer``,
  ``negative``, ``over_prompt``. ``migrated``: the request was answered by a unit it
  migrated to, whose prompt was the original plus the text or tokens generated before;
  neither figure is about the routed prompt, so nothing else is counted for it.
- hit rate of a unit = sum A / sum P over its ``ok`` reports: the engine's own
  prefix cache hit rate for this proxy's requests (vLLM's
  ``vllm:prefix_cache_hits / vllm:prefix_cache_queries`` counts every request and
  canary the engine ran, whoever sent it).
- with a prediction: error e = |p - A| tokens; accuracy = max(0, 1 - e / max(P, 1)),
  1 when the prediction is exact, falling with the share of the prompt it was off by;
  the unit's mean accuracy is its average over the requests with a prediction, and
  its exact fraction the share of them with p == A. ``over`` (p > A: the policy
  expected blocks the engine no longer had) and ``under`` (p < A) tell which way it
  was wrong.

Everything runs on the event loop (a request's end and a scrape alike), so the state is
plain integers; the Prometheus families are built from it at scrape time (a collector
on the proxy's registry) and ``/status`` shows the same figures (``snapshot``).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from proxy.upstream.base import GenerationDelta

OUTCOMES = ("ok", "missing", "migrated", "not_an_integer", "negative", "over_prompt")
RESULTS = ("exact", "over", "under", "none")
# |predicted - actual| in tokens: 0 is an exact prediction; a block is 16 tokens on GPUs
# by default and 128 on vLLM's CPU backend, so a miss by whole blocks lands on a bound.
ERROR_BUCKETS = (0, 1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
ACCURACY_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


@dataclass(slots=True)
class UnitFigures:
    """One unit's counts since the proxy started."""

    reports: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    prompt_tokens: int = 0  # P over ok reports
    cached_tokens: int = 0  # A over ok reports
    predictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    predicted_tokens: int = 0  # p over ok reports with a prediction
    predicted_hits: int = 0  # A over the same reports
    # Per bucket (the last is +Inf), not cumulative; Prometheus's are made at scrape.
    errors: list[int] = field(default_factory=lambda: [0] * (len(ERROR_BUCKETS) + 1))
    error_sum: int = 0
    accuracies: list[int] = field(default_factory=lambda: [0] * (len(ACCURACY_BUCKETS) + 1))
    accuracy_sum: float = 0.0


def check(cached: object, prompt_tokens: int | None) -> str:
    """The outcome of a leader's report (``OUTCOMES``, without ``migrated``)."""
    if cached is None or prompt_tokens is None:
        return "missing"
    if type(cached) is not int:  # bool is an int subclass: refused too
        return "not_an_integer"
    if cached < 0:
        return "negative"
    return "over_prompt" if cached > prompt_tokens else "ok"


def accuracy(predicted: int, cached: int, prompt_tokens: int) -> float:
    return max(0.0, 1.0 - abs(predicted - cached) / max(prompt_tokens, 1))


class KvAccuracy:
    """The figures of every unit that answered a request, and their Prometheus
    collector (registered on ``registry``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._units: dict[str, UnitFigures] = {}
        registry.register(self)

    def answered(
        self, unit_id: str, final: GenerationDelta, predicted: int | None, migrated: bool
    ) -> None:
        """A generation request's final response, from ``unit_id``. vLLM's error
        answers (a status other than 200) ran no prompt: not counted."""
        if final.status is not None and final.status != 200:
            return
        u = self._units.get(unit_id)
        if u is None:
            u = self._units[unit_id] = UnitFigures()
        outcome = "migrated" if migrated else check(final.cached_tokens, final.prompt_tokens)
        u.reports[outcome] += 1
        if outcome != "ok":
            return
        cached, prompt = final.cached_tokens, final.prompt_tokens
        assert isinstance(cached, int) and prompt is not None  # check() said so
        u.prompt_tokens += prompt
        u.cached_tokens += cached
        if predicted is None:
            u.predictions["none"] += 1
            return
        error = abs(predicted - cached)
        u.predictions["exact" if error == 0 else "over" if predicted > cached else "under"] += 1
        u.predicted_tokens += predicted
        u.predicted_hits += cached
        u.errors[bisect_left(ERROR_BUCKETS, error)] += 1
        u.error_sum += error
        a = accuracy(predicted, cached, prompt)
        u.accuracies[bisect_left(ACCURACY_BUCKETS, a)] += 1
        u.accuracy_sum += a

    def snapshot(self, unit_id: str) -> dict[str, Any] | None:
        """``/status``'s view of a unit (None: it has answered nothing yet)."""
        u = self._units.get(unit_id)
        if u is None:
            return None
        predicted = sum(u.predictions.values()) - u.predictions["none"]
        return {
            "reports": dict(u.reports),
            "prompt_tokens": u.prompt_tokens,
            "cached_tokens": u.cached_tokens,
            "hit_rate": _ratio(u.cached_tokens, u.prompt_tokens),
            "predictions": dict(u.predictions),
            "predicted_tokens": u.predicted_tokens,
            "predicted_hits": u.predicted_hits,
            "exact_fraction": _ratio(u.predictions["exact"], predicted),
            "mean_accuracy": _ratio(u.accuracy_sum, predicted),
            "mean_abs_error_tokens": _ratio(u.error_sum, predicted),
        }

    # ---- the Prometheus collector -------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        """The families without samples (the registry checks names with it)."""
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        return self._families(self._units)

    @staticmethod
    def _families(units: dict[str, UnitFigures]) -> Iterator[Metric]:
        reports = CounterMetricFamily(
            "proxy_prefix_cache_reports",
            "Generation requests answered, by serving unit and what its leader reported "
            "of the prompt's prefix cache hit: ok, missing, migrated, not_an_integer, "
            "negative, over_prompt (only ok reports count in the other families)",
            labels=["unit", "outcome"],
        )
        queries = CounterMetricFamily(
            "proxy_prefix_cache_queries",
            "Prompt tokens of the requests with an ok report, by serving unit",
            labels=["unit"],
        )
        hits = CounterMetricFamily(
            "proxy_prefix_cache_hits",
            "Prompt tokens the serving unit's vLLM found in its prefix cache "
            "(num_cached_tokens), requests with an ok report",
            labels=["unit"],
        )
        predictions = CounterMetricFamily(
            "proxy_prefix_cache_predictions",
            "Requests with an ok report by how the routing policy's predicted hit compared "
            "with the reported one: exact, over, under, none (no prediction)",
            labels=["unit", "result"],
        )
        predicted_tokens = CounterMetricFamily(
            "proxy_prefix_cache_predicted_tokens",
            "Predicted cached tokens, requests with a prediction and an ok report",
            labels=["unit"],
        )
        predicted_hits = CounterMetricFamily(
            "proxy_prefix_cache_predicted_hits",
            "Reported cached tokens of the same requests as proxy_prefix_cache_predicted_tokens",
            labels=["unit"],
        )
        errors = HistogramMetricFamily(
            "proxy_prefix_cache_prediction_error_tokens",
            "|predicted - reported| cached tokens per request with a prediction",
            labels=["unit"],
        )
        accuracies = HistogramMetricFamily(
            "proxy_prefix_cache_prediction_accuracy",
            "Per request with a prediction: max(0, 1 - |predicted - reported| / "
            "max(prompt tokens, 1)); _sum / _count is the mean accuracy",
            labels=["unit"],
        )
        for unit_id, u in units.items():
            for outcome, n in u.reports.items():
                reports.add_metric([unit_id, outcome], n)
            queries.add_metric([unit_id], u.prompt_tokens)
            hits.add_metric([unit_id], u.cached_tokens)
            for result, n in u.predictions.items():
                predictions.add_metric([unit_id, result], n)
            predicted_tokens.add_metric([unit_id], u.predicted_tokens)
            predicted_hits.add_metric([unit_id], u.predicted_hits)
            errors.add_metric([unit_id], _cumulative(ERROR_BUCKETS, u.errors), u.error_sum)
            accuracies.add_metric(
                [unit_id], _cumulative(ACCURACY_BUCKETS, u.accuracies), u.accuracy_sum
            )
        yield from (reports, queries, hits, predictions, predicted_tokens, predicted_hits)
        yield from (errors, accuracies)


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    """Prometheus's buckets: cumulative counts, ``le`` as prometheus_client writes it."""
    out, total = [], 0
    for bound, n in zip((*bounds, math.inf), counts, strict=True):
        total += n
        out.append((floatToGoString(bound), total))
    return out


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None
