"""What one Trainium instance type gives a node task: Neuron devices, EFA devices, cores.

Device counts come from AWS's documentation as of writing; none of them was
checked on a real instance from this project (see ecs/README.md):

- trn1.32xlarge: 16 Trainium devices (/dev/neuron0..15, 2 NeuronCores each = 32),
  8 EFA devices (800 Gbps; aws-neuron-sdk v2.27.0 neuron-runtime/nrt-troubleshoot.rst,
  "EFA is not enabled in trn1.32xlarge": "making sure there are eight EFA devices"),
  128 vCPUs, 512 GiB host memory.
- trn1n.32xlarge: as trn1.32xlarge with 16 EFA devices (1600 Gbps).
- trn2.48xlarge: 16 Trainium2 devices (/dev/neuron0..15; 64 logical NeuronCores at
  the default LNC=2), 16 EFA devices, 2 TiB host memory. aws-neuron-sdk v2.27.0
  (0fae2f1), neuron-runtime/about/collectives.rst: "16 Trainium2 chips, each connected
  to a 200Gbps EFA ... network interface, for an aggregated 3.2Tbps"; "64 ranks per
  server" at LNC=2 (also about-neuron/arch/neuron-features/logical-neuroncore-config.rst).
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_serving.devices.neuron import CORES_PER_INSTANCE


@dataclass(frozen=True, slots=True)
class InstanceType:
    name: str
    neuron_devices: int
    efa_devices: int
    neuron_cores: int
    vcpus: int
    memory_mib: int
    # Hard memory limit of the node task by default: host memory minus what the
    # OS, the ECS agent and the Neuron runtime's own host buffers need.
    default_task_memory_mib: int

    def __post_init__(self) -> None:
        if min(self.neuron_devices, self.efa_devices, self.neuron_cores, self.vcpus) <= 0:
            raise ValueError(f"{self.name}: device and core counts must be > 0")
        if not 0 < self.default_task_memory_mib < self.memory_mib:
            raise ValueError(f"{self.name}: default task memory must be below host memory")

    def neuron_device_paths(self) -> list[str]:
        return [f"/dev/neuron{i}" for i in range(self.neuron_devices)]

    def efa_device_paths(self) -> list[str]:
        return [f"/dev/infiniband/uverbs{i}" for i in range(self.efa_devices)]


INSTANCE_TYPES: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType(
            "trn1.32xlarge", 16, 8, CORES_PER_INSTANCE["trn1.32xlarge"], 128, 524288, 491520
        ),
        InstanceType(
            "trn1n.32xlarge", 16, 16, CORES_PER_INSTANCE["trn1n.32xlarge"], 128, 524288, 491520
        ),
        InstanceType(
            "trn2.48xlarge", 16, 16, CORES_PER_INSTANCE["trn2.48xlarge"], 192, 2097152, 2015232
        ),
    )
}


def get_instance_type(name: str) -> InstanceType:
    try:
        return INSTANCE_TYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown instance_type {name!r} (known: {', '.join(sorted(INSTANCE_TYPES))}; "
            "smaller trn1 sizes have no EFA and cannot join a multi-node unit)"
        ) from None
