"""The vLLM compatibility layer at the API level: vLLM 0.11.0 (the Neuron SDK 2.27.0
pin) as read from its source, and the installed 0.32 as imported.

0.11.0 source: the PyPI sdist vllm-0.11.0.tar.gz (sha256
f435a64c24e9c4178d657a76f8edd8548ddc444012f7d06a9f79ac3a6392bfae), whose
``vllm/_version.py`` names commit ``gf71952c1c`` (tag v0.11.0). The signatures below
are copied from it by hand; each names its file.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType, SimpleNamespace

import pytest

from neuron_serving.unit import vllm_compat
from neuron_serving.unit.executor import UnitExecutor

# -- vLLM 0.11.0, literal ------------------------------------------------------------
# name -> (module it is defined in, parameter names in order)
V0_11_0 = {
    # vllm/utils/__init__.py
    "run_method": ("vllm.utils", ("obj", "method", "args", "kwargs")),
    # vllm/worker/worker_base.py (vllm/v1/worker/worker_base.py has only WorkerBase)
    "WorkerWrapperBase.__init__": (
        "vllm.worker.worker_base",
        ("self", "vllm_config", "rpc_rank=0"),
    ),
    # vllm/v1/executor/abstract.py
    "Executor.collective_rpc": (
        "vllm.v1.executor.abstract",
        ("self", "method", "timeout=None", "args=()", "kwargs=None", "non_block=False"),
    ),
    "Executor.execute_model": (
        "vllm.v1.executor.abstract",
        ("self", "scheduler_output", "non_block=False"),
    ),
    "Executor.initialize_from_config": ("vllm.v1.executor.abstract", ("self", "kv_cache_configs")),
    "Executor.register_failure_callback": ("vllm.v1.executor.abstract", ("self", "callback")),
}
# vllm/v1/executor/abstract.py and vllm/executor/executor_base.py (ExecutorBase):
# what 0.11.0's Executor defines, and does not.
V0_11_0_EXECUTOR_HAS = {
    "collective_rpc", "execute_model", "execute_dummy_batch", "take_draft_token_ids",
    "initialize_from_config", "determine_available_memory", "get_kv_cache_specs",
    "register_failure_callback", "check_health", "shutdown", "profile",
}  # fmt: skip
V0_11_0_EXECUTOR_LACKS = {"sample_tokens", "compile_or_warm_up_model", "supports_async_scheduling"}
# ExecutorBase's abstract methods (vllm/executor/executor_base.py).
V0_11_0_ABSTRACT = {"_init_executor", "collective_rpc", "check_health"}
# The engine core's calls on an executor (vllm/v1/engine/core.py): collective_rpc by name
# with args=..., execute_model(scheduler_output) and (batch queue) non_block=True.
V0_11_0_ENGINE_CALLS = [
    ("collective_rpc", ("compile_or_warm_up_model",), {}),
    ("collective_rpc", ("determine_available_memory",), {}),
    ("collective_rpc", ("initialize_from_config",), {"args": ([],)}),
    ("execute_model", (object(),), {}),
    ("execute_model", (object(),), {"non_block": True}),
]


def _signature(params: tuple[str, ...]) -> inspect.Signature:
    """The signature of ``def f(<params>)``: names with their literal defaults."""
    ns: dict = {}
    exec(f"def f({', '.join(params)}): pass", ns)  # literal data of this file only
    return inspect.signature(ns["f"])


def _names_of(params: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p.split("=")[0] for p in params)


def _stub(names: tuple[str, ...]):
    def f(*args, **kwargs):
        return inspect.signature(f).bind(*args, **kwargs)

    f.__signature__ = _signature(names)  # type: ignore[attr-defined]
    return f


def _v0_11_modules() -> dict[str, ModuleType]:
    """Modules shaped as 0.11.0's, each symbol with its literal signature."""
    mods = {
        name: ModuleType(name)
        for name in (
            "vllm.utils",
            "vllm.v1.serial_utils",
            "vllm.worker.worker_base",
            "vllm.v1.worker.worker_base",
        )
    }
    mods["vllm.utils"].run_method = _stub(V0_11_0["run_method"][1])  # type: ignore[attr-defined]

    class WorkerWrapperBase:
        def __init__(self, *args, **kwargs):
            self.bound = inspect.signature(type(self).__init__).bind(self, *args, **kwargs)

    WorkerWrapperBase.__init__.__signature__ = _signature(  # type: ignore[attr-defined]
        V0_11_0["WorkerWrapperBase.__init__"][1]
    )
    mods["vllm.worker.worker_base"].WorkerWrapperBase = WorkerWrapperBase  # type: ignore[attr-defined]
    mods["vllm.v1.worker.worker_base"].WorkerBase = object  # type: ignore[attr-defined]
    return mods


