"""The report from small synthetic result files: markdown, target marks, PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from neuron_serving.bench import report, scaling, serving
from neuron_serving.bench.common import spread
from neuron_serving.bench.metrics import from_chunks, summarize
from neuron_serving.bench.results import Spread

MACHINE = {"cpus": 2, "memory_gib": 23.5, "platform": "Linux"}
LOAD = {"load_avg_1m_start": 1.0, "load_avg_1m_end": 1.5}
# Each benchmark's figures that a result always has and these tests do not look at.
BROADCAST = {"control_p50_us": 230.0, "control_p99_us": 780.0, "payload_bytes_per_msg": 1312.0,
             "wire_bytes_per_msg": 4193.0}  # fmt: skip
LOAD_RATIOS = {"load_model_ratio_sharded_over_full": 1.02,
               "read_bytes_ratio_sharded_over_full": {"0": 0.5, "1": 0.77},
               "ready_ratio_sharded_over_full": 1.18}  # fmt: skip
ROUTING_WORKLOAD = {"tenants": 8, "sessions": 48, "turns": 4, "pressure": 1.5,
                    "model": "smollm2-135m-instruct", "concurrent_sessions": 6}  # fmt: skip
TRACE = {"window_s": [45600.0, 57600.0], "duration_s": 240.0, "base_rps": 30.0,
         "peak_rps": 150.0, "arrivals": 100, "seed": 0, "per_unit_rps_at_target": 70.0}  # fmt: skip


def _proxy(**figures: object) -> dict:
    """A bench proxy result with every figure the report reads; ``figures`` replace some."""
    arm = {
        k: spread([10.0, 12.0]) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    }
    hop = {"added_ttft_p50_ms": spread([0.5, 0.7]), "added_ttft_p99_ms": spread([3.0, 4.0]),
           "proxy_hop_ttft_p50_ms": spread([0.08, 0.09]), "proxy_hop_ttft_p99_ms": spread([2.7, 3.7]),
           "proxy_cpu_us_per_token": spread([88.0, 98.0])}  # fmt: skip
    return {"workload": {"streams": 64}, "arms": {"direct": arm, "proxy": arm}, **hop,
            "targets": {"added_ttft_p50_ms": 1.0, "added_ttft_p99_ms": 5.0},
            "added_itl_p50_ms": spread([-1.0, 0.0]), "added_itl_p99_ms": spread([-2.0, 1.0]),
            "grpc_upstream": {**hop, "sequential_added_ttft_p50_ms": 2.4},
            "sequential": {"added_ttft_p50_ms": -1.1, "added_ttft_p99_ms": 20.2,
                           "proxy": {"hop_p50_ms": 0.67, "hop_p99_ms": 2.84}},
            "throughput": {"streams": 16, "ratio": 0.99, "ratio_per_repeat": spread([0.99, 1.09]),
                           "openai_ratio_per_repeat": spread([0.94, 1.05]), "target": 0.95},
            **figures}  # fmt: skip


def _routing_arm(**spreads: dict) -> dict:
    """A bench routing arm: the spreads given, {} (spread of no values) for the others."""
    keys = ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "output_tokens_per_s", "load_spread",
            "prediction_accuracy")  # fmt: skip
    return {**{k: {} for k in keys}, **spreads, "errors": 0}


def _routing_ratios(**ratios: dict) -> dict:
    """bench routing's ratios: the target ratios {} unless given, the reference ones absent."""
    return {"hit_rate_exact_over_approximate": {}, "ttft_p90_exact_over_approximate": {},
            "hit_rate_pp_2_replicas_vs_1": {}, **ratios}  # fmt: skip


def _run(ttft: float, gap: float, n: int = 8, duration: float = 1.0) -> dict:
    return summarize([from_chunks(0.0, [ttft + gap * k for k in range(4)]) for _ in range(n)],
                     duration)  # fmt: skip


def _write(d: Path, name: str, body: dict, time: str = "2026-12-02T10:00:00Z") -> None:
    body = {"benchmark": name, "commit": "abc1234", "machine": MACHINE, "time": time,
            "machine_load": LOAD, **body}  # fmt: skip
    (d / f"{name}.json").write_text(json.dumps(body))


