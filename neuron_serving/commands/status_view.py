"""The human view of `neuron-serving status`: columns fitted to the terminal, as
`kubectl get` prints them.

A plain table (upper-case headers, two spaces between columns, no borders): borders
and wrapped cells are what made `status` unreadable at 80 columns. Each unit and
node is one line. Fitting, in order:

1. columns with no value in any row are left out (a redacted view has no counts);
2. the one *elastic* column (free text such as an error) takes what is left, cut
   with an ellipsis, down to its ``min_width``;
3. while the table is still too wide, the column with the highest ``drop_rank``
   is dropped (the rightmost first among equals); rank 0 is never dropped;
4. a line that still does not fit (only never-dropped columns left) is cut.

A width of 0 means no limit (output that is not a terminal, like `kubectl get`).
Free-text lines (warnings, the routing summary) are wrapped to the width.
"""

from __future__ import annotations

import re
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.text import Text

GAP = 2


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    drop_rank: int = 0  # 0: always shown; higher ranks are dropped first
    elastic: bool = False  # at most one: takes the width left over, cut with "…"
    min_width: int = 12


def fit(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> dict[int, int]:
    """Index -> width of each column kept, in display order."""
    from rich.cells import cell_len

    natural = [
        max([cell_len(c.header), *(cell_len(r[i]) for r in rows)]) for i, c in enumerate(columns)
    ]
    kept = [i for i, c in enumerate(columns) if c.drop_rank == 0 or any(r[i] for r in rows)]
    while True:
        fixed = [i for i in kept if not columns[i].elastic]
        used = sum(natural[i] for i in fixed) + GAP * (len(kept) - 1)
        elastic = [i for i in kept if columns[i].elastic]
        need = used + sum(min(natural[i], columns[i].min_width) for i in elastic)
        droppable = [i for i in kept if columns[i].drop_rank > 0]
        if not width or need <= width or not droppable:
            break
        kept.remove(max(droppable, key=lambda i: (columns[i].drop_rank, i)))
    widths = {i: natural[i] for i in kept}
    for i in elastic:
        widths[i] = (
            min(natural[i], max(width - used, columns[i].min_width)) if width else natural[i]
        )
    return widths


def render(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    width: int,
    style: Callable[[str], str | None] = lambda _: None,
) -> list[Text]:
    """Header and one line per row; ``style`` colours a cell by its value."""
    from rich.text import Text

    widths = fit(columns, rows, width)
    header = [c.header for c in columns]
    lines = []
    for n, row in enumerate([header, *rows]):
        line = Text(style="bold" if n == 0 else "")
        for k, (i, w) in enumerate(widths.items()):
            cell = Text(row[i], style=(style(row[i]) or "") if n else "")
            cell.truncate(w, overflow="ellipsis", pad=k < len(widths) - 1)
            line.append_text(cell)
            if k < len(widths) - 1:
                line.append(" " * GAP)
        line.rstrip()
        if width:
            line.truncate(width, overflow="ellipsis")
        lines.append(line)
    return lines


# Columns in display order; drop_rank: the order in which a narrow terminal loses them
# (highest first; 0 = always shown). Unit identity and health matter most, then what
# the supervisor is doing, load, and why the unit or node last failed. Columns with no
# value in any row are left out (RUN/WAIT and KV without engine reports; those and
# KV-MODE, HIT/ACC when redacted).
COLUMNS = (
    Column("UNIT/NODE"),
    Column("HEALTH"),
    Column("STATE", drop_rank=1),
    Column("IN-FLIGHT", drop_rank=2),
    # The leader's own report: running/waiting sequences and KV cache use. Left of
    # RESTARTS, so in 80 columns RESTARTS goes first (rightmost among equal ranks).
    Column("RUN/WAIT", drop_rank=4),
    Column("KV", drop_rank=4),
    # The proxy's KV routing for the unit: its exact index's mode (exact, part, approx;
    # "-": the policy keeps none) and prefix cache hit rate / prediction accuracy
    # (proxy/routing/kv/accuracy.py). Left of RESTARTS too, and dropped before the engine's load.
    Column("KV-MODE", drop_rank=4),
    Column("HIT/ACC", drop_rank=4),
    Column("RESTARTS", drop_rank=4),
    Column("REQUESTS", drop_rank=6),
    Column("ERRORS", drop_rank=6),
    Column("VERSION", drop_rank=5),
    Column("PID", drop_rank=7),
    Column("LAST ERROR", drop_rank=3, elastic=True, min_width=16),
)
_COLORS = {"routable": "green", "healthy": "green", "unhealthy": "red", "draining": "yellow",
           "spare": "cyan",
           "ejected": "magenta", "pending": "yellow", "degraded": "yellow"}  # fmt: skip


def age(ts: float | None) -> str:
    if not ts:
        return ""
    s = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= 2 * size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def _probe_error(lines: list[str]) -> str:
    """A gRPC error's ``details`` (what went wrong) rather than its envelope."""
    text = " ".join(lines)
    match = re.search(r'details = "([^"]*)"', text)
    return match.group(1) if match else text


def _cell(v: Any) -> str:
    return "" if v is None else str(v)


def _engine(load: dict[str, Any] | None) -> tuple[str, str]:
    """RUN/WAIT and KV cells from a unit's ``engine_load`` (blank without a report)."""
    if not load:
        return "", ""
    kv = load.get("kv_usage")
    return (
        f"{_cell(load.get('running'))}/{_cell(load.get('waiting'))}",
        "" if kv is None else f"{100 * kv:.0f}%",
    )


_KV_MODES = {"exact": "exact", "partial": "part", "approximate": "approx"}


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _kv_routing(kv: dict[str, Any] | None, cache: dict[str, Any] | None) -> tuple[str, str]:
    """KV-MODE and HIT/ACC cells from a unit's full ``/status``: ``kv``'s mode ("-" when
    null: no exact index) and ``prefix_cache``'s ``hit_rate`` / ``mean_accuracy`` as
    proxy/routing/kv/accuracy.py defines them ("-" for one not defined yet, or before any report)."""
    mode = "-"
    if kv:
        name = _cell(kv.get("mode"))
        mode = _KV_MODES.get(name, name or "-")
    cache = cache or {}
    return mode, f"{_percent(cache.get('hit_rate'))}/{_percent(cache.get('mean_accuracy'))}"


# Per traffic class, below the units: what waits and runs now, then counters since
# the proxy started (dispatched goes first in a narrow terminal).
CLASS_COLUMNS = (
    Column("CLASS"),
    Column("QUEUED"),
    Column("ACTIVE"),
    Column("DISPATCHED", drop_rank=2),
    Column("SHED", drop_rank=1),
    Column("DEADLINE MISSES", drop_rank=1),
)


def class_rows(classes: dict[str, dict[str, Any]]) -> list[list[str]]:
    fields = ("queued", "active", "dispatched", "shed", "deadline_misses")  # CLASS_COLUMNS'
    return [[name, *(_cell(c.get(f)) for f in fields)] for name, c in classes.items()]


# The Batch API's unfinished batches (a full /status only): the id is never cut.
BATCH_COLUMNS = (
    Column("BATCH"),
    Column("TENANT", drop_rank=3, elastic=True, min_width=8),
    Column("STATUS"),
    Column("DONE/FAILED/TOTAL", drop_rank=1),
)


def batch_rows(active: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for b in active:
        rc = b.get("request_counts") or {}
        counts = f"{_cell(rc.get('completed'))}/{_cell(rc.get('failed'))}/{_cell(rc.get('total'))}"
        out.append([_cell(b.get("id")), _cell(b.get("tenant")), _cell(b.get("status")), counts])
    return out


def table_rows(rows: list[dict[str, Any]], full: bool = False) -> list[list[str]]:
    """One line per unit, then one per node (indented), in ``COLUMNS`` order. ``full``:
    the proxy's /status was its full view (a redacted one has no ``kv`` or
    ``prefix_cache``: KV-MODE and HIT/ACC stay blank, not "-")."""
    out = []
    for r in rows:
        failure = ""
        if r["last_failure"]:
            failure = f"{r['last_failure']} ({age(r['last_failure_at'])})"
        run_wait, kv = _engine(r.get("engine_load"))
        mode, hit_acc = ("", "")
        if full and r["health"] is not None:  # the proxy lists the unit
            mode, hit_acc = _kv_routing(r.get("kv"), r.get("prefix_cache"))
        out.append([r["unit_id"], _cell(r["health"]), _cell(r["phase"]), _cell(r["in_flight"]),
                    run_wait, kv, mode, hit_acc,
                    _cell(r["restarts"]), _cell(r["requests_total"]), _cell(r["errors_total"]),
                    r["model_version"] or "", "", failure])  # fmt: skip
        for n in r["nodes"]:
            pid = _cell(n["pid"]) if n["pid"] and n["running"] else ""
            out.append([f"  {n['name']}", _cell(n["health"]), _cell(n["node_state"]),
                        "", "", "", "", "", "", "", "", "", pid,
                        _probe_error(n["last_error"])])  # fmt: skip
    return out


def render_text(
    base: str,
    proxy: dict[str, Any] | None,
    have_state: bool,
    problem: str,
    warning: str | None,
    rows: list[dict[str, Any]],
    width: int,
    proxies: list[dict[str, Any]] | None = None,
    capacity: dict[str, Any] | None = None,
) -> list[Text]:
    """The whole human view, every line at most ``width`` cells (0 = no limit);
    ``proxies``: the state file's replicas of a local cluster, one line each;
    ``capacity``: its autoscaler (supervisor.json ``capacity``), one line."""
    from rich.text import Text

    def wrap(text: str, style: str = "") -> list[Text]:
        parts = textwrap.wrap(text, width, subsequent_indent="  ") if width else [text]
        return [Text(part, style=style) for part in parts]

    lines: list[Text] = []
    if warning:
        lines += wrap(f"warning: {warning}", "yellow")
    if proxy is None:
        suffix = "; showing the supervisor's view only" if have_state else ""
        lines += wrap(f"proxy {base} {problem}{suffix}", "red")
        if not have_state:
            return lines
    lines += wrap(f"neuron-serving status: {base}", "bold")
    full = proxy is not None and not proxy.get("redacted")
    lines += render(COLUMNS, table_rows(rows, full), width, _COLORS.get)
    if proxy is not None:
        adm = proxy.get("admission", {})
        panic = f"; panic: {proxy['panic_models']}" if proxy.get("panic_models") else ""
        lines += wrap(
            f"routing {proxy.get('routing_policy')}; {adm.get('active', 0)} active, "
            f"{adm.get('queued', 0)} queued{panic}"
        )
        if adm.get("classes"):
            lines.append(Text(""))
            lines += render(CLASS_COLUMNS, class_rows(adm["classes"]), width)
        if (batches := proxy.get("batches")) is not None:
            lines += [Text(""), *wrap(_batch_summary(batches))]
            if batches.get("active"):
                lines += render(BATCH_COLUMNS, batch_rows(batches["active"]), width)
    if proxies:
        lines.append(Text(""))
        for p in proxies:
            lines += wrap(_replica_line(p), "" if p.get("phase") == "ready" else "yellow")
    if capacity:
        lines.append(Text(capacity_line(capacity, min(80, width or 80))))
    return lines


def capacity_line(c: dict[str, Any], limit: int = 80) -> str:
    """`up --autoscale`'s controller in one line of at most ``limit`` columns: desired
    and current units within their bounds, the last action (+added, -removed, ^promoted
    from the warm pool, ~held into it), its reason and age; then, as room allows, the
    units starting/draining, the warm spares and the error count."""
    bounds = f"{c.get('min_units')}..{c.get('max_units')}"
    if c.get("error"):
        return f"autoscale {bounds}: {c['error']}"[:limit]
    if c.get("desired") is None:
        return f"autoscale {bounds}: no decision yet"
    line = f"autoscale {bounds}: desired {c['desired']}, current {c.get('current')}"
    a = c.get("last_action")
    if a:
        pool = a.get("pool") or {}
        promoted, held = set(pool.get("promoted", ())), set(pool.get("held", ()))
        did = [f"^{u}" if u in promoted else f"+{u}" for u in a.get("added", [])]
        did += [f"~{u}" if u in held else f"-{u}" for u in a.get("removed", [])]
        did += [f"+{u} (warm)" for u in pool.get("filled", ())]
        line += f"; last {' '.join(did) or 'error'} ({a.get('reason')}) {age(a.get('wall_time'))}"
    else:
        line += f"; {c.get('reason') or 'hold'}"
    errors = (c.get("read_errors") or 0) + (c.get("actuator_errors") or 0)
    moving = [f"{c[k]} {k}" for k in ("starting", "draining") if c.get(k)]
    if c.get("warm_units"):
        moving.append(f"{c.get('spares', 0)}/{c['warm_units']} warm")
    for extra in (", ".join(moving), f"{errors} err" if errors else ""):
        if extra and len(line) + 2 + len(extra) <= limit:
            line += f"; {extra}"
    return line[:limit]


def _replica_line(p: dict[str, Any]) -> str:
    pids = [str(x["pid"]) for x in p.get("processes", []) if x.get("running")]
    return (
        f"{p.get('replica_id')}: {p.get('phase')}, pid {', '.join(pids) or '-'}, "
        f"{p.get('restarts', 0)} restarts; admin {p.get('admin_url')}"
    )


def _batch_summary(b: dict[str, Any]) -> str:
    active = b.get("active") or []
    return (
        f"batches: {len(active) or 'none'} unfinished; {b.get('replica_id') or 'this replica'}: "
        f"{b.get('lines_in_flight', 0)} lines in flight, {b.get('lines_done', 0)} done, "
        f"{b.get('lines_retried', 0)} retried"
    )
