"""Active health checking of every node of every unit (Envoy semantics).

- leader: Triton ``ServerReady`` and ``ModelReady(<triton_model>)`` over gRPC; the
  leader's readiness already means "the whole unit is up" (every follower joined,
  model warmed), but followers are probed too so that a dead follower is seen
  from the proxy side even if the leader has not noticed yet.
- follower: ``grpc.health.v1.Health/Check`` with service "" (the node).

A probe that times out while the unit's leader reported its engine load over the
OpenAI channel within ``VOUCHED_S`` counts neither way: slow is not dead, and a
leader whose engine loop runs is alive (a hung rank makes it fail the unit, which the
next probe sees as "not ready"; a dead process refuses the connection). A node
becomes unhealthy after ``unhealthy_threshold`` consecutive failed probes
and healthy again after ``healthy_threshold`` consecutive successes; a node that
has never been healthy needs a single success (Envoy's start-up rule). Probes of
one node never overlap: each node has one task that probes, then sleeps
``interval + U(0, jitter)`` (jitter de-synchronises probes of many proxies).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proxy.config import HealthCheckConfig
from proxy.registry import NodeHealth, Registry, RegistryEvent, UnitState
from proxy.upstream.leader_client import TritonClientPool, grpc_channel_options

log = logging.getLogger(__name__)

# A probe that times out while the unit's leader has reported its engine load within
# this long is inconclusive (see _probe_loop): a 2-core box under load answers a probe
# late without anything being wrong. Above the leaders' 2 s load refresh.
VOUCHED_S = 3.0
# Besides every unhealthy -> healthy transition, the version is re-read this often.
VERSION_REFRESH_PROBES = 20

ProbeObserver = Callable[[UnitState, NodeHealth, bool, float], None]


def apply_probe_result(
    node: NodeHealth, ok: bool, latency_s: float, error: str, cfg: HealthCheckConfig
) -> bool | None:
    """Advance the node's state machine; return the new health if it flipped, else None."""
    node.probes_total += 1
    node.last_probe_at = time.time()
    node.last_probe_latency_s = latency_s
    if ok:
        node.last_error = ""
        node.consecutive_failures = 0
        node.consecutive_successes += 1
        needed = 1 if node.initial else cfg.healthy_threshold
        if not node.healthy and node.consecutive_successes >= needed:
            node.healthy = True
            node.initial = False
            return True
        return None
    node.probe_failures_total += 1
    node.last_error = error
    node.consecutive_successes = 0
    node.consecutive_failures += 1
    if node.healthy and node.consecutive_failures >= cfg.unhealthy_threshold:
        node.healthy = False
        return False
    return None


class HealthChecker:
    """Owns one probe task per node; follows the registry as units come and go."""

    def __init__(
        self,
        registry: Registry,
        cfg: HealthCheckConfig,
        clients: TritonClientPool,
        observer: ProbeObserver | None = None,
        on_leader_config: Callable[[UnitState, Mapping[str, str]], None] | None = None,
    ) -> None:
        """``on_leader_config(unit, parameters)``: the string parameters of the unit's
        model config each time the probe reads it (see ``_leader_probe``)."""
        self._registry = registry
        self._cfg = cfg
        self._clients = clients
        self._observer = observer
        self._on_leader_config = on_leader_config
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._rng = random.Random()
        self._running = False
        self.inconclusive_total = 0  # probes that timed out while the unit vouched for itself

    def start(self) -> None:
        self._running = True
        for unit in self._registry.units.values():
            self._start_unit(unit)
        self._registry.subscribe(self._on_registry_change)

    async def stop(self) -> None:
        self._running = False
        tasks = [t for ts in self._tasks.values() for t in ts]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    def _on_registry_change(self, event: RegistryEvent, unit: UnitState) -> None:
        if not self._running:
            return
        if event == "added":
            self._start_unit(unit)
        else:
            for t in self._tasks.pop(unit.unit_id, []):
                t.cancel()
            in_use = {n.addr for u in self._registry.units.values() for n in u.nodes}
            for addr in {n.addr for n in unit.nodes if n.role == "follower"} - in_use:
                channel = self._channels.pop(addr, None)
                if channel is not None:
                    asyncio.get_running_loop().create_task(channel.close())

    def _start_unit(self, unit: UnitState) -> None:
        self._tasks[unit.unit_id] = [
            asyncio.create_task(self._probe_loop(unit, node), name=f"probe:{node.node_id}")
            for node in unit.nodes
        ]

    async def _probe_loop(self, unit: UnitState, node: NodeHealth) -> None:
        probe = self._leader_probe(unit) if node.role == "leader" else self._follower_probe(node)
        while True:
            start = time.monotonic()
            try:
                async with asyncio.timeout(self._cfg.timeout_s):
                    ok, error = await probe()
            except TimeoutError:
                ok, error = False, f"probe timed out after {self._cfg.timeout_s}s"
                if unit.fresh_load(time.monotonic(), VOUCHED_S) is not None:
                    # A slow answer, not a dead node: the unit's leader pushed its load
                    # over the channel moments ago (it does so every 2 s while its
                    # engine loop runs; a rank that hangs makes the leader fail the
                    # unit within its heartbeat timeout, which a probe then sees as
                    # "not ready"). Neither a failure nor a success.
                    self.inconclusive_total += 1
                    await asyncio.sleep(self._cfg.interval_s)
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure to probe is a failed probe
                ok, error = False, f"{type(e).__name__}: {e}"[:300]
            latency = time.monotonic() - start
            flipped = apply_probe_result(node, ok, latency, error, self._cfg)
            if flipped is not None:
                state = "healthy" if flipped else "unhealthy"
                self._registry.record(unit.unit_id, f"node {state}", f"{node.node_id} {error}")
                log.info("%s is %s %s", node.node_id, state, error)
            if self._observer is not None:
                self._observer(unit, node, ok, latency)
            await asyncio.sleep(self._cfg.interval_s + self._rng.uniform(0, self._cfg.jitter_s))

    def _leader_probe(self, unit: UnitState) -> Callable[[], Awaitable[tuple[bool, str]]]:
        spec = unit.spec

        async def probe() -> tuple[bool, str]:
            client = self._clients.get(spec.leader_grpc)
            timeout = self._cfg.timeout_s
            if not await client.is_server_ready(client_timeout=timeout):
                return False, "triton server not ready"
            if not await client.is_model_ready(spec.triton_model, client_timeout=timeout):
                return False, f"model {spec.triton_model} not ready"
            if not unit.leader.healthy or unit.leader.probes_total % VERSION_REFRESH_PROBES == 0:
                # Before the leader (re)joins rotation: a recreated unit may serve
                # another checkpoint version, and routing must know it first.
                response = await client.get_model_config(spec.triton_model, client_timeout=timeout)
                params = response.config.parameters
                if "model_version" in params and params["model_version"].string_value:
                    self._registry.set_version(unit, params["model_version"].string_value)
                if self._on_leader_config is not None:
                    self._on_leader_config(unit, {k: v.string_value for k, v in params.items()})
            return True, ""

        return probe

    def _follower_probe(self, node: NodeHealth) -> Callable[[], Awaitable[tuple[bool, str]]]:
        async def probe() -> tuple[bool, str]:
            channel = self._channels.get(node.addr)
            if channel is None:
                channel = grpc.aio.insecure_channel(node.addr, options=grpc_channel_options())
                self._channels[node.addr] = channel
            stub = health_pb2_grpc.HealthStub(channel)
            resp = await stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self._cfg.timeout_s
            )
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                return (
                    False,
                    f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}",
                )
            return True, ""

        return probe
