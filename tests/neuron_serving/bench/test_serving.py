"""serving.py: its ratios, and main's glue (servers, repeats, scaling on the same
leader) with fakes: no server starts, no load is sent."""

from __future__ import annotations

import json

import pytest

from neuron_serving.bench import common, scaling, serving, stack
from neuron_serving.bench.metrics import figure_keys, from_chunks, summarize


class _Proc:
    def __init__(self, log):
        self.log = log

    def stop(self):
        self.log.append("stop")


class _Server:
    def __init__(self, log, name):
        self.process = _Proc(log)
        self.grpc = self.http = self.base = name


def test_serving_then_scaling_on_one_leader(tmp_path, monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(stack, "start_leader", lambda *a, **k: _Server(log, "leader"))
    monkeypatch.setattr(stack, "start_vllm_server", lambda *a, **k: _Server(log, "vllm"))
    monkeypatch.setattr(stack, "wait_ready", lambda servers: log.append(f"ready {len(servers)}"))
    monkeypatch.setattr(serving, "arms", lambda leader, base: ["arms"])

    def run(n=4):
        return summarize([from_chunks(0.0, [0.01, 0.02, 0.03]) for _ in range(n)], 1.0)

    async def fake_serving(arm_list, repeats, requests, max_tokens):
        assert arm_list == ["arms"]
        log.append(f"serving x{repeats}")
        return {"runs": [{"triton_http": run(), "vllm": run(), "triton": run()}
                         for _ in range(repeats)]}  # fmt: skip

    async def fake_scaling(arm, levels, repeats, per_stream, max_tokens, warm_up=True):
        log.append(f"scaling warm_up={warm_up}")
        return {c: [run(c)] for c in levels}

    monkeypatch.setattr(serving, "_measure", fake_serving)
    monkeypatch.setattr(scaling, "_measure", fake_scaling)

    def sweep(leader):
        return scaling.after_serving(leader, True, str(tmp_path / "model"), False, None)

    assert serving.main(True, str(tmp_path / "model"), False, None, on_leader=sweep) == 0
    # vLLM stopped before the sweep; the leader once, at the end.
    assert log[:3] == ["ready 2", "serving x3", "stop"] and log[3] == "scaling warm_up=False"
    s = json.loads((tmp_path / "serving-quick.json").read_text())
    assert s["throughput_ratio"] == 1.0 and set(s["arms"]) == {"triton_http", "vllm", "triton"}
    sc = json.loads((tmp_path / "scaling-quick.json").read_text())
    assert [r["concurrency"] for r in sc["levels"]] == list(scaling.QUICK_LEVELS)
    assert "serving benchmark's leader" in sc["note"] and sc["startup_s"] is None


def test_aggregate_ratios_are_median_over_median():
    def run(tok_s: float, ttft: float) -> dict:
        return {k: 1.0 for k in figure_keys()} | {"output_tok_s": tok_s, "ttft_p50_ms": ttft,
                                                   "failed": 0}  # fmt: skip

    runs = [{"triton_http": run(t, 10.0), "vllm": run(100.0, 8.0), "triton": run(50.0, 4.0)}
            for t in (80.0, 90.0, 120.0)]  # fmt: skip
    agg = serving.aggregate(runs)
    assert agg["ratio_arm"] == "triton_http"
    assert agg["throughput_ratio"] == pytest.approx(0.9)
    assert agg["throughput_ratio_per_repeat"]["min"] == pytest.approx(0.8)
    assert agg["ttft_p50_ratio"] == pytest.approx(1.25)
    assert agg["met"] == {"throughput_ratio": True, "ttft_p50_ratio": False}
    # the gRPC arm's ratios, for information, never decide "met"
    assert agg["grpc_throughput_ratio"] == pytest.approx(0.5)
    assert agg["grpc_ttft_p50_ratio"] == pytest.approx(0.5)
