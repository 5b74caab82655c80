"""Reading a node's /metrics in tests: samples by name and a subset of their labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, name: str, **labels: str) -> list[float]:
    """The values of ``name``'s samples (a family's own name, or a histogram's
    ``_bucket``/``_sum``/``_count``, a counter's ``_total``) whose labels include
    ``labels``."""
    return [s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]  # fmt: skip


def labels_of(text: str, name: str) -> list[dict[str, str]]:
    return [dict(s.labels) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]  # fmt: skip
