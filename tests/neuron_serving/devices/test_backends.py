from __future__ import annotations

import pytest

from neuron_serving.devices.base import DeviceUnavailable, RankPlacement
from neuron_serving.devices.cpu import CpuBackend, default_cpu_bind, parse_cpu_list
from neuron_serving.devices.neuron import NeuronBackend
from neuron_serving.devices.registry import get_backend


def test_cpu_binding_per_rank(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2,3")
    env = CpuBackend().process_env(RankPlacement(1, 2, "10.0.0.1", 29500))
    assert env == {
        "OMP_NUM_THREADS": "2",
        "OMP_PLACES": "{2,3}",
        "OMP_PROC_BIND": "true",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    with pytest.raises(ValueError, match="one '\\|'-separated entry per rank"):
        CpuBackend().process_env(RankPlacement(1, 2, "h", 1))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert CpuBackend().process_env(RankPlacement(0, 2, "h", 1)) == {}
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]


def test_cpu_auto_binding_leaves_the_last_cpu_to_the_front_end(monkeypatch):
    import os

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2, 0})
    env = CpuBackend().process_env(RankPlacement(0, 1, "h", 1))
    assert env["OMP_PLACES"] == "{0,1,2}" and env["OMP_NUM_THREADS"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # vLLM must not bind again
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert CpuBackend().process_env(RankPlacement(0, 1, "h", 1)) == {}  # one CPU: no binding


def test_default_cpu_bind_gives_each_rank_of_a_host_one_cpu(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {6, 2, 4})
    assert default_cpu_bind(2) == "2|4"
    assert default_cpu_bind(4) == "2|4|6|2"  # more ranks than CPUs: round robin
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", default_cpu_bind(3))
    assert CpuBackend().process_env(RankPlacement(2, 3, "h", 1))["OMP_PLACES"] == "{6}"


def test_cpu_shm_patch_targets_exist():
    # prepare_worker patches this private vLLM name; fail loudly if an upgrade moves it.
    from vllm.distributed.device_communicators import cpu_communicator

    assert callable(cpu_communicator._CPUSHMDistributed.make_group_name)


def test_cpu_allreduce_mode_decides_whether_ranks_share_a_group_name(monkeypatch):
    from neuron_serving.devices.cpu import _group_suffix

    ranks = [RankPlacement(r, 2, "h", 1, session="s1") for r in (0, 1)]
    monkeypatch.delenv("NEURON_SERVING_CPU_ALLREDUCE", raising=False)
    assert _group_suffix(ranks[0]) == _group_suffix(ranks[1])  # shm: one name, one segment set
    monkeypatch.setenv("NEURON_SERVING_CPU_ALLREDUCE", "shm")
    assert _group_suffix(ranks[0]) == _group_suffix(ranks[1])
    # gloo: names differ, so vLLM's CpuCommunicator falls back to torch.distributed
    monkeypatch.setenv("NEURON_SERVING_CPU_ALLREDUCE", "gloo")
    assert _group_suffix(ranks[0]) != _group_suffix(ranks[1])
    assert _group_suffix(ranks[0]).startswith(_group_suffix(ranks[1]).rsplit("-rank", 1)[0])
    monkeypatch.setenv("NEURON_SERVING_CPU_ALLREDUCE", "nccl")
    with pytest.raises(ValueError, match="must be one of shm, gloo"):
        _group_suffix(ranks[0])


def test_neuron_env_per_rank():
    b = NeuronBackend(cores_per_node=32)
    env = b.process_env(RankPlacement(2, 4, "10.0.0.5", 29500))
    assert env == {
        "NEURON_RT_ROOT_COMM_ID": "10.0.0.5:29503",
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "FI_EFA_FORK_SAFE": "1",
        "VLLM_PLUGINS": "neuron_serving",
    }


def test_neuron_missing_packages_is_a_clear_error():
    with pytest.raises(DeviceUnavailable, match="pip.repos.neuron.amazonaws.com"):
        NeuronBackend().check_available()


def test_unknown_backend():
    with pytest.raises(ValueError, match="known: cpu, neuron"):
        get_backend("tpu")
