"""`DeploymentSpec`: the YAML unit spec of one ECS deployment, checked before anything runs.

Required keys: name, model, version, instance_type, nodes_per_unit, units, image,
execution_role_arn, task_role_arn. Every other key is optional (see README.md).
All problems of a spec are reported together in one ``SpecError``, so a user fixes
a file in one pass instead of one error per run.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from neuron_serving.checkpoint.pin import is_sha256_hex
from neuron_serving.ecs.instances import InstanceType, get_instance_type

REQUIRED = (
    "name",
    "model",
    "version",
    "instance_type",
    "nodes_per_unit",
    "units",
    "image",
    "execution_role_arn",
    "task_role_arn",
)
# ECS limits `startedBy` to 36 characters; a deployment name is used there as is.
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,27}$")
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/.+$")
_SECRET_ARN = re.compile(r"^arn:aws[a-z-]*:(secretsmanager|ssm):[a-z0-9-]+:\d{12}:.+$")
_SECURITY_GROUP = re.compile(r"^sg-[0-9a-z]+$")
# ECS custom attribute values: letters, digits, hyphens, underscores, periods, at signs,
# forward slashes, colons (spaces too, which the memberOf expression cannot carry).
_ATTRIBUTE_VALUE = re.compile(r"^[A-Za-z0-9_.@/:-]{1,128}$")
# Security groups of the network design (security_groups.py): the units' own group and
# the groups allowed to reach them.
SECURITY_GROUP_KEYS = (
    "unit_security_group",
    "proxy_security_group",
    "deployer_security_group",
    "metrics_security_group",
)
# Triton's ports are fixed by the Triton image convention and the proxy's config.
TRITON_HTTP_PORT, TRITON_GRPC_PORT, TRITON_METRICS_PORT = 8000, 8001, 8002
# The leader's OpenAI channel (neuron_serving/openai_channel.py): fixed on ECS so the
# security group can open it to the proxy (locally the launcher picks a free port).
OPENAI_CHANNEL_PORT = 8003


class SpecError(ValueError):
    """A unit spec that cannot work; ``problems`` lists every reason."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    name: str
    model: str  # the model name clients use through the proxy
    version: str  # deployment label: task definition tag, proxy model_version
    instance_type: str
    nodes_per_unit: int
    units: int
    image: str
    execution_role_arn: str
    task_role_arn: str
    cluster: str = "neuron-serving"
    region: str = "us-east-1"
    subnets: tuple[str, ...] = ()
    security_groups: tuple[str, ...] = ()
    # NxDI's global tensor-parallel degree; must equal nodes_per_unit x NeuronCores. It is
    # the leader's --tp (taskdef.py); unset: nodes_per_unit x NeuronCores.
    tp_degree: int | None = None
    # EC2 cluster placement group of the deployment's instances, as the custom container
    # instance attribute neuron-serving.placement-group (user data); every node task is
    # constrained to it (memberOf), so a unit's EFA traffic stays in one placement group.
    placement_group: str | None = None
    model_dir: str = ""  # in the container; default /models/<model>
    # Host directory with the compiled model, bind-mounted read-only at model_dir
    # (the instance's user data fetches it); None: the image holds the model.
    host_model_dir: str | None = None
    # s3:// prefix of a published checkpoint version: each task fetches its own rank's
    # shards into model_dir before it starts (`checkpoint fetch --rank R`). Set per
    # release by `neuron-serving deploy --unit-spec`; None: the model is at model_dir.
    model_uri: str | None = None
    # sha256 (hex) of the manifest.json the deploy checked: every rank refuses another
    # manifest (NEURON_SERVING_MODEL_MANIFEST_SHA256), so a restart cannot load a
    # manifest swapped in S3 after the deploy. Required with model_uri.
    model_manifest_sha256: str | None = None
    log_group: str = ""  # default /ecs/<name>
    # Cloud Map private DNS namespace (both or neither): leaders are registered as
    # <unit-id>-leader.<namespace> and followers dial that name.
    service_discovery_namespace: str | None = None
    service_discovery_namespace_id: str | None = None
    # Injected as NEURON_SERVING_UNIT_TOKEN; required with more than one node per unit.
    unit_token_secret_arn: str | None = None
    # Leader only: NEURON_SERVING_CHANNEL_TOKEN, the secret of the OpenAI channel; give
    # the proxy the same secret. None = the leader's channel cannot be used by any
    # proxy (each container has its own default token file): the proxy then sends
    # every call over Triton, which works, at about twice the proxy's CPU per token.
    channel_token_secret_arn: str | None = None
    # Leader only: NEURON_SERVING_TRITON_ADMIN_KEY; None = a random key per start, i.e.
    # Triton's model control, repository, statistics, trace, logging APIs are off.
    triton_admin_key_secret_arn: str | None = None
    # The network design (security_groups.py, `ecs render`): the group every node task is
    # in (one of security_groups) and the groups that may reach it.
    unit_security_group: str | None = None
    proxy_security_group: str | None = None  # Triton HTTP/gRPC, node health gRPC
    deployer_security_group: str | None = None  # deploy canaries: Triton HTTP
    metrics_security_group: str | None = None  # the Prometheus scraper
    # Every proxy replica's own admin URL (a change must reach each: a load balancer
    # would deliver it to one), e.g. [http://proxy-0.neuron.internal:8081, ...].
    proxy_admin_urls: tuple[str, ...] = ()
    proxy_admin_token_file: str | None = None  # else NEURON_SERVING_PROXY_ADMIN_TOKEN
    control_port: int = 29500  # +1 store, +2 dist, +3 Neuron CC bootstrap
    health_port: int = 9100  # grpc.health.v1; HTTP /healthz on +1
    task_memory_mib: int | None = None  # default: the instance type's
    ready_timeout_s: float = 1800.0  # launch -> every node HEALTHY
    leader_args: tuple[str, ...] = ()  # extra `neuron-serving leader` flags

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise SpecError(f"unit spec {self.name!r}", problems)
        for key, default in (("model_dir", f"/models/{self.model}"), ("log_group", "")):
            if not getattr(self, key):
                object.__setattr__(self, key, default or f"/ecs/{self.name}")

    def _problems(self) -> list[str]:
        p: list[str] = []
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            p.append(
                f"name {self.name!r} must be lowercase letters, digits and '-', "
                "start with a letter, at most 28 characters"
            )
        for key in ("model", "version", "image"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key).strip():
                p.append(f"{key} is missing or empty")
        for key in ("execution_role_arn", "task_role_arn"):
            value = getattr(self, key)
            if not isinstance(value, str) or not _ROLE_ARN.match(value):
                p.append(f"{key} must be an IAM role ARN (arn:aws:iam::<account>:role/...)")
        itype = self._instance_type(p)
        for key, low in (("nodes_per_unit", 1), ("units", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                p.append(f"{key} must be an integer >= {low}, got {value!r}")
        if self.tp_degree is not None and (
            not isinstance(self.tp_degree, int) or isinstance(self.tp_degree, bool)
        ):
            p.append(f"tp_degree must be an integer, got {self.tp_degree!r}")
        elif (
            itype is not None
            and isinstance(self.nodes_per_unit, int)
            and self.tp_degree is not None
        ):
            total = self.nodes_per_unit * itype.neuron_cores
            if self.tp_degree != total:
                p.append(
                    f"tp_degree {self.tp_degree} does not match nodes_per_unit x NeuronCores "
                    f"= {self.nodes_per_unit} x {itype.neuron_cores} = {total} on "
                    f"{itype.name} (each node shards over all of its cores)"
                )
        if self.placement_group is not None and not _ATTRIBUTE_VALUE.match(
            str(self.placement_group)
        ):
            p.append(
                "placement_group must be 1-128 letters, digits or ._@/:- (an ECS attribute "
                f"value), got {self.placement_group!r}"
            )
        if (self.service_discovery_namespace is None) != (
            self.service_discovery_namespace_id is None
        ):
            p.append("service_discovery_namespace and service_discovery_namespace_id go together")
        for key in ("unit_token_secret_arn", "triton_admin_key_secret_arn"):
            value = getattr(self, key)
            if value and not _SECRET_ARN.match(value):
                p.append(f"{key} must be a Secrets Manager or SSM parameter ARN")
        if isinstance(self.nodes_per_unit, int) and self.nodes_per_unit > 1:
            if not self.unit_token_secret_arn:
                # Without a shared secret every rank makes up its own token and the
                # join handshake (HMAC) can never succeed: the unit would never form.
                p.append(
                    f"nodes_per_unit {self.nodes_per_unit} needs unit_token_secret_arn (the "
                    "unit's shared join secret in Secrets Manager or SSM)"
                )
        p.extend(self._security_group_problems())
        for url in self.proxy_admin_urls:
            if not re.match(r"^https?://", url):
                p.append(f"proxy_admin_urls: {url!r} must start with http:// or https://")
        p.extend(self._port_problems())
        for key in ("model_dir", "host_model_dir"):
            value = getattr(self, key)
            if value and not str(value).startswith("/"):
                p.append(f"{key} must be an absolute path, got {value!r}")
        if self.model_uri is not None:
            if not re.match(r"^s3://[^/]+/.", str(self.model_uri)):
                p.append(f"model_uri must be s3://BUCKET/PREFIX, got {self.model_uri!r}")
            if self.host_model_dir:
                # The bind mount is read-only: nothing could be fetched into it.
                p.append("model_uri and host_model_dir exclude each other")
            if not self.model_manifest_sha256:
                p.append(
                    "model_uri needs model_manifest_sha256 (the sha256 of the manifest the "
                    "deploy checked; `neuron-serving deploy` sets it)"
                )
        if self.model_manifest_sha256 is not None and not is_sha256_hex(self.model_manifest_sha256):
            p.append("model_manifest_sha256 must be 64 lowercase hex characters")
        if self.ready_timeout_s <= 0:
            p.append("ready_timeout_s must be > 0")
        if itype is not None and self.task_memory_mib is not None:
            if not 128 <= self.task_memory_mib <= itype.memory_mib:
                p.append(f"task_memory_mib must be in 128..{itype.memory_mib} on {itype.name}")
        return p

    def _instance_type(self, p: list[str]) -> InstanceType | None:
        try:
            return get_instance_type(self.instance_type)
        except ValueError as e:
            p.append(str(e))
            return None

    def _security_group_problems(self) -> list[str]:
        p = [
            f"{key} must be a security group id (sg-...), got {getattr(self, key)!r}"
            for key in SECURITY_GROUP_KEYS
            if getattr(self, key) is not None and not _SECURITY_GROUP.match(str(getattr(self, key)))
        ]
        unit = self.unit_security_group
        if unit and self.security_groups and unit not in self.security_groups:
            p.append(f"unit_security_group {unit} must be one of security_groups")
        if not unit and any(getattr(self, k) for k in SECURITY_GROUP_KEYS[1:]):
            p.append("proxy/deployer/metrics_security_group need unit_security_group")
        if unit and not self.proxy_security_group:
            p.append("unit_security_group needs proxy_security_group (who may reach Triton)")
        return p

    def _port_problems(self) -> list[str]:
        ctl = range(self.control_port, self.control_port + 4)
        health = range(self.health_port, self.health_port + 2)
        triton = {TRITON_HTTP_PORT, TRITON_GRPC_PORT, TRITON_METRICS_PORT, OPENAI_CHANNEL_PORT}
        if not (1024 <= self.control_port <= 65532 and 1024 <= self.health_port <= 65534):
            return ["control_port must be in 1024..65532 and health_port in 1024..65534"]
        if set(ctl) & set(health) or (set(ctl) | set(health)) & triton:
            return [
                f"ports overlap: control {ctl.start}..{ctl.stop - 1}, health "
                f"{health.start}..{health.stop - 1}, Triton 8000..8002, OpenAI channel 8003"
            ]
        return []

    @property
    def instance(self) -> InstanceType:
        return get_instance_type(self.instance_type)

    @property
    def global_tp_degree(self) -> int:
        """NxDI's tp_degree: the spec's (validated above), else every core of every node."""
        return self.tp_degree or self.nodes_per_unit * self.instance.neuron_cores

    @property
    def memory_mib(self) -> int:
        return self.task_memory_mib or self.instance.default_task_memory_mib

    def unit_id(self, index: int) -> str:
        return f"{self.name}-{index}"

    def replace(self, **changes: Any) -> DeploymentSpec:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: Any, source: str = "unit spec") -> DeploymentSpec:
        if not isinstance(raw, dict):
            raise SpecError(source, ["must be a YAML mapping of keys to values"])
        names = {f.name for f in dataclasses.fields(cls)}
        problems = [f"missing required key {k!r}" for k in REQUIRED if k not in raw]
        problems += [f"unknown key {k!r}" for k in sorted(set(raw) - names)]
        if problems:
            raise SpecError(source, problems)
        data = dict(raw)
        for key in ("subnets", "security_groups", "leader_args", "proxy_admin_urls"):
            if key in data:
                if not isinstance(data[key], list | tuple):
                    raise SpecError(source, [f"{key} must be a list"])
                data[key] = tuple(str(x) for x in data[key])
        data["version"] = str(data["version"])  # YAML reads 2026-12-01 as a date
        return cls(**data)


def load_spec(path: str | Path) -> DeploymentSpec:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpecError(str(path), [f"cannot read: {e}"]) from None
    return DeploymentSpec.from_dict(raw, source=str(path))
