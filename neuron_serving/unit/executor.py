"""The unit executor: vLLM's executor for a model replica that spans several machines.

vLLM builds it (``distributed_executor_backend=UnitExecutor``) inside the
EngineCore, on the leader. Rank 0's worker lives in this process (as in
``UniProcExecutor``); ranks 1..N-1 are ``neuron-serving follower`` processes
that joined over the control port (``control_server.py``). Every
``collective_rpc`` is broadcast to the followers over a Gloo group
(``broadcast.py``) and run by every rank's local worker; rank 0 answers
``execute_model``/``sample_tokens`` alone, and calls where vLLM needs every
rank's answer (memory profiling, KV cache specs, warm-up) gather the followers'
replies over the control connections.

Ordering invariant (lockstep): rank 0 broadcasts a call *before* running it
locally, and every rank runs calls in broadcast order. The model's
tensor-parallel collectives inside a step then pair up across ranks. Breaking
this order deadlocks the unit.

Failure: a unit fails as a whole. When a follower's connection closes, its
heartbeats stop, or it reports an error, and when a call fails on rank 0 or a
gathered call is not answered in time (``_fail_unit``), ``_on_rank_failure``
records a reason naming the rank, tells the other followers, flips health to
FAILED, notifies vLLM's failure callback, and after ``abort_grace_s`` exits the
process: rank 0 may be blocked inside a collective with the dead rank (the CPU
shared-memory all-reduce spins with no timeout), which nothing but exiting can
interrupt.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from neuron_serving import envs
from neuron_serving.checkpoint.compat import manifest_identity
from neuron_serving.devices.base import RankPlacement
from neuron_serving.devices.registry import get_backend
from neuron_serving.exitcodes import ExitCode
from neuron_serving.unit import auth
from neuron_serving.unit.broadcast import (
    KEEPALIVE_INTERVAL_S,
    KIND_CALL,
    KIND_KEEPALIVE,
    KIND_SHUTDOWN,
    ControlBroadcast,
    GroupAddress,
    open_control_broadcast,
)
from neuron_serving.unit.calls import decode_result, encode_call, method_name, runs_collective
from neuron_serving.unit.compile_lock import compile_lock, lock_path
from neuron_serving.unit.config import UnitConfig, take_unit_config
from neuron_serving.unit.control_server import ControlServer
from neuron_serving.unit.health_server import HealthServer
from neuron_serving.unit.late_beats import LateBeats
from neuron_serving.unit.load_io import LoadStats, measured_load_model
from neuron_serving.unit.local_worker import in_session, run_call
from neuron_serving.unit.messages import CheckpointRef, Start
from neuron_serving.unit.node_metrics import NodeCollector
from neuron_serving.unit.node_status import NodeState, NodeStatus
from neuron_serving.unit.step_timing import TIMING, time_collectives
from neuron_serving.unit.store import init_method as store_init_method
from neuron_serving.unit.vllm_compat import (
    EXECUTOR_BASES,
    AsyncModelRunnerOutput,
    FailureCallback,
    WorkerWrapperBase,
    new_worker_wrapper,
    update_block_size_for_backend,
)
from neuron_serving.versions import runtime_versions

logger = logging.getLogger("neuron_serving.unit.executor")


class UnitFailedError(RuntimeError):
    """The inference unit lost a rank; the message names it."""


# On vLLM 0.32 the bases are (Executor,); on 0.11.0 a mixin goes first (vllm_compat.py).
class UnitExecutor(*EXECUTOR_BASES):  # type: ignore[misc]
    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        self.unit = take_unit_config(self.vllm_config.additional_config) or UnitConfig.from_env()
        self.world_size = self.parallel_config.world_size
        self.backend = get_backend(self.unit.device)
        self.backend.check_available()
        self.placement = RankPlacement(
            0, self.world_size, self.unit.control_host, self.unit.control_port
        )
        self.status = NodeStatus(self.unit.unit_id, 0, self.world_size)
        self.checkpoint = self._checkpoint_ref()
        self.status.set_checkpoint(self.checkpoint.model, self.checkpoint.version)
        self.failure: str | None = None
        self._failure_callback: FailureCallback | None = None
        self._failure_lock = threading.Lock()
        self._shutdown_started = False
        self._stop = threading.Event()
        self.server: ControlServer | None = None
        self.broadcast: ControlBroadcast | None = None
        self.driver_worker: WorkerWrapperBase | None = None
        self.health: HealthServer | None = None
        # Per rank: wall time and bytes read by load_model (load_io.py).
        self.load_stats: list[LoadStats] = []
        if self.unit.health_port:
            collector = NodeCollector(
                self.status,
                stats=lambda: self.control_stats,
                heartbeat_ages=self._heartbeat_ages,
                load_stats=lambda: self.load_stats,
                late_beats=self._late_beats,
                heartbeat_rtts=lambda: self.server.heartbeat_rtts() if self.server else {},
                rank_verdicts=lambda: self.server.stragglers.verdicts() if self.server else {},
            )
            self.health = HealthServer(
                self.status, self.unit.health_host, self.unit.health_port, collector=collector
            )
            self.health.start()
        try:
            self._join_followers()
            self._init_workers()
        except BaseException:
            self._teardown(clean=False)
            raise

    # -- startup ------------------------------------------------------------
    def _join_followers(self) -> None:
        if self.world_size == 1:
            return
        token = auth.resolve_token(self.unit.token_file)
        self.server = ControlServer(
            self.unit,
            self.world_size,
            token,
            runtime_versions(),
            self._on_rank_failure,
            leader_state=lambda: str(self.status.state),
            checkpoint=self.checkpoint,
        )
        self.server.listen()
        self.status.degraded = self.server.stragglers.degraded
        logger.info(
            "unit %s: waiting up to %g s for ranks 1..%d on %s:%d",
            self.unit.unit_id,
            self.unit.join_timeout_s,
            self.world_size - 1,
            self.unit.control_host,
            self.unit.control_port,
        )
        self.server.wait_for_followers(self.unit.join_timeout_s)
        self.server.start_unit(
            Start(
                store_host=self.unit.control_host,
                store_port=self.unit.store_port,
                dist_init_method=self._dist_init_method(),
            )
        )
        where = GroupAddress(
            self.world_size, self.unit.control_host, self.unit.store_port, self.unit.control_host
        )
        key = auth.broadcast_key(token, self.server.session_nonce)
        self.broadcast = open_control_broadcast(0, where, key, self.unit.broadcast_inline_bytes)
        self.placement = in_session(self.placement, self.server.session_nonce)
        threading.Thread(target=self._keepalive_loop, name="unit-keepalive", daemon=True).start()

    def _checkpoint_ref(self) -> CheckpointRef:
        # Followers check their host's copy against it before joining (hook 2,
        # checkpoint/README.md): same version and manifest, their rank's files.
        model = self.vllm_config.model_config.model
        version, sha = manifest_identity(Path(model))
        return CheckpointRef(model=model, version=version, manifest_sha256=sha)

    def _dist_init_method(self) -> str:
        # vLLM's world store (rank 0) listens on the control host only, not on
        # every interface as tcp:// would (unit/store.py).
        return store_init_method(self.unit.control_host, self.unit.dist_port)

    def _init_workers(self) -> None:
        self.status.set_state(NodeState.LOADING)
        self.backend.prepare_worker(self.placement)
        for cls in self.backend.communicator_classes():
            time_collectives(cls)
        self.driver_worker = new_worker_wrapper(0, self.vllm_config)
        all_kwargs = [
            dict(
                vllm_config=self.vllm_config,
                # One shard per node: every rank is local rank 0 of its host.
                local_rank=0,
                rank=rank,
                distributed_init_method=self._dist_init_method(),
                is_driver_worker=rank == 0,
            )
            for rank in range(self.world_size)
        ]
        self._call("init_worker", (all_kwargs,), {}, gather=True)
        self._call("init_device", (), {}, gather=True)
        # Every rank's load_model, measured on that rank (wall time, /proc/self/io).
        self.load_stats = self._call(measured_load_model, (), {}, gather=True)
        for st in self.load_stats:
            logger.info("unit %s: %s", self.unit.unit_id, st.render())
        update_block_size_for_backend(self.vllm_config)

    # -- calls --------------------------------------------------------------
    def _call(
        self,
        method: Any,
        args: tuple,
        kwargs: dict,
        gather: bool,
        timeout: float | None = None,
        resolve_async: bool = True,
    ) -> list[Any]:
        if self.failure:
            raise UnitFailedError(self.failure)
        seq = 0
        try:
            if self.broadcast is not None:
                seq = self.broadcast.send(KIND_CALL, encode_call(method, args, kwargs, gather))
            assert self.driver_worker is not None  # set by _init_workers, before any call
            result = run_call(self.driver_worker, method, args, kwargs, resolve=resolve_async)
        except Exception as e:
            if self.server is None:
                raise
            # Followers ran (or are running) the same call; rank 0 cannot rejoin
            # them in lockstep, so the unit fails as a whole.
            raise self._fail_unit(f"rank 0 failed in {method_name(method)}: {e!r}") from e
        if not gather or self.server is None:
            return [result]
        try:
            replies = self.server.gather(
                seq, timeout or self.unit.rpc_timeout_s, lambda: self.failure
            )
        except Exception as e:
            # A rank that did not answer in time is hung or still inside the call:
            # vLLM gets an error, and the ranks no longer agree on what has run,
            # which only recreating the whole unit repairs, as after a failed call.
            raise self._fail_unit(f"{method_name(method)} not answered: {e}") from e
        results = [result]
        for rank, reply in enumerate(replies, start=1):
            if not reply.ok:
                reason = f"rank {rank} failed in {method_name(method)}: {reply.error}"
                raise self._fail_unit(reason)
            # Only Replies whose frame MAC and sequence verified reach here (channel.py).
            results.append(decode_result(reply.payload))
        return results

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        **_ignored: Any,
    ) -> Any:
        results = self._call(
            method, args, kwargs or {}, gather=unique_reply_rank is None, timeout=timeout
        )
        value = results[0] if unique_reply_rank is not None else results
        return _done(value) if non_block else value

    def _leader_only(self, method: str, args: tuple, non_block: bool) -> Any:
        # Under async scheduling (non_block), rank 0's sampled tokens may still be
        # in flight (AsyncModelRunnerOutput): hand vLLM a future that resolves
        # them when it asks, as UniProcExecutor does, so the scheduler can prepare
        # the next step meanwhile. The broadcast order is unchanged: calls are
        # still issued, broadcast and started on rank 0 one at a time.
        out = self._call(method, args, {}, gather=False, resolve_async=not non_block)[0]
        if not non_block:
            return out
        if isinstance(out, AsyncModelRunnerOutput):
            return _AsyncOutputFuture(out)
        return _done(out)

    def execute_model(self, scheduler_output, non_block: bool = False):
        started = time.monotonic()
        out = self._leader_only("execute_model", (scheduler_output,), non_block)
        self.status.step_done()
        # vLLM's CPU runner is synchronous: the forward, with its collectives, has run
        # by the time the call returns, even when its sampled output is handed over
        # later. (Not checked on Neuron: a runner that returned before its collectives
        # finished would make this proof early and a stopped rank slower to find.)
        if runs_collective("execute_model", (scheduler_output,)):
            TIMING.step(time.monotonic() - started)
            if self.server is not None:
                self.server.ranks_alive(started)
        return out

    def sample_tokens(self, grammar_output, non_block: bool = False):
        return self._leader_only("sample_tokens", (grammar_output,), non_block)

    def execute_dummy_batch(self) -> None:
        self._leader_only("execute_dummy_batch", (), False)

    def take_draft_token_ids(self):
        return self._leader_only("take_draft_token_ids", (), False)

    def determine_available_memory(self) -> list[int]:
        # The profile run, where every rank compiles the model on CPU: one unit at a
        # time per host, later ones from the first one's kernels (compile_lock.py).
        with compile_lock(lock_path(), envs.NEURON_SERVING_COMPILE_LOCK_WAIT_S, self.unit.unit_id):
            return super().determine_available_memory()

    def compile_or_warm_up_model(self) -> None:
        super().compile_or_warm_up_model()
        self.status.set_state(NodeState.READY)
        logger.info("unit %s: all %d ranks ready", self.unit.unit_id, self.world_size)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def register_failure_callback(self, callback: FailureCallback) -> None:
        with self._failure_lock:
            if self.failure:
                callback()
            else:
                self._failure_callback = callback

    def check_health(self) -> None:
        if self.failure:
            raise UnitFailedError(self.failure)

    # -- failure ------------------------------------------------------------
    def _fail_unit(self, reason: str) -> UnitFailedError:
        """Fail the unit from the thread running a call, as ``_on_rank_failure``
        does for failures the control server sees; returns the error to raise."""
        # A dead peer usually surfaces here first (Gloo: "connection closed by
        # peer") while the control server is still noticing the closed control
        # connection; wait a moment for it so the error names the rank and not a
        # socket, then fail the unit (which also frees its shared memory).
        deadline = time.monotonic() + 1.0
        while not self.failure and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.failure:
            self._on_rank_failure(0, reason)
        return UnitFailedError(self.failure or reason)

    def _on_rank_failure(self, rank: int, reason: str) -> None:
        with self._failure_lock:
            if self.failure or self._shutdown_started:
                return
            self.failure = f"inference unit {self.unit.unit_id} failed: {reason}"
            callback = self._failure_callback
        logger.error("%s", self.failure)
        self.status.set_state(NodeState.FAILED, self.failure)
        # Now, not at exit: the engine thread may exit the process first.
        self.backend.release(self.placement)
        if self.server is not None:
            self.server.broadcast_failure(self.failure)
        if callback is not None:
            callback()
        threading.Thread(target=self._abort_after_grace, name="unit-abort", daemon=True).start()

    def _abort_after_grace(self) -> None:
        time.sleep(self.unit.abort_grace_s)
        # Still alive: the engine thread is likely blocked in a collective with
        # the failed rank. Exit so the supervisor recreates the whole unit.
        self.backend.release(self.placement)
        sys.stderr.write(
            f"neuron-serving: {self.failure}; exiting with code {ExitCode.UNIT_FAILED:d}\n"
        )
        sys.stderr.flush()
        os._exit(ExitCode.UNIT_FAILED)

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(KEEPALIVE_INTERVAL_S / 3):
            bc = self.broadcast
            if bc is None or self.failure:
                return
            if time.monotonic() - bc.last_send_monotonic > KEEPALIVE_INTERVAL_S:
                try:
                    bc.send(KIND_KEEPALIVE)
                except Exception as e:  # the heartbeat monitor reports the rank
                    logger.warning("control keepalive failed: %s", e)
                    return

    # -- shutdown -----------------------------------------------------------
    def shutdown(self) -> None:
        self._teardown(clean=True)

    def abandon(self) -> None:
        """Tear down without telling the followers, because whoever started them
        is stopping them (``InProcessUnit`` on an exception): their going away is
        then not a rank failure, so it does not end this process with exit 3."""
        self._teardown(clean=False)

    def _teardown(self, clean: bool) -> None:
        with self._failure_lock:
            if self._shutdown_started:
                return
            self._shutdown_started = True
        clean = clean and not self.failure
        self.status.set_state(NodeState.STOPPING)
        self._stop.set()
        if self.broadcast is not None and clean:
            try:
                self.broadcast.send(KIND_SHUTDOWN)
            except Exception as e:
                logger.warning("shutdown broadcast failed: %s", e)
        if self.server is not None:
            self.server.close(clean=clean)
        if self.driver_worker is not None:
            try:
                self.driver_worker.shutdown()
            except Exception as e:
                logger.warning("rank 0 worker shutdown failed: %s", e)
        self.backend.release(self.placement)
        if self.health is not None:
            self.health.stop()

    def _heartbeat_ages(self) -> dict[int, float]:
        if self.server is None:
            return {}
        now = time.monotonic()
        return {rank: now - link.last_seen for rank, link in list(self.server.links.items())}

    def _late_beats(self) -> dict[str, LateBeats | None]:
        if self.server is None:
            return {}
        return {"self": self.server.late_beats,
                **{str(rank): link.beats for rank, link in list(self.server.links.items())}}  # fmt: skip

    @property
    def control_stats(self):
        return None if self.broadcast is None else self.broadcast.stats


class _AsyncOutputFuture(Future):
    """Resolves rank 0's AsyncModelRunnerOutput on first ``result()``."""

    def __init__(self, output: AsyncModelRunnerOutput) -> None:
        super().__init__()
        self._output = output

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self.set_result(self._output.get_output())
            except Exception as e:
                self.set_exception(e)
        return super().result(timeout)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