def _results(d: Path) -> None:
    runs = [{"triton_http": _run(0.05, 0.01, duration=d_t), "vllm": _run(0.04, 0.01, duration=1.0),
             "triton": _run(0.06, 0.0)} for d_t in (1.2, 1.3)]  # fmt: skip
    _write(d, "serving-quick", {"workload": {"concurrency": 16}, **serving.aggregate(runs),
                                "targets": {"throughput_ratio": 0.9, "ttft_p50_ratio": 1.2},
                                "runs": runs})  # fmt: skip
    # An older full run of the same benchmark: the quick one above is newer and wins.
    _write(d, "serving", {"throughput_ratio": 5.0}, time="2026-12-01T10:00:00Z")
    levels = {c: [_run(0.01 * c, 0.01, duration=1.0 / c)] for c in (1, 4, 16)}
    _write(d, "scaling-quick", {"levels": scaling.aggregate(levels)})
    _write(d, "executor", {"ratio": 0.95, "ratio_per_pair": spread([0.9, 1.0]),
                           "unit_tok_s_spread": spread([900, 1000]),
                           "mp_tok_s_spread": spread([1000, 1000]), "target_ratio": 0.9,
                           **BROADCAST})  # fmt: skip
    _write(d, "proxy-quick", _proxy(added_ttft_p50_ms=spread([0.5, 0.7]),
                                    added_ttft_p99_ms=spread([6.0, 8.0])))  # fmt: skip

    def arm(hit: float, p90: float) -> dict:
        return {"hit_rate": spread([hit]), "ttft_p50_ms": spread([5.0]),
                "ttft_p90_ms": spread([p90]), "output_tokens_per_s": spread([50.0]),
                "load_spread": spread([1.2]), "prediction_accuracy": spread([0.97]), "errors": 0}  # fmt: skip

    _write(d, "routing-quick", {
        "arms": {"round_robin": arm(0.3, 90.0), "approximate": arm(0.5, 80.0),
                 "exact": arm(0.65, 60.0), "exact_2_replicas": arm(0.64, 61.0)},
        "ratios": {"hit_rate_exact_over_approximate": spread([1.3, 1.1]),
                   "ttft_p90_exact_over_approximate": spread([0.75, 0.8]),
                   "hit_rate_pp_2_replicas_vs_1": spread([1.0, 0.5])},
        "workload": ROUTING_WORKLOAD,
    })  # fmt: skip
    _write(d, "failover", {"failover": [{"victim": "unit-0/follower-1", "kill_to_unhealthy_s": 0.9,
                                         "client_visible_errors": 0, "streams": 8,
                                         "kill_to_routable_again_s": 60.0}],
                           "time_to_first_ready_s": 150.0, "peak_rss_gib": 5.8,
                           "peak_pss_gib": 4.3, "rss_budget_gib": 12.0})  # fmt: skip
    _write(d, "all", {"quick": True, "wall_s": {"executor": {"wall_s": 60.0, "rc": 0}},
                      "order": ["executor", "report"], "benchmarks_wall_s": 60.0})  # fmt: skip
    # A file from the old standalone script (no "benchmark" key) is ignored.
    (d / "triton_vs_vllm-20261202-152007.json").write_text(json.dumps({"throughput_ratio": 0.5}))


def test_latest_results_picks_newest_per_benchmark(tmp_path):
    _results(tmp_path)
    found = report.latest_results(tmp_path)
    assert set(found) == {"serving", "scaling", "executor", "proxy", "routing", "failover", "all"}
    assert found["serving"].file == "serving-quick.json"


