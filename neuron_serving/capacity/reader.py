"""``ProxyReader``: one ``Signals`` per tick from the proxy replicas and the actuator.

Every tick it asks each proxy replica's admin port (the admin token, as
neuron_serving/proxy_admin.py and `neuron-serving status` reach them; in parallel,
each call bounded) for ``GET /status`` and ``GET /metrics``, and the actuator for
``units()``, then merges:

    classes        /status admission.classes: queued and active added up over the
                   replicas (each admits its own clients); oldest_wait_s the largest
    units          the actuator's units (phase, purpose, mid_deploy, since: it owns
                   them); each one's engine load (running, waiting, kv_usage,
                   max_num_seqs) from /status units[].engine_load: every replica
                   hears the same leader report, so the freshest (smallest age_s)
    ttft_p99_s     proxy_time_to_first_token_seconds (every unit's series of the
                   interactive classes, real-time and near-real-time: a batch tail is
                   not an SLO breach; a proxy without the class label: every series)
    itl_p99_s      and proxy_inter_token_latency_seconds from /metrics: the bucket counts'
                   increase since the previous tick, per replica and series, summed
                   over the replicas and over the ticks of the last latency_window_s,
                   then histogram.quantile(0.99) (None when nothing was observed)
    batch_backlog  /status batches (the shared batch store): every unfinished batch's
                   open lines (total - completed - failed), less the lines the
                   replicas have in flight (those count as batch class active)

A counter that went down (a replica restarted) counts from zero; a replica's first
scrape is only a baseline (its history is not this window's). A replica that does
not answer is left out of this tick (``problems`` says which); when none answers
/status, ``read`` raises ``ReaderError`` and the controller skips the tick.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from neuron_serving.capacity import histogram
from neuron_serving.capacity.signals import (
    BATCH,
    CLASSES,
    REAL_TIME,
    ClassSignals,
    Signals,
    UnitSignals,
)
from neuron_serving.proxy_admin import FanOut

TTFT = "proxy_time_to_first_token_seconds"
ITL = "proxy_inter_token_latency_seconds"
DEFAULT_LATENCY_WINDOW_S = 30.0

Series = tuple[tuple[str, str], ...]  # a histogram's labels without "le"
Buckets = dict[float, float]  # le -> cumulative count (math.inf: the +Inf bucket)


class ReaderError(RuntimeError):
    """No signals this tick (no replica answered, or the actuator failed)."""


class _FanOut(Protocol):
    def call(self, method: str, path: str, body: Any = None) -> FanOut: ...


class _Units(Protocol):
    def units(self) -> list[UnitSignals]: ...


def interactive(series: dict[Series, Buckets]) -> dict[Series, Buckets]:
    """The series of the interactive classes (and those without a class label)."""
    return {s: b for s, b in series.items() if dict(s).get("class", REAL_TIME) != BATCH}


def parse_histograms(text: str, names: tuple[str, ...]) -> dict[str, dict[Series, Buckets]]:
    """The cumulative bucket counts of each named histogram in a /metrics text, by series."""
    out: dict[str, dict[Series, Buckets]] = {n: {} for n in names}
    for family in text_string_to_metric_families(text):
        if family.name not in out:
            continue
        for s in family.samples:
            if not s.name.endswith("_bucket") or "le" not in s.labels:
                continue
            series = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            out[family.name].setdefault(series, {})[float(s.labels["le"])] = s.value
    return out


def _per_bucket(cumulative: Buckets) -> dict[float, float]:
    """Cumulative counts -> the count of each bucket alone."""
    out, below = {}, 0.0
    for le in sorted(cumulative):
        out[le] = max(0.0, cumulative[le] - below)
        below = max(below, cumulative[le])
    return out


class HistogramWindow:
    """One histogram over several replicas: the increase of its buckets per tick, kept
    for ``window_s``; its quantiles over that window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._prev: dict[tuple[str, Series], Buckets] = {}
        self._seen: set[str] = set()  # replicas scraped at least once
        self._bounds: set[float] = set()  # every finite bucket bound seen
        self._ticks: collections.deque[tuple[float, dict[float, float]]] = collections.deque()

    def update(self, now: float, scraped: Mapping[str, Mapping[Series, Buckets]]) -> None:
        """``scraped``: replica id -> its series now (a replica left out: no answer)."""
        tick: dict[float, float] = {}
        for replica, series in scraped.items():
            first = replica not in self._seen
            self._seen.add(replica)
            for labels, cur in series.items():
                self._bounds.update(le for le in cur if math.isfinite(le))
                prev = self._prev.get((replica, labels))
                self._prev[(replica, labels)] = dict(cur)
                if first:
                    continue  # a baseline: its counts are from before this window
                if prev is None or any(cur.get(le, 0.0) < n for le, n in prev.items()):
                    prev = {}  # a new series, or the replica restarted: all of it is new
                delta = {le: n - prev.get(le, 0.0) for le, n in cur.items()}
                for le, n in _per_bucket(delta).items():
                    if n > 0:
                        tick[le] = tick.get(le, 0.0) + n
        self._ticks.append((now, tick))
        while self._ticks and self._ticks[0][0] <= now - self.window_s:
            self._ticks.popleft()

    def quantile(self, q: float) -> float | None:
        total: dict[float, float] = {}
        for _, tick in self._ticks:
            for le, n in tick.items():
                total[le] = total.get(le, 0.0) + n
        if not total:
            return None
        # Every bucket's bounds, empty ones too: a bucket's lower edge is the bound below.
        bounds = sorted(self._bounds | {le for le in total if math.isfinite(le)})
        counts = [total.get(le, 0.0) for le in bounds] + [total.get(math.inf, 0.0)]
        return histogram.quantile(q, bounds, counts)


