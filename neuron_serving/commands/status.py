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

The table fits the terminal (``--width``, else ``$COLUMNS``, else the terminal's
size; no limit into a pipe): columns are dropped in ``COLUMNS``' order of
``drop_rank`` as `kubectl get` does (status_view.py), so each unit and node stays one
line (with a key, each unit's KV routing mode and prefix cache hit rate / prediction
accuracy among its columns). Below the units: one line per traffic class (queued,
active, dispatched, shed, deadline misses) and the Batch API's unfinished batches
(with a key only), then, from the state file, one line per proxy replica of a local
cluster (`up --proxies K` share the client port: the view above is the one replica
the kernel picked; each one's own is ``GET /status`` on its admin port). ``--json``
is for scripts: the whole merged view with every key always present (``proxy``,
``reachable``, ``error``, ``redacted``, ``warning``, ``routing``, ``classes``,
``batches``, ``proxies``, ``capacity``, ``units``; each unit's ``kv`` and
``prefix_cache`` as /status has them). Under `up --autoscale` one more line shows
the capacity controller (desired and current units, the last action and its
reason); ``--json`` has its whole section (the last decisions with their signals).

``--watch`` is the live view: the same table every ``--interval`` seconds (redrawn in
place on a terminal, 80 columns into a pipe unless ``--width`` says otherwise), each
node a line: a rank its leader finds slow shows as ``degraded``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from neuron_serving.commands.status_view import render_text
from neuron_serving.exitcodes import ExitCode


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="table of units and nodes (proxy /status + supervisor)")
    p.add_argument("--proxy", default="http://127.0.0.1:8080", help="proxy base URL")
    p.add_argument(
        "--state",
        default=None,
        help="supervisor state file (default: the `up` run dir of the proxy's port)",
    )
    add_api_key_arg(p)
    p.add_argument(
        "--json", action="store_true", help="print the merged view as JSON (for scripts)"
    )
    p.add_argument(
        "--width",
        type=int,
        default=None,
        help="fit the table to this many columns (default: the terminal's, or $COLUMNS; "
        "0 = no limit; 80 with --watch into a pipe)",
    )
    p.add_argument(
        "--watch", action="store_true",
        help="a live view: the table again every --interval seconds, per unit and per "
        "rank (a slow rank shows as degraded), until Ctrl-C",
    )  # fmt: skip
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="--watch's period")
    p.add_argument(
        "--count", type=int, default=0, metavar="N",
        help="--watch: stop after N views (default 0: until Ctrl-C)",
    )  # fmt: skip
    p.set_defaults(func=run)


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
                # A warm spare is drained on purpose (capacity/README.md, the warm pool).
                "health": "spare"
                if s.get("standby") and p.get("state") == "draining"
                else p.get("state"),
                "phase": s.get("phase"),
                "restarts": s.get("restarts"),
                "in_flight": p.get("in_flight"),
                # The leader's own report (running, waiting, kv_usage, ...), or None.
                "engine_load": p.get("engine_load"),
                # The proxy's exact KV index for it (mode, blocks, ...) and its prefix
                # cache hits against the predicted ones (full view only), or None.
                "kv": p.get("kv"),
                "prefix_cache": p.get("prefix_cache"),
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
    if getattr(args, "state", None):  # `batches` has no --state: the run dir of --proxy
        return Path(args.state)
    from neuron_serving.local.cache import default_run_dir

    port = urlparse(args.proxy).port or 80
    return default_run_dir(port) / "supervisor.json"


def add_api_key_arg(p: argparse.ArgumentParser) -> None:
    """``--api-key``, as every command that calls the proxy's client API reads it."""
    p.add_argument(
        "--api-key",
        default=None,
        help="client API key for the proxy (default: $NEURON_SERVING_API_KEY, else the "
        "api-key file of the local cluster's run dir)",
    )


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


