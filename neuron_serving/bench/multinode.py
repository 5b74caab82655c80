"""vLLM's own multi-node mode, run as N "nodes" on one host: each node's command
line and environment, and starting the nodes that have no engine.

How vLLM 0.32 spans nodes (read from its installed source):

- Every node gets the same model and engine arguments plus ``--nnodes N
  --node-rank R --master-addr A --master-port P`` (``ParallelConfig``,
  ``vllm/config/parallel.py``); the backend must be ``mp`` (``nnodes > 1 can
  only be set when distributed executor backend is mp, uni or
  external_launcher``). ``local_world_size = world_size / N`` ranks run on each
  node, node R holding global ranks ``R * local .. (R + 1) * local - 1``.
- Node 0 runs the engine core (``vllm serve`` or the offline ``LLM``) and its
  ``MultiprocExecutor`` (``vllm/v1/executor/multiproc_executor.py``), which
  spawns node 0's workers. Nodes 1..N-1 run ``vllm serve --headless``: for
  ``node_rank_within_dp > 0``, ``run_headless`` (``vllm/entrypoints/cli/serve.py``)
  builds a ``MultiprocExecutor(vllm_config, monitor_workers=False)`` that spawns
  that node's workers and then watches only them (``start_worker_monitor(inline=True)``).
- The workers form one torch.distributed world through a TCPStore at
  ``master_addr:master_port`` (``init_distributed_environment``,
  ``vllm/distributed/parallel_state.py``: with ``nnodes > 1`` this replaces the
  single-node file store); CPU workers use Gloo.
- Scheduler output reaches the other nodes' workers over ZeroMQ (the
  ``MessageQueue``'s remote readers, ``shm_broadcast.py``), connected to
  ``get_ip()`` of node 0: ``VLLM_HOST_IP``, else the address of the default
  route. On loopback it is set to ``master_addr``.
- CPU binding: each node's ``VLLM_CPU_OMP_THREADS_BIND`` lists its *local* ranks
  only (``OMPProcessManager`` asserts one entry per local rank); the per-rank
  list of the whole unit is split per node here.

Nothing refuses the CPU platform on this path, and it runs here (``bench executor``,
its ``mn`` arm). What running it taught:

- Every node must get the same scheduler limits, spelled out: vLLM does not check
  that nodes agree, and its defaults depend on the entry point (CPU: the offline
  ``LLM`` 8192 batched tokens, ``vllm serve`` 4096 here). A headless node with other
  limits warms up with other batch shapes than node 0 and dies in the first
  collective: ``gloo::EnforceNotMet ... op.preamble.length <= op.nbytes. 1048576 vs
  524288. Received data size doesn't match expected size``.
- The TP all-reduce is Gloo over TCP even with both nodes on one host: each node's
  ``VLLM_DIST_IDENT`` comes from its own local file store, so the ranks' SHM group
  names differ and vLLM logs "CPU SHM communicator disabled for group tp:0"
  (our unit keeps the shared-memory all-reduce for ranks on one host:
  ``devices/cpu.py``). On separate hosts both use Gloo.
- After node 0's engine shuts down in order, the headless node does not exit: it
  was still running 10 s later and ignored SIGTERM for 10 s (``bench executor``
  records ``mn_headless_exit_codes``; ``start_node``'s caller stops the tree).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_serving import proctree
from neuron_serving.proctree import ProcessTree


def cli_args(engine: dict[str, Any]) -> list[str]:
    """``LLM(**engine)`` keyword arguments as ``vllm serve`` flags: ``max_model_len=1024``
    -> ``--max-model-len 1024``; True -> the bare flag; False and None are left out."""
    out: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out


@dataclass(frozen=True, slots=True)
class MultiNodeConfig:
    """One vLLM multi-node deployment: TP across ``nnodes`` nodes on ``master_addr``."""

    model: str
    tp: int = 2
    nnodes: int = 2
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    # vLLM's per-rank CPU lists for the whole unit, global rank order ("0|1": rank 0
    # on core 0, rank 1 on core 1); each node gets its own ranks' entries.
    cpu_bind: str = "0|1"
    # The same on every node (the headless nodes build their own VllmConfig from them).
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nnodes < 2 or self.tp % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must be >= 2 and divide tp ({self.tp})")
        if len(self.cpu_bind.split("|")) != self.tp:
            raise ValueError(f"cpu_bind {self.cpu_bind!r} needs one entry per rank ({self.tp})")

    @property
    def local_world_size(self) -> int:
        return self.tp // self.nnodes

    def node_env(self, node_rank: int) -> dict[str, str]:
        """What node ``node_rank`` needs in its environment on this host."""
        self._check(node_rank)
        lists = self.cpu_bind.split("|")
        local = lists[node_rank * self.local_world_size : (node_rank + 1) * self.local_world_size]
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(local), "VLLM_HOST_IP": self.master_addr}

    def parallel_kwargs(self, node_rank: int = 0) -> dict[str, Any]:
        """Engine arguments that make this process node ``node_rank`` (``LLM(...)`` on node 0)."""
        self._check(node_rank)
        return {
            "tensor_parallel_size": self.tp,
            "distributed_executor_backend": "mp",
            "nnodes": self.nnodes,
            "node_rank": node_rank,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
        }

    def serve_argv(self, node_rank: int, api: tuple[str, ...] = ()) -> list[str]:
        """``vllm serve`` for node ``node_rank``: node 0 with the API server's ``api``
        flags (host, port, served model name), the others ``--headless``."""
        self._check(node_rank)
        if node_rank and api:
            raise ValueError("only node 0 serves the API; headless nodes take no API flags")
        argv = [sys.executable, "-m", "neuron_serving.bench.vllm_cli", "serve", self.model]
        argv += cli_args({**self.parallel_kwargs(node_rank), **self.engine})
        return argv + (["--headless"] if node_rank else list(api))

    def _check(self, node_rank: int) -> None:
        if not 0 <= node_rank < self.nnodes:
            raise ValueError(f"node_rank {node_rank} outside 0..{self.nnodes - 1}")


def start_node(
    cfg: MultiNodeConfig, node_rank: int, log: Path, env: dict[str, str],
    api: tuple[str, ...] = (),
) -> ProcessTree:  # fmt: skip
    """Node ``node_rank`` as its own process tree (own session, SIGTERM when the
    caller dies), output to ``log``. ``env``: the base environment."""
    with open(log, "wb") as f:
        popen = proctree.spawn(
            cfg.serve_argv(node_rank, api),
            env={**env, **cfg.node_env(node_rank), "PYTHONUNBUFFERED": "1"},
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    return ProcessTree(popen, f"vllm node {node_rank}")