def test_report_marks_targets_and_draws_plots(tmp_path):
    _results(tmp_path)
    md_path, ts = report.write_report(tmp_path, tmp_path / "REPORT.md", tmp_path / "plots")
    md = md_path.read_text()
    by = {(t.benchmark, t.target): t for t in ts}
    tput = next(t for t in ts if t.benchmark == "serving" and "tok/s" in t.target)
    assert tput.met is False  # 1/1.25 median ratio = 0.8
    assert tput.measured.startswith("0.80")
    ttft = next(t for t in ts if t.benchmark == "serving" and "TTFT" in t.target)
    assert ttft.met is False  # 50 ms vs 40 ms = 1.25x
    assert "HTTP/SSE both" in tput.target
    info = [t for t in ts if t.benchmark == "serving" and t.target.startswith("information")]
    assert len(info) == 2 and all(t.met is None for t in info)  # the gRPC arm: no status
    assert by[("executor", "unit / MultiprocExecutor output tok/s >= 0.9")].met is True
    proxy = [t for t in ts if t.benchmark == "proxy" and t.target.startswith("added TTFT")]
    assert [t.met for t in proxy] == [True, False]
    routing = [t for t in ts if t.benchmark == "routing"]
    # hit ratio median 1.2 (1.1..1.3) straddles its target; p90 0.775 misses 0.7.
    assert [t.met for t in routing] == [True, False, True, True]
    assert routing[0].straddles and "1.20 (1.10..1.30, n=2)" in routing[0].measured
    assert all(t.met for t in ts if t.benchmark == "failover")
    load = [t for t in ts if t.benchmark == "load"]
    assert load and all(t.met is None for t in load)
    assert "**missed**" in md and "not measured" in md
    assert "commit `abc1234`" in md and "2 CPUs" in md
    assert "time between consecutive streamed chunks" in md
    for name in (
        "serving_throughput",
        "serving_latency",
        "scaling",
        "executor",
        "proxy",
        "routing",
    ):
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](plots/{name}.png)" in md


def test_load_result_with_its_own_targets(tmp_path):
    _write(tmp_path, "load-quick", {"speedup": 1.8, "targets": {"speedup": ">= 1.5"},
                                    "met": {"speedup": True}, **LOAD_RATIOS})  # fmt: skip
    _, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    load = [t for t in ts if t.benchmark == "load"]
    assert [(t.target, t.measured, t.met) for t in load] == [("speedup >= 1.5", "1.80", True)]


@pytest.mark.parametrize("r,order", [(0, [1, 4, 16]), (1, [16, 4, 1])])
def test_scaling_level_order_alternates(r, order):
    assert scaling.level_order((1, 4, 16), r) == order
    assert scaling.requests_at(1, 2) == scaling.MIN_REQUESTS
    assert scaling.requests_at(64, 2) == 128


def test_load_result_without_targets_renders_generically(tmp_path):
    arm = {"ready_s": spread([20.0, 24.0])}
    _write(tmp_path, "load", {"settings": {"tp": 2}, "full": arm, "sharded": arm,
                              **LOAD_RATIOS, "ready_ratio_sharded_over_full": 0.9})  # fmt: skip
    md_path, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    (load,) = [t for t in ts if t.benchmark == "load"]
    assert load.met is None and load.mark() == "no numeric target recorded"
    assert "ready_ratio 0.90" in load.measured
    md = md_path.read_text()
    assert "| ready_s | 22.00 (20.00..24.00, n=2) | 22.00 (20.00..24.00, n=2) |" in md
    assert 'settings: `{"tp": 2}`' in md


def test_verdict_flags_spread_that_straddles_the_target():
    def s(values: list[float]) -> Spread:
        return msgspec.convert(spread(values), Spread)

    assert report.straddles(s([-500.0, -100.0, 30.0]), 1.0)
    assert not report.straddles(s([0.5, 0.7]), 1.0)
    assert not report.straddles(s([3.0]), 1.0)  # n=1: no spread to judge
    t = report.Target("proxy", "x", "y", True, straddles=True)
    assert t.mark() == "met (spread straddles the target)"


