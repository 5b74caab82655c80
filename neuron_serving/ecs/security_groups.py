"""The network design of a deployment: who may reach which port of a node task.

Every node task (leader and follower) is in the spec's ``unit_security_group`` and
binds each listener to its ENI address (taskdef.command), so these ingress rules are
the whole of who can connect. Rendered as the parameters of EC2
``AuthorizeSecurityGroupIngress`` for that group, checked against botocore's EC2
model like every other rendered file:

| port(s) | role | from | why |
| --- | --- | --- | --- |
| 8000, 8001 | leader | proxy group | Triton HTTP / gRPC: inference and health only (the rest needs the admin key), and no client authentication of its own: only the proxy may reach it |
| 8000 | leader | deployer group (optional) | `neuron-serving deploy` canaries call Triton's HTTP generate directly |
| 8003 | leader | proxy group | the leader's OpenAI channel (the proxy's OpenAI calls and generate requests; a handshake with the channel token) |
| health port | all | proxy group | grpc.health.v1: the proxy probes followers |
| 8002, health port + 1 | all | metrics group (optional) | Prometheus (Triton+vLLM merged; node /metrics and /healthz) |
| control port .. +3 | all | the unit group itself | control (HMAC join), control-plane TCPStore, vLLM's TCPStore, Neuron collectives bootstrap: no authentication on the stores, so members only |
| 32768-60999 | all | the unit group itself | Gloo pair sockets (torch.distributed) bind ephemeral ports (Linux's default ip_local_port_range) |

Not rendered: egress (ECS tasks need S3, Secrets Manager, ECR, CloudWatch Logs) and
the instances' EFA security group, which AWS requires to admit all traffic from
itself (set on the Auto Scaling group's launch template, not on the task ENIs).
Every unit of a deployment shares one group, so one unit's members can reach another
unit's control and store ports: the trust boundary is the deployment, not the unit.
"""

from __future__ import annotations

from typing import Any

from neuron_serving.devices.neuron import NEURON_CC_PORT_OFFSET
from neuron_serving.ecs.spec import (
    OPENAI_CHANNEL_PORT,
    TRITON_GRPC_PORT,
    TRITON_HTTP_PORT,
    TRITON_METRICS_PORT,
    DeploymentSpec,
)

# Linux's default net.ipv4.ip_local_port_range: where Gloo's port-0 binds land.
EPHEMERAL_PORTS = (32768, 60999)


def _rule(low: int, high: int, group: str, why: str) -> dict[str, Any]:
    return {
        "IpProtocol": "tcp",
        "FromPort": low,
        "ToPort": high,
        "UserIdGroupPairs": [{"GroupId": group, "Description": why}],
    }


def ingress_rules(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """``IpPermissions`` of the unit group: only group-to-group rules, no CIDR."""
    unit, proxy = spec.unit_security_group, spec.proxy_security_group
    if not unit or not proxy:
        raise ValueError("the network design needs unit_security_group and proxy_security_group")
    rules = [
        _rule(TRITON_HTTP_PORT, TRITON_GRPC_PORT, proxy, "proxy to Triton HTTP and gRPC"),
        _rule(spec.health_port, spec.health_port, proxy, "proxy to node health gRPC"),
        _rule(OPENAI_CHANNEL_PORT, OPENAI_CHANNEL_PORT, proxy, "proxy to the OpenAI channel"),
    ]
    if spec.deployer_security_group:
        rules.append(
            _rule(
                TRITON_HTTP_PORT,
                TRITON_HTTP_PORT,
                spec.deployer_security_group,
                "deploy canaries to Triton HTTP",
            )
        )
    if spec.metrics_security_group:
        scraper = spec.metrics_security_group
        rules += [
            _rule(TRITON_METRICS_PORT, TRITON_METRICS_PORT, scraper, "scraper to leader metrics"),
            _rule(spec.health_port + 1, spec.health_port + 1, scraper, "scraper to node metrics"),
        ]
    if spec.nodes_per_unit > 1:  # a one-node unit has no peers to admit
        last = spec.control_port + NEURON_CC_PORT_OFFSET
        rules += [
            _rule(spec.control_port, last, unit, "unit members: control, stores, Neuron CC"),
            _rule(*EPHEMERAL_PORTS, unit, "unit members: Gloo pairs on ephemeral ports"),
        ]
    return rules


def authorize_ingress_params(spec: DeploymentSpec) -> dict[str, Any]:
    """``aws ec2 authorize-security-group-ingress --cli-input-json file://...``"""
    return {"GroupId": spec.unit_security_group, "IpPermissions": ingress_rules(spec)}
