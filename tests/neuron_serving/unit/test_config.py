"""The unit's config and vLLM's compile-cache key: what the executor takes out of
``additional_config`` leaves a key that no port, unit id or token file changes.

The hashes are vLLM's own (``VllmConfig.compute_hash()``, what
``vllm/compilation/caching.py`` keys ``torch_aot_compile/<hash>`` on), of engine
configs built by the unit's one recipe (``engine.engine_kwargs``) for the demo
model; no engine starts.
"""

from __future__ import annotations

import pytest

from neuron_serving.unit.config import ADDITIONAL_CONFIG_KEY, UnitConfig, take_unit_config
from neuron_serving.unit.engine import engine_kwargs


def _vllm_config(model, unit: UnitConfig):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = engine_kwargs(str(model), 2, unit, max_model_len=512, kv_cache_bytes=256 << 20)
    return EngineArgs(**kwargs).create_engine_config()


def test_take_unit_config_returns_it_and_leaves_only_its_compile_identity():
    unit = UnitConfig(control_port=29600, unit_id="unit-3", token_file="/run/t", health_port=29607)
    additional = {ADDITIONAL_CONFIG_KEY: unit.to_dict(), "other": 1}
    assert take_unit_config(additional) == unit
    assert additional == {ADDITIONAL_CONFIG_KEY: {"device": "cpu"}, "other": 1}
    assert take_unit_config({}) is None
    assert take_unit_config(None) is None


def test_units_of_one_model_share_vllms_compile_key_once_the_executor_took_its_config(
    demo_model,
):
    pytest.importorskip("vllm")
    a = _vllm_config(
        demo_model, UnitConfig(control_port=29600, unit_id="unit-0", health_port=29607)
    )
    b = _vllm_config(demo_model, UnitConfig(control_port=27620, unit_id="unit-1", token_file="/t"))
    # As built: the control plane is in the key (each unit compiled on its own).
    assert a.compute_hash() != b.compute_hash()
    take_unit_config(a.additional_config)
    take_unit_config(b.additional_config)
    assert a.compute_hash() == b.compute_hash()
    # What does shape the graph still counts: the device stays in the key.
    assert UnitConfig(device="neuron").compile_identity() != unit_cpu_identity()


def unit_cpu_identity() -> dict:
    return UnitConfig(control_port=1000, unit_id="x").compile_identity()
