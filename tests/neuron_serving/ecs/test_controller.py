"""The unit controller against moto's ECS, EC2 and Cloud Map, registering with a real
proxy on loopback. See conftest.py for what moto does not emulate."""

from __future__ import annotations

import pytest

from neuron_serving.ecs import fleet, taskdef
from neuron_serving.ecs.controller import UnitController
from neuron_serving.ecs.discovery import LeaderDiscovery
from neuron_serving.ecs.registrar import AdminApiRegistrar
from neuron_serving.proxy_admin import AdminFanOut, replicas_from_urls
from tests.neuron_serving.ecs.conftest import ADMIN_TOKEN, ProxyThread


def make_controller(aws, *proxies, **spec_changes) -> UnitController:
    spec = aws.spec(**spec_changes)
    replicas = replicas_from_urls([p.admin_url for p in proxies])
    return UnitController(
        spec,
        aws.ecs,
        discovery=LeaderDiscovery(aws.sd, spec),
        registrar=AdminApiRegistrar(AdminFanOut(replicas, ADMIN_TOKEN, timeout_s=5)),
        poll_s=0.01,
        sleep=lambda s: None,
    )


def running(aws) -> list[dict]:
    arns = aws.ecs.list_tasks(cluster="trn", desiredStatus="RUNNING")["taskArns"]
    if not arns:
        return []
    return aws.ecs.describe_tasks(cluster="trn", tasks=arns, include=["TAGS"])["tasks"]


def assert_subset(sent, got, path="") -> None:
    """Everything we registered comes back (ECS adds defaults of its own)."""
    if isinstance(sent, dict):
        for k, v in sent.items():
            assert k in got, f"{path}.{k} missing"
            assert_subset(v, got[k], f"{path}.{k}")
    elif isinstance(sent, list):
        assert len(sent) == len(got), path
        for i, (a, b) in enumerate(zip(sent, got, strict=True)):
            assert_subset(a, b, f"{path}[{i}]")
    else:
        assert sent == got, f"{path}: {sent!r} != {got!r}"


def test_task_definitions_register_and_round_trip(aws, proxy):
    ctl = make_controller(aws, proxy)
    arns = ctl.ensure_task_definitions()
    for role in taskdef.ROLES:
        sent = taskdef.task_definition(ctl.spec, role)
        got = aws.ecs.describe_task_definition(taskDefinition=arns[role], include=["TAGS"])
        assert_subset({k: v for k, v in sent.items() if k != "tags"}, got["taskDefinition"])
        assert got["tags"] == sent["tags"]
    assert ctl.ensure_task_definitions() == arns  # unchanged content: no new revision
    ctl.spec = ctl.spec.replace(version="v2")
    assert ctl.ensure_task_definitions()["leader"].endswith("llama-leader:2")


def test_deploy_launches_units_together_and_registers_them(aws, proxy):
    ctl = make_controller(aws, proxy)
    report = ctl.reconcile()
    assert report.ok and report.launched == ["llama-0", "llama-1"]
    tasks = running(aws)
    assert len(tasks) == 4
    assert len({t["containerInstanceArn"] for t in tasks}) == 4  # one node per instance
    views = fleet.units(aws.ecs, ctl.spec)
    assert list(views) == ["llama-0", "llama-1"] and all(v.ready for v in views.values())
    units = proxy.units()
    assert sorted(units) == ["llama-0", "llama-1"]
    for unit_id, view in views.items():
        ips = view.ips()
        assert units[unit_id]["leader_grpc"] == f"{ips[0]}:8001"
        assert units[unit_id]["leader_http"] == f"{ips[0]}:8000"
        assert units[unit_id]["followers"] == (f"{ips[1]}:9100",)
        assert units[unit_id]["model_version"] == "v1"
        # Followers dial the leader's Cloud Map name, which holds the leader's address.
        follower = next(t for t in tasks if t["taskArn"] == view.nodes[1].task_arn)
        env = {
            e["name"]: e["value"]
            for e in follower["overrides"]["containerOverrides"][0]["environment"]
        }
        name = f"{unit_id}-leader.neuron.internal"
        assert env["NEURON_SERVING_LEADER_ADDR"] == f"{name}:29500"
        assert env["NEURON_RT_ROOT_COMM_ID"] == f"{name}:29503"
        (service,) = [
            s for s in aws.sd.list_services()["Services"] if s["Name"] == f"{unit_id}-leader"
        ]
        (inst,) = aws.sd.list_instances(ServiceId=service["Id"])["Instances"]
        assert inst["Attributes"]["AWS_INSTANCE_IPV4"] == ips[0]
        assert inst["Id"] == view.nodes[0].task_id
    assert ctl.reconcile().launched == []  # idempotent
    assert len(running(aws)) == 4
    rows = ctl.status()
    assert [(r["unit_id"], r["state"], r["in_proxy"]) for r in rows] == [
        ("llama-0", "ready", True),
        ("llama-1", "ready", True),
    ]


def test_stopped_follower_replaces_the_whole_unit(aws, proxy):
    ctl = make_controller(aws, proxy)
    assert ctl.reconcile().ok
    before = fleet.units(aws.ecs, ctl.spec)
    old = {n.task_arn for n in before["llama-0"].nodes.values()}
    kept = {n.task_arn for n in before["llama-1"].nodes.values()}
    aws.ecs.stop_task(cluster="trn", task=before["llama-0"].nodes[1].task_arn, reason="EFA error")

    report = ctl.reconcile()
    assert report.replaced == ["llama-0"] and report.launched == [] and report.ok
    after = fleet.units(aws.ecs, ctl.spec)
    new = {n.task_arn for n in after["llama-0"].nodes.values()}
    assert not new & old  # every rank relaunched, the surviving leader too
    assert {n.task_arn for n in after["llama-1"].nodes.values()} == kept  # untouched
    stopped = aws.ecs.describe_tasks(cluster="trn", tasks=sorted(old))["tasks"]
    assert all(t["desiredStatus"] == "STOPPED" for t in stopped)
    leader_stop = next(t for t in stopped if t["taskArn"] == before["llama-0"].nodes[0].task_arn)
    assert (
        "unit failed: rank 1" in leader_stop["stoppedReason"]
        or "missing" in leader_stop["stoppedReason"]
    )
    assert proxy.units()["llama-0"]["leader_grpc"] == f"{after['llama-0'].ips()[0]}:8001"
    assert len(running(aws)) == 4


