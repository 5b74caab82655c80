from proxy.config import HealthCheckConfig
from proxy.registry import NodeHealth
from proxy.upstream.health_checker import apply_probe_result
from tests.proxy.fakes import wait_until

CFG = HealthCheckConfig(unhealthy_threshold=3, healthy_threshold=2)


def run(node: NodeHealth, results: str) -> list[bool]:
    """Feed 'o'k / 'x' failures; return the node's health after each probe."""
    out = []
    for c in results:
        apply_probe_result(node, c == "o", 0.001, "" if c == "o" else "boom", CFG)
        out.append(node.healthy)
    return out


def test_new_node_needs_one_success_then_envoy_thresholds():
    node = NodeHealth("u/leader", "leader", "127.0.0.1:1")
    assert not node.healthy
    assert run(node, "xxo") == [False, False, True]  # start-up: a single success
    assert run(node, "xxo") == [True, True, True]  # two failures < 3: still healthy, count reset
    assert run(node, "xxx") == [True, True, False]  # third consecutive failure flips it
    assert run(node, "oxo") == [False, False, False]  # interleaved failure resets the successes
    assert run(node, "o") == [True]  # second consecutive success
    assert node.consecutive_successes == 2 and node.consecutive_failures == 0


def test_flip_is_reported_once():
    node = NodeHealth("u/leader", "leader", "127.0.0.1:1")
    flips = [
        apply_probe_result(node, ok, 0.0, "", CFG)
        for ok in (True, True, False, False, False, False)
    ]
    assert flips == [True, None, None, None, False, None]
    assert node.probe_failures_total == 4 and node.last_error == ""


async def test_follower_not_serving_makes_unit_unroutable(fleet):
    u = await fleet.unit("u0", followers=2)
    proxy = await fleet.proxy([u])
    unit = proxy.registry.get("u0")
    await u.followers[1].set_serving(False)
    await wait_until(lambda: not unit.nodes_healthy())
    assert unit.nodes[2].healthy is False and unit.nodes[1].healthy and unit.leader.healthy
    assert "NOT_SERVING" in unit.nodes[2].last_error
    await u.followers[1].set_serving(True)
    await wait_until(unit.nodes_healthy)
    kinds = [e.kind for e in proxy.registry.events if e.unit_id == "u0"]
    assert "node unhealthy" in kinds and kinds[-1] == "node healthy"


async def test_leader_model_not_ready_and_dead_follower(fleet):
    u = await fleet.unit("u0", followers=1)
    proxy = await fleet.proxy([u])
    unit = proxy.registry.get("u0")
    u.behavior.model_ready = False
    await wait_until(lambda: not unit.leader.healthy)
    assert "not ready" in unit.leader.last_error
    u.behavior.model_ready = True
    await wait_until(lambda: unit.leader.healthy)
    await u.followers[0].stop()  # the process is gone: connection refused / timeout
    await wait_until(lambda: not unit.nodes[1].healthy)
    assert unit.nodes[1].consecutive_failures >= 2


async def test_a_probe_timeout_is_inconclusive_while_the_leader_reports_its_load(fleet):
    """Slow is not dead: a follower too busy to answer its probes in time stays healthy
    while its unit's leader keeps pushing its engine load (as it does every 2 s over
    the OpenAI channel); once the reports stop, the same timeouts mark it unhealthy."""
    import asyncio
    import time

    from proxy.registry import EngineLoad

    u = await fleet.unit("u0", followers=1)
    proxy = await fleet.proxy([u])
    unit = proxy.registry.get("u0")
    await wait_until(unit.nodes_healthy)
    u.followers[0].health.delay_s = 1.0  # every probe times out
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # the leader's reports, fresh throughout
        unit.set_engine_load(EngineLoad(1, 0, 0.1, 16, time.monotonic()))
        assert unit.nodes[1].healthy
        await asyncio.sleep(0.05)
    assert proxy.health.inconclusive_total > 0
    unit.set_engine_load(None)  # the reports stop
    await wait_until(lambda: not unit.nodes[1].healthy)
    assert "timed out" in unit.nodes[1].last_error