def test_multinode_comparisons_are_reported_for_information(tmp_path):
    """The mn arms of bench executor, bench serving_mn and bench failures: rows with
    their spreads, no target status, and the failure table row by row."""
    _write(tmp_path, "executor", {
        "ratio": 0.89, "ratio_per_pair": spread([0.88, 0.9]), "target_ratio": 0.9,
        "unit_tok_s_spread": spread([89, 90]), "mp_tok_s_spread": spread([100, 100]),
        "mn_tok_s_spread": spread([80, 86]), "ratio_vs_mn": 1.07,
        "ratio_vs_mn_per_pair": spread([1.05, 1.09]), "gloo_ratio_vs_mn": 1.06,
        "gloo_ratio_vs_mn_per_pair": spread([1.04, 1.08]), **BROADCAST,
    })  # fmt: skip
    runs = [{"triton_http": _run(0.05, 0.01, duration=1.0), "vllm": _run(0.05, 0.01, duration=1.1)}
            for _ in range(2)]  # fmt: skip
    _write(tmp_path, "serving_mn-quick", {**serving.aggregate(runs), "runs": runs})
    cases = [
        {"system": "unit", "victim": "rank1", "signal": "SIGSTOP", "health": [["200", 0.0],
         ["400", 3.64]], "exit_s": {"rank0": {"rc": 3, "s": 7.88}},
         "requests": ["error event: model llm is unavailable: unit failed, +3.6 s"] * 4,
         "left": {"rank0": [], "rank1": ["python 1 stopped"]}},
        {"system": "vllm_mn", "victim": "rank1", "signal": "SIGSTOP", "health": [["200", 0.0]],
         "exit_s": {}, "requests": ["hung: open, no event for 120.0 s"] * 4,
         "left": {"rank0": ["python 2 sleeping"], "rank1": ["python 3 stopped"]}},
        {"system": "unit", "victim": "rank0", "signal": "SIGKILL", "error": "no readiness\nx"},
    ]  # fmt: skip
    _write(tmp_path, "failures", {"cases": cases})
    md_path, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    md = md_path.read_text()
    info = {t.target: t for t in ts if t.target.startswith("information")}
    mn = info["information: unit / vLLM multi-node (--nnodes 2) output tok/s"]
    assert mn.met is None and mn.measured == "1.07 (per pair 1.05..1.09, n=2)"
    serving_mn = [t for t in ts if t.benchmark == "serving_mn"]
    assert len(serving_mn) == 2 and serving_mn[0].measured.startswith("1.10 (per repeat")
    assert (
        "| unit | SIGSTOP rank1 | 200@0.0s -> 400@3.64s | rank0 rc 3 at 7.88 s | 4 error event"
        in md
    )
    assert "| vllm_mn | SIGSTOP rank1 | 200@0.0s | none | 4 hung | rank0: 1; rank1: 1 |" in md
    assert "| unit | SIGKILL rank0 | error: no readiness |" in md
    assert "unit on Gloo / multi-node" in md and "`vllm serve --nnodes 2`" in md


def test_proxy_throughput_and_cpu_targets(tmp_path):
    _write(tmp_path, "proxy-quick", _proxy(
        added_ttft_p50_ms=spread([0.5, 0.7]), added_ttft_p99_ms=spread([3.0, 4.0]),
        throughput={"streams": 16, "ratio": 0.93, "ratio_per_repeat": spread([0.9, 0.96]),
                    "openai_ratio_per_repeat": spread([0.8, 0.84]), "target": 0.95},
    ))  # fmt: skip
    other = {"proxy_us_per_token": 60.0, "per_token_ratio": 0.6, "proxy_us_per_request": 800.0}
    _write(tmp_path, "cpu-quick", {"proxy_vs_vllm_api_server": {
        "proxy_us_per_token": 40.0, "api_server_us_per_token": 100.0, "per_token_ratio": 0.4,
        "proxy_us_per_request": 700.0, "api_server_us_per_request": 900.0,
        "proxy_us_per_request_raw": 750.0, "channel_asyncio": other, "grpc_upstream": other,
        "targets": {"per_token_ratio": 0.5, "proxy_us_per_request": 500.0}}})  # fmt: skip
    _, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    by = {t.target: t for t in ts}
    tput = by["throughput through the proxy / direct at 16 streams >= 0.95"]
    assert tput.met is False and tput.straddles and tput.measured.startswith("0.93 (per repeat")
    assert by["proxy CPU per output token / vLLM API server's <= 0.5"].met is True
    assert by["proxy CPU per request <= 500 us"].met is False


