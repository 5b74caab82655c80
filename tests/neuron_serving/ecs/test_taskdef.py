"""Rendered task definitions and RunTask parameters: every device and setting, botocore's
ECS model, and the Neuron environment of every rank."""

from __future__ import annotations

import json

import pytest

from neuron_serving.devices.base import RankPlacement
from neuron_serving.devices.neuron import NeuronBackend
from neuron_serving.devices.neuron_rank import rank_launch
from neuron_serving.ecs import render as render_mod
from neuron_serving.ecs import taskdef
from neuron_serving.ecs.launch import NodeLaunch, run_task_params
from neuron_serving.ecs.schema import SchemaError, validate
from neuron_serving.ecs.spec import DeploymentSpec
from tests.neuron_serving.ecs.conftest import spec_dict

DEVICES = {"trn1.32xlarge": (16, 8, 32), "trn2.48xlarge": (16, 16, 64)}


def make_spec(**changes) -> DeploymentSpec:
    raw = spec_dict(**{"tp_degree": None, **changes})
    return DeploymentSpec.from_dict(raw)


def env_of(container) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["environment"]}


@pytest.mark.parametrize("itype", sorted(DEVICES))
@pytest.mark.parametrize("role", taskdef.ROLES)
def test_task_definition_has_every_device_and_setting(itype, role):
    spec = make_spec(instance_type=itype, task_memory_mib=None)
    td = taskdef.task_definition(spec, role)
    validate("RegisterTaskDefinition", td)
    neuron, efa, cores = DEVICES[itype]
    (c,) = td["containerDefinitions"]
    devices = [d["hostPath"] for d in c["linuxParameters"]["devices"]]
    assert devices == [f"/dev/neuron{i}" for i in range(neuron)] + [
        f"/dev/infiniband/uverbs{i}" for i in range(efa)
    ]
    assert all(d["containerPath"] == d["hostPath"] for d in c["linuxParameters"]["devices"])
    # AWS Batch's EFA guidance: EFA device files need read, write and mknod.
    perms = [d["permissions"] for d in c["linuxParameters"]["devices"]]
    assert perms == [["read", "write"]] * neuron + [["read", "write", "mknod"]] * efa
    assert c["linuxParameters"]["capabilities"] == {"add": ["IPC_LOCK"]}
    assert {"name": "memlock", "softLimit": -1, "hardLimit": -1} in c["ulimits"]
    assert td["networkMode"] == "awsvpc" and td["requiresCompatibilities"] == ["EC2"]
    assert td["family"] == f"llama-{role}" and c["name"] == role
    assert td["placementConstraints"] == [
        {"type": "memberOf", "expression": f"attribute:ecs.instance-type == {itype}"}
    ]
    ports = {p["containerPort"] for p in c["portMappings"]}
    assert all(p["hostPort"] == p["containerPort"] for p in c["portMappings"])
    assert {9100, 9101} <= ports
    if role == "leader":
        assert ports == {8000, 8001, 8002, 8003, 29500, 29501, 29502, 29503, 9100, 9101}
    else:
        assert ports == {9100, 9101}
    hc = c["healthCheck"]
    assert hc["command"][0] == "CMD-SHELL" and "http://%s:9101/healthz" in hc["command"][1]
    assert taskdef.TASK_IP_FILE in hc["command"][1]
    assert c["user"] == taskdef.NODE_USER != "0"
    assert c["logConfiguration"]["logDriver"] == "awslogs"
    assert c["logConfiguration"]["options"]["awslogs-group"] == "/ecs/llama"
    assert c["logConfiguration"]["options"]["awslogs-stream-prefix"] == role
    assert c["secrets"] == [
        {"name": "NEURON_SERVING_UNIT_TOKEN", "valueFrom": spec.unit_token_secret_arn}
    ]
    env = env_of(c)
    assert not {"NEURON_LOCAL_TP", "NEURON_RANK_ID"} & set(env)  # Transformers NeuronX only
    assert env["NEURON_SERVING_NEURON_CORES_PER_NODE"] == str(cores)
    assert env["VLLM_PLUGINS"] == "neuron_serving"
    # Writable and per task: vllm-neuron would compile inside the read-only model mount.
    assert env["NEURON_COMPILED_ARTIFACTS"] == "/tmp/neuron-compiled-artifacts"
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["FI_EFA_FORK_SAFE"] == "1" and env["NEURON_SERVING_DEVICE"] == "neuron"
    assert env["NEURON_SERVING_WORLD_SIZE"] == "2"
    assert ("NEURON_SERVING_LEADER_HEALTH_PORT" in env) == (role == "leader")
    assert td["memory"] == str(spec.instance.default_task_memory_mib)
    assert c["memoryReservation"] == spec.instance.default_task_memory_mib
    assert {t["key"]: t["value"] for t in td["tags"]}["neuron-serving/version"] == "v1"


