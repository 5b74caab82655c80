"""serving_mn.py: both systems get bench serving's engine settings and its arm names,
each driven in its own API (no deployment starts)."""

from __future__ import annotations

from pathlib import Path

from neuron_serving.bench import serving_mn
from neuron_serving.bench.twonode import Deployment
from neuron_serving.bench.workload import ENGINE, triton_generate_stream


def test_engine_is_the_serving_benchmarks():
    e = serving_mn.ENGINE
    assert (e.max_model_len, e.kv_cache_bytes, e.max_num_seqs, e.seed) == (
        ENGINE["max_model_len"], ENGINE["kv_cache_bytes"], ENGINE["max_num_seqs"], ENGINE["seed"],
    )  # fmt: skip


def test_each_system_is_driven_in_its_own_api_under_the_serving_arm_names():
    from vllm.benchmarks.lib.endpoint_request_func import async_request_openai_completions

    def dep(system, path):
        return Deployment(system, None, None, 8123, "/h", path, Path("."))  # type: ignore[arg-type]

    unit = serving_mn.arm(dep("unit", "/v2/models/llm/generate_stream"))
    vllm = serving_mn.arm(dep("vllm_mn", "/v1/completions"))
    assert (unit.name, unit.url, unit.request_func) == (
        "triton_http", "http://127.0.0.1:8123/v2/models/llm/generate_stream", triton_generate_stream,
    )  # fmt: skip
    assert (vllm.name, vllm.url, vllm.request_func) == (
        "vllm", "http://127.0.0.1:8123/v1/completions", async_request_openai_completions,
    )  # fmt: skip
    assert not unit.grpc and not vllm.grpc
