"""This rank's vLLM worker, driven the same way on every rank.

The leader (rank 0, ``executor.py``) and the followers (``worker_loop.py``) both
place their worker in the unit's session and run broadcast calls on it; those
steps live here so that neither side imports the other (a follower never
imports the leader's executor).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from neuron_serving.devices.base import RankPlacement
from neuron_serving.unit.calls import Method
from neuron_serving.unit.vllm_compat import AsyncModelRunnerOutput, WorkerWrapperBase, run_method


def in_session(placement: RankPlacement, session_nonce: bytes) -> RankPlacement:
    """``placement`` in the unit session the leader's ``Welcome`` announced: every
    rank derives the same session id, which names the session's per-host
    resources (CPU shared memory, ``devices/cpu.py``)."""
    return dataclasses.replace(placement, session=session_nonce.hex()[:16])


def run_call(
    worker: WorkerWrapperBase, method: Method | bytes, args: tuple, kwargs: dict, *, resolve: bool
) -> Any:
    """Run one call on the local worker. ``resolve``: wait for the sampled tokens
    of an ``AsyncModelRunnerOutput`` (async scheduling) and return its
    ``ModelRunnerOutput``; otherwise the output may still be in flight."""
    result = run_method(worker, method, args, kwargs)
    if resolve and isinstance(result, AsyncModelRunnerOutput):
        return result.get_output()
    return result