def test_host_model_dir_is_mounted_read_only():
    spec = make_spec(host_model_dir="/opt/neuron-serving/models/llm")
    td = taskdef.task_definition(spec, "follower")
    validate("RegisterTaskDefinition", td)
    assert td["volumes"] == [
        {"name": "model", "host": {"sourcePath": "/opt/neuron-serving/models/llm"}}
    ]
    assert td["containerDefinitions"][0]["mountPoints"] == [
        {"sourceVolume": "model", "containerPath": "/models/llm", "readOnly": True}
    ]
    assert taskdef.task_definition(make_spec(), "leader")["volumes"] == []


def test_commands():
    spec = make_spec()
    leader = taskdef.command(spec, "leader")
    # --tp is NxDI's global tp_degree: 2 nodes x 32 NeuronCores, not the node count.
    assert "exec neuron-serving leader --model /models/llm --tp 64 --control-port 29500" in leader
    assert "NEURON_RANK_ID" not in leader
    assert "--http-port 8000 --grpc-port 8001 --metrics-port 8002" in leader
    assert '--host "$IP" --control-host "$IP"' in leader
    assert "NEURON_RT_ROOT_COMM_ID:-$IP:29503" in leader
    assert 'NEURON_SERVING_HEALTH_HOST="$IP"' in leader
    follower = taskdef.command(spec, "follower")
    ip = f'IP="$({taskdef.TASK_IP})" && printf %s "$IP" > {taskdef.TASK_IP_FILE} && '
    assert leader.startswith(ip) and follower.startswith(ip)
    assert (
        "exec neuron-serving follower --world-size 2 --device neuron --health-port 9100" in follower
    )
    assert '--health-host "$IP" --leader "$NEURON_SERVING_LEADER_ADDR"' in follower
    assert '--rank "$NEURON_SERVING_RANK"' in follower


@pytest.mark.parametrize("role", taskdef.ROLES)
def test_nothing_binds_every_interface(role):
    """Every listener of a node binds the task's ENI address; the security group alone
    decides who reaches it (finding 1 and 12: Triton and /healthz were on 0.0.0.0)."""
    td = taskdef.task_definition(make_spec(), role)
    text = json.dumps(td)
    assert "0.0.0.0" not in text and '"::"' not in text
    assert "NEURON_SERVING_HEALTH_HOST" not in env_of(td["containerDefinitions"][0])


DIGEST = "ab" * 32


def test_model_uri_each_rank_fetches_its_shards_first():
    spec = make_spec(model_uri="s3://ckpt/llama/v2", model_manifest_sha256=DIGEST)
    fetch = 'neuron-serving checkpoint fetch "$NEURON_SERVING_MODEL_URI" /models/llm --rank'
    leader = taskdef.command(spec, "leader")
    assert f"{fetch} 0 && exec neuron-serving leader --model /models/llm" in leader
    follower = taskdef.command(spec, "follower")
    assert f'{fetch} "$NEURON_SERVING_RANK" && exec neuron-serving follower' in follower
    for role in taskdef.ROLES:
        td = taskdef.task_definition(spec, role)
        validate("RegisterTaskDefinition", td)
        assert env_of(td["containerDefinitions"][0])["NEURON_SERVING_MODEL_URI"] == spec.model_uri
        # Another version is another revision (content hash), not the same one.
        other = taskdef.task_definition(spec.replace(model_uri="s3://ckpt/llama/v3"), role)
        assert other["tags"][-1] != td["tags"][-1]
    assert "NEURON_SERVING_MODEL_URI" not in env_of(
        taskdef.task_definition(make_spec(), "leader")["containerDefinitions"][0]
    )