def _v0_11_executor() -> type:
    ns: dict = {name: _stub(("self",)) for name in V0_11_0_EXECUTOR_HAS}
    ns["max_concurrent_batches"] = property(lambda self: 1)
    return type("Executor", (), ns)


def _resolve_v0_11():
    mods = _v0_11_modules()

    def import_module(name: str) -> ModuleType:
        if name not in mods:
            raise ImportError(name)
        return mods[name]

    api = vllm_compat.resolve(import_module, _v0_11_executor(), SimpleNamespace())
    return api, mods


def test_v0_11_0_resolves_to_its_own_places_and_flags():
    api, mods = _resolve_v0_11()
    assert api.run_method is mods["vllm.utils"].run_method
    assert api.worker_wrapper_cls is mods["vllm.worker.worker_base"].WorkerWrapperBase
    assert api.wrapper_takes_vllm_config
    assert not api.executor_warms_up and not api.split_sampling
    assert api.executor_sizes_batch_queue and not api.has_block_size_update
    # What the layer lists first/second is where each version keeps the symbol.
    assert vllm_compat.RUN_METHOD_PLACES[1][0] == V0_11_0["run_method"][0]
    assert vllm_compat.WORKER_WRAPPER_PLACES[1][0] == V0_11_0["WorkerWrapperBase.__init__"][0]


def test_the_layers_parameters_are_0_11_0s():
    theirs = {name: _names_of(params) for name, (_, params) in V0_11_0.items()}
    assert vllm_compat.RUN_METHOD_PARAMS == theirs["run_method"]
    assert vllm_compat.WORKER_WRAPPER_PARAMS["0.11"] == theirs["WorkerWrapperBase.__init__"]
    assert vllm_compat.COLLECTIVE_RPC_PARAMS == theirs["Executor.collective_rpc"]
    assert vllm_compat.EXECUTE_MODEL_PARAMS == theirs["Executor.execute_model"]


def test_our_calls_bind_to_0_11_0s_signatures(monkeypatch):
    api, mods = _resolve_v0_11()
    # run_call's run_method(worker, method, args, kwargs).
    api.run_method(object(), "execute_model", (), {})
    # new_worker_wrapper on 0.11.0: leader with its VllmConfig, follower without one.
    monkeypatch.setattr(vllm_compat, "API", api)
    monkeypatch.setattr(vllm_compat, "WorkerWrapperBase", api.worker_wrapper_cls)
    leader = vllm_compat.new_worker_wrapper(0, SimpleNamespace(model_config="m"))
    assert leader.bound.arguments["rpc_rank"] == 0
    assert leader.bound.arguments["vllm_config"].model_config == "m"
    follower = vllm_compat.new_worker_wrapper(3)
    assert follower.bound.arguments["rpc_rank"] == 3
    # model_config None: 0.11.0 skips init_cached_hf_modules instead of failing.
    assert follower.bound.arguments["vllm_config"].model_config is None


def test_unit_executor_accepts_every_0_11_0_engine_call():
    for name, args, kwargs in V0_11_0_ENGINE_CALLS:
        ours = inspect.signature(getattr(UnitExecutor, name))
        theirs = _signature(V0_11_0[f"Executor.{name}"][1])
        theirs.bind(None, *args, **kwargs)  # the call is valid for 0.11.0 ...
        ours.bind(None, *args, **kwargs)  # ... and for the unit executor
    # ExecutorBase would refuse to instantiate a class missing any of them.
    assert V0_11_0_ABSTRACT <= set(vars(UnitExecutor))


