"""The alert rules (``rules/alerts.yml``) as data: their names, and as a Kubernetes
PrometheusRule (the Prometheus Operator's custom resource, ``monitoring.coreos.com/v1``:
``spec.groups`` is the rule file's ``groups`` unchanged), so one file serves a plain
Prometheus, the local cluster's and a cluster running the operator."""

from __future__ import annotations

from typing import Any

import yaml

from neuron_serving.monitoring.prometheus import ALERT_RULES


def groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(ALERT_RULES.read_text())["groups"])


def alert_names() -> list[str]:
    return [r["alert"] for g in groups() for r in g["rules"] if "alert" in r]


def prometheus_rule(name: str = "neuron-serving", namespace: str | None = None,
                    labels: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The PrometheusRule resource; ``labels`` are what the operator's
    ``ruleSelector`` matches (e.g. ``release: kube-prometheus-stack``)."""
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "neuron-serving",
                                                          **(labels or {})}}  # fmt: skip
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": metadata, "spec": {"groups": groups()}}  # fmt: skip
