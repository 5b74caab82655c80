"""multinode.py: each node's command line and environment, parsed by vLLM's own
`serve` parser (no engine starts)."""

from __future__ import annotations

import dataclasses

import pytest

from neuron_serving.bench.multinode import MultiNodeConfig, cli_args

ENGINE = {"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 30,
          "enable_prefix_caching": True, "seed": 0, "enforce_eager": False}  # fmt: skip


def test_engine_kwargs_become_serve_flags():
    assert cli_args(ENGINE) == ["--max-model-len", "1024", "--kv-cache-memory-bytes",
                                str(1 << 30), "--enable-prefix-caching", "--seed", "0"]  # fmt: skip


def test_each_node_binds_only_its_own_ranks_and_reaches_node0_on_the_master_address():
    two = MultiNodeConfig(model="/m", tp=2, nnodes=2, cpu_bind="0|1")
    assert two.node_env(0) == {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_HOST_IP": "127.0.0.1"}
    assert two.node_env(1)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    four = MultiNodeConfig(model="/m", tp=4, nnodes=2, cpu_bind="0|1|2|3")
    assert [four.node_env(r)["VLLM_CPU_OMP_THREADS_BIND"] for r in (0, 1)] == ["0|1", "2|3"]


@pytest.mark.parametrize(
    "kwargs",
    [{"nnodes": 1}, {"tp": 3, "nnodes": 2, "cpu_bind": "0|1|2"}, {"cpu_bind": "0"}],
    ids=["one-node", "tp-not-divisible", "bind-per-rank"],
)
def test_inconsistent_deployments_are_refused(kwargs):
    with pytest.raises(ValueError):
        MultiNodeConfig(model="/m", **kwargs)


def test_node_rank_outside_the_deployment_is_refused():
    cfg = MultiNodeConfig(model="/m")
    with pytest.raises(ValueError, match="node_rank 2"):
        cfg.serve_argv(2)
    with pytest.raises(ValueError, match="only node 0 serves the API"):
        cfg.serve_argv(1, ("--port", "8000"))


def test_vllm_serve_parses_node0_as_api_server_and_node1_as_headless():
    from vllm.engine.arg_utils import EngineArgs

    from neuron_serving.bench.vllm_cli import serve_parser

    parser, _ = serve_parser()
    cfg = MultiNodeConfig(model="/m", master_port=29555, engine=ENGINE)
    node0 = parser.parse_args(cfg.serve_argv(0, ("--host", "127.0.0.1", "--port", "8123"))[3:])
    node1 = parser.parse_args(cfg.serve_argv(1)[3:])
    for rank, args in enumerate((node0, node1)):
        assert (args.model_tag, args.tensor_parallel_size, args.distributed_executor_backend,
                args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
                "/m", 2, "mp", 2, rank, "127.0.0.1", 29555)  # fmt: skip
        assert (args.max_model_len, args.enable_prefix_caching, args.seed) == (1024, True, 0)
    assert (node0.headless, node0.port, node1.headless) == (False, 8123, True)
    # Node 0's offline engine (LLM(...)) takes the same settings as keyword arguments.
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(cfg.parallel_kwargs(0)) <= fields and set(ENGINE) <= fields
