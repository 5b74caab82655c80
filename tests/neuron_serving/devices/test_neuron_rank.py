"""The per-rank Neuron contract of a 2-node unit: exact NxDI override, environment and
command line, each value checked against the pinned sources named here.

Sources (read through the mirrored repositories, commit given):
- VLLM_NEURON: vllm-project/vllm-neuron tag 0.2.0, a96712544a527761a336ccabdc5846f1a2202606
  * vllm_neuron/worker/neuronx_distributed_model_loader.py: get_neuron_model reads
    additional_config.get("override_neuron_config"); _get_default_neuron_config sets
    "tp_degree": parallel_config.tensor_parallel_size; _get_neuron_config_after_override
    does default_neuron_config.update(override).
  * vllm_neuron/platform.py: check_and_update_config sets
    distributed_executor_backend = "uni" when world_size > 1, and worker_cls only if "auto".
- NXDI: aws-neuron/neuronx-distributed-inference v0.7.14366 (Neuron 2.27.0),
  fcb5a8688d237e1af429d6e72445db17277d630a
  * src/neuronx_distributed_inference/models/config.py:334-361 (NeuronConfig): tp_degree,
    world_size (default tp*pp*ep), start_rank_id (default 0), local_ranks_size (default
    world_size).
  * examples/multi_node.md, "two process with tp=64 on two Trn1 nodes": --tp-degree 64,
    --local_ranks 32, --start_rank_id 0 / 32, the same NEURON_RT_ROOT_COMM_ID on both.
  * scripts/nxdi_distributed_launcher.py: FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1
    FI_EFA_FORK_SAFE=1. `git grep NEURON_RANK_ID\\|NEURON_LOCAL_TP` over the whole tree
    (and over vllm-neuron 0.2.0): no match.
- SDK: aws-neuron/aws-neuron-sdk v2.27.0, 0fae2f1cadaba54ce279482b1a2639148870acd1
  * neuron-runtime/nrt-api-guide.rst: NEURON_RT_ROOT_COMM_ID=<ip_address:port>, "rank 0
    worker", mandatory for collectives.
  * about-neuron/arch/neuron-features/logical-neuroncore-config.rst (LNC=2 default on
    Trainium2: "a Trn2.48xlarge instance presents 64 available NeuronCores");
    neuron-runtime/about/collectives.rst ("64 ranks per server" at LNC=2).
  * archive/transformers-neuronx/transformers-neuronx-developer-guide.rst: NEURON_RANK_ID
    and NEURON_LOCAL_TP are Transformers NeuronX's multi-node variables.
"""

from __future__ import annotations

import types

import pytest

from neuron_serving.devices.neuron import CORES_PER_INSTANCE
from neuron_serving.devices.neuron_rank import (
    OVERRIDE_KEY,
    NeuronUnitShape,
    node_override,
    rank_launch,
)

LEADER = "10.0.1.2"
CONTROL_PORT = 29500
MODEL = "/models/llm"
# NEURON_RT_ROOT_COMM_ID: rank 0's address and the unit's Neuron CC port (control + 3),
# identical on every node (NXDI examples/multi_node.md; SDK nrt-api-guide.rst).
ENV = {
    "NEURON_RT_ROOT_COMM_ID": f"{LEADER}:29503",
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "VLLM_PLUGINS": "neuron_serving",
}


def layout(tp: int, local: int, start: int) -> dict[str, int]:
    return {"tp_degree": tp, "world_size": tp, "local_ranks_size": local, "start_rank_id": start}


def launches(itype: str):
    shape = NeuronUnitShape(2, CORES_PER_INSTANCE[itype])
    return [rank_launch(shape, r, LEADER, CONTROL_PORT, MODEL) for r in range(2)]


def test_trn1_pair_matches_the_nxdi_two_node_example():
    # NXDI examples/multi_node.md (trn1): tp 64, 32 local ranks, start ranks 0 and 32.
    leader, follower = launches("trn1.32xlarge")
    assert leader.override_neuron_config == layout(64, 32, 0)
    assert follower.override_neuron_config == layout(64, 32, 32)
    assert leader.env == ENV and follower.env == ENV
    assert leader.argv == [
        "neuron-serving", "leader", "--model", MODEL, "--tp", "64",
        "--control-port", "29500", "--control-host", LEADER,
    ]  # fmt: skip
    assert follower.argv == [
        "neuron-serving", "follower", "--world-size", "2", "--device", "neuron",
        "--leader", f"{LEADER}:29500", "--rank", "1",
    ]  # fmt: skip


