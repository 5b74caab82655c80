"""Unit state from described tasks (the shapes ECS returns), without AWS."""

from __future__ import annotations

import time

from neuron_serving.ecs.controller import UnitController
from neuron_serving.ecs.fleet import NodeTask, UnitView, task_health, task_ip
from neuron_serving.ecs.spec import DeploymentSpec
from tests.neuron_serving.ecs.conftest import spec_dict


def node(rank: int, health: str = "HEALTHY", last: str = "RUNNING", **kw) -> NodeTask:
    return NodeTask(
        unit_id="llama-0",
        rank=rank,
        task_arn=f"arn:aws:ecs:us-east-1:1:task/trn/t{rank}",
        last_status=last,
        desired_status=kw.pop("desired", "RUNNING"),
        health=health,
        ip=f"10.0.0.{rank + 1}",
        version="v1",
        launched_at=kw.pop("launched_at", time.time()),
    )


def test_task_health_prefers_the_task_then_the_worst_container():
    assert task_health({"healthStatus": "UNHEALTHY", "containers": []}) == "UNHEALTHY"
    assert task_health({"containers": [{"healthStatus": "HEALTHY"}]}) == "HEALTHY"
    assert task_health({"containers": [{"healthStatus": "HEALTHY"}, {}]}) == "UNKNOWN"
    assert task_health({}) == "UNKNOWN"


def test_task_ip_from_the_eni_attachment():
    task = {
        "attachments": [
            {
                "type": "ElasticNetworkInterface",
                "details": [{"name": "privateIPv4Address", "value": "10.1.2.3"}],
            }
        ]
    }
    assert task_ip(task) == "10.1.2.3" and task_ip({}) is None


def test_unit_states():
    view = UnitView("llama-0", 2, {0: node(0), 1: node(1)})
    assert view.ready and not view.failed and view.index == 0
    assert UnitView("llama-0", 2, {0: node(0)}).failed  # rank 1 missing
    assert UnitView("llama-0", 2, {0: node(0), 1: node(1, last="STOPPING")}).failed
    assert UnitView("llama-0", 2, {0: node(0), 1: node(1, desired="STOPPED")}).failed
    assert UnitView("llama-0", 2, {0: node(0), 1: node(1)}, duplicates=[node(1)]).failed
    starting = UnitView("llama-0", 2, {0: node(0, "UNKNOWN", "PENDING"), 1: node(1)})
    assert not starting.ready and not starting.failed


def test_unhealthy_is_a_failure_after_ready_or_after_the_ready_timeout():
    spec = DeploymentSpec.from_dict(spec_dict(ready_timeout_s=600))
    ctl = UnitController(spec, ecs=None)
    now = time.time()
    healthy = UnitView("llama-0", 2, {0: node(0), 1: node(1)})
    sick = UnitView("llama-0", 2, {0: node(0), 1: node(1, "UNHEALTHY")})
    assert ctl._broken(sick, now) is None  # still loading: ECS marks it UNHEALTHY early
    assert ctl._broken(healthy, now) is None  # ... now it has been ready once
    assert ctl._broken(sick, now) == "a node is UNHEALTHY"
    old = UnitView("llama-1", 2, {0: node(0, launched_at=now - 601), 1: node(1, "UNHEALTHY")})
    assert ctl._broken(old, now) == "a node is UNHEALTHY"
