"""The deployment as ECS sees it: node tasks grouped into units (read-only).

A unit is *complete* when every rank 0..N-1 has a task ECS wants RUNNING, *ready*
when all of them are RUNNING and HEALTHY (their container health check calls the
node's own ``/healthz``, which is 200 only in state READY), and *failed* when a rank
is missing or stopping: a unit fails as a whole, so one lost node condemns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neuron_serving.ecs.launch import MID_DEPLOY_TAG, PURPOSE_TAG, started_by, task_tags
from neuron_serving.ecs.spec import DeploymentSpec

_STOPPING = {"DEACTIVATING", "STOPPING", "DEPROVISIONING", "STOPPED", "DELETED"}


@dataclass(frozen=True, slots=True)
class NodeTask:
    unit_id: str
    rank: int
    task_arn: str
    last_status: str
    desired_status: str
    health: str  # HEALTHY / UNHEALTHY / UNKNOWN
    ip: str | None
    version: str
    launched_at: float
    stopped_reason: str = ""
    task_definition: str = ""  # ARN of the revision the task runs
    purpose: str = ""  # the purpose tag (launch.py), "" when absent
    deploying_since: float = 0.0  # the mid-deploy tag (launch.py), 0 when absent

    @property
    def task_id(self) -> str:
        return self.task_arn.rsplit("/", 1)[-1]

    @property
    def stopping(self) -> bool:
        return self.desired_status == "STOPPED" or self.last_status in _STOPPING


@dataclass(slots=True)
class UnitView:
    unit_id: str
    world_size: int
    nodes: dict[int, NodeTask] = field(default_factory=dict)
    # A second task for a rank (a launch that raced a replacement): the unit is unsound.
    duplicates: list[NodeTask] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError("world_size must be >= 1")

    @property
    def index(self) -> int:
        return int(self.unit_id.rsplit("-", 1)[1])

    @property
    def version(self) -> str:
        versions = {n.version for n in self.nodes.values()}
        return versions.pop() if len(versions) == 1 else "mixed"

    @property
    def missing_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.nodes]

    @property
    def failed(self) -> bool:
        return (
            bool(self.missing_ranks)
            or bool(self.duplicates)
            or any(n.stopping for n in self.nodes.values())
        )

    @property
    def ready(self) -> bool:
        return not self.failed and all(
            n.last_status == "RUNNING" and n.health == "HEALTHY" for n in self.nodes.values()
        )

    @property
    def unhealthy(self) -> bool:
        return any(n.health == "UNHEALTHY" for n in self.nodes.values())

    @property
    def launched_at(self) -> float:
        return min((n.launched_at for n in self.nodes.values()), default=0.0)

    @property
    def purpose(self) -> str:
        """Why the unit was added (the leader's purpose tag; "" when none says)."""
        return next((n.purpose for _, n in sorted(self.nodes.items()) if n.purpose), "")

    @property
    def deploying_since(self) -> float:
        """When a rolling deploy launched it (the mid-deploy tag); 0 when none is."""
        return max((n.deploying_since for n in self.tasks()), default=0.0)

    def tasks(self) -> list[NodeTask]:
        return [*self.nodes.values(), *self.duplicates]

    def ips(self) -> dict[int, str]:
        return {r: n.ip for r, n in self.nodes.items() if n.ip}


def task_health(task: dict[str, Any]) -> str:
    """Task health, or (where ECS reports it per container only) the worst container's."""
    if task.get("healthStatus"):
        return task["healthStatus"]
    states = {c.get("healthStatus", "UNKNOWN") for c in task.get("containers", [])}
    for state in ("UNHEALTHY", "UNKNOWN", "HEALTHY"):
        if state in states:
            return state
    return "UNKNOWN"


def task_ip(task: dict[str, Any]) -> str | None:
    for att in task.get("attachments", []):
        if att.get("type") == "ElasticNetworkInterface":
            for d in att.get("details", []):
                if d.get("name") == "privateIPv4Address":
                    return d.get("value")
    return None


def node_task(task: dict[str, Any]) -> NodeTask | None:
    tags = task_tags(task)
    if "unit" not in tags or "rank" not in tags:
        return None
    return NodeTask(
        unit_id=tags["unit"],
        rank=int(tags["rank"]),
        task_arn=task["taskArn"],
        last_status=task.get("lastStatus", "UNKNOWN"),
        desired_status=task.get("desiredStatus", "UNKNOWN"),
        health=task_health(task),
        ip=task_ip(task),
        version=tags.get("version", ""),
        launched_at=float(tags.get("launched-at", 0)),
        stopped_reason=task.get("stoppedReason", ""),
        task_definition=task.get("taskDefinitionArn", ""),
        purpose=tags.get(PURPOSE_TAG, ""),
        deploying_since=_float(tags.get(MID_DEPLOY_TAG, "")),
    )


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0


def describe(ecs: Any, cluster: str, arns: list[str]) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = []
    for i in range(0, len(arns), 100):  # DescribeTasks takes at most 100
        resp = ecs.describe_tasks(cluster=cluster, tasks=arns[i : i + 100], include=["TAGS"])
        tasks.extend(resp["tasks"])
    return tasks


def deployment_tasks(ecs: Any, spec: DeploymentSpec) -> list[NodeTask]:
    """Tasks ECS wants RUNNING that carry this deployment's tags."""
    arns: list[str] = []
    pages = ecs.get_paginator("list_tasks").paginate(
        cluster=spec.cluster, startedBy=started_by(spec), desiredStatus="RUNNING"
    )
    for page in pages:
        arns.extend(page["taskArns"])
    nodes = []
    for task in describe(ecs, spec.cluster, arns):
        node = node_task(task)
        if node is not None and task_tags(task).get("deployment") == spec.name:
            nodes.append(node)
    return nodes


def units(ecs: Any, spec: DeploymentSpec) -> dict[str, UnitView]:
    views: dict[str, UnitView] = {}
    for node in deployment_tasks(ecs, spec):
        view = views.setdefault(node.unit_id, UnitView(node.unit_id, spec.nodes_per_unit))
        if node.rank in view.nodes:
            view.duplicates.append(node)
        else:
            view.nodes[node.rank] = node
    return dict(sorted(views.items(), key=lambda kv: kv[1].index))
