"""The exact KV index on ``/metrics``: read at scrape time from the index and its
sinks (nothing is counted twice on the event path), as a collector registered in the
proxy's own registry (``ProxyMetrics.registry``).

- ``proxy_kv_index_mode{unit,mode}``: 1 for the unit's mode (``exact``, ``partial``,
  ``approximate``; ``fleet.py``), every registered unit;
- ``proxy_kv_index_blocks{unit}``: distinct block hashes the index holds for it;
- ``proxy_kv_event_batches_total{unit}``, ``proxy_kv_event_bytes_total{unit}``: what
  its stream delivered in order (``KvIndexSink``);
- ``proxy_kv_event_decode_errors_total{unit,reason}``: batches skipped (``oversize``,
  ``bad_seq``, ``malformed``);
- ``proxy_kv_index_resets_total{unit}``: its index dropped (a replay the leader could
  not serve, its channel's end), ``proxy_kv_index_gaps_total{unit}``: batches out of
  order at the index (0 behind ``InOrderKvSink``);
- ``proxy_kv_index_skipped_total{unit,reason}``: what the index did not apply
  (``dropped_at_cap``, ``other_tier``, ``unknown_removed``, ``unknown_kind``);
- ``proxy_kv_event_replays_requested_total``, ``proxy_kv_event_duplicates_total``:
  ``InOrderKvSink``'s replays asked for on gaps, and the batches it skipped as
  already applied (replay overlap).

Routing decisions by reason are ``proxy_routing_decisions_total{policy,reason}``
(``metrics.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.routing.kv.fleet import KvMode
from proxy.routing.kv.sink import KvIndexSink
from proxy.upstream.kv_stream import InOrderKvSink


class KvIndexCollector:
    def __init__(
        self, sink: KvIndexSink, order: InOrderKvSink, unit_ids: Callable[[], list[str]]
    ) -> None:
        self._sink = sink
        self._order = order
        self._unit_ids = unit_ids

    def collect(self) -> Iterator[Metric]:
        fleet, sink = self._sink.fleet, self._sink
        mode = GaugeMetricFamily(
            "proxy_kv_index_mode",
            "1 for the unit's KV index mode: exact, partial (hashed exactly, history "
            "incomplete) or approximate (the approximate prefix index)",
            labels=["unit", "mode"],
        )
        blocks = GaugeMetricFamily(
            "proxy_kv_index_blocks",
            "Distinct KV block hashes indexed for the unit",
            labels=["unit"],
        )
        for unit_id in self._unit_ids():
            current = fleet.mode(unit_id)
            for m in KvMode:
                mode.add_metric([unit_id, m.value], float(m is current))
            blocks.add_metric([unit_id], float(fleet.index.size(unit_id)))
        yield mode
        yield blocks
        batches = CounterMetricFamily(
            "proxy_kv_event_batches", "KV event batches delivered in order", labels=["unit"]
        )
        nbytes = CounterMetricFamily(
            "proxy_kv_event_bytes", "KV event payload bytes delivered in order", labels=["unit"]
        )
        errors = CounterMetricFamily(
            "proxy_kv_event_decode_errors",
            "KV event batches that did not decode, skipped",
            labels=["unit", "reason"],
        )
        resets = CounterMetricFamily(
            "proxy_kv_index_resets",
            "Times the unit's KV index was dropped (replay miss, channel end)",
            labels=["unit"],
        )
        gaps = CounterMetricFamily(
            "proxy_kv_index_gaps", "KV event batches out of order at the index", labels=["unit"]
        )
        skipped = CounterMetricFamily(
            "proxy_kv_index_skipped",
            "KV events or hashes the index did not apply, by reason",
            labels=["unit", "reason"],
        )
        for unit_id, c in sink.units.items():
            batches.add_metric([unit_id], c.batches)
            nbytes.add_metric([unit_id], c.bytes)
            resets.add_metric([unit_id], c.resets)
            gaps.add_metric([unit_id], c.gaps)
            for reason, n in c.decode_errors.items():
                errors.add_metric([unit_id, reason], n)
            ic = fleet.index.counters(unit_id)
            for reason, n in (
                ("dropped_at_cap", ic.dropped_at_cap),
                ("other_tier", ic.other_tier),
                ("unknown_removed", ic.unknown_removed),
                ("unknown_kind", ic.unknown_kinds),
            ):
                skipped.add_metric([unit_id, reason], n)
        yield from (batches, nbytes, errors, resets, gaps, skipped)
        replays = CounterMetricFamily(
            "proxy_kv_event_replays_requested", "KV event replays asked of leaders on gaps"
        )
        replays.add_metric([], self._order.replays_asked)
        duplicates = CounterMetricFamily(
            "proxy_kv_event_duplicates", "KV event batches skipped as already applied"
        )
        duplicates.add_metric([], self._order.duplicates_total)
        yield replays
        yield duplicates
