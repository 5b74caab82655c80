"""The rendered network design: who may reach which port of a node task (finding 1, 2, 12:
Triton, the stores and /healthz were reachable from anywhere in the VPC)."""

from __future__ import annotations

import json

import pytest

from neuron_serving.ecs import render as render_mod
from neuron_serving.ecs import taskdef
from neuron_serving.ecs.schema import validate
from neuron_serving.ecs.security_groups import EPHEMERAL_PORTS, authorize_ingress_params
from neuron_serving.ecs.spec import DeploymentSpec
from tests.neuron_serving.ecs.conftest import spec_dict

UNIT, PROXY, DEPLOYER, SCRAPER, OTHER = "sg-0a1", "sg-0b2", "sg-0c3", "sg-0d4", "sg-0e5"


def make_spec(**changes) -> DeploymentSpec:
    raw = spec_dict(
        security_groups=[UNIT],
        unit_security_group=UNIT,
        proxy_security_group=PROXY,
        deployer_security_group=DEPLOYER,
        metrics_security_group=SCRAPER,
    )
    raw.update(changes)
    return DeploymentSpec.from_dict(raw)


def allowed(params: dict, port: int) -> set[str]:
    """The groups the rendered rules let reach ``port`` (TCP)."""
    return {
        pair["GroupId"]
        for rule in params["IpPermissions"]
        if rule["IpProtocol"] == "tcp" and rule["FromPort"] <= port <= rule["ToPort"]
        for pair in rule["UserIdGroupPairs"]
    }


def test_rules_admit_exactly_the_designed_sources():
    spec = make_spec()
    params = authorize_ingress_params(spec)
    validate("AuthorizeSecurityGroupIngress", params, service="ec2")
    assert params["GroupId"] == UNIT
    for rule in params["IpPermissions"]:
        # Group to group only: no address range, so nothing outside these groups.
        assert set(rule) == {"IpProtocol", "FromPort", "ToPort", "UserIdGroupPairs"}, rule
    expected = {
        8000: {PROXY, DEPLOYER},  # Triton HTTP: proxy, deploy canaries
        8001: {PROXY},  # Triton gRPC
        8002: {SCRAPER},  # merged metrics
        8003: {PROXY},  # the leader's OpenAI channel
        29500: {UNIT},  # control (HMAC join)
        29501: {UNIT},  # control-plane TCPStore (no authentication)
        29502: {UNIT},  # vLLM's TCPStore (no authentication)
        29503: {UNIT},  # Neuron collectives bootstrap
        9100: {PROXY},  # node health gRPC
        9101: {SCRAPER},  # node /metrics and /healthz
    }
    for port, sources in expected.items():
        assert allowed(params, port) == sources, port
    # Every port a task maps is reachable by someone it must be (nothing forgotten).
    for role in taskdef.ROLES:
        for mapping in taskdef.port_mappings(spec, role):
            assert mapping["containerPort"] in expected, mapping
    # Gloo pairs bind ephemeral ports: members only.
    low, high = EPHEMERAL_PORTS
    assert allowed(params, low) == allowed(params, high) == {UNIT}
    for port in (22, 80, 443, 8004, 8080, 9102, 29504, 32767, 61000):
        assert allowed(params, port) == set(), port


def test_optional_sources_and_single_node_units():
    params = authorize_ingress_params(
        make_spec(
            deployer_security_group=None,
            metrics_security_group=None,
            nodes_per_unit=1,
            tp_degree=32,
            unit_token_secret_arn=None,
        )
    )
    assert allowed(params, 8000) == allowed(params, 8001) == allowed(params, 9100) == {PROXY}
    # No scraper: no metrics; one node: no peers, so no member rules at all.
    for port in (8002, 9101, 29500, 29502, EPHEMERAL_PORTS[0]):
        assert allowed(params, port) == set(), port


def test_render_writes_the_rules_and_they_apply(aws, tmp_path):
    """`ecs render` writes security-group-ingress.json; EC2 (moto) accepts it as is and
    describes back exactly those rules on the unit group."""
    proxy_sg = aws.ec2.create_security_group(
        GroupName="proxy", Description="proxy", VpcId=_vpc(aws)
    )["GroupId"]
    spec = aws.spec(
        unit_security_group=aws.security_group,
        proxy_security_group=proxy_sg,
    )
    render_mod.write(spec, tmp_path)
    params = json.loads((tmp_path / "security-group-ingress.json").read_text())
    assert params == authorize_ingress_params(spec)
    aws.ec2.authorize_security_group_ingress(**params)
    (group,) = aws.ec2.describe_security_groups(GroupIds=[aws.security_group])["SecurityGroups"]
    applied = {
        (r["FromPort"], r["ToPort"], p["GroupId"])
        for r in group["IpPermissions"]
        for p in r["UserIdGroupPairs"]
    }
    wanted = {
        (r["FromPort"], r["ToPort"], p["GroupId"])
        for r in params["IpPermissions"]
        for p in r["UserIdGroupPairs"]
    }
    assert applied == wanted
    assert not any(r.get("IpRanges") or r.get("Ipv6Ranges") for r in group["IpPermissions"])


def test_no_design_no_file(tmp_path):
    names = {str(p.relative_to(tmp_path)) for p in render_mod.write(
        DeploymentSpec.from_dict(spec_dict()), tmp_path)}  # fmt: skip
    assert "security-group-ingress.json" not in names


@pytest.mark.parametrize("itype", ["trn1.32xlarge", "trn2.48xlarge"])
def test_example_specs_render_a_design(itype):
    from neuron_serving.ecs.spec import load_spec
    from tests.neuron_serving.ecs.test_templates import ECS

    spec = load_spec(ECS / "unit-specs" / f"{itype}.yaml")
    assert "security-group-ingress.json" in render_mod.render(spec)


def _vpc(aws) -> str:
    (group,) = aws.ec2.describe_security_groups(GroupIds=[aws.security_group])["SecurityGroups"]
    return group["VpcId"]
