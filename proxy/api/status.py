"""``GET /status``: the proxy's whole view of the fleet as one JSON document
(for SREs, ``neuron-serving status`` and the dashboard).

``redact=True`` (a caller without a client key or the admin token) keeps what
deploy tooling and load balancers need (unit ids, states, models, checkpoint
labels, load) and drops what helps an attacker: addresses, probe error text and
the event log's details.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from proxy.config import UnitSpec
from proxy.registry import NodeHealth, Registry, UnitState


def _node(n: NodeHealth, degraded: tuple[int, ...] = ()) -> dict[str, Any]:
    if not n.healthy:
        state = "pending" if n.initial else "unhealthy"
    else:
        # Alive and serving, but its unit's leader finds it slower than its peers.
        state = "degraded" if n.rank in degraded else "healthy"
    return {
        "node_id": n.node_id,
        "role": n.role,
        "rank": n.rank,
        "addr": n.addr,
        "state": state,
        "consecutive_failures": n.consecutive_failures,
        "consecutive_successes": n.consecutive_successes,
        "last_probe_at": n.last_probe_at,
        "last_probe_latency_ms": None
        if n.last_probe_latency_s is None
        else round(n.last_probe_latency_s * 1e3, 3),
        "last_error": n.last_error,
        "probes_total": n.probes_total,
        "probe_failures_total": n.probe_failures_total,
    }


def _unit(
    u: UnitState,
    now: float,
    upstream_of: Callable[[UnitSpec], str] | None,
    prefix_cache_of: Callable[[str], dict[str, Any] | None] | None,
) -> dict[str, Any]:
    ejected = u.is_ejected(now)
    degraded = u.engine_load.degraded_ranks if u.engine_load is not None else ()
    state = u.routing_state(now)
    if state == "degraded":
        state = "routable"  # it is: the slow rank's own node shows "degraded"
    return {
        "unit_id": u.unit_id,
        "state": state,
        "model": u.spec.model,
        "model_version": u.model_version,
        "leader_grpc": u.spec.leader_grpc,
        "leader_http": u.spec.leader_http,
        # What carries its OpenAI calls: channel (the leader's OpenAI channel), grpc, http.
        "upstream": upstream_of(u.spec) if upstream_of is not None else "",
        "draining": u.draining,
        "healthy": u.nodes_healthy(),
        # The leader's own load report (flow control's room), or null without one.
        "engine_load": None
        if u.engine_load is None
        else {
            "running": u.engine_load.running,
            "waiting": u.engine_load.waiting,
            "kv_usage": round(u.engine_load.kv_usage, 4),
            "max_num_seqs": u.engine_load.max_num_seqs,
            "num_blocks": u.engine_load.num_blocks,
            "age_s": round(now - u.engine_load.at, 3),
        },
        # Its prefix cache hits, reported against predicted (routing/kv/accuracy.py), or null
        # before it answered a generation request.
        "prefix_cache": None if prefix_cache_of is None else prefix_cache_of(u.unit_id),
        "in_flight": u.in_flight,
        "requests_total": u.requests_total,
        "errors_total": u.errors_total,
        "ejected": ejected,
        "ejected_for_s": round(max(0.0, u.ejected_until - now), 3),
        "ejections_total": u.ejections_total,
        "consecutive_errors": u.consecutive_errors,
        "degraded_ranks": list(degraded),
        "nodes": [_node(n, degraded) for n in u.nodes],
    }


_PUBLIC_UNIT = ("unit_id", "state", "model", "model_version", "draining", "healthy", "in_flight")
_PUBLIC_NODE = ("node_id", "role", "rank", "state")


def _redacted(unit: dict[str, Any]) -> dict[str, Any]:
    out = {k: unit[k] for k in _PUBLIC_UNIT}
    out["nodes"] = [{k: n[k] for k in _PUBLIC_NODE} for n in unit["nodes"]]
    return out


def build_status(
    registry: Registry,
    *,
    policy: str,
    queued: int,
    active: int,
    panic_models: list[str],
    classes: dict[str, dict[str, int | float]] | None = None,
    redact: bool = False,
    upstream_of: Callable[[UnitSpec], str] | None = None,
    kv_of: Callable[[str], dict[str, Any]] | None = None,
    prefix_cache_of: Callable[[str], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    now = time.monotonic()
    units = [
        _unit(u, now, upstream_of, prefix_cache_of)
        for u in sorted(registry.units.values(), key=lambda u: u.unit_id)
    ]
    for unit in units:
        # Its exact KV index (routing/kv/fleet.py: mode, blocks); null without one.
        unit["kv"] = None if kv_of is None else kv_of(unit["unit_id"])
    events = [
        {"at": e.at, "unit_id": e.unit_id, "kind": e.kind, "detail": e.detail}
        for e in list(registry.events)[-50:]
    ]
    if redact:
        units = [_redacted(u) for u in units]
        events = [{k: e[k] for k in ("at", "unit_id", "kind")} for e in events]
    return {
        "time": time.time(),
        "routing_policy": policy,
        "admission": {"active": active, "queued": queued, "classes": classes or {}},
        "panic_models": panic_models,
        "redacted": redact,
        "units": units,
        "events": events,
    }
