"""RunTask parameters for one node of one unit, and the tags that find it again.

ECS has no gang scheduling: each node is its own ``RunTask(count=1)``. The tags
(deployment, unit, rank, version, launch time) are the controller's only state,
so any controller process can pick up a deployment from ECS alone. Two optional
ones, given by whoever launches the unit (``extra_tags``):

    purpose      why the unit was added (``interactive`` / ``batch``): set by the
                 autoscaling actuator (capacity/ecs_actuator.py); batch units are the
                 first given back
    mid-deploy   launch time (epoch seconds) of a unit a rolling deploy is replacing:
                 set on the new tasks at their launch, removed (UntagResource) once
                 the unit is ready again; scale-in never takes such a unit
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuron_serving.ecs.spec import DeploymentSpec
from neuron_serving.ecs.taskdef import TAG_PREFIX, placement_constraints, rank_environment


@dataclass(frozen=True, slots=True)
class NodeLaunch:
    """One node to start: which unit and rank, and where its leader is."""

    unit_id: str
    rank: int
    leader_host: str | None  # None: rank 0 without Cloud Map (see rank_environment)
    task_definition: str  # family:revision or ARN

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if not self.unit_id or not self.task_definition:
            raise ValueError("unit_id and task_definition are required")

    @property
    def role(self) -> str:
        return "leader" if self.rank == 0 else "follower"


PURPOSE_TAG = "purpose"
MID_DEPLOY_TAG = "mid-deploy"
STANDARD_TAGS = ("deployment", "unit", "rank", "role", "version", "launched-at")


def started_by(spec: DeploymentSpec) -> str:
    return spec.name  # <= 28 characters by spec validation; ECS allows 36


def run_task_params(
    spec: DeploymentSpec,
    node: NodeLaunch,
    now: float | None = None,
    extra_tags: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``extra_tags``: more of our tags (key without the prefix), never one of
    ``STANDARD_TAGS`` (those find the unit again and are this function's)."""
    env = rank_environment(spec, node.unit_id, node.rank, node.leader_host)
    clash = set(extra_tags or ()) & set(STANDARD_TAGS)
    if clash:
        raise ValueError(f"extra tags may not set {sorted(clash)}")
    tags = {
        "deployment": spec.name,
        "unit": node.unit_id,
        "rank": str(node.rank),
        "role": node.role,
        "version": spec.version,
        "launched-at": str(int(now if now is not None else time.time())),
        **(extra_tags or {}),
    }
    params: dict[str, Any] = {
        "cluster": spec.cluster,
        "taskDefinition": node.task_definition,
        "count": 1,
        "launchType": "EC2",
        "startedBy": started_by(spec),
        # ECS spreads tasks of a group; one group per unit keeps a unit's view together.
        "group": f"{spec.name}:{node.unit_id}",
        # One node per instance: each node owns all 16 Neuron devices and every EFA
        # device; with a placement group, only instances of that cluster placement group.
        "placementConstraints": [{"type": "distinctInstance"}, *placement_constraints(spec)],
        "overrides": {
            "containerOverrides": [
                {
                    "name": node.role,
                    "environment": [{"name": k, "value": v} for k, v in sorted(env.items())],
                }
            ]
        },
        "tags": [{"key": TAG_PREFIX + k, "value": v} for k, v in tags.items()],
        "enableECSManagedTags": True,
        "propagateTags": "TASK_DEFINITION",
    }
    if spec.subnets:
        vpc: dict[str, Any] = {"subnets": list(spec.subnets)}
        if spec.security_groups:
            vpc["securityGroups"] = list(spec.security_groups)
        params["networkConfiguration"] = {"awsvpcConfiguration": vpc}
    return params


def task_tags(task: dict[str, Any]) -> dict[str, str]:
    """Our tags of a described task (``describe_tasks(include=["TAGS"])``), prefix removed."""
    return {
        t["key"][len(TAG_PREFIX) :]: t["value"]
        for t in task.get("tags", [])
        if t["key"].startswith(TAG_PREFIX)
    }
