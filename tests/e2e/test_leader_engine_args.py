"""`leader --engine-args` reaches the engine of a real leader (tritonserver + vLLM):
vLLM publishes its CacheConfig as ``vllm:cache_config_info`` labels on the leader's
merged metrics port, so a passed ``enable_prefix_caching`` is read back from vLLM
itself (the unit recipe's default is True)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.leader_fixture import running_leader
from tests.e2e.triton_leader_helpers import get, metric

pytestmark = pytest.mark.e2e


def test_engine_args_reach_the_leaders_engine(demo_model: Path, tmp_path: Path) -> None:
    extra = ["--engine-args", '{"enable_prefix_caching": false, "max_num_batched_tokens": 512}']
    with running_leader(demo_model, tmp_path, extra=extra) as ldr:
        info = [
            line
            for line in get(f"http://{ldr.metrics}/metrics")[1].splitlines()
            if line.startswith("vllm:cache_config_info{")
        ]
        assert info, "no vllm:cache_config_info on the metrics port"
        assert metric(ldr.metrics, "vllm:cache_config_info", enable_prefix_caching="False") == 1
        assert 'enable_prefix_caching="True"' not in "\n".join(info)
