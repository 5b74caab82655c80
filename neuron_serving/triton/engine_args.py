"""``--engine-args JSON``: any other vLLM engine argument, passed through to the leader.

Triton's vllm_backend reads its whole ``model.json`` as ``AsyncEngineArgs``; ours is a
typed ``BackendConfig`` (backend_config.py), so the pass-through lives in one of its
fields, ``engine_args``, applied last to the engine arguments the unit recipe builds.

Checked before tritonserver starts, so a typo fails in a second rather than after
the engine loaded:

- a key must be a field of vLLM's ``AsyncEngineArgs``. The names are read from
  ``vllm/engine/arg_utils.py``'s syntax tree (tens of milliseconds) instead of
  importing it (about 10 s: it pulls in torch and most of vLLM);
- a key the unit sets itself is refused with the flag that sets it: the unit
  executor, the rank count and the unit's config must stay ours, and two ways to
  say one thing would leave one of them silently ignored.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

# Engine arguments the leader sets from its own flags (or must set itself).
OWNED: dict[str, str] = {
    "model": "--model",
    "tensor_parallel_size": "--tp",
    "distributed_executor_backend": "--executor",
    "additional_config": "the unit's own config (control port, token file, device)",
    "worker_cls": "--device",
    "max_model_len": "--max-model-len",
    "kv_cache_memory_bytes": "--kv-cache-bytes",
    "max_num_seqs": "--max-num-seqs",
    "stream_interval": "--stream-interval",
    "enforce_eager": "--enforce-eager",
    "dtype": "--dtype",
    "served_model_name": "--served-model-name",
    # A unit is tensor-parallel ranks under one executor; other layouts are not a unit.
    "pipeline_parallel_size": "--tp (a unit is tensor-parallel only)",
    "data_parallel_size": "more units (`up --units`; a unit is tensor-parallel only)",
    # Its endpoints carry token ids unauthenticated: only the leader's private ipc://
    # sockets (kv_events.py), relayed over the authenticated OpenAI channel.
    "kv_events_config": "--no-kv-events to turn them off; the leader sets the endpoints",
}

_ENGINE_ARG_CLASSES = ("EngineArgs", "AsyncEngineArgs")


@functools.cache
def vllm_engine_arg_names() -> frozenset[str]:
    """Field names of vLLM's ``AsyncEngineArgs`` (``EngineArgs``'s and its own), from
    the installed source without importing it. ``ClassVar`` annotations are not fields."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--engine-args needs vLLM installed")
    source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in _ENGINE_ARG_CLASSES:
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and "ClassVar" not in ast.unparse(stmt.annotation)
                ):
                    names.add(stmt.target.id)
    if not names:
        raise ValueError(f"no EngineArgs fields found in {source}: vLLM's layout changed")
    return frozenset(names)


def check_engine_args(engine_args: dict[str, Any]) -> None:
    """ValueError naming the first problem: a non-object, a key we own, an unknown key."""
    if not isinstance(engine_args, dict):
        raise ValueError(f"--engine-args must be a JSON object, got {type(engine_args).__name__}")
    for key in engine_args:
        if key in OWNED:
            raise ValueError(f"--engine-args {key!r} is set by the leader: use {OWNED[key]}")
    unknown = sorted(set(engine_args) - vllm_engine_arg_names())
    if unknown:
        hints = [
            f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
            for key in unknown
            for close in [difflib.get_close_matches(key, vllm_engine_arg_names(), n=1)]
        ]
        raise ValueError(
            "--engine-args: not vLLM engine arguments (EngineArgs fields): " + ", ".join(hints)
        )


def parse_engine_args(text: str) -> dict[str, Any]:
    """The ``--engine-args`` JSON text as a checked dict."""
    try:
        engine_args = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--engine-args is not JSON: {e}") from e
    check_engine_args(engine_args)
    return engine_args
