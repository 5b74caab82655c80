"""The local supervisor's own metrics: what outlives a unit's processes.

A unit in a crash loop may never live long enough to be scraped, and a node's
metrics end with its process; the supervisor counts every restart and failure of
every unit for the cluster's life (``group_supervisor.GroupSupervisor``), so the
restart-loop and checkpoint alerts (monitoring/rules/alerts.yml) read them here.
Served by the supervisor's endpoint (monitoring/endpoint.py), beside the capacity
controller's metrics when `up` autoscales.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Failure causes an alert watches (monitoring/rules/alerts.yml).
ALERTED_CAUSES = ("checkpoint_rejected",)


class SupervisorCollector(Collector):
    def __init__(self, units: Callable[[], list[dict[str, Any]]]) -> None:
        self.units = units  # ClusterSupervisor.units_view()["units"]

    def collect(self) -> Iterable:
        restarts = CounterMetricFamily(
            "neuron_serving_unit_restarts",
            "Times the supervisor recreated the unit after a failure",
            labels=["unit"],
        )
        failures = CounterMetricFamily(
            "neuron_serving_unit_failures",
            "Unit failures by cause: the exit code's name of the process that ended "
            "first (checkpoint_rejected, unit_failed, ...), signal, or timeout",
            labels=["unit", "cause"],
        )
        phase = GaugeMetricFamily(
            "neuron_serving_unit_phase", "1 for the unit's current phase", labels=["unit", "phase"]
        )
        for u in self.units():
            unit = str(u["unit_id"])
            restarts.add_metric([unit], u.get("restarts", 0))
            # The causes alerts read exist from the start at 0: increase() cannot see a
            # counter's first step when its series appears with it.
            causes = {cause: 0 for cause in ALERTED_CAUSES} | (u.get("failure_causes") or {})
            for cause, n in sorted(causes.items()):
                failures.add_metric([unit, cause], n)
            phase.add_metric([unit, str(u.get("phase"))], 1.0)
        yield restarts
        yield failures
        yield phase


def render(units: Callable[[], list[dict[str, Any]]],
           more: Callable[[], bytes] | None = None) -> bytes:  # fmt: skip
    """The supervisor's exposition, then ``more`` (the capacity controller's)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SupervisorCollector(units))
    return generate_latest(registry) + (more() if more is not None else b"")
