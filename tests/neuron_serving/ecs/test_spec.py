from __future__ import annotations

import pytest

from neuron_serving.ecs.spec import DeploymentSpec, SpecError, load_spec
from tests.neuron_serving.ecs.conftest import spec_dict


def errors(**changes) -> str:
    with pytest.raises(SpecError) as e:
        DeploymentSpec.from_dict(spec_dict(**changes))
    return str(e.value)


def test_valid_spec_defaults():
    spec = DeploymentSpec.from_dict(spec_dict(tp_degree=None, task_memory_mib=None))
    assert spec.global_tp_degree == 64
    assert spec.model_dir == "/models/llm" and spec.log_group == "/ecs/llama"
    assert spec.memory_mib == 491520  # trn1.32xlarge default
    assert spec.unit_id(3) == "llama-3"


def test_yaml_file_and_date_version(tmp_path):
    path = tmp_path / "unit.yaml"
    path.write_text(
        "\n".join(f"{k}: {v}" for k, v in spec_dict(subnets=None, security_groups=None).items()
                  if v is not None and k not in ("subnets", "security_groups"))
        + "\nversion: 2026-12-01\nsubnets: [subnet-1]\n"
    )  # fmt: skip
    spec = load_spec(path)
    assert spec.version == "2026-12-01" and spec.subnets == ("subnet-1",)


def test_unknown_instance_type_names_the_known_ones():
    msg = errors(instance_type="trn1.2xlarge")
    assert "unknown instance_type 'trn1.2xlarge'" in msg
    assert "trn1.32xlarge" in msg and "trn2.48xlarge" in msg and "no EFA" in msg


def test_tp_degree_must_match_nodes_times_cores():
    msg = errors(tp_degree=32, nodes_per_unit=2)
    assert "tp_degree 32 does not match nodes_per_unit x NeuronCores = 2 x 32 = 64" in msg
    # trn2.48xlarge has 64 logical NeuronCores per node.
    assert (
        DeploymentSpec.from_dict(
            spec_dict(instance_type="trn2.48xlarge", nodes_per_unit=2, tp_degree=128)
        ).global_tp_degree
        == 128
    )
    assert "= 2 x 64 = 128" in errors(instance_type="trn2.48xlarge", tp_degree=64)


def test_missing_image_and_roles():
    raw = spec_dict()
    for key in ("image", "execution_role_arn", "task_role_arn"):
        raw.pop(key)
    with pytest.raises(SpecError) as e:
        DeploymentSpec.from_dict(raw)
    assert e.value.problems == [
        "missing required key 'image'",
        "missing required key 'execution_role_arn'",
        "missing required key 'task_role_arn'",
    ]
    assert "image is missing or empty" in errors(image=" ")
    assert "task_role_arn must be an IAM role ARN" in errors(task_role_arn="my-role")


def test_all_problems_reported_together():
    with pytest.raises(SpecError) as e:
        DeploymentSpec.from_dict(
            spec_dict(name="Bad_Name", nodes_per_unit=0, units=-1, control_port=8000, colour=1)
        )
    assert e.value.problems == ["unknown key 'colour'"]  # structure first
    with pytest.raises(SpecError) as e:
        DeploymentSpec.from_dict(spec_dict(name="Bad_Name", nodes_per_unit=0, units=-1))
    msg = str(e.value)
    assert "name 'Bad_Name'" in msg and "nodes_per_unit must be an integer >= 1" in msg
    assert "units must be an integer >= 0" in msg


def test_ports_namespace_secret_and_url_checks():
    assert "ports overlap" in errors(control_port=7999)  # 7999..8002 hits Triton
    assert "ports overlap" in errors(health_port=29502)
    assert "go together" in errors(service_discovery_namespace="x.internal")
    assert "Secrets Manager" in errors(unit_token_secret_arn="token")
    assert "http://" in errors(proxy_admin_urls=["http://proxy-0:8081", "proxy-1:8081"])
    assert "model_uri must be s3://BUCKET/PREFIX" in errors(model_uri="/models/v2")
    assert "exclude each other" in errors(model_uri="s3://b/v2", host_model_dir="/opt/m")
    assert "must be a YAML mapping" in str(
        pytest.raises(SpecError, DeploymentSpec.from_dict, []).value
    )


def test_multi_node_unit_needs_a_token_secret():
    """Without a shared secret each rank makes up its own token: the join handshake
    could never succeed and the unit would never form. Refused up front."""
    msg = errors(unit_token_secret_arn=None)
    assert "nodes_per_unit 2 needs unit_token_secret_arn" in msg
    single = DeploymentSpec.from_dict(
        spec_dict(nodes_per_unit=1, tp_degree=32, unit_token_secret_arn=None)
    )
    assert single.unit_token_secret_arn is None  # one node: nobody joins
    assert "Secrets Manager" in errors(triton_admin_key_secret_arn="admin-key")


def test_model_uri_needs_the_manifest_digest():
    msg = errors(model_uri="s3://b/v2")
    assert "model_uri needs model_manifest_sha256" in msg
    assert "64 lowercase hex" in errors(model_uri="s3://b/v2", model_manifest_sha256="AB" * 32)
    assert "64 lowercase hex" in errors(model_manifest_sha256="ab" * 31)
    pinned = DeploymentSpec.from_dict(
        spec_dict(model_uri="s3://b/v2", model_manifest_sha256="ab" * 32)
    )
    assert pinned.model_manifest_sha256 == "ab" * 32


def test_security_group_design_checks():
    assert "must be a security group id" in errors(unit_security_group="default")
    assert "must be one of security_groups" in errors(
        unit_security_group="sg-0aa", proxy_security_group="sg-0bb"
    )
    assert "need unit_security_group" in errors(proxy_security_group="sg-0bb")
    assert "needs proxy_security_group" in errors(
        security_groups=["sg-0aa"], unit_security_group="sg-0aa"
    )
