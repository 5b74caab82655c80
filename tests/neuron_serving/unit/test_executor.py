"""The unit executor's failure path: a gathered call that no rank answers in time
fails the unit exactly as a call that fails on rank 0 does.

The leader is the real ``UnitExecutor`` in its own process (``executor_proc.py``:
no model, so it exits as in production); rank 1 is a real ``Follower`` joined
over the control port with a real Gloo group, which receives the call and never
answers it while its heartbeats keep going.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from neuron_serving.exitcodes import ExitCode
from neuron_serving.unit import auth
from neuron_serving.unit.broadcast import KIND_CALL, ControlBroadcast, GroupAddress, make_group
from neuron_serving.unit.follower import Follower, FollowerConfig
from tests.neuron_serving.unit.executor_proc import GATHER_TIMEOUT_S
from tests.procs import REPO, TEST_TOKEN, free_port_block, unit_env, wait_for

# The leader abandons right after its constructor returns; rank 1 leaves this
# much later (an ordering margin, not a performance bound).
ABANDON_MARGIN_S = 3.0
# The peer's own Gloo timeout: bounds its wait for the call if the leader dies first.
PEER_GROUP_TIMEOUT_S = 60


class SilentPeer:
    """Rank 1: joins, heartbeats, receives broadcast calls and answers none."""

    def __init__(self, port: int) -> None:
        self.exits: list[tuple[int, str]] = []
        self.follower = Follower(
            FollowerConfig("127.0.0.1", port, 1, join_timeout_s=90),
            exit_fn=lambda code, msg: self.exits.append((code, msg)),
        )

    def join_and_receive_one_call(self) -> None:
        bc = self.join()
        kind, _seq, _payload = bc.recv()
        assert kind == KIND_CALL

    def join(self) -> ControlBroadcast:
        f = self.follower
        welcome = f.join()
        f.start_background()
        start = f.wait_start()
        where = GroupAddress(2, start.store_host, start.store_port, "127.0.0.1")
        group = make_group(1, where, PEER_GROUP_TIMEOUT_S)
        key = auth.broadcast_key(f.token, welcome.session_nonce)
        return ControlBroadcast(group, 1, key, welcome.broadcast_inline_bytes)


def _run_leader(tmp_path, call: str) -> tuple[int, list[dict], str, SilentPeer]:
    port = free_port_block()
    log = tmp_path / "leader.log"
    with open(log, "wb") as err:
        leader = subprocess.Popen(
            [sys.executable, "-m", "tests.neuron_serving.unit.executor_proc",
             "--port", str(port), "--call", call],
            stdout=subprocess.PIPE, stderr=err, env=unit_env(), cwd=REPO,
            start_new_session=True,
        )  # fmt: skip
        try:
            peer = SilentPeer(port)
            if call == "abandon":
                peer.join()
                # The leader abandons its executor as soon as rank 1 joined; then
                # rank 1 goes away, as InProcessUnit stops its followers.
                time.sleep(ABANDON_MARGIN_S)
                assert peer.follower.channel is not None
                peer.follower.channel.close()
            else:
                peer.join_and_receive_one_call()
            out, _ = leader.communicate(timeout=120)
        finally:
            if leader.poll() is None:
                leader.kill()
                leader.wait(timeout=10)
    events = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return leader.returncode, events, log.read_text(errors="replace"), peer


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        ("answer_on_every_rank", "answer_on_every_rank not answered: rank 1 ("),
        ("fail_on_rank0", "rank 0 failed in fail_on_rank0: RuntimeError('rank 0 broke')"),
    ],
    ids=["gather_timeout", "rank0_error"],
)
def test_unanswered_gathered_call_fails_the_unit_like_a_failed_call(
    tmp_path, monkeypatch, call, reason
):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", TEST_TOKEN)
    rc, events, stderr, peer = _run_leader(tmp_path, call)
    names = [e["event"] for e in events]
    assert rc == ExitCode.UNIT_FAILED, (rc, events, stderr[-3000:])
    assert names == ["joined", "failure_callback", "raised"], (events, stderr[-3000:])
    raised = events[-1]
    failure = f"inference unit unit-t failed: {reason}"
    assert raised["type"] == "UnitFailedError"
    assert raised["error"].startswith(failure), raised
    # Health flipped to FAILED with the same reason.
    assert raised["state"] == "failed" and raised["status_failure"] == raised["error"]
    if call == "answer_on_every_rank":
        assert f"did not answer call 1 within {GATHER_TIMEOUT_S:g} s" in raised["error"], raised
    assert f"exiting with code {ExitCode.UNIT_FAILED:d}" in stderr
    # The surviving follower was told why and left as a follower of a lost leader.
    wait_for(lambda: peer.exits, timeout=10, what="rank 1 to hear of the failure")
    code, message = peer.exits[0]
    assert code == ExitCode.LEADER_LOST and failure in message, peer.exits


def test_an_abandoned_executor_outlives_its_followers(tmp_path, monkeypatch):
    """``InProcessUnit``'s exception path: the executor is torn down before the
    followers are stopped, so their going away is not a rank failure and the
    process is not ended with exit 3 under the caller's clean-up."""
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", TEST_TOKEN)
    rc, events, stderr, peer = _run_leader(tmp_path, "abandon")
    assert [e["event"] for e in events] == ["joined", "abandoned", "still_alive"], stderr[-3000:]
    assert rc == ExitCode.OK and "exiting with code" not in stderr, (rc, stderr[-3000:])
