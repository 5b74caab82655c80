"""The follower's step loop: receive a broadcast call, run it on the local vLLM worker.

Imported only after the follower has joined its leader: importing torch and
vLLM takes seconds, and a follower should report rejections (wrong token,
version mismatch) before paying for them.
"""

from __future__ import annotations

import logging
import time

from neuron_serving.devices.base import DeviceBackend, RankPlacement
from neuron_serving.exitcodes import ExitCode
from neuron_serving.unit import auth, gc_pauses
from neuron_serving.unit.broadcast import (
    KIND_CALL,
    KIND_KEEPALIVE,
    KIND_SHUTDOWN,
    GroupAddress,
    open_control_broadcast,
)
from neuron_serving.unit.calls import decode_call, method_name, runs_collective
from neuron_serving.unit.follower import Follower
from neuron_serving.unit.load_io import LoadStats
from neuron_serving.unit.local_worker import in_session, run_call
from neuron_serving.unit.node_status import NodeState
from neuron_serving.unit.step_timing import TIMING, time_collectives
from neuron_serving.unit.vllm_compat import new_worker_wrapper

logger = logging.getLogger("neuron_serving.follower")


def serve(follower: Follower, backend: DeviceBackend) -> int:
    cfg, welcome = follower.cfg, follower.welcome
    assert follower.channel is not None and welcome is not None
    start = follower.wait_start()
    # The address this host reaches the leader from is the one peers can reach us on.
    local_host = follower.channel.sock.getsockname()[0]
    where = GroupAddress(welcome.world_size, start.store_host, start.store_port, local_host)
    key = auth.broadcast_key(follower.token, welcome.session_nonce)
    bc = open_control_broadcast(cfg.rank, where, key, welcome.broadcast_inline_bytes)
    follower.broadcast = bc  # the health server's /metrics reads its stats
    placement = in_session(
        RankPlacement(cfg.rank, welcome.world_size, cfg.leader_host, cfg.leader_port),
        welcome.session_nonce,
    )
    follower.on_exit.append(lambda: backend.release(placement))
    backend.prepare_worker(placement)
    for cls in backend.communicator_classes():
        time_collectives(cls)
    worker = new_worker_wrapper(cfg.rank)  # its VllmConfig comes with init_worker
    status = follower.status
    logger.info("rank %d joined unit %s (%d ranks)", cfg.rank, welcome.unit_id, welcome.world_size)

    while True:
        kind, seq, payload = bc.recv()
        if kind == KIND_KEEPALIVE:
            continue
        if kind == KIND_SHUTDOWN:
            status.set_state(NodeState.STOPPING)
            try:
                worker.shutdown()
            except Exception as e:  # exiting anyway; say why it was not clean
                logger.warning("worker shutdown failed: %s", e)
            follower.run_exit_hooks()
            return ExitCode.OK
        if kind != KIND_CALL:
            raise RuntimeError(f"unknown control broadcast kind {kind}")
        method, args, kwargs, gather = decode_call(payload)
        name = method_name(method)
        if name == "init_device":
            status.set_state(NodeState.LOADING)
        started = time.monotonic()
        try:
            result = run_call(worker, method, args, kwargs, resolve=True)
        except Exception as e:
            reason = f"rank {cfg.rank} failed in {name}: {e!r}"
            logger.error("%s\n%s", reason, follower.format_exc())
            status.set_state(NodeState.FAILED, reason)
            if gather:
                follower.reply(seq, ok=False, error=reason)
            follower.report_failure(reason)
            follower.run_exit_hooks()
            return ExitCode.FAILED
        if gather:
            follower.reply(seq, ok=True, result=result)
        if isinstance(result, LoadStats):
            logger.info("%s", result.render())
        if name == "execute_model":
            status.step_done()
            if runs_collective(name, args):
                TIMING.step(time.monotonic() - started)
                follower.ranks_alive(started)
        elif name == "compile_or_warm_up_model":
            # Started: what is alive now (the model, torch's and vLLM's objects) stays
            # alive, so it leaves the collector's view, as EngineCore's heap does on
            # rank 0; unfrozen, a full collection of it takes 250-640 ms here, in which
            # every rank of the unit waits (gc_pauses.py).
            frozen = gc_pauses.freeze_heap()
            logger.info("rank %d started; %d objects frozen out of the collector", cfg.rank, frozen)
            status.set_state(NodeState.READY)
