"""Encoding of executor calls for the control broadcast.

A call is ``(method, args, kwargs, gather)``. vLLM's ``SchedulerOutput`` is
already a diff (``NewRequestData`` once per request, then
``CachedRequestData`` deltas), so per-step payloads stay a few KiB; pickle
protocol 5 is the cheapest faithful encoding of those vLLM objects. Callables
(vLLM sometimes sends a function to run on every worker) go through
cloudpickle, as in vLLM's own executors. Decoding happens only after the
broadcast MAC has been verified (``broadcast.py``).

Results of gathered calls come back pickled in ``Reply.payload`` on the
follower's control connection; the leader unpickles one only after its frame's
link MAC and sequence number verified (``channel.py``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle

Method = str | Callable[..., Any]


def encode_call(method: Method, args: tuple, kwargs: dict, gather: bool) -> bytes:
    send = method if isinstance(method, str) else cloudpickle.dumps(method, protocol=5)
    return pickle.dumps((send, args, kwargs, gather), protocol=5)


def decode_call(payload: bytes) -> tuple[str | bytes, tuple, dict, bool]:
    method, args, kwargs, gather = pickle.loads(payload)
    return method, args, kwargs, gather


def decode_result(payload: bytes) -> Any:
    """A follower's result of a gathered call. Only for payloads of Replies that
    arrived on a sealed control connection (the channel verified them)."""
    return pickle.loads(payload)


def method_name(method: str | bytes | Callable[..., Any]) -> str:
    if isinstance(method, str):
        return method
    if isinstance(method, bytes):
        return "<callable>"
    return getattr(method, "__name__", "<callable>")


def runs_collective(name: str, args: tuple) -> bool:
    """Whether the call is a model step whose forward makes every rank take part
    in the tensor-parallel collectives: when it returns on one rank, each other
    rank was running at some point after it started (a stopped or hung rank would
    have blocked it). A step with no scheduled tokens runs no forward."""
    if name != "execute_model" or not args:
        return False
    return getattr(args[0], "total_num_scheduled_tokens", 0) > 0