def test_trn2_pair_uses_64_logical_cores_per_node():
    # SDK logical-neuroncore-config.rst: 64 NeuronCores per trn2.48xlarge at LNC=2.
    leader, follower = launches("trn2.48xlarge")
    assert leader.override_neuron_config == layout(128, 64, 0)
    assert follower.override_neuron_config == layout(128, 64, 64)
    assert leader.env == ENV and follower.env == ENV
    assert leader.argv[:6] == ["neuron-serving", "leader", "--model", MODEL, "--tp", "128"]
    assert follower.argv[2:6] == ["--world-size", "2", "--device", "neuron"]


def test_no_transformers_neuronx_variables():
    # Nothing in NxDI v0.7.14366 or vllm-neuron 0.2.0 reads them (see module doc).
    for launch in launches("trn1.32xlarge"):
        assert not {"NEURON_RANK_ID", "NEURON_LOCAL_TP"} & set(launch.env)


def test_follower_derives_its_override_from_the_leaders():
    # The executor hands every rank rank 0's VllmConfig; UnitNeuronWorker shifts it.
    leader, follower = launches("trn2.48xlarge")
    assert node_override(leader.override_neuron_config, 1) == follower.override_neuron_config
    with pytest.raises(ValueError, match="outside tp_degree 128"):
        node_override(leader.override_neuron_config, 2)


def test_tp_degree_must_cover_whole_nodes():
    assert NeuronUnitShape.from_tp_degree(64, 32) == NeuronUnitShape(2, 32)
    with pytest.raises(ValueError, match="multiple of the 32 NeuronCores"):
        NeuronUnitShape.from_tp_degree(48, 32)


def test_engine_kwargs_carry_the_override_on_neuron(monkeypatch):
    """The leader's --tp (the global tp_degree) becomes vLLM's tensor_parallel_size = nodes
    (the UnitExecutor's ranks) and NxDI's tp_degree through additional_config (VLLM_NEURON
    model loader: the override is merged over tp_degree = tensor_parallel_size)."""
    from neuron_serving.unit.config import ADDITIONAL_CONFIG_KEY, UnitConfig
    from neuron_serving.unit.engine import UNIT_EXECUTOR, engine_kwargs

    monkeypatch.setenv("NEURON_SERVING_NEURON_CORES_PER_NODE", "32")
    unit = UnitConfig(device="neuron")
    kw = engine_kwargs("/nonexistent/model", 64, unit)
    assert kw["tensor_parallel_size"] == 2
    assert kw["distributed_executor_backend"] == UNIT_EXECUTOR
    assert kw["worker_cls"] == "neuron_serving.devices.neuron_worker.UnitNeuronWorker"
    assert kw["additional_config"] == {
        ADDITIONAL_CONFIG_KEY: unit.to_dict(),
        OVERRIDE_KEY: layout(64, 32, 0),
    }
    with pytest.raises(ValueError, match="multiple of the 32 NeuronCores"):
        engine_kwargs("/nonexistent/model", 2, unit)
    cpu = engine_kwargs("/nonexistent/model", 2, UnitConfig())
    assert cpu["tensor_parallel_size"] == 2 and "worker_cls" not in cpu
    assert OVERRIDE_KEY not in cpu["additional_config"]


def test_unit_worker_shifts_start_rank_before_the_model_runner_exists():
    from neuron_serving.devices.neuron_worker import make_unit_worker

    seen = {}

    class NeuronWorkerInit:
        # NeuronWorker.__init__ builds the model runner from vllm_config (VLLM_NEURON
        # worker/neuron_worker.py); record what it would read.
        def __init__(self, vllm_config, local_rank, rank, distributed_init_method, **kw):
            seen[rank] = dict(vllm_config.additional_config[OVERRIDE_KEY])

    worker = make_unit_worker(NeuronWorkerInit)
    assert worker.__qualname__ == "UnitNeuronWorker"
    leader, follower = launches("trn1.32xlarge")
    for rank in (0, 1):
        config = types.SimpleNamespace(
            additional_config={OVERRIDE_KEY: dict(leader.override_neuron_config)}
        )
        worker(config, 0, rank, "tcp://127.0.0.1:1")
    assert seen == {0: leader.override_neuron_config, 1: follower.override_neuron_config}
