"""Neuron backend: multi-node Trainium ranks (trn1/trn2), NxDI under vllm-neuron.

Written against the real APIs, NOT run here: torch-neuronx,
neuronx-distributed(-inference) and vllm-neuron come from AWS's Neuron package
repository and there is no Trainium in development or CI. Tests check the
environment this module and ``neuron_rank.py`` produce against the pinned sources
(ecs/README.md, "Verified against"); that is all that was verified.

Each rank of a unit is one Trainium node. The Neuron runtime's collectives
bootstrap from rank 0 (``NEURON_RT_ROOT_COMM_ID``) and run over EFA; NxDI sees
one global tensor-parallel group of ``nodes x cores`` ranks, of which this node
owns ``local_ranks_size`` starting at ``start_rank_id``.
"""

from __future__ import annotations

import importlib.util

from neuron_serving import envs
from neuron_serving.devices.base import DeviceBackend, DeviceUnavailable, RankPlacement
from neuron_serving.devices.neuron_release import DLC_IMAGE, NEURON_SDK, release_mismatches

# NeuronCores visible to one process per instance type. trn2 at its default logical
# NeuronCore size LNC=2: "a Trn2.48xlarge instance presents 64 available NeuronCores"
# (aws-neuron-sdk v2.27.0, about-neuron/arch/neuron-features/logical-neuroncore-config.rst).
CORES_PER_INSTANCE = {"trn1.32xlarge": 32, "trn1n.32xlarge": 32, "trn2.48xlarge": 64}

REQUIRED_MODULES = {
    "torch_neuronx": "torch-neuronx",
    "neuronx_distributed": "neuronx-distributed",
    "neuronx_distributed_inference": "neuronx-distributed-inference",
    "vllm_neuron": "vllm-neuron",
}

# Port on the leader for the Neuron runtime's collective bootstrap: kept next to
# the unit's control ports (control+3) so security groups stay declarative.
NEURON_CC_PORT_OFFSET = 3
# Name of our vLLM platform plugin entry point (pyproject.toml, neuron_platform.py).
PLATFORM_PLUGIN = "neuron_serving"


class NeuronBackend(DeviceBackend):
    name = "neuron"

    def __init__(self, cores_per_node: int | None = None) -> None:
        self.cores_per_node = cores_per_node or envs.NEURON_SERVING_NEURON_CORES_PER_NODE
        if self.cores_per_node <= 0:
            raise ValueError(f"cores_per_node must be > 0, got {self.cores_per_node}")

    def process_env(self, placement: RankPlacement) -> dict[str, str]:
        # Only what the Neuron runtime and libfabric read. A node's NxDI ranks
        # (start_rank_id, local_ranks_size) travel in vLLM's additional_config
        # (neuron_rank.py): NEURON_RANK_ID and NEURON_LOCAL_TP were Transformers-NeuronX
        # variables that nothing in NxDI or vllm-neuron reads.
        return {
            # Rank 0's address for the runtime's collective bootstrap (nrt-api-guide:
            # "mandatory for ... Collective Communication"); the same on every node.
            "NEURON_RT_ROOT_COMM_ID": (
                f"{placement.leader_host}:{placement.control_port + NEURON_CC_PORT_OFFSET}"
            ),
            # EFA: libfabric provider, RDMA from device memory, and fork safety (vLLM
            # and Triton fork helpers after EFA is opened); the values NxDI's own
            # launcher exports (scripts/nxdi_distributed_launcher.py).
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",
            "FI_EFA_FORK_SAFE": "1",
            # Only our platform plugin (neuron_platform.py, vllm-neuron's NeuronPlatform
            # with the unit executor kept): vLLM refuses two active platform plugins.
            "VLLM_PLUGINS": PLATFORM_PLUGIN,
        }

    def check_available(self) -> None:
        missing = [
            dist for mod, dist in REQUIRED_MODULES.items() if importlib.util.find_spec(mod) is None
        ]
        if missing:
            raise DeviceUnavailable(
                "the neuron backend needs " + ", ".join(missing) + " from AWS's Neuron package "
                "repository (the PyPI packages of these names are placeholders): pip install "
                "--extra-index-url https://pip.repos.neuron.amazonaws.com '.[neuron]' on a "
                f"Neuron DLAMI, or build ecs/Dockerfile.neuron (FROM {DLC_IMAGE})"
            )
        # The platform and worker subclasses are written against these exact releases.
        wrong = release_mismatches()
        if wrong:
            raise DeviceUnavailable(
                f"the neuron backend is pinned to Neuron SDK {NEURON_SDK}; installed: "
                + ", ".join(wrong)
            )
