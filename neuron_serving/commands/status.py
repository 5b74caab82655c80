"""`neuron-serving status [--proxy URL]`: units and nodes as the proxy and the supervisor see them.

Merges two sources by unit id: the proxy's ``GET /status`` (health, routability,
load, model version, probe errors) and, when this machine runs the cluster with
`neuron-serving up`, the supervisor's state file (process state, restarts, last
failure). Either alone is enough to print a table.

The proxy's /status is redacted (no addresses, probe errors or request counts)
without a client API key, so `status` sends ``Authorization: Bearer`` with the first
key it finds: ``--api-key``, else ``NEURON_SERVING_API_KEY``, else the ``api-key``
file `up` wrote next to the supervisor state (the same run directory). The proxy
answers a missing or wrong key on /status with 200 and ``"redacted": true``, not
401, so that flag is what tells `status` its key was not accepted; it then says so
(a warning line, ``"warning"`` in ``--json``) instead of showing blanks silently.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from neuron_serving.exitcodes import ExitCode


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="table of units and nodes (proxy /status + supervisor)")
    p.add_argument("--proxy", default="http://127.0.0.1:8080", help="proxy base URL")
    p.add_argument(
        "--state",
        default=None,
        help="supervisor state file (default: the `up` run dir of the proxy's port)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="client API key for the proxy (default: $NEURON_SERVING_API_KEY, else the "
        "api-key file of the local cluster's run dir)",
    )
    p.add_argument("--json", action="store_true", help="print the merged view as JSON")
    p.set_defaults(func=run)


def _age(ts: float | None) -> str:
    if not ts:
        return ""
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def merge(proxy: dict[str, Any] | None, state: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per unit: proxy fields, supervisor fields, and nodes joined by name."""
    units: dict[str, dict[str, Any]] = {}
    for u in (proxy or {}).get("units", []):
        units[u["unit_id"]] = {"unit_id": u["unit_id"], "proxy": u, "supervisor": None}
    for u in (state or {}).get("units", []):
        units.setdefault(u["unit_id"], {"unit_id": u["unit_id"], "proxy": None})["supervisor"] = u
    rows = []
    for unit_id in sorted(units):
        row = units[unit_id]
        p, s = row["proxy"] or {}, row["supervisor"] or {}
        procs = {x["name"]: x for x in s.get("processes", [])}
        nodes = []
        for n in p.get("nodes", []) or [{"node_id": f"{unit_id}/{k}"} for k in procs]:
            name = n["node_id"].split("/", 1)[1]
            proc = procs.get(name, {})
            nodes.append(
                {
                    "name": name,
                    "health": n.get("state"),
                    "node_state": proc.get("node_state"),
                    "pid": proc.get("pid"),
                    "running": proc.get("running"),
                    "last_error": (n.get("last_error") or "").splitlines()[0:1],
                    "probe_ms": n.get("last_probe_latency_ms"),
                }
            )
        failure = s.get("last_failure") or {}
        rows.append(
            {
                "unit_id": unit_id,
                "health": p.get("state"),
                "phase": s.get("phase"),
                "restarts": s.get("restarts"),
                "in_flight": p.get("in_flight"),
                "requests_total": p.get("requests_total"),
                "errors_total": p.get("errors_total"),
                "model_version": p.get("model_version"),
                "last_failure": failure.get("reason"),
                "last_failure_at": failure.get("at"),
                "nodes": nodes,
            }
        )
    return rows


def _state_path(args: argparse.Namespace) -> Path:
    if args.state:
        return Path(args.state)
    from neuron_serving.local.cache import default_run_dir

    port = urlparse(args.proxy).port or 80
    return default_run_dir(port) / "supervisor.json"


def api_key(args: argparse.Namespace) -> str | None:
    """The key to send: flag, environment, then the local cluster's ``api-key`` file."""
    from neuron_serving import envs
    from neuron_serving.local.proxy_config import read_api_key
    from neuron_serving.local.spec import API_KEY_FILE

    if args.api_key:
        return args.api_key
    if envs.NEURON_SERVING_API_KEY:
        return envs.NEURON_SERVING_API_KEY
    return read_api_key(_state_path(args).parent / API_KEY_FILE)