def test_capacity_targets_and_section(tmp_path):
    """bench capacity: SLO points and unit-seconds against the peak-sized fleet, scale-in
    failures (not measured when nothing scaled in), the simulator for information."""

    def arm(att: float, us: float, **kw) -> dict:
        return {"requests": 100, "slo_attainment": att, "ttft_p50_s": 0.05, "ttft_p99_s": 0.8,
                "failed": 0, "unit_seconds": us, "units_mean": us / 240, "units_max": 3,
                "per_minute": [{"minute": 0, "requests": 50, "slo_attainment": att,
                                "ttft_p99_s": 0.8, "failed": 0}], "failed_during_scale_in": 0,
                **kw}  # fmt: skip

    auto = arm(0.96, 400.0, scale_in_windows=[[150.0, 160.0]], failed_during_scale_in=0,
               decision_to_routable_s=[29.5], units_added=2, units_removed=1)  # fmt: skip
    side = {"predicted": 1.0, "measured": 0.8, "within": True}
    _write(tmp_path, "capacity-quick", {
        "slo_ttft_s": 1.0, "trace": {**TRACE, "name": "spike"},
        "arms": {"fixed_min": arm(0.6, 240.0), "autoscaled": auto, "fixed_peak": arm(0.99, 720.0)},
        "slo_points_autoscaled_minus_peak": -3.0, "unit_seconds_saving_vs_peak": 0.444,
        "failed_during_scale_in": 0, "scale_ins": 1,
        "simulator": {"startup_s": 29.5, "tolerance": {"ttft_ratio_max": 2.0},
                      "startup_from": "autoscaled arm", "policy_from": "defaults",
                      "vs_measured": {"autoscaled": {
                          "ttft_p50_s": side, "ttft_p99_s": side, "units_mean": side,
                          "units_max": side, "within_tolerance": True}},
                      "startup_sweep": [
                          {"startup_s": 5.0, "slo_points_minus_peak": -0.3,
                           "unit_seconds_saving_vs_peak": 0.388, "targets_met": True},
                          {"startup_s": 28.0, "slo_points_minus_peak": -9.3,
                           "unit_seconds_saving_vs_peak": 0.383, "targets_met": False}]},
    })  # fmt: skip
    md_path, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    cap = [t for t in ts if t.benchmark == "capacity"]
    assert [t.met for t in cap] == [True, True, True, None]
    assert "96.0% vs 99.0% (-3.0 points); minimum-sized 60.0%" in cap[0].measured
    assert cap[1].measured.startswith("44.4% fewer (400 vs 720")
    assert cap[3].status == "information, no target"
    md = md_path.read_text()
    assert "| autoscaled | 96.0% |" in md and "decision to routable [29.5] s" in md
    assert "| 0 | 60.0%, p99 0.80 s | 96.0%, p99 0.80 s | 99.0%, p99 0.80 s |" in md
    assert "| SLO points vs peak | -0.3 | -9.3 |" in md and "| both targets | true | false |" in md
    # The diurnal day is a family of its own: the spike's result stays beside it.
    assert "No result yet (`neuron-serving bench capacity --trace diurnal`)" in md
    _write(tmp_path, "capacity-diurnal", {
        "slo_ttft_s": 1.0, "trace": {**TRACE, "name": "diurnal"},
        "arms": {"fixed_min": arm(0.7, 600.0), "autoscaled": auto, "fixed_peak": arm(0.99, 720.0)},
        "slo_points_autoscaled_minus_peak": -1.0, "unit_seconds_saving_vs_peak": 0.35,
        "failed_during_scale_in": 0, "scale_ins": 2})  # fmt: skip
    found = report.latest_results(tmp_path)
    assert found["capacity"].file == "capacity-quick.json"
    assert found["capacity_diurnal"].file == "capacity-diurnal.json"
    _, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    assert [t.met for t in ts if t.benchmark == "capacity_diurnal"] == [True, True, True]
    (tmp_path / "capacity-diurnal.json").unlink()
    # No scale-in in the run: that target is not measured, not met.
    _write(tmp_path, "capacity-quick", {"slo_ttft_s": 1.0, "arms": {},
                                        "failed_during_scale_in": 0, "scale_ins": 0,
                                        "slo_points_autoscaled_minus_peak": -8.0})  # fmt: skip
    _, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    cap = [t for t in ts if t.benchmark == "capacity"]
    assert [t.met for t in cap] == [False, None, None]
    assert cap[2].mark() == "not measured (no scale-in)"


