"""A TP=2 unit behind Triton: a real follower process joins the leader's unit executor.

Readiness means the whole unit: the model is ready only after the follower joined
and a warm-up generation went through both ranks; killing the follower turns
readiness off and makes the leader exit non-zero, leaving no process behind.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from neuron_serving.exitcodes import ExitCode
from neuron_serving.ports import free_port_block
from tests.e2e.triton_leader_helpers import get, start_leader, wait_ready
from tests.procs import Proc, leftover, unit_env

pytestmark = pytest.mark.e2e


def _generate(http: str, prompt: str, max_tokens: int) -> dict:
    body = {"text_input": prompt, "exclude_input_in_output": True,
            "parameters": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(
        f"http://{http}/v2/models/llm/generate", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _gauge(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{")]  # fmt: skip
    assert len(values) == 1, (name, values)
    return values[0]


def test_follower_death_turns_readiness_off_and_leader_exits(demo_model: Path, tmp_path) -> None:
    # This unit all-reduces over Gloo (NEURON_SERVING_CPU_ALLREDUCE, devices/cpu.py), as
    # ranks on two hosts do; every `up` cluster in the suite covers the shared-memory path.
    gloo = {"NEURON_SERVING_CPU_ALLREDUCE": "gloo"}
    leader = start_leader(
        demo_model, tmp_path, tp=2, extra=["--max-model-len", "512", "--drain", "1"], env=gloo
    )
    health = free_port_block(2)  # gRPC health, then HTTP /healthz and /metrics
    follower = Proc(
        "follower",
        [
            "follower",
            "--leader",
            f"127.0.0.1:{leader.control_port}",
            "--rank",
            "1",
            "--world-size",
            "2",
            "--health-port",
            str(health),
        ],
        tmp_path,
        unit_env(**gloo),
    )
    try:
        wait_ready(leader, follower)
        out = _generate(leader.http, "Is this coffee maker in stock?", 8)
        assert out["completion_tokens"] == 8 and out["finish_reason"] == "length"
        # vLLM's own fallback said so (vllm/distributed/device_communicators/cpu_communicator.py).
        assert "CPU SHM communicator disabled for group tp" in follower.stderr() + follower.stdout()
        # The unit's control-plane metrics are merged into the leader's metrics port.
        metrics = get(f"http://{leader.metrics}/metrics")[1]
        for name in (
            "vllm:num_requests_running",
            "neuron_serving_control_broadcast_seconds",
            "neuron_serving_follower_heartbeat_age_seconds",
        ):
            assert name in metrics, name
        # Both ranks' heaps left the collector's view once started: rank 0's by vLLM's
        # EngineCore, the follower's by its step loop (unit/gc_pauses.py). Unfrozen, a
        # full collection of a follower's heap takes 250-640 ms, and its unit waits.
        follower_metrics = get(f"http://127.0.0.1:{health + 1}/metrics")[1]
        for text in (metrics, follower_metrics):
            assert _gauge(text, "neuron_serving_gc_frozen_objects") > 10_000
            assert "neuron_serving_gc_pause_seconds_bucket" in text

        follower.signal(signal.SIGKILL)
        killed = time.monotonic()
        while leader.model_ready() and time.monotonic() - killed < 60:
            time.sleep(0.1)
        print(f"model not ready {time.monotonic() - killed:.2f} s after the follower's SIGKILL")
        assert not leader.model_ready()
        rc = leader.proc.wait(timeout=90)
        print(f"leader exited {rc} {time.monotonic() - killed:.2f} s after the follower's SIGKILL")
        assert rc == ExitCode.UNIT_FAILED, leader.log_tail()
        assert leftover([leader.proc, follower]) == []
    finally:
        leader.proc.stop()
        follower.stop()