def test_every_rank_is_pinned_to_the_deploys_manifest():
    """The manifest's digest reaches every rank's environment (task definition env +
    RunTask overrides), and another digest is another task definition revision."""
    spec = make_spec(model_uri="s3://ckpt/llama/v2", model_manifest_sha256=DIGEST, nodes_per_unit=3)
    for rank in range(spec.nodes_per_unit):
        role = "leader" if rank == 0 else "follower"
        td = taskdef.task_definition(spec, role)
        validate("RegisterTaskDefinition", td)
        params = run_task_params(spec, NodeLaunch("llama-0", rank, "10.0.0.5", f"llama-{role}"))
        override = {e["name"]: e["value"] for e in
                    params["overrides"]["containerOverrides"][0]["environment"]}  # fmt: skip
        env = {**env_of(td["containerDefinitions"][0]), **override}
        assert env["NEURON_SERVING_MODEL_MANIFEST_SHA256"] == DIGEST, rank
        swapped = taskdef.task_definition(spec.replace(model_manifest_sha256="cd" * 32), role)
        assert swapped["tags"][-1] != td["tags"][-1]
    # A model baked into the image or mounted from the host can be pinned too.
    mounted = make_spec(host_model_dir="/opt/m", model_manifest_sha256=DIGEST)
    env = env_of(taskdef.task_definition(mounted, "follower")["containerDefinitions"][0])
    assert env["NEURON_SERVING_MODEL_MANIFEST_SHA256"] == DIGEST


def test_triton_admin_key_secret_goes_to_the_leader_only():
    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:neuron-serving/triton-admin"
    spec = make_spec(triton_admin_key_secret_arn=arn)
    leader = taskdef.task_definition(spec, "leader")["containerDefinitions"][0]
    follower = taskdef.task_definition(spec, "follower")["containerDefinitions"][0]
    assert {"name": "NEURON_SERVING_TRITON_ADMIN_KEY", "valueFrom": arn} in leader["secrets"]
    assert [s["name"] for s in follower["secrets"]] == ["NEURON_SERVING_UNIT_TOKEN"]
    single = make_spec(nodes_per_unit=1, unit_token_secret_arn=None)
    assert "secrets" not in taskdef.task_definition(single, "leader")["containerDefinitions"][0]


def test_the_openai_channel_is_fixed_and_keyed_on_the_leader_only():
    """The leader's OpenAI channel on ECS: a fixed port (the security group opens it to
    the proxy) and, when configured, its token from Secrets Manager."""
    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:neuron-serving/channel"
    spec = make_spec(channel_token_secret_arn=arn)
    leader = taskdef.task_definition(spec, "leader")["containerDefinitions"][0]
    follower = taskdef.task_definition(spec, "follower")["containerDefinitions"][0]
    assert {"name": "NEURON_SERVING_CHANNEL_TOKEN", "valueFrom": arn} in leader["secrets"]
    assert "NEURON_SERVING_CHANNEL_TOKEN" not in {s["name"] for s in follower["secrets"]}
    assert env_of(leader)["NEURON_SERVING_LEADER_CHANNEL_PORT"] == "8003"
    assert "NEURON_SERVING_LEADER_CHANNEL_PORT" not in env_of(follower)
    assert {"name": "openai-channel", "containerPort": 8003, "hostPort": 8003,
            "protocol": "tcp"} in leader["portMappings"]  # fmt: skip


def test_health_check_passes_only_for_a_ready_node(tmp_path):
    """The rendered health check command, run by sh as ECS would, against a real node
    health server bound to one address as in a task: this machine's first non-loopback
    IPv4 address stands in for the ENI (loopback if it has none)."""
    import socket
    import subprocess
    import sys

    import psutil

    from neuron_serving.unit.health_server import HealthServer
    from neuron_serving.unit.node_status import NodeState, NodeStatus
    from tests.procs import free_port_block

    port = free_port_block(2)
    spec = make_spec(health_port=port)
    ip_file = tmp_path / "task-ip"
    (cmd,) = [
        c.replace(taskdef.TASK_IP_FILE, str(ip_file)).replace("python3 ", f"{sys.executable} ")
        for c in taskdef.health_check(spec)["command"][1:]
    ]

    def check() -> int:
        return subprocess.run(["/bin/sh", "-c", cmd], timeout=30, capture_output=True).returncode

    addrs = [a.address for nic in psutil.net_if_addrs().values() for a in nic
             if a.family == socket.AF_INET and not a.address.startswith("127.")]  # fmt: skip
    eni = addrs[0] if addrs else "127.0.0.1"
    status = NodeStatus("llama-0", 1, 2)
    server = HealthServer(status, eni, port, poll_interval_s=0.05)
    server.start()
    try:
        assert check() == 1, "no task-ip file yet (the node has not started): unhealthy"
        ip_file.write_text(eni)
        assert check() == 1, "state joining: unhealthy"
        status.set_state(NodeState.READY)
        assert check() == 0, "state ready: healthy"
        status.set_state(NodeState.FAILED, "rank 1 lost the leader")
        assert check() == 1, "state failed: unhealthy"
    finally:
        server.stop()