def test_legacy_mixin_routes_warm_up_through_the_executor():
    """On 0.11.0 initialize_from_config ran compile_or_warm_up_model on the workers
    only; the mixin makes it reach UnitExecutor.compile_or_warm_up_model (READY)."""
    legacy = _v0_11_executor()
    calls: list = []

    class Unit(vllm_compat.LegacyExecutorMixin, legacy):  # as EXECUTOR_BASES on 0.11.0
        scheduler_config = SimpleNamespace(async_scheduling=False)

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
            calls.append((method, args))
            return []

        def compile_or_warm_up_model(self):
            super().compile_or_warm_up_model()
            calls.append("ready")

    unit = Unit()
    unit.initialize_from_config(["kv"])
    assert calls == [
        ("initialize_from_config", (["kv"],)),
        ("compile_or_warm_up_model", ()),
        "ready",
    ]
    assert unit.max_concurrent_batches == 1
    unit.scheduler_config = SimpleNamespace(async_scheduling=True)
    assert unit.max_concurrent_batches == 2


# -- the installed vLLM 0.32 ----------------------------------------------------------


def test_0_32_resolves_to_vllms_own_objects():
    from vllm.platforms import current_platform
    from vllm.v1.executor.abstract import Executor, FailureCallback
    from vllm.v1.outputs import AsyncModelRunnerOutput
    from vllm.v1.serial_utils import run_method
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    api = vllm_compat.API
    assert vllm_compat.run_method is run_method and api.run_method is run_method
    assert vllm_compat.WorkerWrapperBase is WorkerWrapperBase
    assert vllm_compat.Executor is Executor
    assert vllm_compat.FailureCallback is FailureCallback
    assert vllm_compat.AsyncModelRunnerOutput is AsyncModelRunnerOutput
    assert not api.wrapper_takes_vllm_config
    assert api.executor_warms_up and api.split_sampling
    assert not api.executor_sizes_batch_queue
    assert api.has_block_size_update and callable(current_platform.update_block_size_for_backend)
    # Nothing of the 0.11.0 path on 0.32: the unit executor is Executor's direct subclass.
    assert vllm_compat.EXECUTOR_BASES == (Executor,)
    assert UnitExecutor.__mro__[1] is Executor
    assert not issubclass(UnitExecutor, vllm_compat.LegacyExecutorMixin)


def _names(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def test_0_32_signatures_are_what_the_layer_expects():
    from vllm.v1.executor.abstract import Executor

    assert _names(vllm_compat.run_method) == vllm_compat.RUN_METHOD_PARAMS
    assert (
        _names(vllm_compat.WorkerWrapperBase.__init__) == vllm_compat.WORKER_WRAPPER_PARAMS["0.32"]
    )
    assert _names(Executor.collective_rpc) == vllm_compat.COLLECTIVE_RPC_PARAMS
    assert _names(Executor.execute_model) == vllm_compat.EXECUTE_MODEL_PARAMS
    assert _names(Executor.sample_tokens) == ("self", "grammar_output", "non_block")
    assert {"_init_executor", "collective_rpc", "check_health"} <= Executor.__abstractmethods__
    wrapper = vllm_compat.new_worker_wrapper(2)
    assert isinstance(wrapper, vllm_compat.WorkerWrapperBase) and wrapper.rpc_rank == 2


def test_0_32_module_paths_still_hold_the_symbols():
    for module, name in (vllm_compat.RUN_METHOD_PLACES[0], vllm_compat.WORKER_WRAPPER_PLACES[0]):
        assert getattr(importlib.import_module(module), name, None) is not None, (module, name)


def test_a_missing_symbol_is_one_clear_error():
    def import_module(name: str) -> ModuleType:
        raise ImportError(name)

    with pytest.raises(ImportError, match="WorkerWrapperBase"):
        vllm_compat.resolve(import_module)
