"""Grafana dashboards, generated from this one source: each dashboard a list of panels,
each panel its PromQL. ``neuron-serving monitoring dashboards --out DIR`` writes the
JSON models (Grafana's dashboard schema 39, a Prometheus datasource chosen at import);
the same files are committed in ``dashboards/`` and a test keeps them equal to this
source. Another test (tests/e2e) checks that every metric a query names exists in a
live cluster's /metrics, so a renamed metric cannot leave a panel empty.

The dashboards: ``fleet`` (is it serving: units, requests, latency, errors, alerts),
``unit`` (one unit and each of its ranks: engine, steps, collectives, heartbeats,
memory), ``classes`` (traffic classes, tenants and batches), ``kv-routing`` (the
proxy's KV-aware routing and the engines' prefix caches), ``capacity`` (the
autoscaler and the units' load).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DIR = Path(__file__).parent / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
UNIT = 'unit="$unit"'


def q(quantile: float, metric: str, by: str = "", where: str = "", window: str = "1m") -> str:
    """A quantile of a histogram over ``window`` (grouped ``by`` more labels)."""
    group = f"{by}, le" if by else "le"
    return (f"histogram_quantile({quantile}, sum by ({group}) "
            f"(rate({metric}_bucket{{{where}}}[{window}])))")  # fmt: skip


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"  # Grafana's unit id: s, percentunit, bytes, reqps, short
    kind: str = "timeseries"  # or stat
    width: int = 12
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[str, ...] = ()  # "unit", "class"
    tags: tuple[str, ...] = field(default=("neuron-serving",))


FLEET = Dashboard(
    "neuron-serving-fleet",
    "neuron-serving: fleet",
    "Is the fleet serving: units, requests, latency, errors, alerts",
    (
        Panel(
            "Units routable",
            (
                ("sum(max by (unit) (proxy_unit_healthy))", "routable"),
                ("count(max by (unit) (proxy_unit_healthy))", "units"),
            ),
            kind="stat",
            width=6,
        ),  # fmt: skip
        Panel(
            "Firing alerts",
            (('count(ALERTS{alertstate="firing"}) or vector(0)', "firing"),),
            kind="stat",
            width=6,
        ),  # fmt: skip
        Panel(
            "Slow ranks",
            (("sum(proxy_node_degraded) or vector(0)", "degraded"),),
            kind="stat",
            width=6,
        ),  # fmt: skip
        Panel(
            "Unit restarts (1 h)",
            (("sum(increase(neuron_serving_unit_restarts_total[1h]))", "restarts"),),
            kind="stat",
            width=6,
        ),  # fmt: skip
        Panel(
            "Requests by code",
            (("sum by (code) (rate(proxy_requests_total[1m]))", "{{code}}"),),
            unit="reqps",
        ),  # fmt: skip
        Panel(
            "Output tokens",
            (("sum by (unit) (rate(vllm:generation_tokens_total[1m]))", "{{unit}}"),),
            unit="short",
            description="tokens/s each unit's engine generated",
        ),  # fmt: skip
        Panel(
            "TTFT",
            (
                (q(0.5, "proxy_time_to_first_token_seconds"), "p50"),
                (q(0.99, "proxy_time_to_first_token_seconds"), "p99"),
            ),
            unit="s",
        ),
        Panel(
            "Inter-token latency",
            (
                (q(0.5, "proxy_inter_token_latency_seconds"), "p50"),
                (q(0.99, "proxy_inter_token_latency_seconds"), "p99"),
            ),
            unit="s",
        ),  # fmt: skip
        Panel(
            "Request latency",
            (
                (q(0.5, "proxy_e2e_request_latency_seconds"), "p50"),
                (q(0.99, "proxy_e2e_request_latency_seconds"), "p99"),
            ),
            unit="s",
        ),  # fmt: skip
        Panel(
            "5xx ratio",
            (
                (
                    'sum(rate(proxy_requests_total{code=~"5.."}[5m])) / '
                    "sum(rate(proxy_requests_total[5m]))",
                    "5xx",
                ),
            ),
            unit="percentunit",
        ),  # fmt: skip
        Panel(
            "Node health",
            (
                ("min by (unit) (proxy_node_healthy)", "{{unit}} healthy"),
                ("max by (unit) (proxy_node_degraded)", "{{unit}} degraded"),
            ),
            description="1: every node of the unit passes its probes; degraded: a slow rank",
        ),
        Panel(
            "Retries and migrations",
            (
                ("sum by (outcome) (rate(proxy_retries_total[5m]))", "retry {{outcome}}"),
                ("sum by (outcome) (rate(proxy_migrations_total[5m]))", "migration {{outcome}}"),
            ),
            unit="reqps",
        ),  # fmt: skip
    ),
)

UNIT_DASHBOARD = Dashboard(
    "neuron-serving-unit",
    "neuron-serving: unit and its ranks",
    "One unit: its engine, and each rank's steps, collectives, heartbeats and memory",
    (
        Panel(
            "Engine requests",
            (
                (f"sum(vllm:num_requests_running{{{UNIT}}})", "running"),
                (f"sum(vllm:num_requests_waiting{{{UNIT}}})", "waiting"),
            ),
        ),
        Panel(
            "KV cache use",
            ((f"max(vllm:kv_cache_usage_perc{{{UNIT}}})", "used"),),
            unit="percentunit",
        ),  # fmt: skip
        Panel(
            "Preemptions",
            ((f"sum(rate(vllm:num_preemptions_total{{{UNIT}}}[5m]))", "preempted/s"),),
        ),  # fmt: skip
        Panel(
            "Prefix cache hit rate",
            (
                (
                    f"sum(rate(vllm:prefix_cache_hits_total{{{UNIT}}}[5m])) / "
                    f"sum(rate(vllm:prefix_cache_queries_total{{{UNIT}}}[5m]))",
                    "hits",
                ),
            ),
            unit="percentunit",
        ),  # fmt: skip
        Panel(
            "Engine TTFT and ITL",
            (
                (q(0.99, "vllm:time_to_first_token_seconds", where=UNIT), "TTFT p99"),
                (q(0.99, "vllm:inter_token_latency_seconds", where=UNIT), "ITL p99"),
            ),
            unit="s",
        ),  # fmt: skip
        Panel(
            "Step time by rank",
            (
                (q(0.5, "neuron_serving_step_seconds", "rank", UNIT), "rank {{rank}} p50"),
                (q(0.99, "neuron_serving_step_seconds", "rank", UNIT), "rank {{rank}} p99"),
            ),
            unit="s",
        ),  # fmt: skip
        Panel(
            "Collective wait per step by rank",
            (
                (
                    f"sum by (rank) (rate(neuron_serving_collective_wait_seconds_sum{{{UNIT}}}[1m])) / "
                    f"sum by (rank) (rate(neuron_serving_collective_wait_seconds_count{{{UNIT}}}[1m]))",
                    "rank {{rank}}",
                ),
            ),
            unit="s",
            description="time each step waits for the other ranks: the ranks that "
            "wait least are the slowest",
        ),  # fmt: skip
        Panel(
            "Peer wait share (slow-rank detector)",
            (
                (f"neuron_serving_rank_peer_wait_share{{{UNIT}}}", "rank {{peer_rank}}"),
                (f"neuron_serving_rank_degraded{{{UNIT}}}", "rank {{peer_rank}} degraded"),
            ),
            unit="percentunit",
        ),  # fmt: skip
        Panel(
            "Heartbeats",
            (
                (
                    f"neuron_serving_heartbeat_rtt_seconds{{{UNIT}}}",
                    "rank {{rank}} to {{peer}} rtt",
                ),
                (
                    f"sum by (rank) (rate(neuron_serving_heartbeats_late_total{{{UNIT}}}[5m]))",
                    "rank {{rank}} late/s",
                ),
            ),
            unit="s",
        ),  # fmt: skip
        Panel(
            "Control broadcast",
            ((q(0.99, "neuron_serving_control_broadcast_seconds", where=UNIT), "p99"),),
            unit="s",
        ),  # fmt: skip
        Panel(
            "GC pauses by rank",
            (
                (
                    f"sum by (rank) (rate(neuron_serving_gc_pause_seconds_sum{{{UNIT}}}[1m]))",
                    "rank {{rank}}",
                ),
            ),
            unit="percentunit",
            description="share of wall time in collector pauses",
        ),
        Panel(
            "Memory by rank",
            ((f"neuron_serving_resident_memory_bytes{{{UNIT}}}", "rank {{rank}}"),),
            unit="bytes",
        ),  # fmt: skip
        Panel(
            "Last step age by rank",
            ((f"neuron_serving_last_step_age_seconds{{{UNIT}}}", "rank {{rank}}"),),
            unit="s",
        ),  # fmt: skip
        Panel(
            "Restarts and failures",
            (
                (f"neuron_serving_unit_restarts_total{{{UNIT}}}", "restarts"),
                (f"sum by (cause) (neuron_serving_unit_failures_total{{{UNIT}}})", "{{cause}}"),
            ),
        ),  # fmt: skip
    ),
    variables=("unit",),
)

CLASSES = Dashboard(
    "neuron-serving-classes",
    "neuron-serving: traffic classes and batches",
    "Flow control per traffic class and tenant; the Batch API's progress",
    (
        Panel(
            "Queued by class",
            (
                ("sum by (class) (proxy_class_queued)", "{{class}}"),
                ("max by (class) (proxy_class_queue_limit)", "{{class}} limit"),
            ),
        ),
        Panel("Active by class", (("sum by (class) (proxy_class_active)", "{{class}}"),)),
        Panel(
            "Queue wait p99 by class",
            ((q(0.99, "proxy_class_queue_wait_seconds", "class"), "{{class}}"),),
            unit="s",
        ),  # fmt: skip
        Panel(
            "Dispatched by class",
            (("sum by (class) (rate(proxy_class_dispatched_total[1m]))", "{{class}}"),),
            unit="reqps",
        ),  # fmt: skip
        Panel(
            "Refused by class and reason",
            (
                (
                    "sum by (class, reason) (rate(proxy_class_rejected_total[5m]))",
                    "{{class}} {{reason}}",
                ),
            ),
            unit="reqps",
        ),  # fmt: skip
        Panel(
            "Requests by tenant",
            (("sum by (tenant) (rate(proxy_requests_total[1m]))", "{{tenant}}"),),
            unit="reqps",
        ),  # fmt: skip
        Panel(
            "TTFT p99 by class",
            ((q(0.99, "proxy_time_to_first_token_seconds", "class"), "{{class}}"),),
            unit="s",
        ),  # fmt: skip
        Panel(
            "Batches",
            (
                ("sum(proxy_batches_active)", "active batches"),
                ("sum by (outcome) (rate(proxy_batch_requests_total[5m]))", "lines {{outcome}}/s"),
            ),
        ),  # fmt: skip
    ),
)

KV_ROUTING = Dashboard(
    "neuron-serving-kv-routing",
    "neuron-serving: KV routing",
    "The proxy's KV-aware routing: decisions, predicted against actual prefix-cache hits, "
    "the exact index and its event streams",
    (
        Panel(
            "Routing decisions by reason",
            (("sum by (reason) (rate(proxy_routing_decisions_total[5m]))", "{{reason}}"),),
            unit="reqps",
        ),  # fmt: skip
        Panel(
            "Prefix cache hit rate by unit",
            (
                (
                    "sum by (unit) (rate(proxy_prefix_cache_hits_total[5m])) / "
                    "sum by (unit) (rate(proxy_prefix_cache_queries_total[5m]))",
                    "{{unit}}",
                ),
            ),
            unit="percentunit",
        ),  # fmt: skip
        Panel(
            "Prediction accuracy",
            (
                (
                    "sum(rate(proxy_prefix_cache_prediction_accuracy_sum[5m])) / "
                    "sum(rate(proxy_prefix_cache_prediction_accuracy_count[5m]))",
                    "mean",
                ),
            ),
            unit="percentunit",
        ),  # fmt: skip
        Panel("Index blocks by unit", (("sum by (unit) (proxy_kv_index_blocks)", "{{unit}}"),)),
        Panel(
            "Index mode by unit",
            (("max by (unit, mode) (proxy_kv_index_mode)", "{{unit}} {{mode}}"),),
        ),  # fmt: skip
        Panel(
            "KV event stream",
            (
                ("sum by (unit) (rate(proxy_kv_event_batches_total[1m]))", "{{unit}} batches/s"),
                ("sum by (unit) (increase(proxy_kv_index_resets_total[10m]))", "{{unit}} resets"),
                ("sum(increase(proxy_kv_event_replays_requested_total[10m]))", "replays"),
            ),
        ),  # fmt: skip
        Panel(
            "Engine prefix cache hit rate by unit",
            (
                (
                    "sum by (unit) (rate(vllm:prefix_cache_hits_total[5m])) / "
                    "sum by (unit) (rate(vllm:prefix_cache_queries_total[5m]))",
                    "{{unit}}",
                ),
            ),
            unit="percentunit",
        ),  # fmt: skip
    ),
)

CAPACITY = Dashboard(
    "neuron-serving-capacity",
    "neuron-serving: capacity",
    "The autoscaler's decisions against the units' load",
    (
        Panel(
            "Units",
            (
                ("max(capacity_desired_units)", "desired"),
                ("max(capacity_max_units)", "max"),
                ("sum by (phase) (capacity_units)", "{{phase}}"),
            ),
        ),  # fmt: skip
        Panel(
            "Decisions",
            (
                (
                    "sum by (action, reason) (increase(capacity_decisions_total[5m]))",
                    "{{action}} {{reason}}",
                ),
            ),
        ),  # fmt: skip
        Panel("In flight by unit", (("sum by (unit) (proxy_unit_in_flight)", "{{unit}}"),)),
        Panel(
            "Engine running by unit", (("sum by (unit) (vllm:num_requests_running)", "{{unit}}"),)
        ),  # fmt: skip
        Panel("Unit phases", (("sum by (phase) (neuron_serving_unit_phase)", "{{phase}}"),)),
        Panel(
            "Warm pool", (("sum by (op) (increase(capacity_pool_actions_total[10m]))", "{{op}}"),)
        ),  # fmt: skip
    ),
)

DASHBOARDS = (FLEET, UNIT_DASHBOARD, CLASSES, KV_ROUTING, CAPACITY)


def _variable(name: str) -> dict[str, Any]:
    return {"name": name, "type": "query", "datasource": DS, "refresh": 2,
            "query": {"query": f"label_values(proxy_node_healthy, {name})", "refId": name},
            "definition": f"label_values(proxy_node_healthy, {name})",
            "includeAll": False, "multi": False, "current": {}}  # fmt: skip


def model(d: Dashboard) -> dict[str, Any]:
    """Grafana's JSON model of ``d``: panels laid out left to right, 24 columns a row."""
    panels, x, y = [], 0, 0
    for i, p in enumerate(d.panels, start=1):
        height = 4 if p.kind == "stat" else 8
        if x + p.width > 24:
            x, y = 0, y + height
        panels.append({
            "id": i, "type": p.kind, "title": p.title, "description": p.description,
            "datasource": DS, "gridPos": {"h": height, "w": p.width, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "options": {}, "targets": [
                {"refId": chr(ord("A") + j), "datasource": DS, "expr": expr,
                 "legendFormat": legend}
                for j, (expr, legend) in enumerate(p.exprs)
            ],
        })  # fmt: skip
        x += p.width
    templating = [{"name": "datasource", "type": "datasource", "query": "prometheus",
                   "current": {}, "label": "Prometheus"}]  # fmt: skip
    templating += [_variable(v) for v in d.variables]
    return {
        "uid": d.uid, "title": d.title, "description": d.description, "tags": list(d.tags),
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "",
        "templating": {"list": templating}, "panels": panels,
    }  # fmt: skip


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{d.uid}.json": json.dumps(model(d), indent=1) + "\n" for d in DASHBOARDS}


def write_all(directory: Path = DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in render_all().items():
        path = directory / name
        path.write_text(text)
        out.append(path)
    return out


# ---- the metrics a query names ------------------------------------------------------------

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "bool", "offset", "vector", "inf", "nan"}  # fmt: skip
# Series Prometheus makes itself, not scraped from any endpoint.
SYNTHETIC = {"ALERTS", "ALERTS_FOR_STATE", "up"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, ranges, grouping
    clauses, strings and function names left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        name = m.group(0)
        after = text[m.end() :].lstrip()
        if after.startswith("(") or name.lower() in _KEYWORDS or name in SYNTHETIC:
            continue
        names.add(name)
    return names


def queried_metrics(d: Dashboard) -> set[str]:
    return {n for p in d.panels for expr, _ in p.exprs for n in metric_names(expr)}
