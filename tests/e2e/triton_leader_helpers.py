"""Starting `neuron-serving leader` for e2e tests, and reading its HTTP endpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from neuron_serving.bench.common import metric_sum
from neuron_serving.bench.stack import http_get
from neuron_serving.ports import free_port
from tests.procs import Proc, free_port_block, unit_env

READY_TIMEOUT_S = 300.0


@dataclass
class LeaderEndpoints:
    proc: Proc
    http: str
    grpc: str
    metrics: str
    control_port: int

    def log_tail(self, n: int = 60) -> str:
        text = self.proc.stderr() + self.proc.stdout()
        return "\n".join(text.splitlines()[-n:])

    def ports(self) -> tuple[int, int, int, int]:
        """(control, http, grpc, metrics): what ``start_leader(ports=)`` takes."""
        return (
            self.control_port,
            *(int(a.rsplit(":", 1)[1]) for a in (self.http, self.grpc, self.metrics)),
        )

    def model_ready(self) -> bool:
        return get(f"http://{self.http}/v2/models/llm/ready")[0] == 200


get = http_get  # one HTTP GET helper for tests and benchmarks


def metric(metrics_addr: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return metric_sum(get(f"http://{metrics_addr}/metrics")[1], name, **labels)


def start_leader(
    model: Path, tmp: Path, *, tp: int, extra: list[str] = (), env: dict[str, str] | None = None,
    ports: tuple[int, int, int, int] | None = None,
) -> LeaderEndpoints:  # fmt: skip
    """``ports``: (control, http, grpc, metrics), e.g. a dead leader's ``ports()``;
    free ones by default."""
    if ports is None:
        control = free_port_block(4)
        http, grpc, metrics = (free_port() for _ in range(3))
    else:
        control, http, grpc, metrics = ports
    args = [
        "leader", "--model", str(model), "--tp", str(tp), "--control-port", str(control),
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        "--run-dir", str(tmp / "run"),
        # The name the e2e proxies route by (leader_fixture.proxy_config): vLLM's OpenAI
        # layer on the leader answers only for its served name.
        "--served-model-name", "llm",
        # Tests exercise the serving path, not torch.compile: eager startup keeps
        # each leader to seconds instead of ~30 s per rank on CPU.
        "--enforce-eager", *extra,
    ]  # fmt: skip
    proc = Proc("leader", args, tmp, unit_env(**(env or {})))
    print("leader:", " ".join(args), "logs in", tmp)
    return LeaderEndpoints(proc, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                           f"127.0.0.1:{metrics}", control)  # fmt: skip


def wait_ready(leader: LeaderEndpoints, *others: Proc) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not leader.model_ready():
        for p in (leader.proc, *others):
            if p.popen.poll() is not None:
                pytest.fail(f"{p.name} exited with {p.popen.returncode}:\n{leader.log_tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"leader not ready in {READY_TIMEOUT_S} s:\n{leader.log_tail()}")
        time.sleep(0.5)
