"""Task definitions of a deployment's leader and followers, as `RegisterTaskDefinition` params.

Per role (leader = rank 0, follower = ranks 1..N-1) one task definition family,
``<name>-leader`` and ``<name>-follower``; one revision per spec version. What
differs per task (unit id, rank, the leader's address, the Neuron rank variables)
is not in the task definition but in RunTask's container overrides
(``rank_environment``), so one revision serves every unit and rank.

The Neuron variables come from ``NeuronBackend.process_env``: the same function
the follower applies after joining, so the task and the process agree.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from neuron_serving.devices.base import RankPlacement
from neuron_serving.devices.neuron import NEURON_CC_PORT_OFFSET, NeuronBackend
from neuron_serving.devices.neuron_rank import NeuronUnitShape, follower_argv, leader_argv
from neuron_serving.ecs.spec import (
    OPENAI_CHANNEL_PORT,
    TRITON_GRPC_PORT,
    TRITON_HTTP_PORT,
    TRITON_METRICS_PORT,
    DeploymentSpec,
)

ROLES = ("leader", "follower")
# Neuron variables that differ per unit (the leader's address): RunTask overrides. A
# node's NxDI ranks are not environment: the leader's --tp and the rank give them.
PER_RANK_NEURON_VARS = ("NEURON_RT_ROOT_COMM_ID",)
# ECS custom container-instance attribute naming the instance's EC2 cluster placement
# group (set by the launch template's user data, see ecs/README.md "Placement").
PLACEMENT_GROUP_ATTRIBUTE = "neuron-serving.placement-group"
# EFA device files: AWS Batch's EFA guidance maps them with read, write and mknod.
EFA_DEVICE_PERMISSIONS = ["read", "write", "mknod"]
NEURON_DEVICE_PERMISSIONS = ["read", "write"]
# Installed by ecs/Dockerfile.*: prints the task's awsvpc ENI address.
TASK_IP = "/opt/neuron-serving/task-ip"
# Where a node's command leaves that address for the container health check, which
# must probe the health server where it listens (the ENI address, not loopback).
TASK_IP_FILE = "/tmp/neuron-serving-task-ip"
# The unprivileged user of ecs/Dockerfile.* (uid 10001); the task definition names it
# too, so an image without a USER line does not silently run the node as root.
NODE_USER = "10001"
TAG_PREFIX = "neuron-serving/"
COMPILED_ARTIFACTS_DIR = "/tmp/neuron-compiled-artifacts"


def family(spec: DeploymentSpec, role: str) -> str:
    return f"{spec.name}-{role}"


def leader_dns_name(spec: DeploymentSpec, unit_id: str) -> str | None:
    """The unit leader's Cloud Map name, or None without a namespace (followers then
    get the leader's IP once its task has one)."""
    if spec.service_discovery_namespace:
        return f"{unit_id}-leader.{spec.service_discovery_namespace}"
    return None


def unit_shape(spec: DeploymentSpec) -> NeuronUnitShape:
    """The spec's unit: its tp_degree (validated = nodes x cores) over its nodes."""
    return NeuronUnitShape.from_tp_degree(spec.global_tp_degree, spec.instance.neuron_cores)


def placement_constraints(spec: DeploymentSpec) -> list[dict[str, str]]:
    """``memberOf`` constraints every node task has (task definition and RunTask)."""
    out = [
        {"type": "memberOf", "expression": f"attribute:ecs.instance-type == {spec.instance_type}"}
    ]
    if spec.placement_group:
        out.append(
            {
                "type": "memberOf",
                "expression": f"attribute:{PLACEMENT_GROUP_ATTRIBUTE} == {spec.placement_group}",
            }
        )
    return out


def neuron_environment(spec: DeploymentSpec, rank: int, leader_host: str) -> dict[str, str]:
    backend = NeuronBackend(cores_per_node=spec.instance.neuron_cores)
    return backend.process_env(
        RankPlacement(rank, spec.nodes_per_unit, leader_host, spec.control_port)
    )


