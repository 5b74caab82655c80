"""Neuron backend: multi-node Trainium ranks (trn1/trn2), NxDI under vllm-neuron.

Written against the real APIs, NOT run here: torch-neuronx,
neuronx-distributed(-inference) and vllm-neuron come from AWS's Neuron package
repository and there is no Trainium in development or CI. Tests check the
environment and NxDI configuration this module produces; that is all that was
verified.

Each rank of a unit is one Trainium node. The Neuron runtime's collectives
bootstrap from rank 0 (``NEURON_RT_ROOT_COMM_ID``) and run over EFA; NxDI sees
one global tensor-parallel group of ``nodes x cores`` ranks, of which this node
owns ``local_ranks_size`` starting at ``start_rank_id``.
"""

from __future__ import annotations

import importlib.util

from neuron_serving import envs
from neuron_serving.devices.base import DeviceBackend, DeviceUnavailable, RankPlacement

# NeuronCores visible to one process per instance type (trn2 at its default
# logical-core size LNC=2).
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


class NeuronBackend(DeviceBackend):
    name = "neuron"

    def __init__(self, cores_per_node: int | None = None) -> None:
        self.cores_per_node = cores_per_node or envs.NEURON_SERVING_NEURON_CORES_PER_NODE
        if self.cores_per_node <= 0:
            raise ValueError(f"cores_per_node must be > 0, got {self.cores_per_node}")

    def process_env(self, placement: RankPlacement) -> dict[str, str]:
        return {
            "NEURON_RT_ROOT_COMM_ID": (
                f"{placement.leader_host}:{placement.control_port + NEURON_CC_PORT_OFFSET}"
            ),
            "NEURON_RANK_ID": str(placement.rank),
            "NEURON_LOCAL_TP": str(self.cores_per_node),
            # EFA: libfabric provider, GPUDirect-style RDMA from device memory,
            # and fork safety (vLLM and Triton fork helpers after EFA is opened).
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",
            "FI_EFA_FORK_SAFE": "1",
        }

    def nxdi_config(self, placement: RankPlacement) -> dict[str, int]:
        """NxDI ``NeuronConfig`` fields for this rank (passed through vllm-neuron's
        ``override_neuron_config``)."""
        local = self.cores_per_node
        return {
            "tp_degree": placement.world_size * local,
            "world_size": placement.world_size * local,
            "local_ranks_size": local,
            "start_rank_id": placement.rank * local,
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
                "Neuron DLAMI or the Neuron deep learning container"
            )
