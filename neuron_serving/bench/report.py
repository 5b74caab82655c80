"""`neuron-serving bench report`: bench/REPORT.md, plots and the top README's
"Measured" table from bench/results/*.json.

For every benchmark the latest result is used (by its ``time`` field; a ``-quick``
run and a full run are the same benchmark), decoded through its struct in
``results.py``: a result that lacks a field the report reads (a key renamed in its
writer, say) shows as not decoding, with the field's name, in the targets and its
section, and the command exits 1, instead of leaving rows empty. Each target from the
issues is listed next to the measured value and its spread, marked met / missed / not
measured; then one section per benchmark with its figures, settings, commit and
machine, and matplotlib plots in ``results/plots/``. Results written by other scripts
(``triton_vs_vllm-*.json`` from before ``bench serving``) are ignored. The README's
table (``readme_table.py``) holds the targets of the same results, with each result's
file, date and CPU, so it is as current as the report.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from neuron_serving.bench import results as res
from neuron_serving.bench.common import RESULTS_DIR
from neuron_serving.bench.readme_table import MeasuredRow, rewrite_readme
from neuron_serving.bench.results import (
    AllResult,
    BenchResult,
    CapacityArm,
    CapacityResult,
    ClassesResult,
    CpuResult,
    ExecutorResult,
    FailoverResult,
    FailureCase,
    FailuresResult,
    Loaded,
    LoadResult,
    MaybeSpread,
    Number,
    ProxyLatencies,
    ProxyResult,
    RoutingResult,
    ScalingLevel,
    ScalingResult,
    ServingArm,
    ServingCommon,
    ServingMnResult,
    ServingResult,
    SoakResult,
    Spread,
    StartupResult,
    Undecodable,
    spread_of,
)

REPORT = RESULTS_DIR.parent / "REPORT.md"
README = RESULTS_DIR.parent.parent / "README.md"
FAMILIES = ("executor", "serving", "proxy", "routing", "routing_open", "failover", "scaling",
            "load",
            "serving_mn", "failures", "cpu", "startup", "classes", "capacity",
            "capacity_diurnal", "soak")  # fmt: skip
# A family run by a command other than `bench <family>`.
COMMANDS = {"capacity_diurnal": "capacity --trace diurnal",
            "routing_open": "routing --session-rate 0.8"}  # fmt: skip

# The newest result of each family: decoded, or why not.
Results = dict[str, Loaded[Any] | Undecodable]


def family(name: str) -> str:
    """``serving-quick`` -> ``serving``; ``load-sharded`` -> ``load``;
    ``capacity-diurnal[-quick]`` -> ``capacity_diurnal`` (a trace of its own, reported
    beside the spike's ``capacity``); ``routing-open[-quick]`` -> ``routing_open`` (bench
    routing's open loop, beside its closed loop)."""
    if name.startswith("capacity-diurnal"):
        return "capacity_diurnal"
    if name.startswith("routing-open"):
        return "routing_open"
    base = name.split("-", 1)[0]
    return base


def latest_results(results_dir: Path) -> Results:
    """The newest result of each benchmark family (and ``all``, bench all's wall times),
    decoded through its struct (``results.TYPES``)."""
    newest: dict[str, tuple[str, Path, dict[str, Any]]] = {}
    for path in sorted(results_dir.glob("*.json")):
        raw = res.read_json(path)
        if raw is None or "benchmark" not in raw:
            continue  # not a benchmark's result (other scripts' files)
        fam = family(str(raw["benchmark"]))
        if fam not in res.TYPES:
            continue
        # Which is newest is read before decoding: a result without a ``time`` string
        # sorts first, and fails to decode if it is the only one of its family.
        when = raw.get("time")
        stamp = when if isinstance(when, str) else ""
        if fam not in newest or stamp >= newest[fam][0]:
            newest[fam] = (stamp, path, raw)
    return {fam: res.decode(path.name, raw, fam) for fam, (_, path, raw) in newest.items()}


# ---- formatting ----------------------------------------------------------------------


def num(x: object, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def spread_text(s: Spread | None, digits: int = 2, unit: str = "") -> str:
    """``median unit (min..max, n=N)``: the spread over repeats."""
    if s is None:
        return "n/a"
    med = f"{num(s.median, digits)}{unit}"
    if s.n <= 1:
        return f"{med} (n=1)"
    return f"{med} ({num(s.min, digits)}..{num(s.max, digits)}, n={s.n})"


def _raw_spread(v: object) -> Spread | None:
    """A spread found in a result's raw JSON (the generic tables): checked as one."""
    return None if v is None else msgspec.convert(v, MaybeSpread).value


@dataclass
class Target:
    benchmark: str
    target: str
    measured: str
    met: bool | None  # None: not measured, or no target to compare with
    status: str = ""  # overrides the met/missed/not measured mark
    straddles: bool = False  # the spread over repeats has values on both sides of the target

    def mark(self) -> str:
        mark = self.status or {True: "met", False: "**missed**", None: "not measured"}[self.met]
        return mark + (" (spread straddles the target)" if self.straddles else "")


def straddles(s: Spread | None, limit: float) -> bool:
    """min and max of a spread on both sides of ``limit``: the verdict is noise-bound."""
    return s is not None and s.n > 1 and s.min < limit < s.max


def _info(benchmark: str, target: str, measured: str) -> Target:
    return Target(benchmark, target, measured, None, status="information, no target")


# ---- targets -------------------------------------------------------------------------


def _executor_targets(r: ExecutorResult) -> list[Target]:
    t, pair = r.target_ratio, r.ratio_per_pair
    out = [Target("executor", f"unit / MultiprocExecutor output tok/s >= {t}",
                  _with_pairs(r.ratio, pair), r.ratio >= t, straddles=straddles(pair, t))]  # fmt: skip
    for v, per, label in ((r.ratio_vs_mn, r.ratio_vs_mn_per_pair, "unit"),
                          (r.gloo_ratio_vs_mn, spread_of(r.gloo_ratio_vs_mn_per_pair),
                           "unit on Gloo")):  # fmt: skip
        if v is not None:  # results from before the multi-node arm have neither
            out.append(_info("executor", f"information: {label} / vLLM multi-node "
                             "(--nnodes 2) output tok/s", _with_pairs(v, per)))  # fmt: skip
    return out


def _with_pairs(v: Number | None, per: Spread | None, word: str = "per pair") -> str:
    return num(v) + (f" ({word} {num(per.min)}..{num(per.max)}, n={per.n})"
                     if per is not None else "")  # fmt: skip


def _serving_targets(r: ServingResult) -> list[Target]:
    """The target ratios (on ``ratio_arm``), then the gRPC arm's ratios for information
    (no status) when that arm ran."""
    tp, tt = r.targets.throughput_ratio, r.targets.ttft_p50_ratio
    # The peer's settings, said where it is compared: both sides run vLLM's default CPU
    # binding ("auto": the engine on core 0, core 1 kept for the front end), so this is
    # the untuned baseline; bench vs-vllm has vLLM tuned by hand.
    via = {"triton_http": " (HTTP/SSE both", "triton": " (Triton over gRPC"}.get(r.ratio_arm, " (")
    via += "; vLLM's auto CPU binding both: untuned)"
    tput, ttft = r.throughput_ratio, r.ttft_p50_ratio
    out = [
        Target("serving", f"Triton leader / vllm serve{via} output tok/s >= {tp}",
               _with_pairs(tput, r.throughput_ratio_per_repeat, "per repeat"), tput >= tp,
               straddles=straddles(r.throughput_ratio_per_repeat, tp)),
        Target("serving", f"Triton leader / vllm serve{via} TTFT p50 <= {tt}",
               _with_pairs(ttft, r.ttft_p50_ratio_per_repeat, "per repeat"), ttft <= tt,
               straddles=straddles(r.ttft_p50_ratio_per_repeat, tt)),
    ]  # fmt: skip
    for label, v, per in (("output tok/s", r.grpc_throughput_ratio,
                           r.grpc_throughput_ratio_per_repeat),
                          ("TTFT p50", r.grpc_ttft_p50_ratio, r.grpc_ttft_p50_ratio_per_repeat)):  # fmt: skip
        if v is not None:
            out.append(_info("serving", "information: Triton over gRPC (tritonclient aio) / "
                             f"vllm serve {label}", _with_pairs(v, per, "per repeat")))  # fmt: skip
    return out


def _serving_mn_targets(r: ServingMnResult) -> list[Target]:
    return [_info("serving_mn", f"information: TP=2 unit behind Triton / vllm serve "
                  f"--nnodes 2 (rank i on core i, both), {label}",
                  _with_pairs(v, per, "per repeat"))
            for label, v, per in (("output tok/s", r.throughput_ratio, r.throughput_ratio_per_repeat),
                                  ("TTFT p50", r.ttft_p50_ratio, r.ttft_p50_ratio_per_repeat))]  # fmt: skip


def _proxy_targets(r: ProxyResult) -> list[Target]:
    streams, g = r.workload.streams, r.grpc_upstream
    out = []
    for q, added, hop, limit in (
        ("p50", r.added_ttft_p50_ms, r.proxy_hop_ttft_p50_ms, r.targets.added_ttft_p50_ms),
        ("p99", r.added_ttft_p99_ms, r.proxy_hop_ttft_p99_ms, r.targets.added_ttft_p99_ms),
    ):
        out.append(Target("proxy", f"added TTFT {q} <= {num(limit, 0)} ms at {streams} streams",
                          spread_text(added, 1, " ms"), added.median <= limit,
                          straddles=straddles(added, limit)))  # fmt: skip
        # The proxy's own account of its hop (informational next to the A/B).
        out.append(Target("proxy", f"proxy's own hop (its histogram) {q} <= "
                          f"{num(limit, 0)} ms at {streams} streams",
                          spread_text(hop, 2, " ms"), hop.median <= limit,
                          straddles=straddles(hop, limit)))  # fmt: skip
    # The second proxy arm: the channel off, over Triton's gRPC front end.
    for q, added, hop in (("p50", g.added_ttft_p50_ms, g.proxy_hop_ttft_p50_ms),
                          ("p99", g.added_ttft_p99_ms, g.proxy_hop_ttft_p99_ms)):  # fmt: skip
        for s, what in ((added, "added TTFT"), (hop, "proxy's own hop")):
            out.append(_info("proxy", f"information: Triton gRPC upstream, {what} {q} at "
                             f"{streams} streams", spread_text(s, 2, " ms")))  # fmt: skip
    tp = r.throughput
    out.append(Target("proxy", f"throughput through the proxy / direct at {tp.streams} "
                      f"streams >= {tp.target}", _with_pairs(tp.ratio, tp.ratio_per_repeat,
                                                            "per repeat"),
                      tp.ratio >= tp.target, straddles=straddles(tp.ratio_per_repeat, tp.target)))  # fmt: skip
    oa = tp.openai_ratio_per_repeat
    out.append(_info("proxy", "information: OpenAI /v1/completions through the proxy "
                     "/ direct generate_stream", _with_pairs(oa.median, oa, "per repeat")))  # fmt: skip
    return out


def _cpu_targets(r: CpuResult) -> list[Target]:
    """bench cpu: the proxy's CPU per output token against vLLM's API server's, and per
    request."""
    c = r.proxy_vs_vllm_api_server
    tg = c.targets
    return [
        Target("cpu", f"proxy CPU per output token / vLLM API server's <= {tg.per_token_ratio}",
               f"{num(c.per_token_ratio)} ({num(c.proxy_us_per_token, 0)} vs "
               f"{num(c.api_server_us_per_token, 0)} us)",
               c.per_token_ratio <= tg.per_token_ratio),
        Target("cpu", f"proxy CPU per request <= {num(tg.proxy_us_per_request, 0)} us",
               f"{num(c.proxy_us_per_request, 0)} us (vLLM API server "
               f"{num(c.api_server_us_per_request, 0)} us)"
               + (f"; net of idle CPU, raw {num(c.proxy_us_per_request_raw, 0)} us"
                  if c.proxy_us_per_request_raw else ""),
               c.proxy_us_per_request <= tg.proxy_us_per_request),
        *(_info("cpu", f"information: {what}, proxy CPU per output token and per request",
                f"{num(x.proxy_us_per_token, 0)} us/token (ratio {num(x.per_token_ratio)}), "
                f"{num(x.proxy_us_per_request, 0)} us/request")
          for x, what in ((c.channel_asyncio, "the channel on asyncio's loop"),
                          (c.grpc_upstream, "Triton gRPC upstream (channel off)"))),
    ]  # fmt: skip


def _routing_targets(r: RoutingResult) -> list[Target]:
    """bench routing: the exact (KV-event-fed) index against the approximate one under
    cache pressure, and 2 proxy replicas against 1 (ratios within each repeat)."""
    ra = r.ratios
    hit, p90 = ra.hit_rate_exact_over_approximate.value, ra.ttft_p90_exact_over_approximate.value
    pp = ra.hit_rate_pp_2_replicas_vs_1.value
    exact = r.arms.get("exact")
    acc = None if exact is None else exact.prediction_accuracy.value

    # Beside the verdicts, not in them: the reference placement that knows the plan
    # (every tenant on one unit), against the approximate index and the exact one.
    # Results from before the reference arms have none of these.
    def context(*pairs: tuple[str, MaybeSpread | None]) -> str:
        spreads = ((name, spread_of(x)) for name, x in pairs)
        return "".join(f"; {name}: {spread_text(s)}" for name, s in spreads if s is not None)

    hit_ref = context(
        ("tenant partition / approximate", ra.hit_rate_partition_over_approximate),
        ("exact / tenant partition", ra.hit_rate_exact_over_partition),
        # The most any routing reaches against the approximate index (reuse_ceiling).
        ("ceiling / approximate", ra.hit_rate_ceiling_over_approximate),
    )
    p90_ref = context(
        ("tenant partition / approximate", ra.ttft_p90_partition_over_approximate),
        ("exact again / exact", ra.ttft_p90_exact_again_over_exact),
    )
    again = spread_of(ra.hit_rate_pp_exact_again_vs_exact)
    pp_ref = f" (exact run twice: {spread_text(again, 1, ' points')})" if again else ""
    return [
        Target("routing", "exact KV index hit rate / approximate index's >= 1.2",
               spread_text(hit) + (f" ({hit_ref[2:]})" if hit_ref else ""),
               None if hit is None else hit.median >= 1.2, straddles=straddles(hit, 1.2)),
        Target("routing", "exact KV index TTFT p90 / approximate index's <= 0.7",
               spread_text(p90) + (f" ({p90_ref[2:]})" if p90_ref else ""),
               None if p90 is None else p90.median <= 0.7, straddles=straddles(p90, 0.7)),
        Target("routing", "2 proxy replicas' hit rate within 2 points of 1 replica's",
               spread_text(pp, 1, " points") + pp_ref, None if pp is None else pp.median <= 2.0,
               straddles=straddles(pp, 2.0)),
        Target("routing", "prediction accuracy reported (exact arm)", spread_text(acc, 3),
               None if acc is None else True),
    ]  # fmt: skip


def _routing_open_targets(r: RoutingResult) -> list[Target]:
    """bench routing --session-rate: the same ratios under an open loop, information
    beside the closed loop's verdicts (the issue's workload is the closed loop's)."""
    ra = r.ratios
    ceiling = spread_of(ra.hit_rate_ceiling_over_approximate)
    return [
        _info("routing_open", f"information: exact / approximate index, open loop at "
              f"{num(r.workload.sessions_per_s)} sessions/s",
              f"hit rate {spread_text(ra.hit_rate_exact_over_approximate.value)}; TTFT p90 "
              f"{spread_text(ra.ttft_p90_exact_over_approximate.value)}; tenant partition "
              f"/ approximate TTFT p90 "
              f"{spread_text(spread_of(ra.ttft_p90_partition_over_approximate))}"
              + (f"; hit-rate ceiling / approximate {spread_text(ceiling)}" if ceiling else "")),
    ]  # fmt: skip


def _failover_targets(r: FailoverResult) -> list[Target]:
    out = []
    for f in r.failover or []:  # None: the run ended in an error (the row below says it)
        out.append(Target("failover", f"kill {f.victim} -> unhealthy < 3 s",
                          f"{num(f.kill_to_unhealthy_s)} s", f.kill_to_unhealthy_s < 3.0))  # fmt: skip
        e = f.client_visible_errors
        out.append(Target("failover", f"kill {f.victim}: 0 client errors ({f.streams} streams)",
                          num(e), e == 0))  # fmt: skip
    if not r.failover:
        out.append(Target("failover", "kill a rank -> unhealthy < 3 s, 0 client errors",
                          r.error if r.error is not None else "n/a", None))  # fmt: skip
    # The budget is 12 GB; results record GiB (1 GiB = 1.0737 GB).
    rss = r.peak_rss_gib
    rss_gb = rss * 2**30 / 1e9
    out.append(Target("failover", "peak RSS of the default cluster < 12 GB",
                      f"{num(rss_gb)} GB = {num(rss)} GiB (PSS {num(r.peak_pss_gib)} GiB)",
                      rss_gb < 12.0))  # fmt: skip
    return out


def _load_targets(r: LoadResult, raw: dict[str, Any]) -> list[Target]:
    """The load benchmark (issue 6) is another engineer's: its own ``met``/``targets``
    when a result has them (their keys name figures of the result, whatever they are:
    read from the file as it is), else the ratios sharded / full."""
    targets = r.targets or {}
    out = []
    for key, ok in (r.met or {}).items():
        value = raw.get(key)
        measured = spread_text(_raw_spread(value)) if isinstance(value, dict) else num(value)
        out.append(Target("load", f"{key} {targets.get(key, '')}".strip(), measured,
                          None if ok is None else bool(ok)))  # fmt: skip
    if not out:
        per_rank = ", ".join(
            f"{k}: {num(v)}" for k, v in r.read_bytes_ratio_sharded_over_full.items()
        )
        ratios = [f"load_model_ratio {num(r.load_model_ratio_sharded_over_full)}",
                  f"read_bytes_ratio {per_rank}",
                  f"ready_ratio {num(r.ready_ratio_sharded_over_full)}"]  # fmt: skip
        out.append(Target("load", "sharded vs full checkpoint (ratios sharded / full)",
                          "; ".join(ratios), None, status="no numeric target recorded"))  # fmt: skip
    return out


def _compact(v: Any) -> str:
    """A number, a spread's median, or a small dict of numbers, in one short string (of
    a raw JSON value: the generic tables)."""
    if isinstance(v, dict) and "median" in v:
        return spread_text(_raw_spread(v))
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_compact(x)}" for k, x in v.items())
    return num(v)


# A failed rank must take its unit out of rotation, or end the unit, within 5 s.
FAILURE_LIMIT_S = 5.0


def _failures_targets(r: FailuresResult) -> list[Target]:
    """bench failures, our unit's cases: how soon the leader's readiness turned (a
    follower killed or frozen), how soon the follower exited (the leader killed)."""
    out = []
    for c in r.cases:
        if c.system != "unit":
            continue
        follower = c.victim == "rank1"
        what = (f"follower {c.signal} -> unit out of rotation (readiness)" if follower
                else f"leader {c.signal} -> follower exits non-zero")  # fmt: skip
        target = f"{what} <= {num(FAILURE_LIMIT_S, 0)} s"
        if c.error is not None or c.exit_s is None or c.health is None:
            out.append(Target("failures", target, _case_error(c), None))
            continue
        if follower:
            t = next((at for state, at in c.health if state != "200"), None)
            leader = c.exit_s.get("rank0")
            measured = f"{num(t)} s" + (f" (leader exits {leader.rc} after {leader.s} s)"
                                        if leader else "")  # fmt: skip
            ok = None if t is None else t <= FAILURE_LIMIT_S
        else:
            f = c.exit_s.get("rank1")
            measured = "did not exit" if f is None else f"exit {f.rc} after {f.s} s"
            ok = f is not None and f.rc != 0 and f.s <= FAILURE_LIMIT_S
        out.append(Target("failures", target, measured, ok))
    return out


def _case_error(c: FailureCase) -> str:
    """The first line of a case's error (a case without one has all its figures)."""
    return "error: " + str(c.error).splitlines()[0]


def _startup_targets(r: StartupResult) -> list[Target]:
    """bench startup: the default cluster's ready time against `vllm serve`'s, and a
    recreated unit's time to routable after its leader's SIGKILL."""
    ratio, recreated = r.ratio_cluster_to_vllm, r.recreated_unit_routable_s
    limit, bound = r.targets.ratio_cluster_to_vllm, r.targets.recreated_unit_routable_s
    return [
        Target("startup", f"default cluster ready / vllm serve ready (same engine flags, vLLM's "
               f"auto CPU binding) <= {num(limit)}",
               f"{spread_text(ratio)} ({num(r.cluster_ready_s.median, 1)} vs "
               f"{num(r.vllm_serve_ready_s.median, 1)} s)",
               ratio.median <= limit, straddles=straddles(ratio, limit)),
        Target("startup", f"unit recreated after a leader SIGKILL routable <= {num(bound, 0)} s",
               spread_text(recreated, 1, " s"), recreated.median <= bound,
               straddles=straddles(recreated, bound)),
    ]  # fmt: skip


def _classes_targets(r: ClassesResult) -> list[Target]:
    """bench classes: real-time beside a batch backlog through the traffic classes."""
    b, c = r.rt_ttft_p99_ratio_b_over_a, r.rt_ttft_p99_ratio_c_over_a
    share, rejected = r.batch_share_of_idle_capacity_b, r.rt_rejected_by_flow_control
    errors = r.rt_client_errors_b
    if b is None or c is None or share is None or rejected is None or errors is None:
        # Only a run that ended in an error lacks them (ClassesResult.__post_init__).
        return [Target("classes", t, f"error: {r.error}", None) for t in NOT_MEASURED["classes"]]
    # Beside the verdict, not in it: the host's sensitivity (idle-priority spinners that
    # do no serving work) and the same arm measured twice (the ratio's own spread);
    # results from before those arms have neither.
    floor, again = r.rt_ttft_p99_ratio_f_over_a, r.rt_ttft_p99_ratio_a2_over_a
    context = "".join(
        f"; {name}: {spread_text(x)}"
        for name, x in (("SCHED_IDLE spinners", floor), ("alone again", again))
        if x is not None
    )
    return [
        Target("classes", "real-time TTFT p99 with batch (classes) / alone <= 1.1",
               f"{spread_text(b)} (first come first served: {spread_text(c)}{context})",
               b.median <= 1.1, straddles=straddles(b, 1.1)),
        Target("classes", "batch tokens/s >= 0.8 of the capacity real-time leaves",
               spread_text(share), share.median >= 0.8, straddles=straddles(share, 0.8)),
        Target("classes", "no real-time request shed or refused while batch waits",
               f"{rejected}, client errors {errors}",
               not any(rejected.values()) and not errors),
    ]  # fmt: skip


SOAK_ZERO = {
    "lost": "requests lost (no answer, no error)",
    "duplicated_engine_work_total": "engine requests beyond the proxies' attempts",
    "false_ejections": "units ejected / nodes unhealthy with no kill or stop on them",
    "error_5xx": "5xx other than a fault's retriable ones",
    "error_4xx": "4xx the requests did not ask for",
    "batch_lines_failed": "batch lines failed",
    "batch_lines_unfinished": "batch lines unfinished",
    "rollouts_failed": "checkpoint rollouts failed or not run",
}


def _soak_targets(r: SoakResult) -> list[Target]:
    """bench soak: every count that must be 0, for the run as a whole."""
    length = f"{num(r.duration_s / 60, 0)}-min soak"
    if r.zero_counts is None:  # the run ended in an error (SoakResult.__post_init__)
        return [Target("soak", f"{length}: all counts 0", "error: " + str(r.error), None)]
    counts = msgspec.structs.asdict(r.zero_counts)
    return [Target("soak", f"{length}: {what} = 0", _compact(counts[key]), not counts[key])
            for key, what in SOAK_ZERO.items()]  # fmt: skip


def _soak_section(r: SoakResult) -> list[str]:
    """The counts, each kind of request's outcomes, the faults and rollouts as applied,
    the processes that grew most, and the latency plot."""
    zero, kinds, faults, rollouts, growth = r.zero_counts, r.by_kind, r.faults, r.rollouts, r.growth
    if zero is None or kinds is None or faults is None or rollouts is None or growth is None:
        # Only a run that ended in an error lacks them (SoakResult.__post_init__).
        out = [f"The run ended in an error: {r.error}"]
    else:
        counts = msgspec.structs.asdict(zero)
        out = _table(["count (must be 0)", "value"],
                     [[SOAK_ZERO[k], _compact(v)] for k, v in sorted(counts.items())])  # fmt: skip
        statuses = sorted({s for v in kinds.values() for s in v})
        out += ["", *_table(["kind", *statuses],
                            [[k, *(str(v.get(s, 0)) for s in statuses)] for k, v in kinds.items()])]  # fmt: skip
        events = [[num(f.at_s, 0), f.what, f.error or ""] for f in faults]
        events += [[num(d.at_s, 0), f"rollout to {d.version} ({d.s} s)",
                    "" if d.rc == 0 else f"rc {d.rc}"] for d in rollouts]  # fmt: skip
        out += [
            "",
            *_table(
                ["at (s)", "fault or rollout", "error"], sorted(events, key=lambda e: float(e[0]))
            ),
        ]
        grew = sorted(growth, key=lambda g: g.rss_mb[-1] - g.rss_mb[0], reverse=True)
        out += ["", *_table(["process", "RSS MB first -> last", "open files first -> last"],
                            [[f"{g.owner} {g.name}", " -> ".join(map(str, g.rss_mb)),
                              " -> ".join(map(str, g.fds))] for g in grew[:5]])]  # fmt: skip
    if r.plot:
        # Written beside the result (bench/results/), the report one level up.
        out += ["", f"![TTFT and ITL over the soak]({RESULTS_DIR.name}/{Path(r.plot).name})"]
    return out


def _pct(x: Number | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _capacity_targets(r: CapacityResult, fam: str = "capacity") -> list[Target]:
    """bench capacity: the autoscaled fleet against the peak-sized one on a compressed
    trace (``fam``: capacity, the spike; capacity_diurnal, the diurnal day); the
    minimum-sized one beside them; the simulator's prediction."""
    a, b, c = (r.arms.get(k) for k in ("autoscaled", "fixed_peak", "fixed_min"))

    def att(x: CapacityArm | None) -> str:
        return _pct(None if x is None else x.slo_attainment)

    def unit_s(x: CapacityArm | None) -> str:
        return num(None if x is None else x.unit_seconds, 0)

    slo = num(r.slo_ttft_s, 1)
    pts, saving = r.slo_points_autoscaled_minus_peak, r.unit_seconds_saving_vs_peak
    failed_in, scale_ins = r.failed_during_scale_in, r.scale_ins
    out = [
        Target(fam, f"autoscaled SLO attainment (TTFT <= {slo} s) within 5 points of "
               "the peak-sized fleet",
               f"{att(a)} vs {att(b)} ({num(pts, 1)} points); minimum-sized {att(c)}",
               None if pts is None else pts >= -5.0),
        Target(fam, "autoscaled unit-seconds >= 30% fewer than the peak-sized fleet",
               f"{_pct(saving)} fewer ({unit_s(a)} vs {unit_s(b)}; minimum-sized {unit_s(c)})",
               None if saving is None else saving >= 0.30),
    ]  # fmt: skip
    if failed_in is not None and not scale_ins:
        out.append(Target(fam, "no failed request during scale-in",
                          f"{failed_in} (no scale-in happened in the run)", None,
                          status="not measured (no scale-in)"))  # fmt: skip
    else:
        out.append(Target(fam, "no failed request during scale-in",
                          f"{num(failed_in)} over {num(scale_ins)} scale-in(s)",
                          None if failed_in is None else failed_in == 0))  # fmt: skip
    sim = None if r.simulator is None else r.simulator.vs_measured.get("autoscaled")
    if sim:
        p99, mean = sim.ttft_p99_s, sim.units_mean
        out.append(_info(fam, "information: simulator vs measured, autoscaled fleet",
                         f"TTFT p99 {num(p99.predicted)} vs {num(p99.measured)} s, "
                         f"units mean {num(mean.predicted)} vs {num(mean.measured)}; "
                         f"within tolerance: {num(sim.within_tolerance)}"))  # fmt: skip
    return out


# Each family's target rows, from its decoded result (load's also from the file as read).
TARGETS: dict[str, Callable[[Loaded[Any]], list[Target]]] = {
    "executor": lambda lr: _executor_targets(lr.result),
    "serving": lambda lr: _serving_targets(lr.result),
    "proxy": lambda lr: _proxy_targets(lr.result),
    "routing": lambda lr: _routing_targets(lr.result),
    "routing_open": lambda lr: _routing_open_targets(lr.result),
    "failover": lambda lr: _failover_targets(lr.result),
    "load": lambda lr: _load_targets(lr.result, lr.raw),
    "serving_mn": lambda lr: _serving_mn_targets(lr.result),
    "cpu": lambda lr: _cpu_targets(lr.result),
    "failures": lambda lr: _failures_targets(lr.result),
    "startup": lambda lr: _startup_targets(lr.result),
    "classes": lambda lr: _classes_targets(lr.result),
    "capacity": lambda lr: _capacity_targets(lr.result),
    "capacity_diurnal": lambda lr: _capacity_targets(lr.result, "capacity_diurnal"),
    "soak": lambda lr: _soak_targets(lr.result),
}
_CAPACITY_NOT_MEASURED = [
    "autoscaled SLO attainment within 5 points of the peak-sized fleet, >= 30% fewer "
    "unit-seconds, no failed request during scale-in"
]
NOT_MEASURED = {
    "capacity": _CAPACITY_NOT_MEASURED,
    "capacity_diurnal": _CAPACITY_NOT_MEASURED,
    "classes": ["real-time TTFT p99 with batch within 1.1x; batch >= 0.8 of idle capacity"],
    "startup": ["default cluster ready within 1.5x of vllm serve; recreated unit <= 30 s"],
    "executor": ["unit / MultiprocExecutor output tok/s >= 0.9"],
    "serving": ["Triton leader / vllm serve output tok/s >= 0.9", "TTFT p50 within 1.2x"],
    "proxy": ["added TTFT p50 <= 1 ms, p99 <= 5 ms at 64 streams"],
    "routing": ["exact KV index: hit rate >= 1.2x, TTFT p90 <= 0.7x the approximate index"],
    "routing_open": ["information: bench routing's ratios under an open loop"],
    "failover": ["follower kill -> unhealthy < 3 s, 0 client errors, peak RSS < 12 GB"],
    "load": ["sharded vs full checkpoint load (bench load)"],
    "serving_mn": ["information: TP=2 unit behind Triton / vllm serve --nnodes 2"],
    "failures": ["a follower killed or frozen, or the leader killed: noticed <= 5 s"],
    "soak": ["30-min soak under faults: nothing lost, run twice, failed or falsely ejected"],
    "cpu": [
        "proxy CPU per output token / vLLM API server's <= 0.5",
        "proxy CPU per request <= 500 us",
    ],
}
UNDECODABLE = "**result does not decode**"


def targets(results: Results) -> list[Target]:
    out: list[Target] = []
    for fam, fn in TARGETS.items():
        lr = results.get(fam)
        if lr is None:
            out += [Target(fam, t, "no result", None) for t in NOT_MEASURED[fam]]
        elif isinstance(lr, Undecodable):
            out += [Target(fam, t, f"{lr.file}: {lr.error}", None, status=UNDECODABLE)
                    for t in NOT_MEASURED[fam]]  # fmt: skip
        else:
            out += fn(lr)
    return out


# ---- plots ---------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _err(s: Spread) -> list[float]:
    return [s.median - s.min, s.max - s.median]


def _bars(path: Path, title: str, ylabel: str, groups: list[str],
          series: dict[str, list[Spread]]) -> Path:  # fmt: skip
    """Grouped bars (median) with min..max error bars."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(groups) + 2), 3.6))
    width = 0.8 / max(1, len(series))
    for i, (label, spreads) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        meds = [s.median for s in spreads]
        errs = list(zip(*(_err(s) for s in spreads), strict=True))
        ax.bar(xs, meds, width, label=label, yerr=errs, capsize=3)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _serving_arms(r: ServingCommon) -> dict[str, ServingArm]:
    """Arms in a fixed order: the two compared, then the informational ones."""
    arms = r.arms
    first = (r.ratio_arm, "vllm")
    order = [a for a in first if a in arms] + sorted(set(arms) - set(first))
    return {a: arms[a] for a in order}


def _serving_figures(a: ServingArm) -> dict[str, Spread]:
    """An arm's latency and throughput figures by name, in the report's order."""
    return {"output_tok_s": a.output_tok_s,
            "ttft_p50_ms": a.ttft_p50_ms, "ttft_p99_ms": a.ttft_p99_ms,
            "tpot_p50_ms": a.tpot_p50_ms, "tpot_p99_ms": a.tpot_p99_ms,
            "itl_p50_ms": a.itl_p50_ms, "itl_p99_ms": a.itl_p99_ms,
            "e2el_p50_ms": a.e2el_p50_ms, "e2el_p99_ms": a.e2el_p99_ms}  # fmt: skip


def plot_serving(r: ServingCommon, plots: Path) -> list[Path]:
    arms = {a: _serving_figures(arm) for a, arm in _serving_arms(r).items()}
    names = list(arms)
    out = [_bars(plots / "serving_throughput.png", "Output tok/s (median, min..max over repeats)",
                 "tok/s", names, {"output tok/s": [arms[a]["output_tok_s"] for a in names]})]  # fmt: skip
    groups = [f"{m.upper()} {q}" for m in ("ttft", "tpot", "itl", "e2el") for q in ("p50", "p99")]
    series = {a: [arms[a][f"{m}_{q}_ms"] for m in ("ttft", "tpot", "itl", "e2el")
                  for q in ("p50", "p99")] for a in names}  # fmt: skip
    out.append(_bars(plots / "serving_latency.png", "Latency (ms, median over repeats)", "ms",
                     groups, series))  # fmt: skip
    return out


def plot_scaling(r: ScalingResult, plots: Path) -> list[Path]:
    plt = _plt()
    rows = r.levels
    cs = [row.concurrency for row in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))

    def line(ax: Any, figure: Callable[[ScalingLevel], Spread], label: str) -> None:
        meds = [figure(row).median for row in rows]
        errs = list(zip(*(_err(figure(row)) for row in rows), strict=True))
        ax.errorbar(cs, meds, yerr=errs, marker="o", capsize=3, label=label)

    line(a1, lambda row: row.output_tok_s, "output tok/s")
    a1.set_ylabel("output tok/s")
    line(a2, lambda row: row.ttft_p50_ms, "TTFT p50")
    line(a2, lambda row: row.ttft_p99_ms, "TTFT p99")
    a2.set_ylabel("ms")
    a2.legend()
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent streams")
    fig.suptitle("Triton leader (TP=1) vs concurrency")
    fig.tight_layout()
    path = plots / "scaling.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def plot_executor(r: ExecutorResult, plots: Path) -> list[Path]:
    return [_bars(plots / "executor.png", "TP=2 output tok/s (median, min..max)", "tok/s",
                  ["unit executor", "MultiprocExecutor"],
                  {"tok/s": [r.unit_tok_s_spread, r.mp_tok_s_spread]})]  # fmt: skip


def _latencies(a: ProxyLatencies) -> list[Spread]:
    return [a.ttft_p50_ms, a.ttft_p99_ms, a.itl_p50_ms, a.itl_p99_ms]


def plot_proxy(r: ProxyResult, plots: Path) -> list[Path]:
    return [_bars(plots / "proxy.png", "Direct vs through the proxy (ms, median, min..max)", "ms",
                  ["TTFT P50", "TTFT P99", "ITL P50", "ITL P99"],
                  {"direct": _latencies(r.arms.direct), "proxy": _latencies(r.arms.proxy)})]  # fmt: skip


def _median_or_0(s: MaybeSpread) -> Number:
    """A bar's height: an arm without the figure (``{}``) draws none."""
    v = s.value
    return 0 if v is None else v.median


def plot_routing(r: RoutingResult, plots: Path) -> list[Path]:
    plt = _plt()
    arms = r.arms
    names = list(arms)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    a1.bar(names, [_median_or_0(arms[n].hit_rate) for n in names])
    a1.set_title("prefix-cache hit rate (vLLM's counters)")
    for label, off, figure in (("p50", -0.2, lambda a: a.ttft_p50_ms),
                               ("p90", 0.2, lambda a: a.ttft_p90_ms)):  # fmt: skip
        a2.bar([i + off for i in range(len(names))],
               [_median_or_0(figure(arms[n])) for n in names], width=0.4, label=label)  # fmt: skip
    a2.set_xticks(range(len(names)), names)
    a2.legend()
    a2.set_title("TTFT ms")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    path = plots / "routing.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


PLOTS: dict[str, Callable[[Any, Path], list[Path]]] = {
    "executor": plot_executor,
    "serving": plot_serving,
    "proxy": plot_proxy,
    "routing": plot_routing,
    "scaling": plot_scaling,
}


# ---- sections ------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]  # fmt: skip


def _meta(lr: Loaded[Any]) -> list[str]:
    r: BenchResult = lr.result
    m = r.machine
    lines = [f"- result `{lr.file}`, {r.time}, commit `{r.commit}`",
             f"- machine: {m.cpus} CPUs ({m.cpu_model if m.cpu_model is not None else '?'}; "
             f"{' '.join(m.cpu_flags or []) or 'ISA flags not recorded'}), "
             f"{m.memory_gib} GiB, {m.platform}"]  # fmt: skip
    if r.machine_load is not None:
        ml = r.machine_load
        lines.append(f"- load average (1 min) at start {num(ml.load_avg_1m_start)}, "
                     f"at end {num(ml.load_avg_1m_end)}")  # fmt: skip
    # The settings as the run recorded them, whatever they hold: echoed, not read.
    raw = lr.raw
    settings = (raw.get("workload") or raw.get("settings")
                or {k: raw[k] for k in ("command", "quick") if k in raw})  # fmt: skip
    if settings:
        lines.append(f"- settings: `{json.dumps(settings, sort_keys=True)}`")
    return lines


def _serving_section(r: ServingCommon) -> list[str]:
    arms = _serving_arms(r)
    figures = {a: _serving_figures(arm) for a, arm in arms.items()}
    keys = list(figures[next(iter(figures))]) if figures else []
    rows = [[k] + [spread_text(figures[a][k], 1) for a in arms] for k in keys]
    # The load driver's CPU: {} in every arm when the runs did not measure it.
    cpu = {a: arm.client_cpu_us_per_token.value for a, arm in arms.items()}
    if any(s is not None for s in cpu.values()):
        rows.append(["client_cpu_us_per_token", *(spread_text(s, 1) for s in cpu.values())])
    if r.benchmark.startswith("serving_mn"):
        how = ("`triton_http`: our TP=2 unit (leader behind Triton, one follower), Triton's "
               "HTTP generate_stream; `vllm`: `vllm serve --nnodes 2` (node 1 headless), "
               "/v1/completions. Each repeat starts each system afresh; the ratio is ours "
               "over theirs.")  # fmt: skip
    elif r.ratio_arm == "triton_http":
        how = ("The target ratios compare `triton_http` (the leader's HTTP generate_stream, SSE) "
               "with `vllm` (OpenAI /v1/completions, SSE): same transport, aiohttp clients of "
               "about the same CPU per token (`client_cpu_us_per_token`: the load driver's own "
               "CPU, which shares the machine's cores with the servers). `triton` is the same "
               "leader over gRPC with tritonclient's aio client (the proxy's path), for "
               "information.")  # fmt: skip
    else:
        how = (
            "The ratios compare the `triton` arm (gRPC streaming, the proxy's path) with "
            "`vllm`; `triton_http` is the leader's HTTP generate_stream, for information."
        )
    return [
        *_table(["figure", *arms], rows),
        "",
        "ITL: time between consecutive streamed chunks of one request (vLLM's definition). " + how,
    ]


def _scaling_section(r: ScalingResult) -> list[str]:
    keys = ["output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms",
            "e2el_p50_ms"]  # fmt: skip
    rows = [[str(lv.concurrency)] + [spread_text(s, 1) for s in (
                lv.output_tok_s, lv.ttft_p50_ms, lv.ttft_p99_ms, lv.tpot_p50_ms, lv.itl_p50_ms,
                lv.e2el_p50_ms)]
            for lv in r.levels]  # fmt: skip
    return _table(["streams", *keys], rows)


def _executor_section(r: ExecutorResult) -> list[str]:
    return _table(["figure", "value"], [
        ["unit executor tok/s", spread_text(r.unit_tok_s_spread, 0)],
        ["MultiprocExecutor tok/s", spread_text(r.mp_tok_s_spread, 0)],
        ["ratio (median/median)", num(r.ratio)],
        # Results from before the multi-node arm have none of it.
        *([["vLLM multi-node (--nnodes 2) tok/s", spread_text(r.mn_tok_s_spread, 0)],
           ["unit / multi-node", _with_pairs(r.ratio_vs_mn, r.ratio_vs_mn_per_pair)],
           ["unit on Gloo / multi-node (like for like: no shared-memory all-reduce)",
            _with_pairs(r.gloo_ratio_vs_mn, spread_of(r.gloo_ratio_vs_mn_per_pair))]]
          if r.mn_tok_s_spread is not None else []),
        ["control broadcast p50 / p99", f"{num(r.control_p50_us, 0)} / {num(r.control_p99_us, 0)} us"],
        ["bytes per broadcast (payload / wire)", f"{num(r.payload_bytes_per_msg, 0)} / {num(r.wire_bytes_per_msg, 0)}"],
    ])  # fmt: skip


def _proxy_section(r: ProxyResult) -> list[str]:
    d, p = r.arms.direct, r.arms.proxy
    rows = [[k, spread_text(direct, 1), spread_text(proxy, 1), spread_text(added, 2)]
            for k, direct, proxy, added in (
                ("ttft_p50_ms", d.ttft_p50_ms, p.ttft_p50_ms, r.added_ttft_p50_ms),
                ("ttft_p99_ms", d.ttft_p99_ms, p.ttft_p99_ms, r.added_ttft_p99_ms),
                ("itl_p50_ms", d.itl_p50_ms, p.itl_p50_ms, r.added_itl_p50_ms),
                ("itl_p99_ms", d.itl_p99_ms, p.itl_p99_ms, r.added_itl_p99_ms))]  # fmt: skip
    seq, g = r.sequential, r.grpc_upstream
    hop = (f" The proxy's own account of its hop (TTFT at the proxy minus the unit's, "
           f"from its `proxy_added_time_to_first_token_seconds` histogram): p50 "
           f"{spread_text(r.proxy_hop_ttft_p50_ms, 2)} ms, p99 "
           f"{spread_text(r.proxy_hop_ttft_p99_ms, 2)} ms at 64 streams; "
           f"{num(seq.proxy.hop_p50_ms, 2)} / {num(seq.proxy.hop_p99_ms, 2)} ms "
           f"one stream at a time.")  # fmt: skip
    lines = [*_table(["figure", "direct", "proxy", "added"], rows), "",
             f"One stream at a time: added TTFT p50 {num(seq.added_ttft_p50_ms)} ms, "
             f"p99 {num(seq.added_ttft_p99_ms)} ms.{hop}"]  # fmt: skip
    upstream = [[k, spread_text(ours, 2), spread_text(grpc, 2)] for k, ours, grpc in (
        ("added ttft p50 ms", r.added_ttft_p50_ms, g.added_ttft_p50_ms),
        ("added ttft p99 ms", r.added_ttft_p99_ms, g.added_ttft_p99_ms),
        ("proxy hop ttft p50 ms", r.proxy_hop_ttft_p50_ms, g.proxy_hop_ttft_p50_ms),
        ("proxy hop ttft p99 ms", r.proxy_hop_ttft_p99_ms, g.proxy_hop_ttft_p99_ms),
        ("proxy cpu us per token", r.proxy_cpu_us_per_token, g.proxy_cpu_us_per_token))]  # fmt: skip
    upstream.append(["one stream at a time: added TTFT p50 ms", num(seq.added_ttft_p50_ms, 2),
                     num(g.sequential_added_ttft_p50_ms, 2)])  # fmt: skip
    lines += ["", "By upstream transport:", "",
              *_table(["figure", "the channel (default)", "Triton gRPC upstream"], upstream)]  # fmt: skip
    return lines


def _routing_section(r: RoutingResult) -> list[str]:
    rows = [[name, *(spread_text(s.value, digits) for s, digits in (
                (a.hit_rate, 3), (a.ttft_p50_ms, 0), (a.ttft_p90_ms, 0),
                (a.output_tokens_per_s, 0), (a.load_spread, 0), (a.prediction_accuracy, 3))),
             num(a.errors)]
            for name, a in r.arms.items()]  # fmt: skip
    w = r.workload
    arrivals = (
        f"{num(w.sessions_per_s)} sessions/s arriving as a Poisson process"
        if w.sessions_per_s
        else f"{w.concurrent_sessions} at a time"
    )
    reuse = w.reuse  # None in results from before the plan's reuse was recorded
    ceiling = (
        f"; hit-rate ceiling {num(reuse.ceiling, 3)} (a session's own earlier turns "
        f"{num(reuse.session_local, 3)}, other sessions of its tenant "
        f"{num(reuse.others, 3)})"
        if reuse is not None
        else ""
    )
    return [f"- {w.tenants} tenants, {w.sessions} sessions x {w.turns} "
            f"turns ({arrivals}), prefix working set {num(w.pressure)}x the fleet's KV "
            f"cache, model {Path(w.model).name}{ceiling}", "",
            *_table(["arm", "hit rate", "TTFT p50 ms", "TTFT p90 ms", "output tok/s",
                     "load spread", "prediction accuracy", "errors"], rows)]  # fmt: skip


def _failover_section(r: FailoverResult) -> list[str]:
    rows = [["time to first ready", f"{num(r.time_to_first_ready_s, 1)} s"],
            ["peak RSS / PSS", f"{num(r.peak_rss_gib)} / {num(r.peak_pss_gib)} GiB"]]  # fmt: skip
    for f in r.failover or []:  # None: the run ended in an error (the row below says it)
        rows.append([f"kill {f.victim}",
                     f"unhealthy after {num(f.kill_to_unhealthy_s)} s, "
                     f"{f.client_visible_errors} client errors of {f.streams} streams, "
                     f"routable again after {num(f.kill_to_routable_again_s, 1)} s"])  # fmt: skip
    if r.error:
        rows.append(["error", r.error])
    return _table(["figure", "value"], rows)


def _failures_section(r: FailuresResult) -> list[str]:
    """One row per case: what the serving process's health said, who exited when, how
    the in-flight requests ended and what was left running."""
    rows = []
    for c in r.cases:
        case = [c.system, f"{c.signal} {c.victim}"]
        health_s, exit_s, outcomes, alive = c.health, c.exit_s, c.requests, c.left
        if (
            c.error is not None
            or health_s is None
            or exit_s is None
            or outcomes is None
            or alive is None
        ):
            rows.append([*case, _case_error(c), "", "", ""])
            continue
        health = " -> ".join(f"{a}@{t}s" for a, t in health_s)
        exits = ", ".join(f"{k} rc {v.rc} at {v.s} s" for k, v in sorted(exit_s.items()))
        counts: dict[str, int] = {}
        for outcome in outcomes:
            kind = outcome.split(":", 1)[0].split(",", 1)[0]
            counts[kind] = counts.get(kind, 0) + 1
        requests = ", ".join(f"{n} {k}" for k, n in counts.items())
        left = "; ".join(f"{k}: {len(v)}" for k, v in sorted(alive.items()) if v)
        rows.append([*case, health, exits or "none", requests or "n/a", left or "nothing"])
    return _table(["system", "failure", "health over time", "exits", "in-flight requests",
                   "processes left at window end"], rows)  # fmt: skip


def _generic_section(r: dict[str, Any]) -> list[str]:
    """Any result layout, from the file as read: top-level figures, then per-arm tables
    of spreads. For the benchmarks without a section of their own: it lists what each
    run recorded, so a renamed key shows under its new name."""
    skip = {"benchmark", "commit", "machine", "time", "workload", "settings", "trials", "runs"}
    rows, arms = [], {}
    for k, v in sorted(r.items()):
        if k.startswith("_") or k in skip:
            continue
        if isinstance(v, dict) and v and all(isinstance(x, dict) and "median" in x
                                             for x in v.values()):  # fmt: skip
            arms[k] = v
        elif isinstance(v, dict) and any(isinstance(x, dict) for x in v.values()):
            continue
        else:
            rows.append([k, _compact(v)])
    out = _table(["figure", "value"], rows)
    if arms:
        keys = sorted({k for a in arms.values() for k in a})
        out += ["", *_table(["figure", *arms], [[k, *(spread_text(_raw_spread(a.get(k)), 2)
                                                      for a in arms.values())]
                                                 for k in keys])]  # fmt: skip
    return out


def _capacity_section(r: CapacityResult) -> list[str]:
    """The arms side by side, SLO attainment per minute, the simulator's prediction."""
    tr, probe = r.trace, r.probe
    if tr is None:  # the first arm's cluster failed before the probe
        out = [f"No trace: the run stopped before its probe; SLO TTFT <= "
               f"{num(r.slo_ttft_s, 1)} s.", ""]  # fmt: skip
    else:
        out = [f"Trace `{tr.name}` {tr.window_s} s of its day, {num(tr.duration_s, 0)} s "
               f"long, {num(tr.base_rps, 1)} -> {num(tr.peak_rps, 1)} req/s "
               f"({num(tr.arrivals)} arrivals, seed {tr.seed}); SLO TTFT <= "
               f"{num(r.slo_ttft_s, 1)} s; probe: "
               f"{num(None if probe is None else probe.saturated_streams_per_s, 1)} "
               f"streams/s saturated, {num(tr.per_unit_rps_at_target, 1)} req/s at target per unit.", ""]  # fmt: skip
    rows = []
    for name, a in r.arms.items():
        if a.error is not None and a.requests is None:
            rows.append([name, f"error: {a.error}", "", "", "", "", "", ""])
            continue
        ups = a.decision_to_routable_s  # the autoscaled arms only
        rows.append([name, _pct(a.slo_attainment), num(a.ttft_p50_s, 3),
                     num(a.ttft_p99_s, 3), num(a.failed),
                     num(a.unit_seconds, 0),
                     f"{num(a.units_mean)} (max {num(a.units_max)})",
                     "" if ups is None else f"+{a.units_added} / -{a.units_removed}; "
                     f"decision to routable {ups} s; failed in scale-in "
                     f"{a.failed_during_scale_in}"])  # fmt: skip
    out += _table(["fleet", "SLO met", "TTFT p50 s", "TTFT p99 s", "failed", "unit-s",
                   "units mean", "scaling"], rows)  # fmt: skip
    minutes = {n: a.per_minute for n, a in r.arms.items() if a.per_minute}
    if minutes:
        n = max(len(m) for m in minutes.values())
        out += ["", *_table(["minute", *minutes], [[str(i), *(
            f"{_pct(m[i].slo_attainment)}, p99 {num(m[i].ttft_p99_s, 2)} s"
            if i < len(m) else "" for m in minutes.values())] for i in range(n)])]  # fmt: skip
    sim = r.simulator
    if sim:
        out += ["", f"Simulator (start-up {num(sim.startup_s, 1)} s: "
                f"{sim.startup_from}; policy: {sim.policy_from}; tolerance "
                f"`{json.dumps(sim.tolerance)}`):", ""]  # fmt: skip
        rows = []
        for name, v in sim.vs_measured.items():
            rows.append([name] + [f"{num(x.predicted, 3)} vs {num(x.measured, 3)}"
                                  for x in (v.ttft_p50_s, v.ttft_p99_s, v.units_mean, v.units_max)]
                        + [num(v.within_tolerance)])  # fmt: skip
        out += _table(["fleet", "TTFT p50 s (sim vs run)", "TTFT p99 s", "units mean",
                       "units max", "within tolerance"], rows)  # fmt: skip
        sweep = sim.startup_sweep  # None in results from before the sweep
        if sweep:
            out += ["", "The simulator's start-up sweep (the cold autoscaled fleet at each "
                    "decision-to-routable time, against the predicted peak fleet):", ""]  # fmt: skip
            out += _table(["decision -> routable", *(f"{num(x.startup_s, 0)} s" for x in sweep)],
                          [["SLO points vs peak", *(num(x.slo_points_minus_peak, 1) for x in sweep)],
                           ["unit-seconds fewer", *(_pct(x.unit_seconds_saving_vs_peak) for x in sweep)],
                           ["both targets", *(num(x.targets_met) for x in sweep)]])  # fmt: skip
    if r.error:
        out += ["", f"error: {r.error}"]
    return out


# Each family's section: from its decoded result, or (the benchmarks without a section
# of their own) every figure of the file as read.
SECTIONS: dict[str, Callable[[Loaded[Any]], list[str]]] = {
    "executor": lambda lr: _executor_section(lr.result),
    "serving": lambda lr: _serving_section(lr.result),
    "proxy": lambda lr: _proxy_section(lr.result),
    "routing": lambda lr: _routing_section(lr.result),
    "routing_open": lambda lr: _routing_section(lr.result),
    "failover": lambda lr: _failover_section(lr.result),
    "scaling": lambda lr: _scaling_section(lr.result),
    "load": lambda lr: _generic_section(lr.raw),
    "serving_mn": lambda lr: _serving_section(lr.result),
    "failures": lambda lr: _failures_section(lr.result),
    "cpu": lambda lr: _generic_section(lr.raw),
    "startup": lambda lr: _generic_section(lr.raw),
    "classes": lambda lr: _generic_section(lr.raw),
    "capacity": lambda lr: _capacity_section(lr.result),
    "capacity_diurnal": lambda lr: _capacity_section(lr.result),
    "soak": lambda lr: _soak_section(lr.result),
}
TITLES = {
    "executor": "Executor: unit executor vs MultiprocExecutor (TP=2)",
    "serving": "Serving: Triton leader vs vllm serve (TP=1, 16 streams)",
    "proxy": "Proxy overhead (64 streams)",
    "routing": "Routing policies (2 units)",
    "routing_open": "Routing policies (2 units), open loop",
    "failover": "Failover and memory of the default local cluster",
    "scaling": "Scaling with concurrency (Triton leader, TP=1)",
    "load": "Checkpoint load: sharded vs full",
    "serving_mn": "Serving across two nodes: TP=2 unit vs vllm serve --nnodes 2 (16 streams)",
    "failures": "A rank's failure: TP=2 unit vs vLLM multi-node",
    "cpu": "CPU per output token and per request, by process",
    "startup": "Start-up: the default cluster vs vllm serve, and a recreated unit",
    "classes": "Traffic classes: real-time beside a batch backlog",
    "capacity": "Capacity: autoscaled vs fixed fleets on a compressed spike trace (TP=1)",
    "capacity_diurnal": "Capacity: autoscaled vs fixed fleets on the compressed diurnal day (TP=1)",
    "soak": "Soak: mixed traffic, faults and a rollout (2 units of TP=2, 2 proxy replicas)",
}


def _run_order(all_result: AllResult, name: str) -> int:
    order = all_result.order
    return order.index(name) if name in order else len(order)


def _undecodable(fam: str, lr: Undecodable) -> str:
    return f"- result `{lr.file}` does not decode as a `{fam}` result: {lr.error}"


def render(results: Results, plots_dir: Path, report_path: Path) -> str:
    """The markdown text; writes the plots into ``plots_dir`` (linked relative to the report)."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmark report", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} by "
             "`neuron-serving bench report` from the latest result of each benchmark in "
             "`bench/results/`. Figures are medians with (min..max, n = repeats); n=1 has no "
             "spread. Quick runs (`-quick` files, what `make bench` runs) use reduced loads. "
             "On a shared 2-core machine other work shifts latencies and throughputs: each "
             "section records the load average around its run.", "",
             "## Targets", ""]  # fmt: skip
    rows = [[t.benchmark, t.target, t.measured, t.mark()] for t in targets(results)]
    lines += _table(["benchmark", "target", "measured", "status"], rows)
    if "all" in results:
        lines += ["", "## `bench all` wall time", ""]
        lr = results["all"]
        if isinstance(lr, Undecodable):
            lines.append(_undecodable("all", lr))
        else:
            a: AllResult = lr.result
            lines += [f"Run of {a.time} (commit `{a.commit}`, "
                      f"{'quick' if a.quick else 'full'} sizes):", ""]  # fmt: skip
            lines += _table(["benchmark", "wall s", "exit code"],
                            [[k, num(v.wall_s, 0), num(v.rc)]
                             for k, v in sorted(a.wall_s.items(),
                                                key=lambda kv: _run_order(a, kv[0]))])  # fmt: skip
            lines.append(f"| total (benchmarks) | {num(a.benchmarks_wall_s, 0)} | |")
    for fam in FAMILIES:
        lines += ["", f"## {TITLES[fam]}", ""]
        found = results.get(fam)
        if found is None:
            lines.append(f"No result yet (`neuron-serving bench {COMMANDS.get(fam, fam)}`).")
            continue
        if isinstance(found, Undecodable):
            lines.append(_undecodable(fam, found))
            continue
        lines += _meta(found) + [""]
        try:
            lines += SECTIONS[fam](found)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            lines.append(f"(figures not rendered: {type(e).__name__}: {e})")
        if fam in PLOTS:
            try:
                for p in PLOTS[fam](found.result, plots_dir):
                    rel = Path(p).resolve().relative_to(report_path.resolve().parent)
                    lines += ["", f"![{fam}]({rel.as_posix()})"]
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                lines.append(f"(plot not drawn: {type(e).__name__}: {e})")
    return "\n".join(lines) + "\n"


def run_label(fam: str, lr: Loaded[Any] | Undecodable) -> str:
    """``executor``: ``executor.json, 2026-12-04, AMD EPYC 7763`` (the result's file,
    date and CPU model; ratios move with the CPU more than with anything else)."""
    if isinstance(lr, Undecodable):
        return f"`{fam}`: {lr.file}, does not decode"
    r: BenchResult = lr.result
    cpu = r.machine.cpu_model or "CPU not recorded"
    return f"`{fam}`: {lr.file}, {r.time[:10]}, {cpu}"


def readme_rows(results: Results) -> list[MeasuredRow]:
    """The README's table: every target (not the information rows) of the newest
    result of each benchmark; the result's file, date and CPU on its first row."""
    rows, labelled = [], set()
    for t in targets(results):
        if t.status.startswith("information"):
            continue
        lr = results.get(t.benchmark)
        label = "" if t.benchmark in labelled else (
            run_label(t.benchmark, lr) if lr else f"`{t.benchmark}`: no result")  # fmt: skip
        labelled.add(t.benchmark)
        rows.append(MeasuredRow(label, t.target, t.measured, t.mark()))
    return rows


def write_report(
    results_dir: Path = RESULTS_DIR,
    report_path: Path = REPORT,
    plots_dir: Path | None = None,
    readme: Path | None = None,
) -> tuple[Path, list[Target]]:
    """REPORT.md and plots; with ``readme``, also that file's "Measured" table."""
    results = latest_results(results_dir)
    plots_dir = plots_dir or results_dir / "plots"
    report_path.write_text(render(results, plots_dir, report_path))
    if readme is not None and not rewrite_readme(readme, readme_rows(results)):
        print(f"report: {readme} has no measured markers: its table is not rewritten",
              file=sys.stderr)  # fmt: skip
    return report_path, targets(results)


def main(emit_json: bool = False) -> int:
    """Exits 1 when a benchmark's latest result does not decode (the report says which
    and why): its figures are missing from the report, and that is not a pass."""
    path, ts = write_report(readme=README)
    met = sum(1 for t in ts if t.met)
    missed = sum(1 for t in ts if t.met is False)
    info = sum(1 for t in ts if t.met is None and t.status.startswith("information"))
    print(f"report: {met} targets met, {missed} missed, {len(ts) - met - missed - info} not "
          f"measured, {info} information rows -> {path}", file=sys.stderr)  # fmt: skip
    broken = [lr for lr in latest_results(RESULTS_DIR).values() if isinstance(lr, Undecodable)]
    for lr in broken:
        print(f"report: {lr.file} does not decode: {lr.error}", file=sys.stderr)
    if emit_json:
        print(json.dumps([t.__dict__ for t in ts]))
    return 1 if broken else 0