@pytest.mark.parametrize("itype", sorted(DEVICES))
def test_neuron_environment_per_rank_matches_the_backend(itype):
    """Task definition env + RunTask overrides = what NeuronBackend gives each rank."""
    spec = make_spec(instance_type=itype, nodes_per_unit=4)
    cores = DEVICES[itype][2]
    backend = NeuronBackend(cores_per_node=cores)
    leader = "llama-1-leader.neuron.internal"
    starts = []
    for rank in range(4):
        role = "leader" if rank == 0 else "follower"
        static = env_of(taskdef.container_definition(spec, role))
        params = run_task_params(spec, NodeLaunch("llama-1", rank, leader, f"llama-{role}"))
        validate("RunTask", params)
        (override,) = params["overrides"]["containerOverrides"]
        assert override["name"] == role
        env = {**static, **{e["name"]: e["value"] for e in override["environment"]}}
        placement = RankPlacement(rank, 4, leader, 29500)
        for key, value in backend.process_env(placement).items():
            assert env[key] == value, key
        assert env["NEURON_RT_ROOT_COMM_ID"] == f"{leader}:29503"
        assert env["NEURON_SERVING_RANK"] == str(rank) and "NEURON_RANK_ID" not in env
        assert env["NEURON_SERVING_LEADER_ADDR"] == f"{leader}:29500"
        assert env["NEURON_SERVING_UNIT_ID"] == "llama-1"
        # The rank's NxDI layout follows from the leader's --tp and the rank.
        launch = rank_launch(taskdef.unit_shape(spec), rank, leader, 29500, spec.model_dir)
        assert launch.env == backend.process_env(placement)
        assert launch.override_neuron_config["tp_degree"] == spec.global_tp_degree == 4 * cores
        starts.append(launch.override_neuron_config["start_rank_id"])
        tags = {t["key"]: t["value"] for t in params["tags"]}
        assert tags["neuron-serving/unit"] == "llama-1" and tags["neuron-serving/rank"] == str(rank)
        assert {"type": "distinctInstance"} in params["placementConstraints"]
    assert starts == [0, cores, 2 * cores, 3 * cores]


