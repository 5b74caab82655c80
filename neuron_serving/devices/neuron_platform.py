"""vLLM platform plugin for Neuron units: vllm-neuron's platform, keeping the unit executor.

vllm-neuron 0.2.0's ``NeuronPlatform.check_and_update_config`` (``vllm_neuron/platform.py``)
sets ``parallel_config.distributed_executor_backend = "uni"`` whenever world_size > 1:
NxDI drives every NeuronCore of a node from one process, so vLLM's ``mp``/``ray``
executors, which start one process per rank on one host, must not run. A unit's
``UnitExecutor`` starts no local processes either (one rank per node, the others join
over the network), but the platform replaces it all the same, silently.

``UnitNeuronPlatform`` is that platform with one change: an executor named by class or
qualified name (``neuron_serving.unit.executor.UnitExecutor``) survives the check;
vLLM's own names ("mp", "ray", None) still become "uni". Everything else the platform
sets (worker class, scheduler, block size) is kept. vLLM resolves the platform in every
process (the Triton model process and EngineCore alike) from the
``vllm.platform_plugins`` entry point ``neuron_serving`` (pyproject.toml);
``VLLM_PLUGINS=neuron_serving`` (``NeuronBackend.process_env``) keeps vllm-neuron's own
``neuron`` plugin from activating too, which vLLM refuses ("Only one platform plugin
can be activated"). Not run here: vllm-neuron is not installed on this machine.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from neuron_serving import envs
from neuron_serving.devices.lazy_class import module_getattr, named

PLATFORM_QUALNAME = f"{__name__}.UnitNeuronPlatform"


def register() -> str | None:
    """The ``vllm.platform_plugins`` entry point: active only on a Neuron node."""
    if envs.NEURON_SERVING_DEVICE != "neuron":
        return None
    if importlib.util.find_spec("vllm_neuron") is None:
        return None
    return PLATFORM_QUALNAME


def is_custom_executor(backend: Any) -> bool:
    """An executor class or qualified name, as opposed to vLLM's built-in names."""
    return isinstance(backend, type) or (isinstance(backend, str) and "." in backend)


def keep_custom_executor(base: type) -> type:
    """``base`` (a vLLM platform class) whose config check keeps a custom executor."""

    class UnitNeuronPlatform(base):
        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            parallel = vllm_config.parallel_config
            chosen = parallel.distributed_executor_backend
            super().check_and_update_config(vllm_config)
            if is_custom_executor(chosen):
                parallel.distributed_executor_backend = chosen

    return named(UnitNeuronPlatform, __name__, "UnitNeuronPlatform")


__getattr__ = module_getattr(
    __name__, "UnitNeuronPlatform", "vllm_neuron.platform.NeuronPlatform", keep_custom_executor
)
