"""What each rank (node) of a Neuron unit gets: NxDI config, environment, command line.

A unit is N nodes x C NeuronCores. vLLM sees N ranks (``tensor_parallel_size`` = N, the
``UnitExecutor``'s world: one process per node). NxD Inference sees one tensor-parallel
group of N x C NeuronCores, of which node r owns C, from global rank r x C. Sources
(cited by commit in tests/neuron_serving/devices/test_neuron_rank.py):

- vllm-neuron 0.2.0 ``worker/neuronx_distributed_model_loader.py``: the default
  ``tp_degree`` is vLLM's ``tensor_parallel_size`` (here N), and
  ``additional_config["override_neuron_config"]`` is merged over the defaults, so the
  global ``tp_degree`` has to come from the override.
- NxDI 0.7 ``models/config.py`` (``NeuronConfig``): ``tp_degree``, ``world_size``
  (default tp x pp x ep), ``start_rank_id`` (default 0), ``local_ranks_size`` (default
  ``world_size``, i.e. "this process owns every rank": right on one node, wrong on two).
- NxDI ``examples/multi_node.md``: two trn1 nodes, ``--tp-degree 64``, 32 local ranks,
  start ranks 0 and 32, the same ``NEURON_RT_ROOT_COMM_ID`` on both.
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_serving.devices.base import RankPlacement
from neuron_serving.devices.neuron import NeuronBackend

# The key vllm-neuron reads from vLLM's additional_config.
OVERRIDE_KEY = "override_neuron_config"


@dataclass(frozen=True, slots=True)
class NeuronUnitShape:
    """N nodes x C NeuronCores per node (C at the instance's default LNC)."""

    nodes: int
    cores_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.cores_per_node < 1:
            raise ValueError(f"nodes and cores_per_node must be >= 1, got {self}")

    @property
    def tp_degree(self) -> int:
        return self.nodes * self.cores_per_node

    @classmethod
    def from_tp_degree(cls, tp_degree: int, cores_per_node: int) -> NeuronUnitShape:
        """The unit of a global NxDI ``tp_degree`` (the leader's ``--tp`` on Neuron)."""
        if tp_degree < 1 or tp_degree % cores_per_node:
            raise ValueError(
                f"tp_degree {tp_degree} is not a positive multiple of the {cores_per_node} "
                "NeuronCores of a node: every node shards over all of its cores"
            )
        return cls(tp_degree // cores_per_node, cores_per_node)


def override_neuron_config(shape: NeuronUnitShape, node_rank: int) -> dict[str, int]:
    """NxDI ``NeuronConfig`` fields of node ``node_rank`` (vllm-neuron's override dict).

    ``world_size`` is set although NxDI would derive the same value (tp x pp x ep with
    pp = ep = 1), so the dict states the whole layout the model is compiled for."""
    if not 0 <= node_rank < shape.nodes:
        raise ValueError(f"node rank {node_rank} outside 0..{shape.nodes - 1}")
    return {
        "tp_degree": shape.tp_degree,
        "world_size": shape.tp_degree,
        "local_ranks_size": shape.cores_per_node,
        "start_rank_id": node_rank * shape.cores_per_node,
    }


def node_override(override: dict[str, int], node_rank: int) -> dict[str, int]:
    """The leader's override (rank 0's) as node ``node_rank`` must build its model.

    The executor hands every rank the leader's ``VllmConfig``; only ``start_rank_id``
    differs per node (NxDI examples/multi_node.md: "--start_rank_id ... multiple of
    --local_ranks_size")."""
    local = override["local_ranks_size"]
    out = {**override, "start_rank_id": node_rank * local}
    if not 0 <= out["start_rank_id"] <= out["tp_degree"] - local:
        raise ValueError(
            f"node rank {node_rank} x {local} local ranks is outside tp_degree {out['tp_degree']}"
        )
    return out


def leader_argv(shape: NeuronUnitShape, model_dir: str, control_port: int) -> list[str]:
    """Rank 0: ``--tp`` is the global NeuronCore count (NxDI's tp_degree); the unit's
    vLLM world (nodes) follows from it and NEURON_SERVING_NEURON_CORES_PER_NODE."""
    return [
        "neuron-serving", "leader",
        "--model", model_dir,
        "--tp", str(shape.tp_degree),
        "--control-port", str(control_port),
    ]  # fmt: skip


def follower_argv(shape: NeuronUnitShape) -> list[str]:
    """Ranks 1..N-1 alike; ``--leader`` and ``--rank`` are appended per task."""
    return [
        "neuron-serving", "follower",
        "--world-size", str(shape.nodes),
        "--device", "neuron",
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class NeuronRankLaunch:
    """Everything one node of a Neuron unit is started with."""

    rank: int
    override_neuron_config: dict[str, int]
    env: dict[str, str]
    argv: list[str]


def rank_launch(
    shape: NeuronUnitShape, rank: int, leader_host: str, control_port: int, model_dir: str
) -> NeuronRankLaunch:
    placement = RankPlacement(rank, shape.nodes, leader_host, control_port)
    env = NeuronBackend(cores_per_node=shape.cores_per_node).process_env(placement)
    if rank == 0:
        argv = [*leader_argv(shape, model_dir, control_port), "--control-host", leader_host]
    else:
        argv = [
            *follower_argv(shape),
            "--leader", f"{leader_host}:{control_port}",
            "--rank", str(rank),
        ]  # fmt: skip
    return NeuronRankLaunch(rank, override_neuron_config(shape, rank), env, argv)