def test_classes_targets_show_the_hosts_sensitivity_beside_the_verdict(tmp_path):
    """The spinners' arm and the repeat of the alone arm are context: the verdict is (b)/(a)'s."""
    _write(tmp_path, "classes-quick", {
        "rt_ttft_p99_ratio_b_over_a": spread([1.6, 1.8]),
        "rt_ttft_p99_ratio_c_over_a": spread([9.0, 10.0]),
        "rt_ttft_p99_ratio_f_over_a": spread([1.7, 1.9]),
        "rt_ttft_p99_ratio_a2_over_a": spread([0.9, 1.0]),
        "batch_share_of_idle_capacity_b": spread([1.1, 1.2]),
        "rt_rejected_by_flow_control": {"shed": 0, "refused": 0, "deadline_misses": 0},
        "rt_client_errors_b": 0,
    })  # fmt: skip
    _, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    p99 = next(t for t in ts if t.target.startswith("real-time TTFT p99"))
    assert p99.met is False
    assert "SCHED_IDLE spinners: 1.8" in p99.measured
    assert "alone again: 0.95" in p99.measured
    # An older result without those arms still renders, without them.
    _write(tmp_path, "classes-quick", {
        "rt_ttft_p99_ratio_b_over_a": spread([1.0]), "rt_ttft_p99_ratio_c_over_a": spread([9.0]),
        "batch_share_of_idle_capacity_b": spread([1.1]), "rt_client_errors_b": 0,
        "rt_rejected_by_flow_control": {"shed": 0, "refused": 0, "deadline_misses": 0},
    })  # fmt: skip
    _, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    p99 = next(t for t in ts if t.target.startswith("real-time TTFT p99"))
    assert p99.met is True and "spinners" not in p99.measured


def test_routing_targets_show_the_tenant_partition_beside_the_verdicts(tmp_path):
    """The reference placement is context: the verdicts are exact / approximate."""
    _write(tmp_path, "routing-quick", {"arms": {}, "ratios": {
        "hit_rate_exact_over_approximate": spread([1.1, 1.15]),
        "ttft_p90_exact_over_approximate": spread([0.9]),
        "hit_rate_pp_2_replicas_vs_1": spread([1.0]),
        "hit_rate_partition_over_approximate": spread([1.12, 1.18]),
        "hit_rate_exact_over_partition": spread([0.98]),
        "ttft_p90_partition_over_approximate": spread([1.05]),
        "hit_rate_pp_exact_again_vs_exact": spread([3.0]),
        "ttft_p90_exact_again_over_exact": spread([0.95]),
        "hit_rate_ceiling_over_approximate": spread([1.16]),
    }, "workload": {**ROUTING_WORKLOAD,
                    "reuse": {"ceiling": 0.9, "session_local": 0.74, "other_sessions": 0.16}}})  # fmt: skip
    path, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    hit, p90 = (next(t for t in ts if t.target.startswith(k)) for k in
                ("exact KV index hit rate", "exact KV index TTFT p90"))  # fmt: skip
    assert hit.met is False and p90.met is False
    assert "tenant partition / approximate: 1.15" in hit.measured
    assert "exact / tenant partition: 0.98" in hit.measured
    assert "tenant partition / approximate: 1.05" in p90.measured
    assert "exact again / exact: 0.95" in p90.measured
    # The most any routing reaches against the approximate index, and the ceiling.
    assert "ceiling / approximate: 1.16" in hit.measured
    assert (
        "hit-rate ceiling 0.900 (a session's own earlier turns 0.740, other sessions of "
        "its tenant 0.160)"
    ) in path.read_text()
    pp = next(t for t in ts if t.target.startswith("2 proxy replicas"))
    assert "exact run twice: 3.0 points" in pp.measured
    # A result from before the reference arm renders without it.
    _write(tmp_path, "routing-quick", {"arms": {}, "workload": ROUTING_WORKLOAD,
                                       "ratios": _routing_ratios(
                                           hit_rate_exact_over_approximate=spread([1.3]))})  # fmt: skip
    _, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    hit = next(t for t in ts if t.target.startswith("exact KV index hit rate"))
    assert hit.met is True and "partition" not in hit.measured