def rank_environment(
    spec: DeploymentSpec, unit_id: str, rank: int, leader_host: str | None
) -> dict[str, str]:
    """Variables of one task that the task definition cannot know (RunTask overrides).

    ``leader_host`` None (rank 0 without Cloud Map): the leader does not know its own
    address before it starts, and its command fills the leader variables from its ENI.
    """
    env = {
        "NEURON_SERVING_UNIT_ID": unit_id,
        "NEURON_SERVING_RANK": str(rank),
        "NEURON_SERVING_MODEL_VERSION": spec.version,
    }
    if leader_host is None:
        if rank != 0:
            raise ValueError(f"rank {rank} needs its leader's address")
        return env
    neuron = neuron_environment(spec, rank, leader_host)
    env["NEURON_SERVING_LEADER_ADDR"] = f"{leader_host}:{spec.control_port}"
    env.update({k: neuron[k] for k in PER_RANK_NEURON_VARS})
    return env


def static_environment(spec: DeploymentSpec, role: str) -> dict[str, str]:
    neuron = neuron_environment(spec, 0, "leader.invalid")
    env = {k: v for k, v in neuron.items() if k not in PER_RANK_NEURON_VARS}
    env.update(
        NEURON_SERVING_DEVICE="neuron",
        NEURON_SERVING_NEURON_CORES_PER_NODE=str(spec.instance.neuron_cores),
        NEURON_SERVING_WORLD_SIZE=str(spec.nodes_per_unit),
        PYTHONUNBUFFERED="1",
        # vllm-neuron 0.2.0 (worker/neuronx_distributed_model_loader.py) otherwise
        # compiles into <model>/neuron-compiled-artifacts/<hash>, which it creates and
        # empties first: impossible on the read-only host_model_dir mount. Container-local
        # and fresh per task, so a node never loads artifacts compiled for another
        # layout (precompiled artifacts ignore override_neuron_config, start_rank_id too).
        NEURON_COMPILED_ARTIFACTS=COMPILED_ARTIFACTS_DIR,
    )
    # NEURON_SERVING_HEALTH_HOST is the task's ENI address, set by the command.
    if role == "leader":
        env["NEURON_SERVING_LEADER_HEALTH_PORT"] = str(spec.health_port)
        env["NEURON_SERVING_LEADER_CHANNEL_PORT"] = str(OPENAI_CHANNEL_PORT)
    if spec.model_uri:
        env["NEURON_SERVING_MODEL_URI"] = spec.model_uri
    if spec.model_manifest_sha256:
        # Every rank checks the manifest it loads against the deploy's pin.
        env["NEURON_SERVING_MODEL_MANIFEST_SHA256"] = spec.model_manifest_sha256
    return env


def fetch_command(spec: DeploymentSpec, rank: str) -> str:
    """Before the node starts: its own rank's shards (plus config, tokenizer, manifest),
    checked against the manifest's sha256; a failure exits the task, i.e. fails the
    unit's start. Empty when the model is already at model_dir."""
    if not spec.model_uri:
        return ""
    target = shlex.quote(spec.model_dir)
    return f'neuron-serving checkpoint fetch "$NEURON_SERVING_MODEL_URI" {target} --rank {rank} && '


