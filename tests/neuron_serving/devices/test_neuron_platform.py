"""The unit executor survives vllm-neuron's platform check (neuron_platform.py).

The stand-in base below is vllm-neuron 0.2.0's rule, copied from
vllm-project/vllm-neuron@a96712544a527761a336ccabdc5846f1a2202606 vllm_neuron/platform.py,
NeuronPlatform.check_and_update_config:

    if parallel_config.worker_cls == "auto":
        parallel_config.worker_cls = "vllm_neuron.worker.neuron_worker.NeuronWorker"
    if parallel_config.world_size > 1:
        parallel_config.distributed_executor_backend = "uni"

applied to vLLM's real ParallelConfig.
"""

from __future__ import annotations

import importlib.util
import tomllib
import types
from pathlib import Path

import pytest

from neuron_serving.devices.base import RankPlacement
from neuron_serving.devices.neuron import PLATFORM_PLUGIN, NeuronBackend
from neuron_serving.devices.neuron_platform import keep_custom_executor, register

UNIT_EXECUTOR = "neuron_serving.unit.executor.UnitExecutor"


class NeuronPlatformRule:
    @classmethod
    def check_and_update_config(cls, vllm_config):
        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = "vllm_neuron.worker.neuron_worker.NeuronWorker"
        if parallel_config.world_size > 1:
            parallel_config.distributed_executor_backend = "uni"


def checked(backend, worker_cls="auto"):
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(
        tensor_parallel_size=2, distributed_executor_backend=backend, worker_cls=worker_cls
    )
    keep_custom_executor(NeuronPlatformRule).check_and_update_config(
        types.SimpleNamespace(parallel_config=parallel)
    )
    return parallel


def test_unit_executor_and_worker_survive_the_platform_check():
    worker = "neuron_serving.devices.neuron_worker.UnitNeuronWorker"
    parallel = checked(UNIT_EXECUTOR, worker)
    assert parallel.distributed_executor_backend == UNIT_EXECUTOR
    assert parallel.worker_cls == worker


def test_vllm_executors_still_become_uni():
    # NxDI drives a node's cores from one process: vLLM's mp executor must not run.
    parallel = checked("mp")
    assert parallel.distributed_executor_backend == "uni"
    assert parallel.worker_cls == "vllm_neuron.worker.neuron_worker.NeuronWorker"


@pytest.mark.skipif(
    importlib.util.find_spec("vllm_neuron") is not None, reason="vllm-neuron is installed"
)
def test_plugin_is_inactive_off_neuron(monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_DEVICE", "cpu")
    assert register() is None
    monkeypatch.setenv("NEURON_SERVING_DEVICE", "neuron")
    assert register() is None  # vllm-neuron is not installed on this machine
    with pytest.raises(ImportError):
        import neuron_serving.devices.neuron_platform as mod

        mod.UnitNeuronPlatform  # noqa: B018 (the lazy attribute imports vllm_neuron)


def test_entry_point_is_the_plugin_vllm_plugins_names():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["vllm.platform_plugins"]
    assert plugins == {PLATFORM_PLUGIN: "neuron_serving.devices.neuron_platform:register"}
    env = NeuronBackend(32).process_env(RankPlacement(0, 2, "h", 29500))
    assert env["VLLM_PLUGINS"] == PLATFORM_PLUGIN
