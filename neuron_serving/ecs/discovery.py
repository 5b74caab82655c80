"""Cloud Map names of unit leaders: followers dial ``<unit-id>-leader.<namespace>``.

ECS registers tasks in Cloud Map only for services, and a unit's nodes are
standalone tasks (RunTask), so the controller registers each leader itself: one
Cloud Map service per unit (an A record, TTL 10 s), one instance per leader task
(instance id = task id). Followers start at the same time as their leader and
retry the name until it resolves (their join loop retries on any OSError).
"""

from __future__ import annotations

import re
from typing import Any

from neuron_serving.ecs.spec import DeploymentSpec


class LeaderDiscovery:
    def __init__(self, client: Any, spec: DeploymentSpec) -> None:
        if not spec.service_discovery_namespace_id:
            raise ValueError("LeaderDiscovery needs service_discovery_namespace_id")
        self.client = client
        self.spec = spec
        self.namespace_id = spec.service_discovery_namespace_id
        self._unit_service = re.compile(rf"^{re.escape(spec.name)}-\d+-leader$")

    def _services(self) -> dict[str, str]:
        """Service name -> id, for this deployment's units only."""
        found: dict[str, str] = {}
        pages = self.client.get_paginator("list_services").paginate(
            Filters=[{"Name": "NAMESPACE_ID", "Values": [self.namespace_id], "Condition": "EQ"}]
        )
        for page in pages:
            for s in page["Services"]:
                if self._unit_service.match(s["Name"]):
                    found[s["Name"]] = s["Id"]
        return found

    def _service_id(self, unit_id: str) -> str:
        name = f"{unit_id}-leader"
        existing = self._services().get(name)
        if existing:
            return existing
        resp = self.client.create_service(
            Name=name,
            NamespaceId=self.namespace_id,
            Description=f"leader of inference unit {unit_id} ({self.spec.name})",
            DnsConfig={"RoutingPolicy": "MULTIVALUE", "DnsRecords": [{"Type": "A", "TTL": 10}]},
        )
        return resp["Service"]["Id"]

    def register_leader(self, unit_id: str, task_id: str, ip: str) -> None:
        service_id = self._service_id(unit_id)
        # A predecessor's address must not linger: followers would dial a dead leader.
        for inst in self.client.list_instances(ServiceId=service_id)["Instances"]:
            if inst["Id"] != task_id:
                self.client.deregister_instance(ServiceId=service_id, InstanceId=inst["Id"])
        self.client.register_instance(
            ServiceId=service_id, InstanceId=task_id, Attributes={"AWS_INSTANCE_IPV4": ip}
        )

    def remove_unit(self, unit_id: str) -> None:
        service_id = self._services().get(f"{unit_id}-leader")
        if service_id:
            self._delete(service_id)

    def remove_all(self) -> None:
        for service_id in self._services().values():
            self._delete(service_id)

    def _delete(self, service_id: str) -> None:
        for inst in self.client.list_instances(ServiceId=service_id)["Instances"]:
            self.client.deregister_instance(ServiceId=service_id, InstanceId=inst["Id"])
        self.client.delete_service(Id=service_id)

    def names(self) -> list[str]:
        return sorted(self._services())