def test_watch_replaces_a_unit_whose_leader_stopped(aws, proxy):
    ctl = make_controller(aws, proxy, units=1)
    ctl.reconcile()
    leader = fleet.units(aws.ecs, ctl.spec)["llama-0"].nodes[0].task_arn
    aws.ecs.stop_task(cluster="trn", task=leader, reason="OOM")
    ctl.watch(interval_s=0, iterations=1)
    view = fleet.units(aws.ecs, ctl.spec)["llama-0"]
    assert view.ready and view.nodes[0].task_arn != leader


def test_scale_up_and_down(aws, proxy):
    ctl = make_controller(aws, proxy, units=1)
    assert ctl.reconcile().launched == ["llama-0"]
    report = ctl.scale(3)
    assert report.launched == ["llama-1", "llama-2"] and report.ok
    assert len(running(aws)) == 6 and sorted(proxy.units()) == ["llama-0", "llama-1", "llama-2"]
    report = ctl.scale(1)
    assert report.retired == ["llama-2", "llama-1"]  # highest first
    assert len(running(aws)) == 2 and sorted(proxy.units()) == ["llama-0"]
    names = {s["Name"] for s in aws.sd.list_services()["Services"]}
    assert names == {"llama-0-leader"}


def test_scale_beyond_capacity_reports_and_cleans_up(aws, proxy):
    ctl = make_controller(aws, proxy, units=3)
    assert ctl.reconcile().ok  # 6 nodes on 6 instances
    report = ctl.scale(4)
    assert list(report.failed) == ["llama-3"]
    assert "RunTask placed no task" in report.failed["llama-3"]
    assert len(running(aws)) == 6  # no half-started unit left behind
    assert "llama-3" not in proxy.units()


def test_rolling_replacement_unit_by_unit(aws, proxy):
    ctl = make_controller(aws, proxy)
    ctl.reconcile()
    seen_in_proxy = []
    real_add = ctl.registrar.add

    def add(unit):
        # When a new-version unit registers, every other unit is still in the proxy.
        seen_in_proxy.append((unit["unit_id"], sorted(proxy.units())))
        real_add(unit)

    ctl.registrar.add = add
    ctl.spec = ctl.spec.replace(version="v2", image=ctl.spec.image.replace(":v1", ":v2"))
    report = ctl.reconcile()
    assert report.rolled == ["llama-0", "llama-1"] and report.ok
    assert seen_in_proxy == [("llama-0", ["llama-1"]), ("llama-1", ["llama-0"])]
    views = fleet.units(aws.ecs, ctl.spec)
    assert {v.version for v in views.values()} == {"v2"}
    assert {u["model_version"] for u in proxy.units().values()} == {"v2"}
    for t in running(aws):
        assert t["taskDefinitionArn"].endswith(":2")


def test_teardown_leaves_nothing(aws, proxy):
    ctl = make_controller(aws, proxy)
    ctl.reconcile()
    ctl.spec = ctl.spec.replace(version="v2")
    ctl.reconcile()  # two revisions per family now
    summary = ctl.teardown()
    assert summary == {"units": 2, "task_definitions": 4}
    assert running(aws) == []
    for status in ("ACTIVE", "INACTIVE"):
        assert aws.ecs.list_task_definitions(status=status)["taskDefinitionArns"] == []
    assert aws.sd.list_services()["Services"] == []
    assert proxy.units() == {}
    # Only the spec's wanted units remain in status, as absent.
    assert [(r["unit_id"], r["state"]) for r in ctl.status()] == [
        ("llama-0", "absent"),
        ("llama-1", "absent"),
    ]
    assert all(r["nodes"] == [] for r in ctl.status())


def test_controller_needs_discovery_for_a_namespace(aws):
    with pytest.raises(ValueError, match="LeaderDiscovery"):
        UnitController(aws.spec(), aws.ecs)


def test_every_proxy_replica_gets_the_units_and_one_that_lost_them_gets_them_back(
    aws, proxy, tmp_path
):
    (tmp_path / "second").mkdir()
    second = ProxyThread(tmp_path / "second")
    try:
        ctl = make_controller(aws, proxy, second)
        assert ctl.reconcile().ok
        assert sorted(proxy.units()) == sorted(second.units()) == ["llama-0", "llama-1"]
        assert proxy.units() == second.units()
        kept = dict(proxy.server.registry.units)

        async def forget() -> None:  # as a replica restarted from a config without units
            for unit_id in list(second.server.registry.units):
                second.server.registry.remove(unit_id)

        second._call(forget())
        assert ctl.reconcile().ok
        assert proxy.units() == second.units() and sorted(second.units()) == ["llama-0", "llama-1"]
        # The replica that had them keeps them as they were (no re-add, no health reset).
        assert all(proxy.server.registry.units[u] is kept[u] for u in kept)
        second.stop()
        assert ctl.reconcile().ok  # a replica that does not answer is logged, not fatal
    finally:
        if second.thread.is_alive():
            second.stop()