def json_view(
    base: str,
    proxy: dict[str, Any] | None,
    problem: str,
    warning: str | None,
    rows: list[dict[str, Any]],
    proxies: list[dict[str, Any]] | None = None,
    capacity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``--json``: every key always present (null when it does not apply)."""
    routing = None
    if proxy is not None:
        adm = proxy.get("admission", {})
        routing = {
            "policy": proxy.get("routing_policy"),
            "active": adm.get("active", 0),
            "queued": adm.get("queued", 0),
            "panic_models": proxy.get("panic_models") or [],
        }
    return {
        "proxy": base,
        "reachable": proxy is not None,
        "error": None if proxy is not None else problem,
        "redacted": None if proxy is None else bool(proxy.get("redacted")),
        "warning": warning,
        "routing": routing,
        # Per traffic class: queued, active and counters since the proxy started.
        "classes": None if proxy is None else proxy.get("admission", {}).get("classes") or {},
        # The Batch API's runner and its unfinished batches (None when redacted or off).
        "batches": None if proxy is None else proxy.get("batches"),
        # A local cluster's proxy replicas as its supervisor sees them (None: no state).
        "proxies": proxies,
        # `up --autoscale`'s controller: bounds, desired/current, the last decisions
        # (supervisor.json "capacity"; None: no state, or no autoscaler).
        "capacity": capacity,
        "units": rows,
    }


def width(args: argparse.Namespace) -> int:
    """``--width``, else the terminal's (``COLUMNS`` first, as shutil reads it); 0 = no
    limit, which is what output to a pipe or file gets, as from `kubectl get`."""
    if args.width is not None:
        return max(0, args.width)
    return shutil.get_terminal_size((0, 0)).columns


@dataclass
class View:
    """One reading of the proxy and the supervisor's state, as `status` shows it."""

    base: str
    proxy: dict[str, Any] | None
    problem: str
    warning: str | None
    rows: list[dict[str, Any]]
    have_state: bool
    proxies: list[dict[str, Any]] | None
    capacity: dict[str, Any] | None


def read_view(args: argparse.Namespace) -> View:
    from neuron_serving.local.cluster import _pid_alive, read_state
    from neuron_serving.local.probe import get_json, http_status

    base = args.proxy.rstrip("/")
    key = api_key(args)
    proxy = get_json(f"{base}/status", 3.0, token=key)
    problem = "unreachable"
    if proxy is None and (code := http_status(f"{base}/status", 3.0, token=key)):
        problem = f"answered /status with HTTP {code}"  # not the proxy, or not its port
    state = read_state(_state_path(args))
    if state is not None and not _pid_alive(state.get("pid")):
        state = None  # a dead supervisor's file describes nothing that runs
    return View(base, proxy, problem, redaction_warning(proxy, key), merge(proxy, state),
                state is not None, None if state is None else state.get("proxies"),
                None if state is None else state.get("capacity"))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.watch:
        return watch(args)
    v = read_view(args)
    if args.json:
        print(json.dumps(json_view(v.base, v.proxy, v.problem, v.warning, v.rows, v.proxies,
                                   v.capacity)))  # fmt: skip
        return ExitCode.OK if v.proxy is not None else ExitCode.FAILED
    console = Console(highlight=False, soft_wrap=True)
    for line in _lines(v, width(args)):
        console.print(line)
    return ExitCode.OK if v.proxy is not None else ExitCode.FAILED


def _lines(v: View, cols: int) -> list[Any]:
    return render_text(v.base, v.proxy, v.have_state, v.problem, v.warning, v.rows, cols,
                       v.proxies, v.capacity)  # fmt: skip


def watch(args: argparse.Namespace) -> int:
    """The table again every ``--interval`` seconds, redrawn in place on a terminal
    (rich's Live) and one view after another into a pipe; the time of each view on
    its first line. Ctrl-C ends it (exit 0)."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    if args.json:
        print("neuron-serving status: --watch shows the table; --json is for one view",
              file=sys.stderr)  # fmt: skip
        return ExitCode.USAGE
    console = Console(highlight=False, soft_wrap=True)
    cols = width(args) or 80

    def frame() -> Group:
        v = read_view(args)
        head = Text(f"{time.strftime('%H:%M:%S')}  every {args.interval:g} s  (Ctrl-C ends)",
                    style="dim")  # fmt: skip
        return Group(head, *_lines(v, cols))

    shown = 0
    try:
        if console.is_terminal:
            with Live(frame(), console=console, auto_refresh=False) as live:
                shown = 1
                while not args.count or shown < args.count:
                    time.sleep(max(0.1, args.interval))
                    live.update(frame(), refresh=True)
                    shown += 1
        else:
            while not args.count or shown < args.count:
                if shown:
                    time.sleep(max(0.1, args.interval))
                    console.print()
                console.print(frame())
                shown += 1
    except KeyboardInterrupt:
        pass
    return ExitCode.OK
