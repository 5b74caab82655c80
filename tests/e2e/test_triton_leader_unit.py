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


def test_follower_death_turns_readiness_off_and_leader_exits(demo_model: Path, tmp_path) -> None:
    leader = start_leader(
        demo_model, tmp_path, tp=2, extra=["--max-model-len", "512", "--drain", "1"]
    )
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
        ],
        tmp_path,
        unit_env(),
    )
    try:
        wait_ready(leader, follower)
        out = _generate(leader.http, "Is this coffee maker in stock?", 8)
        assert out["completion_tokens"] == 8 and out["finish_reason"] == "length"
        # The unit's control-plane metrics are merged into the leader's metrics port.
        metrics = get(f"http://{leader.metrics}/metrics")[1]
        for name in (
            "vllm:num_requests_running",
            "neuron_serving_control_broadcast_seconds",
            "neuron_serving_follower_heartbeat_age_seconds",
        ):
            assert name in metrics, name

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