def redaction_warning(proxy: dict[str, Any] | None, key: str | None) -> str | None:
    """What to tell the user when the proxy showed its redacted view (None otherwise)."""
    if not proxy or not proxy.get("redacted"):
        return None
    why = (
        "none found (--api-key, NEURON_SERVING_API_KEY, the run dir's api-key file)"
        if key is None
        else "the proxy did not accept the one sent"
    )
    return f"no valid API key ({why}): addresses, probe errors and request counts hidden"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from neuron_serving.local.cluster import _pid_alive, read_state
    from neuron_serving.local.probe import get_json, http_status

    base = args.proxy.rstrip("/")
    key = api_key(args)
    proxy = get_json(f"{base}/status", 3.0, token=key)
    problem = "unreachable"
    if proxy is None and (code := http_status(f"{base}/status", 3.0, token=key)):
        problem = f"answered /status with HTTP {code}"  # not the proxy, or not its port
    warning = redaction_warning(proxy, key)
    state = read_state(_state_path(args))
    if state is not None and not _pid_alive(state.get("pid")):
        state = None  # a dead supervisor's file describes nothing that runs
    rows = merge(proxy, state)
    if args.json:
        out: dict[str, Any] = {"proxy": base, "reachable": proxy is not None, "units": rows}
        if proxy is None:
            out["error"] = problem
        else:
            out["redacted"] = bool(proxy.get("redacted"))
        if warning:
            out["warning"] = warning
        print(json.dumps(out))
        return ExitCode.OK if proxy is not None else ExitCode.FAILED
    console = Console()
    if warning:
        console.print(f"[yellow]warning: {warning}[/yellow]")
    if proxy is None:
        console.print(f"[red]proxy {base} {problem}[/red]" + (
            "; showing the supervisor's view only" if state else ""))  # fmt: skip
        if state is None:
            return ExitCode.FAILED
    table = Table(title=f"neuron-serving status: {base}", show_lines=False)
    for col in ("unit / node", "health", "state", "restarts", "load", "version"):
        table.add_column(col, overflow="fold")
    # Probe errors are long gRPC messages: one line, cut, so the table stays readable.
    table.add_column("last failure / probe error", overflow="ellipsis", no_wrap=True, max_width=60)
    colors = {"routable": "green", "healthy": "green", "unhealthy": "red", "draining": "yellow",
              "ejected": "magenta", "pending": "yellow"}  # fmt: skip

    def paint(v: Any) -> str:
        return f"[{colors[v]}]{v}[/]" if v in colors else ("" if v is None else str(v))

    for r in rows:
        load = "" if r["in_flight"] is None else f"{r['in_flight']} in flight"
        if r["requests_total"] is not None:  # absent from a redacted view
            load += f" ({r['requests_total']} req, {r['errors_total']} err)"
        failure = ""
        if r["last_failure"]:
            failure = f"{r['last_failure']} ({_age(r['last_failure_at'])})"
        table.add_row(f"[bold]{r['unit_id']}[/]", paint(r["health"]), paint(r["phase"]),
                      "" if r["restarts"] is None else str(r["restarts"]), load,
                      r["model_version"] or "", failure)  # fmt: skip
        for n in r["nodes"]:
            pid = f" pid {n['pid']}" if n["pid"] and n["running"] else ""
            table.add_row(f"  {n['name']}{pid}", paint(n["health"]), paint(n["node_state"]),
                          "", "", "", " ".join(n["last_error"]))  # fmt: skip
    console.print(table)
    if proxy is not None:
        adm = proxy.get("admission", {})
        console.print(
            f"routing {proxy.get('routing_policy')}; {adm.get('active', 0)} active, "
            f"{adm.get('queued', 0)} queued" + (
                f"; panic: {proxy['panic_models']}" if proxy.get("panic_models") else "")
        )  # fmt: skip
    return ExitCode.OK if proxy is not None else ExitCode.FAILED
