"""Fixtures: a moto AWS (ECS cluster with fake trn1 container instances, VPC, Cloud Map
namespace) and a real proxy on loopback whose admin API the controller registers with.

What moto does not emulate (and these tests therefore do not check): device
mappings reaching a container, health checks being run (moto reports every
container HEALTHY), placement constraints (memberOf/distinctInstance are accepted
and ignored; one task per instance here comes from moto's host-port bookkeeping),
task start-up time, and awslogs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from neuron_serving.ecs.spec import DeploymentSpec

REGION = "us-east-1"
ADMIN_TOKEN = "ecs-test-admin-token"


def spec_dict(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "llama",
        "model": "llm",
        "version": "v1",
        "instance_type": "trn1.32xlarge",
        "nodes_per_unit": 2,
        "units": 2,
        "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/neuron-serving:v1",
        "execution_role_arn": "arn:aws:iam::123456789012:role/ecsTaskExecutionRole",
        "task_role_arn": "arn:aws:iam::123456789012:role/neuron-serving-task",
        "cluster": "trn",
        "region": REGION,
        "tp_degree": 64,
        "subnets": ["subnet-placeholder"],
        "security_groups": ["sg-placeholder"],
        "unit_token_secret_arn": (
            "arn:aws:secretsmanager:us-east-1:123456789012:secret:neuron-serving/unit-token"
        ),
        # moto's fake container instances offer 7482 MiB; real trn1 tasks take ~480 GiB.
        "task_memory_mib": 2048,
    }
    base.update(changes)
    return base


@dataclass
class FakeAws:
    ecs: Any
    ec2: Any
    sd: Any
    subnet: str
    security_group: str
    namespace_id: str
    namespace: str

    def spec_dict(self, **changes: Any) -> dict[str, Any]:
        """A unit spec (as YAML would hold it) on this fake VPC and Cloud Map namespace."""
        raw = spec_dict(
            subnets=[self.subnet],
            security_groups=[self.security_group],
            service_discovery_namespace=self.namespace,
            service_discovery_namespace_id=self.namespace_id,
        )
        raw.update(changes)
        return raw

    def spec(self, **changes: Any) -> DeploymentSpec:
        return DeploymentSpec.from_dict(self.spec_dict(**changes))

    def add_instances(self, n: int, cluster: str = "trn") -> None:
        resp = self.ec2.run_instances(
            ImageId="ami-12c6146b", MinCount=n, MaxCount=n, InstanceType="trn1.32xlarge"
        )
        for inst in resp["Instances"]:
            doc = {
                "instanceId": inst["InstanceId"],
                "instanceType": "trn1.32xlarge",
                "region": REGION,
                "availabilityZone": f"{REGION}a",
                "privateIp": inst["PrivateIpAddress"],
            }
            self.ecs.register_container_instance(
                cluster=cluster, instanceIdentityDocument=json.dumps(doc)
            )


@pytest.fixture
def aws(monkeypatch) -> Iterator[FakeAws]:
    import boto3
    from moto import mock_aws
    from moto.moto_api import state_manager

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    with mock_aws():
        # moto advances a task's lastStatus on every DescribeTasks (RUNNING -> ... ->
        # STOPPED) by default; a real task stays RUNNING until it stops.
        state_manager.set_transition("ecs::task", {"progression": "manual", "times": 10**9})
        ecs = boto3.client("ecs", region_name=REGION)
        ec2 = boto3.client("ec2", region_name=REGION)
        sd = boto3.client("servicediscovery", region_name=REGION)
        ecs.create_cluster(clusterName="trn")
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        # Cloud Map private DNS needs DNS support and hostnames on the VPC (moto's
        # awsvpc task ENIs need hostnames too).
        ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsSupport={"Value": True})
        ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsHostnames={"Value": True})
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24")["Subnet"]["SubnetId"]
        sg = ec2.create_security_group(GroupName="units", Description="units", VpcId=vpc)
        sd.create_private_dns_namespace(Name="neuron.internal", Vpc=vpc)
        (ns,) = sd.list_namespaces()["Namespaces"]
        fake = FakeAws(ecs, ec2, sd, subnet, sg["GroupId"], ns["Id"], ns["Name"])
        fake.add_instances(6)
        try:
            yield fake
        finally:
            state_manager.unset_transition("ecs::task")


class ProxyThread:
    """The real proxy (proxy.server.ProxyServer) on its own event loop thread."""

    def __init__(self, tmp_path) -> None:
        from proxy.config import config_from_dict
        from proxy.server import ProxyServer

        token_file = tmp_path / "admin-token"
        token_file.write_text(ADMIN_TOKEN + "\n")
        # Long probe interval: the units' addresses are moto's, nothing answers there.
        cfg = config_from_dict(
            {
                "port": 0,
                "admin_port": 0,
                "admin_token_file": str(token_file),
                "health": {"interval_s": 60.0, "timeout_s": 0.05, "jitter_s": 0.0},
            }
        )
        self.server = ProxyServer(cfg, seed=0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._call(self.server.start())

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.server.admin_port}"

    def units(self) -> dict[str, Any]:
        async def snapshot() -> dict[str, Any]:
            return {
                u.unit_id: {**dataclasses.asdict(u.spec), "draining": u.draining}
                for u in self.server.registry.units.values()
            }

        return self._call(snapshot())

    def stop(self) -> None:
        self._call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


@pytest.fixture
def proxy(tmp_path) -> Iterator[ProxyThread]:
    p = ProxyThread(tmp_path)
    try:
        yield p
    finally:
        p.stop()
