"""Removal of a deployment's task definitions: every revision of both families.

ECS keeps a deregistered revision (INACTIVE) until it is deleted, and a deleted
one lingers as DELETE_IN_PROGRESS until no task uses it; "leave nothing" means
both steps. Tasks are stopped (and Cloud Map names removed) by the controller first.
"""

from __future__ import annotations

from typing import Any

from neuron_serving.ecs.spec import DeploymentSpec
from neuron_serving.ecs.taskdef import ROLES, family


def revisions(ecs: Any, spec: DeploymentSpec, status: str) -> list[str]:
    """ARNs of one status in this deployment's families (not of families sharing a prefix)."""
    arns = []
    for role in ROLES:
        fam = family(spec, role)
        pages = ecs.get_paginator("list_task_definitions").paginate(familyPrefix=fam, status=status)
        for page in pages:
            # familyPrefix is a prefix: "llama-leader" also lists "llama-leader2".
            arns += [
                a
                for a in page["taskDefinitionArns"]
                if a.rsplit("/", 1)[-1].rsplit(":", 1)[0] == fam
            ]
    return arns


def delete_task_definitions(ecs: Any, spec: DeploymentSpec) -> int:
    for arn in revisions(ecs, spec, "ACTIVE"):
        ecs.deregister_task_definition(taskDefinition=arn)
    inactive = revisions(ecs, spec, "INACTIVE")
    for i in range(0, len(inactive), 10):  # DeleteTaskDefinitions takes at most 10
        ecs.delete_task_definitions(taskDefinitions=inactive[i : i + 10])
    return len(inactive)
