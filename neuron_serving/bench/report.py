"""`neuron-serving bench report`: bench/REPORT.md, plots and the top README's
"Measured" table from bench/results/*.json.

For every benchmark the latest result is used (by its ``time`` field; a ``-quick``
run and a full run are the same benchmark). Each target from the issues is listed
next to the measured value and its spread, marked met / missed / not measured;
then one section per benchmark with its figures, settings, commit and machine,
and matplotlib plots in ``results/plots/``. Results written by other scripts
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

from neuron_serving.bench.common import RESULTS_DIR
from neuron_serving.bench.readme_table import MeasuredRow, rewrite_readme

REPORT = RESULTS_DIR.parent / "REPORT.md"
README = RESULTS_DIR.parent.parent / "README.md"
FAMILIES = ("executor", "serving", "proxy", "routing", "routing_open", "failover", "scaling",
            "load",
            "serving_mn", "failures", "cpu", "startup", "classes", "capacity",
            "capacity_diurnal", "soak")  # fmt: skip
# A family run by a command other than `bench <family>`.
COMMANDS = {"capacity_diurnal": "capacity --trace diurnal",
            "routing_open": "routing --session-rate 0.8"}  # fmt: skip


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


def latest_results(results_dir: Path) -> dict[str, dict[str, Any]]:
    """The newest result of each benchmark family (and ``all``, bench all's wall times)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict) or "benchmark" not in data:
            continue
        fam = family(str(data["benchmark"]))
        if fam not in (*FAMILIES, "all"):
            continue
        data["_file"] = path.name
        if fam not in found or str(data.get("time", "")) >= str(found[fam].get("time", "")):
            found[fam] = data
    return found


# ---- formatting ----------------------------------------------------------------------


def num(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def spread_text(s: dict[str, Any] | None, digits: int = 2, unit: str = "") -> str:
    """``median unit (min..max, n=N)``: the spread over repeats."""
    if not s:
        return "n/a"
    med = f"{num(s.get('median'), digits)}{unit}"
    if s.get("n", 1) <= 1:
        return f"{med} (n=1)"
    return f"{med} ({num(s.get('min'), digits)}..{num(s.get('max'), digits)}, n={s['n']})"


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


def straddles(s: dict[str, Any] | None, limit: float) -> bool:
    """min and max of a spread on both sides of ``limit``: the verdict is noise-bound."""
    if not s:
        return False
    return s.get("n", 1) > 1 and s["min"] < limit < s["max"]


# ---- targets -------------------------------------------------------------------------


def _executor_targets(r: dict[str, Any]) -> list[Target]:
    t = r.get("target_ratio", 0.9)
    pair = r.get("ratio_per_pair")
    measured = f"{num(r.get('ratio'))} (per pair {num(pair['min'])}..{num(pair['max'])}, n={pair['n']})" if pair else num(r.get("ratio"))  # fmt: skip
    ratio = r.get("ratio")
    out = [Target("executor", f"unit / MultiprocExecutor output tok/s >= {t}", measured,
                  None if ratio is None else ratio >= t, straddles=straddles(pair, t))]  # fmt: skip
    for key, label in (("ratio_vs_mn", "unit"), ("gloo_ratio_vs_mn", "unit on Gloo")):
        if r.get(key) is not None:
            per = r.get(f"{key}_per_pair")
            out.append(Target("executor", f"information: {label} / vLLM multi-node "
                              "(--nnodes 2) output tok/s", _with_pairs(r[key], per), None,
                              status="information, no target"))  # fmt: skip
    return out


def _with_pairs(v: Any, per: dict[str, Any] | None, word: str = "per pair") -> str:
    return num(v) + (f" ({word} {num(per['min'])}..{num(per['max'])}, n={per['n']})"
                     if per else "")  # fmt: skip


def _serving_targets(r: dict[str, Any]) -> list[Target]:
    """The target ratios (on ``ratio_arm``; results before it existed used the gRPC
    arm), then the gRPC arm's ratios for information (no status)."""
    tg = r.get("targets", {})
    tp, tt = tg.get("throughput_ratio", 0.9), tg.get("ttft_p50_ratio", 1.2)
    via = {"triton_http": " (HTTP/SSE both)", "triton": " (Triton over gRPC)"}.get(
        r.get("ratio_arm", "triton"), ""
    )
    out = []
    for prefix, info in (("", False), ("grpc_", True)):
        for key, rule, ok in (("throughput_ratio", f">= {tp}", lambda v: v >= tp),
                              ("ttft_p50_ratio", f"<= {tt}", lambda v: v <= tt)):  # fmt: skip
            v = r.get(prefix + key)
            if v is None and info:
                continue
            per = r.get(f"{prefix}{key}_per_repeat")
            text = num(v) + (f" (per repeat {num(per['min'])}..{num(per['max'])}, n={per['n']})"
                             if per else "")  # fmt: skip
            label = "output tok/s" if key == "throughput_ratio" else "TTFT p50"
            limit = tp if key == "throughput_ratio" else tt
            if info:
                out.append(Target("serving", f"information: Triton over gRPC (tritonclient aio) "
                                  f"/ vllm serve {label}", text, None,
                                  status="information, no target"))  # fmt: skip
            else:
                out.append(Target("serving", f"Triton leader / vllm serve{via} {label} {rule}",
                                  text, None if v is None else ok(v),
                                  straddles=straddles(per, limit)))  # fmt: skip
    return out


def _serving_mn_targets(r: dict[str, Any]) -> list[Target]:
    out = []
    for key, label in (("throughput_ratio", "output tok/s"), ("ttft_p50_ratio", "TTFT p50")):
        if r.get(key) is not None:
            text = _with_pairs(r[key], r.get(f"{key}_per_repeat"), "per repeat")
            out.append(Target("serving_mn", f"information: TP=2 unit behind Triton / vllm serve "
                              f"--nnodes 2, {label}", text, None,
                              status="information, no target"))  # fmt: skip
    return out


def _proxy_targets(r: dict[str, Any]) -> list[Target]:
    tg = r.get("targets", {})
    streams = r.get("workload", {}).get("streams", 64)
    out = []
    for q, default in (("p50", 1.0), ("p99", 5.0)):
        s = r.get(f"added_ttft_{q}_ms")
        limit = tg.get(f"added_ttft_{q}_ms", default)
        out.append(Target("proxy", f"added TTFT {q} <= {num(limit, 0)} ms at {streams} streams",
                          spread_text(s, 1, " ms"), None if not s else s["median"] <= limit,
                          straddles=straddles(s, limit)))  # fmt: skip
        hop = r.get(f"proxy_hop_ttft_{q}_ms")
        if hop:  # the proxy's own account of its hop (informational next to the A/B)
            out.append(Target("proxy", f"proxy's own hop (its histogram) {q} <= "
                              f"{num(limit, 0)} ms at {streams} streams",
                              spread_text(hop, 2, " ms"), hop["median"] <= limit,
                              straddles=straddles(hop, limit)))  # fmt: skip
    # Results before the channel (2026-12-04) compared the HTTP upstream instead.
    other, other_name = _other_upstream(r)
    for q in ("p50", "p99"):
        for key, what in ((f"added_ttft_{q}_ms", "added TTFT"),
                          (f"proxy_hop_ttft_{q}_ms", "proxy's own hop")):  # fmt: skip
            if other.get(key):
                out.append(Target("proxy", f"information: {other_name}, {what} {q} at "
                                  f"{streams} streams", spread_text(other[key], 2, " ms"), None,
                                  status="information, no target"))  # fmt: skip
    tp = r.get("throughput")
    if tp:
        per, limit = tp.get("ratio_per_repeat"), tp.get("target", 0.95)
        out.append(Target("proxy", f"throughput through the proxy / direct at {tp['streams']} "
                          f"streams >= {limit}", _with_pairs(tp["ratio"], per, "per repeat"),
                          tp["ratio"] >= limit, straddles=straddles(per, limit)))  # fmt: skip
        oa = tp.get("openai_ratio_per_repeat")
        if oa:
            out.append(Target("proxy", "information: OpenAI /v1/completions through the proxy "
                              "/ direct generate_stream", _with_pairs(oa["median"], oa, "per repeat"),
                              None, status="information, no target"))  # fmt: skip
    return out


def _other_upstream(r: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """bench proxy's second proxy arm: Triton gRPC (since the channel), else HTTP."""
    if r.get("grpc_upstream"):
        return r["grpc_upstream"], "Triton gRPC upstream"
    return r.get("http_upstream") or {}, "HTTP upstream"


def _cpu_targets(r: dict[str, Any]) -> list[Target]:
    """bench cpu: the proxy's CPU per output token against vLLM's API server's, and per
    request."""
    c = r.get("proxy_vs_vllm_api_server")
    if not c:
        return [Target("cpu", t, "no result", None) for t in NOT_MEASURED["cpu"]]
    tg = c.get("targets", {})
    ratio, per_req = c.get("per_token_ratio"), c.get("proxy_us_per_request")
    return [
        Target("cpu", f"proxy CPU per output token / vLLM API server's <= {tg.get('per_token_ratio')}",
               f"{num(ratio)} ({num(c.get('proxy_us_per_token'), 0)} vs "
               f"{num(c.get('api_server_us_per_token'), 0)} us)",
               None if ratio is None else ratio <= tg.get("per_token_ratio", 0.5)),
        Target("cpu", f"proxy CPU per request <= {num(tg.get('proxy_us_per_request'), 0)} us",
               f"{num(per_req, 0)} us (vLLM API server {num(c.get('api_server_us_per_request'), 0)} us)"
               + (f"; net of idle CPU, raw {num(c['proxy_us_per_request_raw'], 0)} us"
                  if c.get("proxy_us_per_request_raw") else ""),
               None if per_req is None else per_req <= tg.get("proxy_us_per_request", 500.0)),
        *(Target("cpu", f"information: {what}, proxy CPU per output token and per request",
                 f"{num(c[key].get('proxy_us_per_token'), 0)} us/token (ratio "
                 f"{num(c[key].get('per_token_ratio'))}), "
                 f"{num(c[key].get('proxy_us_per_request'), 0)} us/request", None,
                 status="information, no target")
          for key, what in (("channel_asyncio", "the channel on asyncio's loop"),
                            ("grpc_upstream", "Triton gRPC upstream (channel off)"),
                            ("http_upstream", "Triton HTTP upstream (channel off)"),
                            ("http_upstream_asyncio", "HTTP upstream on asyncio's loop"))
          if c.get(key)),
    ]  # fmt: skip


def _routing_targets(r: dict[str, Any]) -> list[Target]:
    """bench routing: the exact (KV-event-fed) index against the approximate one under
    cache pressure, and 2 proxy replicas against 1 (ratios within each repeat)."""
    ra = r.get("ratios", {})
    hit, p90 = ra.get("hit_rate_exact_over_approximate"), ra.get("ttft_p90_exact_over_approximate")
    pp = ra.get("hit_rate_pp_2_replicas_vs_1")
    acc = (r.get("arms", {}).get("exact") or {}).get("prediction_accuracy")

    # Beside the verdicts, not in them: the reference placement that knows the plan
    # (every tenant on one unit), against the approximate index and the exact one.
    def context(*pairs: tuple[str, str]) -> str:
        return "".join(f"; {name}: {spread_text(ra[k])}" for name, k in pairs if ra.get(k))

    hit_ref = context(
        ("tenant partition / approximate", "hit_rate_partition_over_approximate"),
        ("exact / tenant partition", "hit_rate_exact_over_partition"),
        # The most any routing reaches against the approximate index (reuse_ceiling).
        ("ceiling / approximate", "hit_rate_ceiling_over_approximate"),
    )
    p90_ref = context(
        ("tenant partition / approximate", "ttft_p90_partition_over_approximate"),
        ("exact again / exact", "ttft_p90_exact_again_over_exact"),
    )
    again = ra.get("hit_rate_pp_exact_again_vs_exact")
    pp_ref = f" (exact run twice: {spread_text(again, 1, ' points')})" if again else ""
    return [
        Target("routing", "exact KV index hit rate / approximate index's >= 1.2",
               spread_text(hit) + (f" ({hit_ref[2:]})" if hit_ref else ""),
               None if not hit else hit["median"] >= 1.2, straddles=straddles(hit, 1.2)),
        Target("routing", "exact KV index TTFT p90 / approximate index's <= 0.7",
               spread_text(p90) + (f" ({p90_ref[2:]})" if p90_ref else ""),
               None if not p90 else p90["median"] <= 0.7, straddles=straddles(p90, 0.7)),
        Target("routing", "2 proxy replicas' hit rate within 2 points of 1 replica's",
               spread_text(pp, 1, " points") + pp_ref, None if not pp else pp["median"] <= 2.0,
               straddles=straddles(pp, 2.0)),
        Target("routing", "prediction accuracy reported (exact arm)", spread_text(acc, 3),
               None if not acc else True),
    ]  # fmt: skip


def _routing_open_targets(r: dict[str, Any]) -> list[Target]:
    """bench routing --session-rate: the same ratios under an open loop, information
    beside the closed loop's verdicts (the issue's workload is the closed loop's)."""
    ra = r.get("ratios", {})
    rate = (r.get("workload") or {}).get("sessions_per_s")
    ceiling = ra.get("hit_rate_ceiling_over_approximate")
    return [
        Target("routing_open", f"information: exact / approximate index, open loop at "
               f"{num(rate)} sessions/s",
               f"hit rate {spread_text(ra.get('hit_rate_exact_over_approximate'))}; TTFT p90 "
               f"{spread_text(ra.get('ttft_p90_exact_over_approximate'))}; tenant partition "
               f"/ approximate TTFT p90 "
               f"{spread_text(ra.get('ttft_p90_partition_over_approximate'))}"
               + (f"; hit-rate ceiling / approximate {spread_text(ceiling)}" if ceiling else ""),
               None,
               status="information, no target"),
    ]  # fmt: skip


def _failover_targets(r: dict[str, Any]) -> list[Target]:
    out = []
    for f in r.get("failover", []):
        victim = f.get("victim", "?")
        t = f.get("kill_to_unhealthy_s")
        out.append(Target("failover", f"kill {victim} -> unhealthy < 3 s", f"{num(t)} s",
                          None if t is None else t < 3.0))  # fmt: skip
        e = f.get("client_visible_errors")
        out.append(Target("failover", f"kill {victim}: 0 client errors ({f.get('streams')} streams)",
                          num(e), None if e is None else e == 0))  # fmt: skip
    if not r.get("failover"):
        out.append(Target("failover", "kill a rank -> unhealthy < 3 s, 0 client errors",
                          r.get("error", "n/a"), None))  # fmt: skip
    # The budget is 12 GB; results record GiB (1 GiB = 1.0737 GB).
    rss = r.get("peak_rss_gib")
    rss_gb = None if rss is None else rss * 2**30 / 1e9
    out.append(Target("failover", "peak RSS of the default cluster < 12 GB",
                      f"{num(rss_gb)} GB = {num(rss)} GiB (PSS {num(r.get('peak_pss_gib'))} GiB)",
                      None if rss_gb is None else rss_gb < 12.0))  # fmt: skip
    return out


def _load_targets(r: dict[str, Any]) -> list[Target]:
    """The load benchmark (issue 6) is another engineer's: its own ``met``/``targets``."""
    met, targets = r.get("met") or {}, r.get("targets") or {}
    out = []
    for key, ok in met.items():
        value = r.get(key)
        measured = spread_text(value) if isinstance(value, dict) else num(value)
        out.append(Target("load", f"{key} {targets.get(key, '')}".strip(), measured,
                          None if ok is None else bool(ok)))  # fmt: skip
    if not out:
        ratios = [f"{k.removesuffix('_sharded_over_full')} {_compact(v)}"
                  for k, v in sorted(r.items()) if "ratio" in k]  # fmt: skip
        out.append(Target("load", "sharded vs full checkpoint (ratios sharded / full)",
                          "; ".join(ratios) or "see section", None,
                          status="no numeric target recorded"))  # fmt: skip
    return out


def _compact(v: Any) -> str:
    """A number, a spread's median, or a small dict of numbers, in one short string."""
    if isinstance(v, dict) and "median" in v:
        return spread_text(v)
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_compact(x)}" for k, x in v.items())
    return num(v)


# A failed rank must take its unit out of rotation, or end the unit, within 5 s.
FAILURE_LIMIT_S = 5.0


def _failures_targets(r: dict[str, Any]) -> list[Target]:
    """bench failures, our unit's cases: how soon the leader's readiness turned (a
    follower killed or frozen), how soon the follower exited (the leader killed)."""
    out = []
    for c in r.get("cases", []):
        if c.get("system") != "unit":
            continue
        follower = c.get("victim") == "rank1"
        what = (f"follower {c.get('signal')} -> unit out of rotation (readiness)" if follower
                else f"leader {c.get('signal')} -> follower exits non-zero")  # fmt: skip
        target = f"{what} <= {num(FAILURE_LIMIT_S, 0)} s"
        if "error" in c:
            out.append(
                Target("failures", target, "error: " + str(c["error"]).splitlines()[0], None)
            )
            continue
        exits = c.get("exit_s", {})
        if follower:
            t = next((at for state, at in c.get("health", []) if state != "200"), None)
            leader = exits.get("rank0")
            measured = f"{num(t)} s" + (f" (leader exits {leader['rc']} after {leader['s']} s)"
                                        if leader else "")  # fmt: skip
            ok = None if t is None else t <= FAILURE_LIMIT_S
        else:
            f = exits.get("rank1")
            measured = "did not exit" if f is None else f"exit {f['rc']} after {f['s']} s"
            ok = f is not None and f["rc"] != 0 and f["s"] <= FAILURE_LIMIT_S
        out.append(Target("failures", target, measured, ok))
    return out


def _startup_targets(r: dict[str, Any]) -> list[Target]:
    """bench startup: the default cluster's ready time against `vllm serve`'s, and a
    recreated unit's time to routable after its leader's SIGKILL."""
    tg = r.get("targets", {})
    ratio, recreated = r.get("ratio_cluster_to_vllm"), r.get("recreated_unit_routable_s")
    limit, bound = tg.get("ratio_cluster_to_vllm", 1.5), tg.get("recreated_unit_routable_s", 30.0)
    cluster, vllm = r.get("cluster_ready_s") or {}, r.get("vllm_serve_ready_s") or {}
    return [
        Target("startup", f"default cluster ready / vllm serve ready <= {num(limit)}",
               f"{spread_text(ratio)} ({num(cluster.get('median'), 1)} vs "
               f"{num(vllm.get('median'), 1)} s)",
               None if not ratio else ratio["median"] <= limit,
               straddles=straddles(ratio, limit)),
        Target("startup", f"unit recreated after a leader SIGKILL routable <= {num(bound, 0)} s",
               spread_text(recreated, 1, " s"),
               None if not recreated else recreated["median"] <= bound,
               straddles=straddles(recreated, bound)),
    ]  # fmt: skip


def _classes_targets(r: dict[str, Any]) -> list[Target]:
    """bench classes: real-time beside a batch backlog through the traffic classes."""
    b, c = r.get("rt_ttft_p99_ratio_b_over_a"), r.get("rt_ttft_p99_ratio_c_over_a")
    # Beside the verdict, not in it: the host's sensitivity (idle-priority spinners that
    # do no serving work) and the same arm measured twice (the ratio's own spread).
    floor, again = r.get("rt_ttft_p99_ratio_f_over_a"), r.get("rt_ttft_p99_ratio_a2_over_a")
    context = "".join(
        f"; {name}: {spread_text(x)}"
        for name, x in (("SCHED_IDLE spinners", floor), ("alone again", again))
        if x
    )
    share = r.get("batch_share_of_idle_capacity_b")
    rejected = r.get("rt_rejected_by_flow_control")
    errors = r.get("rt_client_errors_b")
    return [
        Target("classes", "real-time TTFT p99 with batch (classes) / alone <= 1.1",
               f"{spread_text(b)} (first come first served: {spread_text(c)}{context})",
               None if not b else b["median"] <= 1.1, straddles=straddles(b, 1.1)),
        Target("classes", "batch tokens/s >= 0.8 of the capacity real-time leaves",
               spread_text(share), None if not share else share["median"] >= 0.8,
               straddles=straddles(share, 0.8)),
        Target("classes", "no real-time request shed or refused while batch waits",
               f"{rejected}, client errors {errors}",
               None if rejected is None else not any(rejected.values()) and not errors),
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


def _soak_targets(r: dict[str, Any]) -> list[Target]:
    """bench soak: every count that must be 0, for the run as a whole."""
    counts = r.get("zero_counts")
    length = f"{num((r.get('duration_s') or 0) / 60, 0)}-min soak"
    if counts is None:
        return [Target("soak", f"{length}: all counts 0", "error: " + str(r.get("error")), None)]
    return [Target("soak", f"{length}: {what} = 0", _compact(counts[key]), not counts[key])
            for key, what in SOAK_ZERO.items() if key in counts]  # fmt: skip


def _soak_section(r: dict[str, Any]) -> list[str]:
    """The counts, each kind of request's outcomes, the faults and rollouts as applied,
    the processes that grew most, and the latency plot."""
    out = _table(["count (must be 0)", "value"],
                 [[SOAK_ZERO.get(k, k), _compact(v)] for k, v in
                  (r.get("zero_counts") or {}).items()])  # fmt: skip
    kinds = r.get("by_kind") or {}
    statuses = sorted({s for v in kinds.values() for s in v})
    out += ["", *_table(["kind", *statuses],
                        [[k, *(str(v.get(s, 0)) for s in statuses)] for k, v in kinds.items()])]  # fmt: skip
    events = [[num(f.get("at_s"), 0), f.get("what", ""), f.get("error") or ""]
              for f in r.get("faults", [])]  # fmt: skip
    events += [[num(d.get("at_s"), 0), f"rollout to {d.get('version')} ({d.get('s')} s)",
                "" if d.get("rc") == 0 else f"rc {d.get('rc')}"] for d in r.get("rollouts", [])]  # fmt: skip
    out += [
        "",
        *_table(["at (s)", "fault or rollout", "error"], sorted(events, key=lambda e: float(e[0]))),
    ]
    grew = sorted(r.get("growth", []), key=lambda g: g["rss_mb"][-1] - g["rss_mb"][0], reverse=True)
    out += ["", *_table(["process", "RSS MB first -> last", "open files first -> last"],
                        [[f"{g['owner']} {g['name']}", " -> ".join(map(str, g["rss_mb"])),
                          " -> ".join(map(str, g["fds"]))] for g in grew[:5]])]  # fmt: skip
    if r.get("plot"):
        # Written beside the result (bench/results/), the report one level up.
        out += ["", f"![TTFT and ITL over the soak]({RESULTS_DIR.name}/{Path(r['plot']).name})"]
    return out


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _capacity_targets(r: dict[str, Any], fam: str = "capacity") -> list[Target]:
    """bench capacity: the autoscaled fleet against the peak-sized one on a compressed
    trace (``fam``: capacity, the spike; capacity_diurnal, the diurnal day); the
    minimum-sized one beside them; the simulator's prediction."""
    arms = r.get("arms", {})
    a, b, c = (arms.get(k, {}) for k in ("autoscaled", "fixed_peak", "fixed_min"))
    slo = num(r.get("slo_ttft_s"), 1)
    pts, saving = r.get("slo_points_autoscaled_minus_peak"), r.get("unit_seconds_saving_vs_peak")
    failed_in, scale_ins = r.get("failed_during_scale_in"), r.get("scale_ins")
    out = [
        Target(fam, f"autoscaled SLO attainment (TTFT <= {slo} s) within 5 points of "
               "the peak-sized fleet",
               f"{_pct(a.get('slo_attainment'))} vs {_pct(b.get('slo_attainment'))} "
               f"({num(pts, 1)} points); minimum-sized {_pct(c.get('slo_attainment'))}",
               None if pts is None else pts >= -5.0),
        Target(fam, "autoscaled unit-seconds >= 30% fewer than the peak-sized fleet",
               f"{_pct(saving)} fewer ({num(a.get('unit_seconds'), 0)} vs "
               f"{num(b.get('unit_seconds'), 0)}; minimum-sized {num(c.get('unit_seconds'), 0)})",
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
    sim = (r.get("simulator") or {}).get("vs_measured", {}).get("autoscaled")
    if sim:
        p99, mean = sim["ttft_p99_s"], sim["units_mean"]
        out.append(Target(fam, "information: simulator vs measured, autoscaled fleet",
                          f"TTFT p99 {num(p99['predicted'])} vs {num(p99['measured'])} s, "
                          f"units mean {num(mean['predicted'])} vs {num(mean['measured'])}; "
                          f"within tolerance: {num(sim['within_tolerance'])}", None,
                          status="information, no target"))  # fmt: skip
    return out


TARGETS: dict[str, Callable[[dict[str, Any]], list[Target]]] = {
    "executor": _executor_targets,
    "serving": _serving_targets,
    "proxy": _proxy_targets,
    "routing": _routing_targets,
    "routing_open": _routing_open_targets,
    "failover": _failover_targets,
    "load": _load_targets,
    "serving_mn": _serving_mn_targets,
    "cpu": _cpu_targets,
    "failures": _failures_targets,
    "startup": _startup_targets,
    "classes": _classes_targets,
    "capacity": _capacity_targets,
    "capacity_diurnal": lambda r: _capacity_targets(r, "capacity_diurnal"),
    "soak": _soak_targets,
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


def targets(results: dict[str, dict[str, Any]]) -> list[Target]:
    out: list[Target] = []
    for fam, fn in TARGETS.items():
        if fam in results:
            out += fn(results[fam])
        else:
            out += [Target(fam, t, "no result", None) for t in NOT_MEASURED[fam]]
    return out


# ---- plots ---------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _err(s: dict[str, Any]) -> list[float]:
    return [s["median"] - s["min"], s["max"] - s["median"]]


def _bars(path: Path, title: str, ylabel: str, groups: list[str],
          series: dict[str, list[dict[str, Any]]]) -> Path:  # fmt: skip
    """Grouped bars (median) with min..max error bars."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(groups) + 2), 3.6))
    width = 0.8 / max(1, len(series))
    for i, (label, spreads) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        meds = [s["median"] for s in spreads]
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


def _serving_arms(r: dict[str, Any]) -> dict[str, Any]:
    """Arms in a fixed order: the two compared, then the informational ones."""
    arms = r["arms"]
    first = (r.get("ratio_arm", "triton"), "vllm")
    order = [a for a in first if a in arms] + sorted(set(arms) - set(first))
    return {a: arms[a] for a in order}


def plot_serving(r: dict[str, Any], plots: Path) -> list[Path]:
    arms = _serving_arms(r)
    names = list(arms)
    out = [_bars(plots / "serving_throughput.png", "Output tok/s (median, min..max over repeats)",
                 "tok/s", names, {"output tok/s": [arms[a]["output_tok_s"] for a in names]})]  # fmt: skip
    groups = [f"{m.upper()} {q}" for m in ("ttft", "tpot", "itl", "e2el") for q in ("p50", "p99")]
    series = {a: [arms[a][f"{m}_{q}_ms"] for m in ("ttft", "tpot", "itl", "e2el")
                  for q in ("p50", "p99")] for a in names}  # fmt: skip
    out.append(_bars(plots / "serving_latency.png", "Latency (ms, median over repeats)", "ms",
                     groups, series))  # fmt: skip
    return out


def plot_scaling(r: dict[str, Any], plots: Path) -> list[Path]:
    plt = _plt()
    rows = r["levels"]
    cs = [row["concurrency"] for row in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))

    def line(ax: Any, key: str, label: str) -> None:
        meds = [row[key]["median"] for row in rows]
        errs = list(zip(*(_err(row[key]) for row in rows), strict=True))
        ax.errorbar(cs, meds, yerr=errs, marker="o", capsize=3, label=label)

    line(a1, "output_tok_s", "output tok/s")
    a1.set_ylabel("output tok/s")
    line(a2, "ttft_p50_ms", "TTFT p50")
    line(a2, "ttft_p99_ms", "TTFT p99")
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


def plot_executor(r: dict[str, Any], plots: Path) -> list[Path]:
    return [_bars(plots / "executor.png", "TP=2 output tok/s (median, min..max)", "tok/s",
                  ["unit executor", "MultiprocExecutor"],
                  {"tok/s": [r["unit_tok_s_spread"], r["mp_tok_s_spread"]]})]  # fmt: skip


def plot_proxy(r: dict[str, Any], plots: Path) -> list[Path]:
    arms = r["arms"]
    keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    return [_bars(plots / "proxy.png", "Direct vs through the proxy (ms, median, min..max)", "ms",
                  [k.removesuffix("_ms").replace("_", " ").upper() for k in keys],
                  {a: [arms[a][k] for k in keys] for a in ("direct", "proxy")})]  # fmt: skip


def plot_routing(r: dict[str, Any], plots: Path) -> list[Path]:
    plt = _plt()
    arms = r["arms"]
    names = list(arms)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    a1.bar(names, [(arms[n].get("hit_rate") or {}).get("median", 0) for n in names])
    a1.set_title("prefix-cache hit rate (vLLM's counters)")
    for key, off in (("ttft_p50_ms", -0.2), ("ttft_p90_ms", 0.2)):
        a2.bar([i + off for i in range(len(names))],
               [(arms[n].get(key) or {}).get("median", 0) for n in names], width=0.4,
               label=key.removeprefix("ttft_").removesuffix("_ms"))  # fmt: skip
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


PLOTS: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
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


def _meta(r: dict[str, Any]) -> list[str]:
    m = r.get("machine", {})
    lines = [f"- result `{r['_file']}`, {r.get('time', '?')}, commit `{r.get('commit', '?')}`",
             f"- machine: {m.get('cpus')} CPUs ({m.get('cpu_model', '?')}; "
             f"{' '.join(m.get('cpu_flags', [])) or 'ISA flags not recorded'}), "
             f"{m.get('memory_gib')} GiB, {m.get('platform', '')}"]  # fmt: skip
    if "machine_load" in r:
        ml = r["machine_load"]
        lines.append(f"- load average (1 min) at start {num(ml.get('load_avg_1m_start'))}, "
                     f"at end {num(ml.get('load_avg_1m_end'))}")  # fmt: skip
    settings = (r.get("workload") or r.get("settings")
                or {k: r[k] for k in ("command", "quick") if k in r})  # fmt: skip
    if settings:
        lines.append(f"- settings: `{json.dumps(settings, sort_keys=True)}`")
    return lines


def _serving_section(r: dict[str, Any]) -> list[str]:
    arms = _serving_arms(r)
    keys = ["output_tok_s"] + [f"{m}_{q}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                               for q in ("p50", "p99")] + ["client_cpu_us_per_token"]  # fmt: skip
    rows = [[k] + [spread_text(arms[a].get(k), 1) for a in arms] for k in keys
            if any(arms[a].get(k) for a in arms)]  # fmt: skip
    if r.get("benchmark", "").startswith("serving_mn"):
        how = ("`triton_http`: our TP=2 unit (leader behind Triton, one follower), Triton's "
               "HTTP generate_stream; `vllm`: `vllm serve --nnodes 2` (node 1 headless), "
               "/v1/completions. Each repeat starts each system afresh; the ratio is ours "
               "over theirs.")  # fmt: skip
    elif r.get("ratio_arm") == "triton_http":
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


def _scaling_section(r: dict[str, Any]) -> list[str]:
    keys = [
        "output_tok_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "itl_p50_ms",
        "e2el_p50_ms",
    ]
    rows = [[str(row["concurrency"])] + [spread_text(row[k], 1) for k in keys]
            for row in r["levels"]]  # fmt: skip
    return _table(["streams", *keys], rows)


def _executor_section(r: dict[str, Any]) -> list[str]:
    return _table(["figure", "value"], [
        ["unit executor tok/s", spread_text(r.get("unit_tok_s_spread"), 0)],
        ["MultiprocExecutor tok/s", spread_text(r.get("mp_tok_s_spread"), 0)],
        ["ratio (median/median)", num(r.get("ratio"))],
        *([["vLLM multi-node (--nnodes 2) tok/s", spread_text(r.get("mn_tok_s_spread"), 0)],
           ["unit / multi-node", _with_pairs(r.get("ratio_vs_mn"), r.get("ratio_vs_mn_per_pair"))],
           ["unit on Gloo / multi-node (like for like: no shared-memory all-reduce)",
            _with_pairs(r.get("gloo_ratio_vs_mn"), r.get("gloo_ratio_vs_mn_per_pair") or None)]]
          if r.get("mn_tok_s_spread") else []),
        ["control broadcast p50 / p99", f"{num(r.get('control_p50_us'), 0)} / {num(r.get('control_p99_us'), 0)} us"],
        ["bytes per broadcast (payload / wire)", f"{num(r.get('payload_bytes_per_msg'), 0)} / {num(r.get('wire_bytes_per_msg'), 0)}"],
    ])  # fmt: skip


def _proxy_section(r: dict[str, Any]) -> list[str]:
    keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    rows = [[k, *(spread_text(r["arms"][a][k], 1) for a in ("direct", "proxy")),
             spread_text(r.get(f"added_{k}"), 2)] for k in keys]  # fmt: skip
    seq = r.get("sequential", {})
    hop = ""
    if r.get("proxy_hop_ttft_p50_ms"):
        seq_hop = seq.get("proxy", {})
        hop = (f" The proxy's own account of its hop (TTFT at the proxy minus the unit's, "
               f"from its `proxy_added_time_to_first_token_seconds` histogram): p50 "
               f"{spread_text(r['proxy_hop_ttft_p50_ms'], 2)} ms, p99 "
               f"{spread_text(r['proxy_hop_ttft_p99_ms'], 2)} ms at 64 streams; "
               f"{num(seq_hop.get('hop_p50_ms'), 2)} / {num(seq_hop.get('hop_p99_ms'), 2)} ms "
               f"one stream at a time.")  # fmt: skip
    lines = [*_table(["figure", "direct", "proxy", "added"], rows), "",
             f"One stream at a time: added TTFT p50 {num(seq.get('added_ttft_p50_ms'))} ms, "
             f"p99 {num(seq.get('added_ttft_p99_ms'))} ms.{hop}"]  # fmt: skip
    http, other_name = _other_upstream(r)
    if http:
        cpu = r.get("proxy_cpu_us_per_token")
        rows = [[k.replace("_", " "), spread_text(cpu if k == "proxy_cpu_us_per_token" else
                                                  r.get(k), 2), spread_text(http.get(k), 2)]
                for k in ("added_ttft_p50_ms", "added_ttft_p99_ms", "proxy_hop_ttft_p50_ms",
                          "proxy_hop_ttft_p99_ms", "proxy_cpu_us_per_token")]  # fmt: skip
        rows.append(["one stream at a time: added TTFT p50 ms",
                     num(seq.get("added_ttft_p50_ms"), 2),
                     num(http.get("sequential_added_ttft_p50_ms"), 2)])  # fmt: skip
        first = "the channel (default)" if r.get("grpc_upstream") else "gRPC (default)"
        lines += ["", "By upstream transport:", "",
                  *_table(["figure", first, other_name], rows)]  # fmt: skip
    return lines


def _routing_section(r: dict[str, Any]) -> list[str]:
    keys = ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "output_tokens_per_s", "load_spread",
            "prediction_accuracy")  # fmt: skip
    rows = [[name, *(spread_text(a.get(k), 3 if k in ("hit_rate", "prediction_accuracy") else 0)
                     for k in keys), num(a.get("errors"))]
            for name, a in r.get("arms", {}).items()]  # fmt: skip
    w = r.get("workload", {})
    arrivals = (
        f"{num(w['sessions_per_s'])} sessions/s arriving as a Poisson process"
        if w.get("sessions_per_s")
        else f"{w.get('concurrent_sessions')} at a time"
    )
    reuse = w.get("reuse") or {}
    ceiling = (
        f"; hit-rate ceiling {num(reuse['ceiling'], 3)} (a session's own earlier turns "
        f"{num(reuse.get('session_local'), 3)}, other sessions of its tenant "
        # "first_turn": the name in results of 9734e78
        f"{num(reuse.get('other_sessions', reuse.get('first_turn')), 3)})"
        if reuse.get("ceiling") is not None
        else ""
    )
    return [f"- {w.get('tenants')} tenants, {w.get('sessions')} sessions x {w.get('turns')} "
            f"turns ({arrivals}), prefix working set {num(w.get('pressure'))}x the fleet's KV "
            f"cache, model {Path(str(w.get('model'))).name}{ceiling}", "",
            *_table(["arm", "hit rate", "TTFT p50 ms", "TTFT p90 ms", "output tok/s",
                     "load spread", "prediction accuracy", "errors"], rows)]  # fmt: skip


def _failover_section(r: dict[str, Any]) -> list[str]:
    rows = [["time to first ready", f"{num(r.get('time_to_first_ready_s'), 1)} s"],
            ["peak RSS / PSS", f"{num(r.get('peak_rss_gib'))} / {num(r.get('peak_pss_gib'))} GiB"]]  # fmt: skip
    for f in r.get("failover", []):
        rows.append([f"kill {f.get('victim')}",
                     f"unhealthy after {num(f.get('kill_to_unhealthy_s'))} s, "
                     f"{f.get('client_visible_errors')} client errors of {f.get('streams')} streams, "
                     f"routable again after {num(f.get('kill_to_routable_again_s'), 1)} s"])  # fmt: skip
    if r.get("error"):
        rows.append(["error", str(r["error"])])
    return _table(["figure", "value"], rows)


def _failures_section(r: dict[str, Any]) -> list[str]:
    """One row per case: what the serving process's health said, who exited when, how
    the in-flight requests ended and what was left running."""

    def exits(c: dict[str, Any]) -> str:
        return ", ".join(f"{k} rc {v['rc']} at {v['s']} s" for k, v in
                         sorted(c.get("exit_s", {}).items())) or "none"  # fmt: skip

    def requests(c: dict[str, Any]) -> str:
        counts: dict[str, int] = {}
        for outcome in c.get("requests", []):
            kind = outcome.split(":", 1)[0].split(",", 1)[0]
            counts[kind] = counts.get(kind, 0) + 1
        return ", ".join(f"{n} {k}" for k, n in counts.items()) or "n/a"

    def left(c: dict[str, Any]) -> str:
        return (
            "; ".join(f"{k}: {len(v)}" for k, v in sorted(c.get("left", {}).items()) if v)
            or "nothing"
        )

    rows = []
    for c in r.get("cases", []):
        case = [c.get("system", "?"), f"{c.get('signal')} {c.get('victim')}"]
        if "error" in c:
            rows.append([*case, "error: " + str(c["error"]).splitlines()[0], "", "", ""])
            continue
        health = " -> ".join(f"{a}@{t}s" for a, t in c.get("health", []))
        rows.append([*case, health, exits(c), requests(c), left(c)])
    return _table(["system", "failure", "health over time", "exits", "in-flight requests",
                   "processes left at window end"], rows)  # fmt: skip


def _generic_section(r: dict[str, Any]) -> list[str]:
    """Any result layout: top-level figures, then per-arm tables of spreads."""
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
        out += ["", *_table(["figure", *arms], [[k, *(spread_text(a.get(k), 2) for a in arms.values())]
                                                 for k in keys])]  # fmt: skip
    return out


def _capacity_section(r: dict[str, Any]) -> list[str]:
    """The arms side by side, SLO attainment per minute, the simulator's prediction."""
    arms = r.get("arms", {})
    tr = r.get("trace", {})
    out = [f"Trace `{tr.get('name')}` {tr.get('window_s')} s of its day, {num(tr.get('duration_s'), 0)} s "
           f"long, {num(tr.get('base_rps'), 1)} -> {num(tr.get('peak_rps'), 1)} req/s "
           f"({num(tr.get('arrivals'))} arrivals, seed {tr.get('seed')}); SLO TTFT <= "
           f"{num(r.get('slo_ttft_s'), 1)} s; probe: {num((r.get('probe') or {}).get('saturated_streams_per_s'), 1)} "
           f"streams/s saturated, {num(tr.get('per_unit_rps_at_target'), 1)} req/s at target per unit.", ""]  # fmt: skip
    rows = []
    for name, a in arms.items():
        if "error" in a and "requests" not in a:
            rows.append([name, f"error: {a['error']}", "", "", "", "", "", ""])
            continue
        ups = a.get("decision_to_routable_s")
        rows.append([name, _pct(a.get("slo_attainment")), num(a.get("ttft_p50_s"), 3),
                     num(a.get("ttft_p99_s"), 3), num(a.get("failed")),
                     num(a.get("unit_seconds"), 0),
                     f"{num(a.get('units_mean'))} (max {num(a.get('units_max'))})",
                     "" if ups is None else f"+{a.get('units_added')} / -{a.get('units_removed')}; "
                     f"decision to routable {ups} s; failed in scale-in "
                     f"{a.get('failed_during_scale_in')}"])  # fmt: skip
    out += _table(["fleet", "SLO met", "TTFT p50 s", "TTFT p99 s", "failed", "unit-s",
                   "units mean", "scaling"], rows)  # fmt: skip
    minutes = {n: a.get("per_minute", []) for n, a in arms.items() if a.get("per_minute")}
    if minutes:
        n = max(len(m) for m in minutes.values())
        out += ["", *_table(["minute", *minutes], [[str(i), *(
            f"{_pct(m[i]['slo_attainment'])}, p99 {num(m[i]['ttft_p99_s'], 2)} s"
            if i < len(m) else "" for m in minutes.values())] for i in range(n)])]  # fmt: skip
    sim = r.get("simulator")
    if sim:
        out += ["", f"Simulator (start-up {num(sim.get('startup_s'), 1)} s: "
                f"{sim.get('startup_from')}; policy: {sim.get('policy_from')}; tolerance "
                f"`{json.dumps(sim.get('tolerance'))}`):", ""]  # fmt: skip
        rows = []
        for name, v in sim.get("vs_measured", {}).items():
            rows.append([name] + [f"{num(v[k]['predicted'], 3)} vs {num(v[k]['measured'], 3)}"
                                  for k in ("ttft_p50_s", "ttft_p99_s", "units_mean", "units_max")]
                        + [num(v.get("within_tolerance"))])  # fmt: skip
        out += _table(["fleet", "TTFT p50 s (sim vs run)", "TTFT p99 s", "units mean",
                       "units max", "within tolerance"], rows)  # fmt: skip
        sweep = sim.get("startup_sweep") or []
        if sweep:
            out += ["", "The simulator's start-up sweep (the cold autoscaled fleet at each "
                    "decision-to-routable time, against the predicted peak fleet):", ""]  # fmt: skip
            out += _table(["decision -> routable", *(f"{num(x['startup_s'], 0)} s" for x in sweep)],
                          [["SLO points vs peak", *(num(x["slo_points_minus_peak"], 1) for x in sweep)],
                           ["unit-seconds fewer", *(_pct(x["unit_seconds_saving_vs_peak"]) for x in sweep)],
                           ["both targets", *(num(x["targets_met"]) for x in sweep)]])  # fmt: skip
    if r.get("error"):
        out += ["", f"error: {r['error']}"]
    return out


SECTIONS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "executor": _executor_section,
    "serving": _serving_section,
    "proxy": _proxy_section,
    "routing": _routing_section,
    "routing_open": _routing_section,
    "failover": _failover_section,
    "scaling": _scaling_section,
    "load": _generic_section,
    "serving_mn": _serving_section,
    "failures": _failures_section,
    "cpu": _generic_section,
    "startup": _generic_section,
    "classes": _generic_section,
    "capacity": _capacity_section,
    "capacity_diurnal": _capacity_section,
    "soak": _soak_section,
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


def _run_order(all_result: dict[str, Any], name: str) -> int:
    order = all_result.get("order") or []
    return order.index(name) if name in order else len(order)


def render(results: dict[str, dict[str, Any]], plots_dir: Path, report_path: Path) -> str:
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
        a = results["all"]
        lines += ["", "## `bench all` wall time", "",
                  f"Run of {a.get('time')} (commit `{a.get('commit')}`, "
                  f"{'quick' if a.get('quick') else 'full'} sizes):", ""]  # fmt: skip
        lines += _table(["benchmark", "wall s", "exit code"],
                        [[k, num(v.get("wall_s"), 0), num(v.get("rc"))]
                         for k, v in sorted(a.get("wall_s", {}).items(),
                                            key=lambda kv: _run_order(a, kv[0]))])  # fmt: skip
        lines.append(f"| total (benchmarks) | {num(a.get('benchmarks_wall_s'), 0)} | |")
    for fam in FAMILIES:
        lines += ["", f"## {TITLES[fam]}", ""]
        r = results.get(fam)
        if r is None:
            lines.append(f"No result yet (`neuron-serving bench {COMMANDS.get(fam, fam)}`).")
            continue
        lines += _meta(r) + [""]
        try:
            lines += SECTIONS[fam](r)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            lines.append(f"(figures not rendered: {type(e).__name__}: {e})")
        if fam in PLOTS:
            try:
                for p in PLOTS[fam](r, plots_dir):
                    rel = Path(p).resolve().relative_to(report_path.resolve().parent)
                    lines += ["", f"![{fam}]({rel.as_posix()})"]
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                lines.append(f"(plot not drawn: {type(e).__name__}: {e})")
    return "\n".join(lines) + "\n"


def run_label(fam: str, r: dict[str, Any]) -> str:
    """``executor``: ``executor.json, 2026-12-04, AMD EPYC 7763`` (the result's file,
    date and CPU model; ratios move with the CPU more than with anything else)."""
    cpu = (r.get("machine") or {}).get("cpu_model") or "CPU not recorded"
    return f"`{fam}`: {r.get('_file', '?')}, {str(r.get('time', '?'))[:10]}, {cpu}"


def readme_rows(results: dict[str, dict[str, Any]]) -> list[MeasuredRow]:
    """The README's table: every target (not the information rows) of the newest
    result of each benchmark; the result's file, date and CPU on its first row."""
    rows, labelled = [], set()
    for t in targets(results):
        if t.status.startswith("information"):
            continue
        r = results.get(t.benchmark)
        label = "" if t.benchmark in labelled else (
            run_label(t.benchmark, r) if r else f"`{t.benchmark}`: no result")  # fmt: skip
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
    path, ts = write_report(readme=README)
    met = sum(1 for t in ts if t.met)
    missed = sum(1 for t in ts if t.met is False)
    info = sum(1 for t in ts if t.met is None and t.status.startswith("information"))
    print(f"report: {met} targets met, {missed} missed, {len(ts) - met - missed - info} not "
          f"measured, {info} information rows -> {path}", file=sys.stderr)  # fmt: skip
    if emit_json:
        print(json.dumps([t.__dict__ for t in ts]))
    return 0
