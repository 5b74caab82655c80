"""`ecs render`: the deployment as files, each validated before any is written.

    <out>/task-definitions/<name>-leader.json    RegisterTaskDefinition parameters
    <out>/task-definitions/<name>-follower.json
    <out>/run-task/<unit-id>-rank<r>.json        RunTask parameters of every node
    <out>/deployment.json                        spec, families, units, leader names
    <out>/security-group-ingress.json            AuthorizeSecurityGroupIngress of the unit
                                                 group (with unit_security_group set)

Use them with the AWS CLI: ``aws ecs register-task-definition --cli-input-json
file://...``, ``aws ec2 authorize-security-group-ingress --cli-input-json file://...``. Without Cloud Map, a follower's leader address is only known at
launch: its file holds the placeholder ``LEADER_IP``; the controller fills it in.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from neuron_serving.ecs.launch import NodeLaunch, run_task_params
from neuron_serving.ecs.schema import validate
from neuron_serving.ecs.security_groups import authorize_ingress_params
from neuron_serving.ecs.spec import DeploymentSpec
from neuron_serving.ecs.taskdef import ROLES, family, leader_dns_name, task_definition

LEADER_IP_PLACEHOLDER = "LEADER_IP"


def render(spec: DeploymentSpec) -> dict[str, dict[str, Any]]:
    """Relative path -> document; raises before returning if anything is invalid."""
    docs: dict[str, dict[str, Any]] = {}
    for role in ROLES:
        params = task_definition(spec, role)
        validate("RegisterTaskDefinition", params)
        docs[f"task-definitions/{family(spec, role)}.json"] = params
    leaders = {}
    for i in range(spec.units):
        unit_id = spec.unit_id(i)
        dns = leader_dns_name(spec, unit_id)
        leaders[unit_id] = dns
        for rank in range(spec.nodes_per_unit):
            role = "leader" if rank == 0 else "follower"
            host = dns if dns or rank == 0 else LEADER_IP_PLACEHOLDER
            params = run_task_params(
                spec, NodeLaunch(unit_id, rank, host, family(spec, role)), now=0
            )
            validate("RunTask", params)
            docs[f"run-task/{unit_id}-rank{rank}.json"] = params
    if spec.unit_security_group:
        ingress = authorize_ingress_params(spec)
        validate("AuthorizeSecurityGroupIngress", ingress, service="ec2")
        docs["security-group-ingress.json"] = ingress
    docs["deployment.json"] = {
        "spec": dataclasses.asdict(spec),
        "families": {role: family(spec, role) for role in ROLES},
        "units": list(leaders),
        "leader_names": leaders,
        "tp_degree": spec.global_tp_degree,
    }
    return docs


def write(spec: DeploymentSpec, out: str | Path) -> list[Path]:
    docs = render(spec)  # everything validated before the first file is written
    out = Path(out)
    written = []
    for rel, doc in docs.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
        written.append(path)
    return written
