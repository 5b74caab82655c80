"""The vLLM APIs the unit's executor and workers use, on vLLM 0.32 and on 0.11.0.

The CPU path runs the installed vLLM 0.32; the Neuron path is pinned to Neuron
SDK 2.27.0, whose vLLM is 0.11.0 (devices/neuron_release.py). Everything that
differs between the two is resolved here, once, by probing the installed vLLM
(what a symbol is and where it lives, not the version string), so that
``executor.py``, ``local_worker.py`` and ``worker_loop.py`` read the same on
both. On 0.32 every name below is vLLM's own object and nothing is wrapped.

0.11.0 was read from its PyPI sdist (vllm-0.11.0.tar.gz, sha256 f435a64c...bfae,
``vllm/_version.py``: commit g f71952c1c); 0.32 is the installed package. The
differences (0.11.0 file | 0.32 file):

- ``run_method``: ``vllm/utils/__init__.py`` | ``vllm/v1/serial_utils.py``;
  same parameters ``(obj, method, args, kwargs)``.
- ``WorkerWrapperBase``: ``vllm/worker/worker_base.py`` with
  ``__init__(vllm_config, rpc_rank=0)`` (``vllm_config`` only decides whether to
  ``init_cached_hf_modules`` for ``trust_remote_code``; "it can be None in tests"
  for ``model_config``) | ``vllm/v1/worker/worker_base.py`` with
  ``__init__(rpc_rank=0, global_rank=None)``.
- ``Executor`` (``vllm/v1/executor/abstract.py`` in both): 0.11.0 subclasses
  ``vllm/executor/executor_base.py``'s ``ExecutorBase``; its
  ``initialize_from_config`` runs ``compile_or_warm_up_model`` on the workers
  itself and the executor has no such method; ``execute_model`` returns the
  sampled output (no ``sample_tokens``); the engine core's batch queue is sized by
  the executor's ``max_concurrent_batches`` property (``vllm/v1/engine/core.py``),
  2 under async scheduling as ``vllm/executor/uniproc_executor.py`` does. 0.32:
  ``compile_or_warm_up_model`` is an executor method that ``EngineCore`` calls,
  ``execute_model`` + ``sample_tokens``, the batch queue is sized by
  ``VllmConfig.max_concurrent_batches`` and async scheduling is allowed by the
  ``supports_async_scheduling`` classmethod.
- ``Platform.update_block_size_for_backend``: absent | ``vllm/platforms/interface.py``
  (the 0.32 executors call it after loading the model).
- The same in both: ``FailureCallback`` (``vllm/v1/executor/abstract.py``),
  ``AsyncModelRunnerOutput`` (``vllm/v1/outputs.py``), ``collective_rpc(method,
  timeout=None, args=(), kwargs=None, non_block=False)`` (``unique_reply_rank`` is
  ``MultiprocExecutor``'s own in both, never passed by the engine).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import vllm
from vllm.platforms import current_platform
from vllm.v1.executor.abstract import Executor, FailureCallback
from vllm.v1.outputs import AsyncModelRunnerOutput

__all__ = [
    "API",
    "AsyncModelRunnerOutput",
    "EXECUTOR_BASES",
    "Executor",
    "FailureCallback",
    "VllmApi",
    "WorkerWrapperBase",
    "new_worker_wrapper",
    "resolve",
    "run_method",
    "update_block_size_for_backend",
]

# (module, name) in lookup order: the 0.32 place first, then 0.11.0's.
RUN_METHOD_PLACES = (("vllm.v1.serial_utils", "run_method"), ("vllm.utils", "run_method"))
WORKER_WRAPPER_PLACES = (
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase"),
    ("vllm.worker.worker_base", "WorkerWrapperBase"),
)

# The parameters this package passes, per symbol, as each version declares them.
# tests/neuron_serving/unit/test_vllm_compat.py holds these against 0.11.0's source
# (literal data) and against the installed 0.32 (inspect.signature).
RUN_METHOD_PARAMS = ("obj", "method", "args", "kwargs")
WORKER_WRAPPER_PARAMS = {
    "0.32": ("self", "rpc_rank", "global_rank"),
    "0.11": ("self", "vllm_config", "rpc_rank"),
}
COLLECTIVE_RPC_PARAMS = ("self", "method", "timeout", "args", "kwargs", "non_block")
EXECUTE_MODEL_PARAMS = ("self", "scheduler_output", "non_block")


@dataclass(frozen=True, slots=True)
class VllmApi:
    """What the installed vLLM offers, found by probing it (``resolve``)."""

    run_method: Callable[..., Any]
    worker_wrapper_cls: type
    # 0.11.0: WorkerWrapperBase(vllm_config, rpc_rank); 0.32: (rpc_rank, global_rank).
    wrapper_takes_vllm_config: bool
    # 0.32: the executor has compile_or_warm_up_model and EngineCore calls it.
    executor_warms_up: bool
    # 0.32: execute_model schedules, sample_tokens samples.
    split_sampling: bool
    # 0.11.0: EngineCore sizes its batch queue from executor.max_concurrent_batches.
    executor_sizes_batch_queue: bool
    has_block_size_update: bool


def _first(places: tuple[tuple[str, str], ...], import_module: Callable[[str], Any]) -> Any:
    for module, name in places:
        try:
            found = getattr(import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise ImportError(f"none of {places} in vLLM {vllm.__version__}")


def resolve(
    import_module: Callable[[str], Any] = importlib.import_module,
    executor_cls: type = Executor,
    platform: Any = current_platform,
) -> VllmApi:
    wrapper = _first(WORKER_WRAPPER_PLACES, import_module)
    return VllmApi(
        run_method=_first(RUN_METHOD_PLACES, import_module),
        worker_wrapper_cls=wrapper,
        wrapper_takes_vllm_config="vllm_config" in inspect.signature(wrapper.__init__).parameters,
        executor_warms_up=callable(getattr(executor_cls, "compile_or_warm_up_model", None)),
        split_sampling=callable(getattr(executor_cls, "sample_tokens", None)),
        executor_sizes_batch_queue=isinstance(
            inspect.getattr_static(executor_cls, "max_concurrent_batches", None), property
        ),
        has_block_size_update=callable(getattr(platform, "update_block_size_for_backend", None)),
    )


API = resolve()
run_method = API.run_method
if TYPE_CHECKING:
    # As a type: the installed vLLM's class (0.32), which mypy checks against.
    from vllm.v1.worker.worker_base import WorkerWrapperBase
else:
    WorkerWrapperBase = API.worker_wrapper_cls

# model_config None: 0.11.0's WorkerWrapperBase then skips init_cached_hf_modules,
# which only trust_remote_code models need (vllm/worker/worker_base.py).
_NO_MODEL = SimpleNamespace(model_config=None)


def new_worker_wrapper(rpc_rank: int, vllm_config: Any = None) -> Any:
    """vLLM's ``WorkerWrapperBase`` for this rank. A follower has no ``VllmConfig``
    until ``init_worker`` brings it; 0.32 never needs one here."""
    if API.wrapper_takes_vllm_config:  # 0.11.0's signature, unknown to the type checker
        return API.worker_wrapper_cls(vllm_config=vllm_config or _NO_MODEL, rpc_rank=rpc_rank)
    return WorkerWrapperBase(rpc_rank=rpc_rank)


def update_block_size_for_backend(vllm_config: Any) -> None:
    if API.has_block_size_update:
        current_platform.update_block_size_for_backend(vllm_config)


class LegacyExecutorMixin:
    """0.11.0's ``Executor`` made to call what a 0.32 executor overrides.

    Only in ``UnitExecutor``'s bases when the installed vLLM is 0.11-shaped
    (``EXECUTOR_BASES``); on 0.32 the class is ``Executor``'s direct subclass."""

    collective_rpc: Callable[..., Any]
    scheduler_config: Any

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        # 0.11.0 runs compile_or_warm_up_model on the workers from here, bypassing
        # the executor; route it through the executor as 0.32's EngineCore does.
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))
        self.compile_or_warm_up_model()

    def compile_or_warm_up_model(self) -> None:
        self.collective_rpc("compile_or_warm_up_model")

    @property
    def max_concurrent_batches(self) -> int:
        # As 0.11.0's UniProcExecutor: one batch in flight while the next is
        # scheduled under async scheduling (the unit executor supports it).
        return 2 if self.scheduler_config.async_scheduling else 1


EXECUTOR_BASES: tuple[type, ...] = (
    (Executor,) if API.executor_warms_up else (LegacyExecutorMixin, Executor)
)
