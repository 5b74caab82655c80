"""A leader's unit executor without a model, alone in its own process.

``python -m tests.neuron_serving.unit.executor_proc --port P --call NAME`` builds
the real ``UnitExecutor`` (control server, join, control broadcast, gather and
failure path) for a 2-rank unit, waits for rank 1 to join, and makes one gathered
``collective_rpc`` of the function ``NAME`` below with a 2 s timeout. Rank 0's
worker has no model (``_init_workers`` creates a bare vLLM worker wrapper and
nothing else), which is all a function call needs. A unit failure ends the
process with the executor's exit code, as in production; one JSON line per event
on stdout tells the test what the executor reported before that.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from vllm.config import ParallelConfig, VllmConfig
from vllm.v1.worker.worker_base import WorkerWrapperBase

from neuron_serving.unit.config import ADDITIONAL_CONFIG_KEY, UnitConfig
from neuron_serving.unit.executor import UnitExecutor
from neuron_serving.unit.messages import CheckpointRef

GATHER_TIMEOUT_S = 2.0
# Far beyond abort_grace_s: a process still alive by then was not failed.
STILL_ALIVE_AFTER_S = 30.0


def answer_on_every_rank(worker: Any) -> str:
    return "answered"


def fail_on_rank0(worker: Any) -> str:
    raise RuntimeError("rank 0 broke")


CALLS = {f.__name__: f for f in (answer_on_every_rank, fail_on_rank0)}


class ModelFreeExecutor(UnitExecutor):
    def _checkpoint_ref(self) -> CheckpointRef:
        return CheckpointRef(model="", version="", manifest_sha256="")

    def _init_workers(self) -> None:
        self.driver_worker = WorkerWrapperBase(rpc_rank=0)


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    # "abandon": no call; the executor is abandoned (InProcessUnit's exception path)
    # and must then outlive its follower's going away.
    p.add_argument("--call", choices=[*sorted(CALLS), "abandon"], required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    unit = UnitConfig(control_port=args.port, unit_id="unit-t", join_timeout_s=60)
    config = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=2),
        additional_config={ADDITIONAL_CONFIG_KEY: unit.to_dict()},
    )
    executor = ModelFreeExecutor(config)
    executor.register_failure_callback(lambda: emit("failure_callback"))
    emit("joined")
    if args.call == "abandon":
        executor.abandon()
        emit("abandoned")
        # Rank 1 goes away a few seconds later (the test closes its connection); a
        # live executor would take that for a rank failure and exit 3.
        time.sleep(unit.abort_grace_s + 10)
        emit("still_alive")
        return
    try:
        value = executor.collective_rpc(CALLS[args.call], timeout=GATHER_TIMEOUT_S)
        emit("returned", value=repr(value))
    except Exception as e:
        emit(
            "raised",
            type=type(e).__name__,
            error=str(e),
            state=str(executor.status.state),
            status_failure=executor.status.failure,
        )
    time.sleep(STILL_ALIVE_AFTER_S)
    emit("still_alive")


if __name__ == "__main__":
    main()