def _int(v: Any) -> int:
    return int(v) if isinstance(v, int | float) and math.isfinite(v) else 0


def _float(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else 0.0


def merge_classes(statuses: Sequence[Mapping[str, Any]]) -> tuple[ClassSignals, ...]:
    """Per class over the replicas: queued and active added, the oldest wait the largest."""
    acc: dict[str, list[float]] = {}
    for status in statuses:
        for name, c in ((status.get("admission") or {}).get("classes") or {}).items():
            if not isinstance(c, Mapping):
                continue
            a = acc.setdefault(str(name), [0, 0, 0.0])
            a[0] += _int(c.get("queued"))
            a[1] += _int(c.get("active"))
            a[2] = max(a[2], _float(c.get("oldest_wait_s")))
    names = [c for c in CLASSES if c in acc] + sorted(set(acc) - set(CLASSES))
    return tuple(
        ClassSignals(name=n, queued=int(acc[n][0]), active=int(acc[n][1]), oldest_wait_s=acc[n][2])
        for n in names
    )


def freshest_loads(statuses: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """unit id -> its engine load as the replica with the freshest report has it."""
    best: dict[str, Mapping[str, Any]] = {}
    for status in statuses:
        for u in status.get("units") or []:
            load = u.get("engine_load") if isinstance(u, Mapping) else None
            if not isinstance(load, Mapping):
                continue
            unit_id = str(u.get("unit_id"))
            have = best.get(unit_id)
            if have is None or _float(load.get("age_s")) < _float(have.get("age_s")):
                best[unit_id] = load
    return best


def with_load(units: list[UnitSignals], loads: Mapping[str, Mapping[str, Any]]) -> tuple:
    """The actuator's units with their engine loads (a unit no replica reports: none)."""
    out = []
    for u in units:
        load = loads.get(u.unit_id)
        if load is None:
            out.append(u)
            continue
        # replace(): every other field the actuator gave (phase, purpose, standby, ...)
        # stays as it was.
        out.append(
            msgspec.structs.replace(
                u,
                running=_int(load.get("running")),
                waiting=_int(load.get("waiting")),
                kv_usage=_float(load.get("kv_usage")),
                max_num_seqs=_int(load.get("max_num_seqs")),
            )
        )
    return tuple(out)


def batch_backlog(statuses: Sequence[Mapping[str, Any]]) -> int:
    """Open lines of the unfinished batches (the store is shared: each batch once, as
    the replica that read it last saw it) less the lines in flight on any replica."""
    open_lines: dict[str, int] = {}
    in_flight = 0
    for status in statuses:
        b = status.get("batches")
        if not isinstance(b, Mapping):
            continue
        in_flight += _int(b.get("lines_in_flight"))
        for batch in b.get("active") or []:
            rc = batch.get("request_counts") or {}
            left = _int(rc.get("total")) - _int(rc.get("completed")) - _int(rc.get("failed"))
            bid = str(batch.get("id"))
            open_lines[bid] = min(open_lines.get(bid, left), left)
    return max(0, sum(open_lines.values()) - in_flight)


class ProxyReader:
    """Builds the tick's ``Signals`` (module doc). ``admin``: an ``AdminFanOut`` over
    the replicas' admin ports; ``actuator``: what ``units()`` comes from."""

    def __init__(
        self,
        admin: _FanOut,
        actuator: _Units,
        latency_window_s: float = DEFAULT_LATENCY_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.admin = admin
        self.actuator = actuator
        self.clock = clock
        self.ttft = HistogramWindow(latency_window_s)
        self.itl = HistogramWindow(latency_window_s)
        self.problems: list[str] = []  # the last read's replicas that did not answer

    def read(self) -> Signals:
        statuses_out = self.admin.call("GET", "/status")
        metrics_out = self.admin.call("GET", "/metrics")
        problems = []
        statuses = []
        for a in statuses_out.answers:
            if a.status == 200 and isinstance(a.body, dict):
                statuses.append(a.body)
            else:
                problems.append(f"/status {a.describe()}"[:300])
        if not statuses:
            self.problems = problems
            raise ReaderError("no proxy replica answered /status: " + "; ".join(problems))
        scraped: dict[str, dict[str, dict[Series, Buckets]]] = {}
        for a in metrics_out.answers:
            if a.status == 200 and isinstance(a.body, str):
                try:
                    scraped[a.replica.replica_id] = parse_histograms(a.body, (TTFT, ITL))
                except ValueError as e:
                    problems.append(f"/metrics {a.replica.replica_id}: unparsable: {e}"[:300])
            else:
                problems.append(f"/metrics {a.describe()}"[:300])
        units = self.actuator.units()  # ActuatorError: the controller counts it
        now = self.clock()
        self.ttft.update(now, {r: interactive(h[TTFT]) for r, h in scraped.items()})
        self.itl.update(now, {r: h[ITL] for r, h in scraped.items()})
        self.problems = problems
        return Signals(
            now=now,
            classes=merge_classes(statuses),
            units=with_load(units, freshest_loads(statuses)),
            ttft_p99_s=self.ttft.quantile(0.99),
            itl_p99_s=self.itl.quantile(0.99),
            batch_backlog=batch_backlog(statuses),
        )