def command(spec: DeploymentSpec, role: str) -> str:
    """Shell command of the node: `$VAR`s are filled from the task's overrides.

    Every listener binds the task's ENI address ($IP), never 0.0.0.0: what reaches a
    port is then decided by the unit's security group alone (security_groups.py)."""
    # The ENI address, kept for the container health check (TASK_IP_FILE).
    ip = f'IP="$({TASK_IP})" && printf %s "$IP" > {TASK_IP_FILE} && '
    shape = unit_shape(spec)
    if role == "leader":
        # --tp is NxDI's global tp_degree (every NeuronCore of the unit); the leader's
        # engine derives the unit's nodes from it (unit/engine.py, devices/neuron_rank.py).
        args = [
            *leader_argv(shape, spec.model_dir, spec.control_port),
            "--http-port", str(TRITON_HTTP_PORT),
            "--grpc-port", str(TRITON_GRPC_PORT),
            "--metrics-port", str(TRITON_METRICS_PORT),
            *spec.leader_args,
        ]  # fmt: skip
        # The control address is bound and advertised: it must be this task's ENI address.
        # Without Cloud Map the Neuron root (rank 0 itself) is that address too.
        cc = spec.control_port + NEURON_CC_PORT_OFFSET
        prefix = (
            ip + f'export NEURON_RT_ROOT_COMM_ID="${{NEURON_RT_ROOT_COMM_ID:-$IP:{cc}}}" '
            'NEURON_SERVING_HEALTH_HOST="$IP" && '
        )
        tail = ' --host "$IP" --control-host "$IP" --unit-id "$NEURON_SERVING_UNIT_ID"'
        prefix += fetch_command(spec, "0")
    else:
        args = [*follower_argv(shape), "--health-port", str(spec.health_port)]
        prefix = ip + fetch_command(spec, '"$NEURON_SERVING_RANK"')
        tail = (
            ' --health-host "$IP" --leader "$NEURON_SERVING_LEADER_ADDR"'
            ' --rank "$NEURON_SERVING_RANK"'
        )
    return prefix + "exec " + shlex.join(args) + tail


def port_mappings(spec: DeploymentSpec, role: str) -> list[dict[str, Any]]:
    ports = [("health-grpc", spec.health_port), ("health-http", spec.health_port + 1)]
    if role == "leader":
        ports = [
            ("triton-http", TRITON_HTTP_PORT),
            ("triton-grpc", TRITON_GRPC_PORT),
            ("triton-metrics", TRITON_METRICS_PORT),
            ("openai-channel", OPENAI_CHANNEL_PORT),
            ("control", spec.control_port),
            ("control-store", spec.control_port + 1),
            ("dist-store", spec.control_port + 2),
            ("neuron-cc", spec.control_port + NEURON_CC_PORT_OFFSET),
            *ports,
        ]
    # awsvpc: hostPort must equal containerPort (each task has its own ENI).
    return [{"name": n, "containerPort": p, "hostPort": p, "protocol": "tcp"} for n, p in ports]


def health_check(spec: DeploymentSpec) -> dict[str, Any]:
    # The node's own HTTP /healthz: 200 only in state READY (python3 is in every image
    # we build; curl is not guaranteed in the Neuron DLC), at the ENI address the health
    # server binds (the command wrote it to TASK_IP_FILE; missing = not started = fail).
    port = spec.health_port + 1
    probe = (
        'python3 -c "import sys, urllib.request; '
        f"urllib.request.urlopen('http://%s:{port}/healthz' % sys.argv[1], timeout=4)\" "
        f'"$(cat {TASK_IP_FILE})"'
    )
    # startPeriod is ECS's maximum (300 s); loading and compiling take longer, which
    # the controller covers with ready_timeout_s rather than ECS.
    return {
        "command": ["CMD-SHELL", f"{probe} || exit 1"],
        "interval": 15,
        "timeout": 5,
        "retries": 3,
        "startPeriod": 300,
    }


# Docker labels the CloudWatch agent's ECS service discovery reads (its docker_label
# mode: sd_port_label, sd_metrics_path_label, sd_job_name_label; AWS's "Detailed guide
# for autodiscovery on Amazon ECS clusters"); its result file is Prometheus file SD,
# so a Prometheus of your own can scrape the same targets (ecs/README.md, Monitoring).
PROMETHEUS_PORT_LABEL = "ECS_PROMETHEUS_EXPORTER_PORT"
PROMETHEUS_PATH_LABEL = "ECS_PROMETHEUS_METRICS_PATH"
PROMETHEUS_JOB_LABEL = "ECS_PROMETHEUS_JOB_NAME"


def prometheus_labels(spec: DeploymentSpec, role: str) -> dict[str, str]:
    """Where Prometheus scrapes this container: a leader's merged Triton + vLLM + node
    metrics port, a follower's node metrics (its health port + 1); the job names are
    the local cluster's (monitoring/prometheus.py), so the same rules and dashboards
    apply."""
    from neuron_serving.monitoring.prometheus import JOB_PREFIX

    port = TRITON_METRICS_PORT if role == "leader" else spec.health_port + 1
    job = JOB_PREFIX + ("leaders" if role == "leader" else "followers")
    return {PROMETHEUS_PORT_LABEL: str(port), PROMETHEUS_PATH_LABEL: "/metrics",
            PROMETHEUS_JOB_LABEL: job}  # fmt: skip