def test_the_open_loop_is_reported_beside_the_closed_loop_for_information(tmp_path):
    """bench routing --session-rate writes routing-open.json: a family of its own, so
    the closed loop's verdicts stay the routing family's."""
    assert report.family("routing-open-quick") == "routing_open"
    _write(tmp_path, "routing", {"arms": {}, "workload": ROUTING_WORKLOAD,
                                 "ratios": _routing_ratios(
                                     hit_rate_exact_over_approximate=spread([1.25]))})  # fmt: skip
    open_loop = {**ROUTING_WORKLOAD, "concurrent_sessions": None}
    _write(tmp_path, "routing-open", {
        "workload": {**open_loop, "sessions_per_s": 0.9, "sessions": 128, "turns": 5},
        "arms": {"exact": _routing_arm(hit_rate=spread([0.6]))},
        "ratios": _routing_ratios(hit_rate_exact_over_approximate=spread([0.85]),
                                  ttft_p90_exact_over_approximate=spread([1.9])),
    }, time="2026-12-03T10:00:00Z")  # newer, and still not the routing family's  # fmt: skip
    path, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    md = path.read_text()
    hit = next(t for t in ts if t.target.startswith("exact KV index hit rate"))
    assert hit.met is True and hit.measured.startswith("1.25")
    (info,) = [t for t in ts if t.benchmark == "routing_open"]
    assert info.status == "information, no target" and "0.90 sessions/s" in info.target
    assert "TTFT p90 1.90" in info.measured and "ceiling" not in info.measured
    assert "## Routing policies (2 units), open loop" in md
    assert "0.90 sessions/s arriving as a Poisson process" in md
    assert all(r.target != info.target for r in report.readme_rows(report.latest_results(tmp_path)))
    # With the plan's ceiling (results from 9734e78 on): the most any routing reaches.
    _write(tmp_path, "routing-open", {
        "workload": {**open_loop, "sessions_per_s": 0.8}, "arms": {},
        "ratios": _routing_ratios(hit_rate_exact_over_approximate=spread([1.09]),
                                  hit_rate_ceiling_over_approximate=spread([1.18])),
    }, time="2026-12-03T11:00:00Z")  # fmt: skip
    _, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    (info,) = [t for t in ts if t.benchmark == "routing_open"]
    assert "hit-rate ceiling / approximate 1.18" in info.measured


def test_soak_counts_are_targets_of_zero_and_its_section_lists_faults_and_growth(tmp_path):
    zero = {k: 0 for k in report.SOAK_ZERO}
    _write(tmp_path, "soak", {
        "duration_s": 1800.0, "zero_counts": {**zero, "lost": 2},
        "by_kind": {"chat_n": {"completed": 9, "retriable": 1}},
        "faults": [{"at_s": 30.0, "what": "SIGKILL proxy-1", "error": None}],
        "rollouts": [{"at_s": 720.0, "version": "v2", "s": 210.0, "rc": 0}],
        "growth": [{"owner": "unit-0/leader", "name": "VLLM::EngineCore", "pid": 1,
                    "rss_mb": [1000.0, 1010.0], "fds": [130, 130], "lived_s": 1800}],
        "plot": "bench/results/soak.png",
    })  # fmt: skip
    path, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    text = path.read_text()
    soak = {t.target: t for t in ts if t.benchmark == "soak"}
    assert len(soak) == len(report.SOAK_ZERO)
    lost = soak["30-min soak: requests lost (no answer, no error) = 0"]
    assert lost.met is False and lost.measured == "2"
    assert all(t.met for name, t in soak.items() if "lost" not in name)
    assert "SIGKILL proxy-1" in text and "rollout to v2 (210.0 s)" in text
    assert "unit-0/leader VLLM::EngineCore" in text and "1000.0 -> 1010.0" in text
    assert "(results/soak.png)" in text
    # A run that ended in an error has no counts: one unmet line saying so.
    _write(tmp_path, "soak", {"duration_s": 300.0, "error": "RuntimeError: up did not start",
                              "plot": None})  # fmt: skip
    _, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    (only,) = [t for t in ts if t.benchmark == "soak"]
    assert only.met is None and "up did not start" in only.measured
