"""A follower's worker imports (torch, vLLM), run while it joins its leader.

A follower needs torch and vLLM only once it has joined (``worker_loop.py``), and
importing them takes 8-10 s on a loaded 2-core host. Done after the join, that
import sat on the unit's start-up critical path: the leader's executor cannot
start the unit until every rank has joined *and* answered ``init_worker``, so it
waited the follower's whole import (measured: leader "joining" -> "loading" 8.2 s,
every start and every recreation). Started before the join, the import overlaps
the leader's own start (tritonserver, the backend stub's imports, EngineCore's).

Only when the unit size is known before the join (``follower --world-size``, which
`up` and ``InProcessUnit`` pass): the thread binding (``OMP_*``, from the device
backend's ``process_env``) must be in the environment before torch is imported, as
OpenMP reads it once. A follower without it imports after the join, as before.

A rejection (wrong token, version mismatch) is still reported as soon as the
leader answers: the import runs on a daemon thread beside the join, and the
process exits without waiting for it.
"""

from __future__ import annotations

import importlib
import os
import threading

WORKER_MODULE = "neuron_serving.unit.worker_loop"


def engine_env(device: str) -> dict[str, str]:
    """What vLLM's platform sets in its engine process for the workers it starts
    (``CpuPlatform.check_and_update_config``), which a follower never runs: set
    before torch is imported (inductor reads ``TORCHINDUCTOR_*`` at import), rank r
    compiles as rank 0 does (no async compile workers, no thread count baked into
    kernels against the OpenMP binding) and keys vLLM's compile cache alike
    (``VLLM_DISABLE_SHARED_EXPERTS_STREAM`` is in its environment hash; without it
    rank 1 compiled into a cache directory of its own).

    Every rank of a unit also compiles without vLLM's AOT artifacts
    (``VLLM_USE_AOT_COMPILE=0``, set on rank 0 too: the leader's backend and
    ``InProcessUnit``): vLLM 0.32 on CPU saves them but never loads them ("'function'
    object has no attribute 'finalize_loading'"), and compiled everything again at
    every start; torch.compile's own caches (inductor's FX graph and AOTAutograd
    caches) then serve a warm start. Measured on one TP=2 unit of the demo model:
    a recreation's compile + warm-up 14.9 s -> 5.8 s, a cold one unchanged."""
    if device != "cpu":
        return {}
    return {
        "NUMEXPR_MAX_THREADS": str(os.cpu_count() or 1),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1",
        "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1",
        "VLLM_USE_AOT_COMPILE": "0",
    }


class WorkerImport:
    """Imports ``module`` on a daemon thread; ``wait`` before using it."""

    def __init__(self, module: str = WORKER_MODULE) -> None:
        self.module = module
        self._thread = threading.Thread(target=self._run, name="worker-import", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> WorkerImport:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            importlib.import_module(self.module)
        except BaseException as e:  # noqa: BLE001 - re-raised by the import after wait()
            self.error = e

    def wait(self, timeout_s: float) -> None:
        """Block until the import has finished (TimeoutError after ``timeout_s``). A
        failed import is not raised here: the caller's own import of the module then
        raises it, with its traceback, where the module is used."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"importing {self.module} took over {timeout_s:g} s")