def container_definition(spec: DeploymentSpec, role: str) -> dict[str, Any]:
    itype = spec.instance
    devices = [
        {"hostPath": p, "containerPath": p, "permissions": perms}
        for paths, perms in (
            (itype.neuron_device_paths(), NEURON_DEVICE_PERMISSIONS),
            (itype.efa_device_paths(), EFA_DEVICE_PERMISSIONS),
        )
        for p in paths
    ]
    env = static_environment(spec, role)
    container: dict[str, Any] = {
        "name": role,
        "image": spec.image,
        "user": NODE_USER,
        "essential": True,
        "entryPoint": ["/bin/sh", "-c"],
        "command": [command(spec, role)],
        "memoryReservation": spec.memory_mib,
        "portMappings": port_mappings(spec, role),
        "environment": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "linuxParameters": {
            "devices": devices,
            "capabilities": {"add": ["IPC_LOCK"]},  # EFA and Neuron pin host memory
            "initProcessEnabled": True,  # reaps tritonserver's stub and EngineCore children
            "sharedMemorySize": 16384,
        },
        "ulimits": [
            {"name": "memlock", "softLimit": -1, "hardLimit": -1},
            {"name": "nofile", "softLimit": 65535, "hardLimit": 65535},
        ],
        "healthCheck": health_check(spec),
        "dockerLabels": prometheus_labels(spec, role),
        # The leader's own exit path waits for Triton (15 s) before SIGKILL.
        "stopTimeout": 30,
        "logConfiguration": {
            "logDriver": "awslogs",
            "options": {
                "awslogs-group": spec.log_group,
                "awslogs-region": spec.region,
                "awslogs-stream-prefix": role,
                "awslogs-create-group": "true",
            },
        },
    }
    if spec.host_model_dir:
        container["mountPoints"] = [
            {"sourceVolume": "model", "containerPath": spec.model_dir, "readOnly": True}
        ]
    secrets = {"NEURON_SERVING_UNIT_TOKEN": spec.unit_token_secret_arn}
    if role == "leader":
        secrets["NEURON_SERVING_TRITON_ADMIN_KEY"] = spec.triton_admin_key_secret_arn
        secrets["NEURON_SERVING_CHANNEL_TOKEN"] = spec.channel_token_secret_arn
    if any(secrets.values()):
        container["secrets"] = [
            {"name": name, "valueFrom": arn} for name, arn in secrets.items() if arn
        ]
    return container


def task_definition(spec: DeploymentSpec, role: str) -> dict[str, Any]:
    """`RegisterTaskDefinition` parameters of one role, tags included."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    params: dict[str, Any] = {
        "family": family(spec, role),
        "taskRoleArn": spec.task_role_arn,
        "executionRoleArn": spec.execution_role_arn,
        "networkMode": "awsvpc",
        "requiresCompatibilities": ["EC2"],
        "memory": str(spec.memory_mib),
        "containerDefinitions": [container_definition(spec, role)],
        "volumes": (
            [{"name": "model", "host": {"sourcePath": spec.host_model_dir}}]
            if spec.host_model_dir
            else []
        ),
        # distinctInstance is a RunTask constraint; task definitions take memberOf only.
        "placementConstraints": placement_constraints(spec),
    }
    params["tags"] = [
        {"key": TAG_PREFIX + "deployment", "value": spec.name},
        {"key": TAG_PREFIX + "role", "value": role},
        {"key": TAG_PREFIX + "version", "value": spec.version},
        {"key": TAG_PREFIX + "content", "value": content_hash(params)},
    ]
    return params


def content_hash(params: dict[str, Any]) -> str:
    """Identity of a rendered definition (without tags): re-registering is skipped if equal."""
    body = {k: v for k, v in params.items() if k != "tags"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