@pytest.mark.parametrize(("itype", "tp"), [("trn1.32xlarge", "64"), ("trn2.48xlarge", "128")])
def test_leader_tp_is_the_specs_tp_degree(itype, tp):
    """The rendered leader's --tp is the spec's tp_degree (nodes x NeuronCores), which
    vllm-neuron would otherwise take from tensor_parallel_size (the node count)."""
    spec = make_spec(instance_type=itype, tp_degree=int(tp))
    assert spec.tp_degree == spec.global_tp_degree == int(tp)
    (c,) = taskdef.task_definition(spec, "leader")["containerDefinitions"]
    assert f" leader --model /models/llm --tp {tp} --control-port 29500 " in c["command"][0]
    with pytest.raises(ValueError, match="does not match nodes_per_unit x NeuronCores"):
        make_spec(instance_type=itype, tp_degree=int(tp) // 2)


def test_placement_group_constrains_every_node_task():
    pg = [{"type": "memberOf", "expression": "attribute:ecs.instance-type == trn1.32xlarge"}]
    assert taskdef.task_definition(make_spec(), "leader")["placementConstraints"] == pg
    spec = make_spec(placement_group="neuron-serving-trn1")
    pg.append(
        {
            "type": "memberOf",
            "expression": "attribute:neuron-serving.placement-group == neuron-serving-trn1",
        }
    )
    for role in taskdef.ROLES:
        assert taskdef.task_definition(spec, role)["placementConstraints"] == pg
    for rank in (0, 1):
        params = run_task_params(spec, NodeLaunch("llama-0", rank, "10.0.0.1", "llama-leader"))
        validate("RunTask", params)
        assert params["placementConstraints"] == [{"type": "distinctInstance"}, *pg]
    with pytest.raises(ValueError, match="placement_group must be"):
        make_spec(placement_group="has space")


def test_leader_without_cloud_map_learns_its_address_in_the_container():
    spec = make_spec()
    params = run_task_params(spec, NodeLaunch("llama-0", 0, None, "llama-leader"))
    env = {e["name"] for e in params["overrides"]["containerOverrides"][0]["environment"]}
    assert "NEURON_RT_ROOT_COMM_ID" not in env and "NEURON_SERVING_LEADER_ADDR" not in env
    with pytest.raises(ValueError, match="needs its leader's address"):
        taskdef.rank_environment(spec, "llama-0", 1, None)


def test_schema_rejects_what_ecs_would():
    td = taskdef.task_definition(make_spec(), "leader")
    td["containerDefinitions"][0]["ulimits"][0]["softLimit"] = "unlimited"
    td["containerDefinitions"][0]["linuxParameters"]["devices"][0]["permissions"] = ["rw"]
    td["networkMode"] = "vpc"
    with pytest.raises(SchemaError) as e:
        validate("RegisterTaskDefinition", td)
    msg = str(e.value)
    assert "softLimit" in msg and "networkMode, value: 'vpc'" in msg
    assert "containerDefinitions[0].linuxParameters.devices[0].permissions[0]" in msg


def test_render_writes_validated_files(tmp_path):
    spec = make_spec(
        service_discovery_namespace="neuron.internal", service_discovery_namespace_id="ns-1"
    )
    written = render_mod.write(spec, tmp_path)
    names = sorted(str(p.relative_to(tmp_path)) for p in written)
    assert names == [
        "deployment.json",
        "run-task/llama-0-rank0.json",
        "run-task/llama-0-rank1.json",
        "run-task/llama-1-rank0.json",
        "run-task/llama-1-rank1.json",
        "task-definitions/llama-follower.json",
        "task-definitions/llama-leader.json",
    ]
    td = json.loads((tmp_path / "task-definitions/llama-leader.json").read_text())
    assert td == taskdef.task_definition(spec, "leader")
    deployment = json.loads((tmp_path / "deployment.json").read_text())
    assert deployment["leader_names"]["llama-1"] == "llama-1-leader.neuron.internal"


def test_render_writes_nothing_when_invalid(tmp_path, monkeypatch):
    real = taskdef.task_definition

    def broken(spec, role):
        td = real(spec, role)
        if role == "follower":
            td["containerDefinitions"][0]["healthCheck"]["interval"] = "often"
        return td

    monkeypatch.setattr(render_mod, "task_definition", broken)
    with pytest.raises(SchemaError, match="interval"):
        render_mod.write(make_spec(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_render(tmp_path, capsys):
    import yaml

    from neuron_serving.cli import main

    spec_file = tmp_path / "unit.yaml"
    spec_file.write_text(yaml.safe_dump(spec_dict()))
    assert main(["ecs", "render", "--unit-spec", str(spec_file), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o/task-definitions/llama-follower.json").exists()
    run = json.loads((tmp_path / "o/run-task/llama-0-rank1.json").read_text())
    env = {e["name"]: e["value"] for e in run["overrides"]["containerOverrides"][0]["environment"]}
    assert env["NEURON_SERVING_LEADER_ADDR"] == "LEADER_IP:29500"
    spec_file.write_text(yaml.safe_dump(spec_dict(instance_type="p5.48xlarge")))
    assert main(["ecs", "render", "--unit-spec", str(spec_file), "--out", str(tmp_path / "x")]) == 2
    assert "unknown instance_type 'p5.48xlarge'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("role", taskdef.ROLES)
def test_docker_labels_tell_the_cloudwatch_agent_where_to_scrape(role):
    """ECS has no Prometheus service discovery of its own: the CloudWatch agent's
    docker-label mode finds each node's metrics port, under the local cluster's job
    names (so the same alert rules and dashboards apply); the port is one the task
    publishes."""
    spec = make_spec()
    (c,) = taskdef.task_definition(spec, role)["containerDefinitions"]
    labels = c["dockerLabels"]
    port = int(labels["ECS_PROMETHEUS_EXPORTER_PORT"])
    assert port in {p["containerPort"] for p in c["portMappings"]}
    assert port == (8002 if role == "leader" else spec.health_port + 1)
    assert labels["ECS_PROMETHEUS_METRICS_PATH"] == "/metrics"
    assert labels["ECS_PROMETHEUS_JOB_NAME"] == f"neuron-serving-{role}s"
