"""Rows of `neuron-serving ecs status`: units, their tasks and health, and proxy membership."""

from __future__ import annotations

import time
from typing import Any

from neuron_serving.ecs.fleet import UnitView
from neuron_serving.ecs.registrar import ProxyRegistrar, RegistrarError
from neuron_serving.ecs.spec import DeploymentSpec


def unit_rows(
    spec: DeploymentSpec,
    views: dict[str, UnitView],
    registrar: ProxyRegistrar,
    wanted: set[str] | None = None,
) -> list[dict[str, Any]]:
    """``wanted``: the unit ids to run (UnitController.wanted_units); default: the
    spec's ``units`` of them."""
    try:
        in_proxy: set[str] | None = registrar.units()
    except RegistrarError:
        in_proxy = None  # unknown, shown as such rather than failing the whole status
    if wanted is None:
        wanted = {spec.unit_id(i) for i in range(spec.units)}
    rows = []
    for unit_id in sorted(set(views) | wanted, key=lambda u: int(u.rsplit("-", 1)[1])):
        view = views.get(unit_id)
        if view is None:
            state = "absent"
        elif view.failed:
            state = "failed"
        elif view.ready:
            state = "ready"
        else:
            state = "starting"
        rows.append(
            {
                "unit_id": unit_id,
                "state": state,
                "wanted": unit_id in wanted,
                "version": view.version if view else None,
                "in_proxy": None if in_proxy is None else unit_id in in_proxy,
                "age_s": round(time.time() - view.launched_at) if view else None,
                "nodes": [
                    {
                        "rank": n.rank,
                        "task_id": n.task_id,
                        "last_status": n.last_status,
                        "health": n.health,
                        "ip": n.ip,
                    }
                    for n in (sorted(view.tasks(), key=lambda n: n.rank) if view else [])
                ],
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'UNIT':<24} {'STATE':<9} {'VERSION':<14} {'PROXY':<6} NODES"]
    for r in rows:
        proxy = {None: "?", True: "yes", False: "no"}[r["in_proxy"]]
        nodes = " ".join(
            f"r{n['rank']}:{n['last_status']}/{n['health']}@{n['ip'] or '-'}" for n in r["nodes"]
        )
        lines.append(
            f"{r['unit_id']:<24} {r['state']:<9} {r['version'] or '-':<14} {proxy:<6} {nodes}"
        )
    return "\n".join(lines)
