"""Join handshake between a real ControlServer and real Followers on loopback."""

from __future__ import annotations

import re
import socket
import struct
import threading
import time

import pytest

from neuron_serving.exitcodes import ExitCode
from neuron_serving.unit.channel import Channel, ChannelClosed, LinkBroken
from neuron_serving.unit.config import UnitConfig
from neuron_serving.unit.control_server import ControlServer, UnitJoinError
from neuron_serving.unit.follower import Follower, FollowerConfig, FollowerRejected
from neuron_serving.unit.late_beats import SATURATED_FACTOR
from neuron_serving.unit.messages import Heartbeat, Start
from neuron_serving.unit.node_status import NodeState
from neuron_serving.unit.step_timing import StepTiming
from neuron_serving.versions import runtime_versions
from tests.procs import TEST_TOKEN, free_port_block


@pytest.fixture(autouse=True)
def token_env(monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", TEST_TOKEN)


class Leader:
    def __init__(self, world_size=2, versions=None, **unit_kw):
        self.port = free_port_block()
        self.failures: list[tuple[int, str]] = []
        self.follower_exits: list[tuple[int, str]] = []
        unit = UnitConfig(control_port=self.port, join_timeout_s=5, **unit_kw)
        self.server = ControlServer(
            unit,
            world_size,
            TEST_TOKEN.encode(),
            versions or runtime_versions(),
            lambda rank, reason: self.failures.append((rank, reason)),
        )
        self.server.listen()

    def follower(self, rank=1, timeout=5.0) -> Follower:
        return Follower(
            FollowerConfig("127.0.0.1", self.port, rank, join_timeout_s=timeout),
            exit_fn=lambda code, msg: self.follower_exits.append((code, msg)),
        )


@pytest.fixture
def leader():
    made: list[Leader] = []

    def make(**kw):
        lead = Leader(**kw)
        made.append(lead)
        return lead

    yield make
    for lead in made:
        lead.server.close(clean=False)


def test_join_and_start(leader):
    lead = leader(world_size=3)
    f1, f2 = lead.follower(1), lead.follower(2)
    w1, w2 = f1.join(), f2.join()
    assert w1.world_size == w2.world_size == 3
    assert w1.session_nonce == w2.session_nonce
    lead.server.wait_for_followers(5)
    f1.start_background()
    lead.server.start_unit(Start("127.0.0.1", lead.port + 1, "tcp://x"))
    assert f1.wait_start().store_port == lead.port + 1
    assert sorted(lead.server.links) == [1, 2]


def test_follower_may_start_before_leader():
    port = free_port_block()
    follower = Follower(FollowerConfig("127.0.0.1", port, 1, join_timeout_s=10))
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("w", follower.join()))
    t.start()
    time.sleep(1.0)  # the follower is retrying a refused connection meanwhile
    server = ControlServer(
        UnitConfig(control_port=port), 2, TEST_TOKEN.encode(), runtime_versions(), lambda *a: None
    )
    server.listen()
    try:
        t.join(timeout=10)
        assert result["w"].world_size == 2
        server.wait_for_followers(5)
    finally:
        server.close(clean=False)


def test_wrong_token_rejected_without_leaking(leader, monkeypatch):
    lead = leader()
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", "some-other-token-1234567890")
    with pytest.raises(FollowerRejected, match="token: authentication failed"):
        lead.follower().join()
    assert lead.server.links == {}
    with pytest.raises(UnitJoinError) as e:
        lead.server.wait_for_followers(0.5)
    assert "ranks [1] did not join" in str(e.value)
    assert "authentication failed" in str(e.value)


def test_version_mismatch_names_field_and_both_values(leader):
    theirs = runtime_versions()
    lead = leader(versions={**theirs, "vllm": "0.31.9"})
    with pytest.raises(FollowerRejected) as e:
        lead.follower().join()
    msg = str(e.value)
    assert "versions.vllm" in msg and "0.31.9" in msg and theirs["vllm"] in msg


def test_duplicate_rank_rejected(leader):
    lead = leader(world_size=3)
    first = lead.follower(1)
    first.join()
    # The follower's join() returns once it has sent its Joined ack; the leader records
    # the link when it reads that ack. Wait for it, or the duplicate may come first
    # (seen on a loaded 2-core CI host).
    deadline = time.monotonic() + 10
    while 1 not in lead.server.links:
        assert time.monotonic() < deadline, "the leader never recorded rank 1"
        time.sleep(0.01)
    with pytest.raises(FollowerRejected, match="rank: rank 1 already joined"):
        lead.follower(1).join()


def test_rank_out_of_range_rejected(leader):
    lead = leader(world_size=2)
    with pytest.raises(FollowerRejected, match="rank 5 is outside 1..1"):
        lead.follower(5).join()


def test_join_timeout_lists_missing_ranks(leader):
    lead = leader(world_size=4)
    present = lead.follower(2)
    present.join()
    with pytest.raises(UnitJoinError, match=r"ranks \[1, 3\] did not join within 1 s"):
        lead.server.wait_for_followers(1.0)
    assert present.channel is not None


def test_follower_gives_up_when_no_leader():
    port = free_port_block()
    f = Follower(FollowerConfig("127.0.0.1", port, 1, join_timeout_s=1.0))
    with pytest.raises(TimeoutError, match="could not join leader"):
        f.join()


def test_unauthenticated_oversized_frame_is_dropped(leader):
    lead = leader()
    with socket.create_connection(("127.0.0.1", lead.port), timeout=5) as s:
        s.recv(4096)  # challenge
        s.sendall(struct.pack("!I", 50 << 20) + b"x" * 1024)
        s.settimeout(5)
        assert s.recv(1024) == b""  # the leader closed the connection
    assert lead.server.links == {}


def test_garbage_hello_is_dropped_and_server_keeps_serving(leader):
    lead = leader()
    with socket.create_connection(("127.0.0.1", lead.port), timeout=5) as s:
        s.recv(4096)
        s.sendall(struct.pack("!I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
        s.settimeout(5)
        assert s.recv(1024) == b""
    real = lead.follower()
    real.join()  # a real follower still gets in
    lead.server.wait_for_followers(5)
    assert real.welcome is not None


def test_follower_disconnect_after_start_is_reported(leader):
    lead = leader()
    f = lead.follower()
    f.join()
    lead.server.wait_for_followers(5)
    lead.server.start_unit(Start("127.0.0.1", lead.port + 1, "tcp://x"))
    f.channel.close()
    deadline = time.monotonic() + 5
    while not lead.failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lead.failures and lead.failures[0][0] == 1
    assert (
        "rank 1" in lead.failures[0][1] and "closed its control connection" in lead.failures[0][1]
    )


def test_send_to_a_closed_peer_says_the_peer_closed_it():
    # A peer that exits is met either by the reader (EOF) or by the heartbeat
    # loop's next send (EPIPE), whichever comes first: both must say the same
    # thing, not "stopped, hung or cut off" for a process that simply exited.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname(), timeout=5)
        b, _ = listener.accept()
    chan = Channel(a, "rank 1")
    b.close()
    with pytest.raises(ChannelClosed, match="closed the connection") as err:
        for _ in range(100):  # the first sends may land in the buffer
            chan.send(Heartbeat("ready", 0), timeout=0.5)
    assert not isinstance(err.value, LinkBroken)
    with pytest.raises(ChannelClosed, match="closed the connection") as again:
        chan.send(Heartbeat("ready", 0), timeout=0.5)
    assert not isinstance(again.value, LinkBroken)


def test_silent_follower_is_declared_hung(leader):
    lead = leader(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, startup_heartbeat_timeout_s=0.6
    )
    f = lead.follower()
    f.join()  # joined, but no heartbeat thread: looks like a stopped process
    lead.server.wait_for_followers(5)
    lead.server.start_unit(Start("127.0.0.1", lead.port + 1, "tcp://x"))
    deadline = time.monotonic() + 5
    while not lead.failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lead.failures and "no heartbeat" in lead.failures[0][1]


def _steps_for(seconds: float, proven) -> None:
    """Steps every rank takes part in, finishing every 50 ms, for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        time.sleep(0.05)
        proven(started)


def test_steps_every_rank_took_part_in_keep_a_starved_follower_alive(leader):
    # Under load a follower's heartbeat thread can be starved (CPU, GIL) while its
    # steps go on; a step rank 0 finished needed every rank, so it proves them
    # alive. When the steps stop too (a stopped rank blocks them), the timeout
    # applies as before.
    lead = leader(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, startup_heartbeat_timeout_s=0.6
    )
    f = lead.follower()
    f.join()  # no heartbeat thread
    lead.server.wait_for_followers(5)
    lead.server.start_unit(Start("127.0.0.1", lead.port + 1, "tcp://x"))
    _steps_for(2.0, lead.server.ranks_alive)  # 3x the timeout without a beat
    assert not lead.failures
    deadline = time.monotonic() + 5
    while not lead.failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lead.failures and "no heartbeat" in lead.failures[0][1]


def test_steps_keep_a_starved_leader_alive_for_its_follower(leader, monkeypatch):
    lead = leader(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, startup_heartbeat_timeout_s=0.6
    )
    monkeypatch.setattr(lead.server, "_heartbeat_loop", lambda: None)  # a starved leader
    f = lead.follower()
    f.join()
    lead.server.wait_for_followers(5)
    f.start_background()
    lead.server.start_unit(Start("127.0.0.1", lead.port + 1, "tcp://x"))
    f.wait_start()
    _steps_for(2.0, f.ranks_alive)
    assert not lead.follower_exits
    deadline = time.monotonic() + 5
    while not lead.follower_exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lead.follower_exits, "the follower kept a silent leader with no steps"
    code, msg = lead.follower_exits[0]
    assert code == ExitCode.LEADER_LOST and "no heartbeat from the leader" in msg, msg


def test_a_follower_whose_beats_came_late_gets_more_silence(leader):
    # Beats that arrived late say the follower's host is saturated: its silence is
    # judged SATURATED_FACTOR times more leniently for a while.
    lead = leader(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, startup_heartbeat_timeout_s=0.6
    )
    f = lead.follower()
    f.join()  # beats sent by hand below
    lead.server.wait_for_followers(5)
    lead.server.start_unit(Start("127.0.0.1", lead.port + 1, "tcp://x"))
    f.channel.send(Heartbeat("ready", 0))
    time.sleep(0.3)  # 3 intervals: late, and under the 0.5 s timeout
    f.channel.send(Heartbeat("ready", 0))
    deadline = time.monotonic() + 5
    while not lead.failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lead.failures, "a silent follower was never declared hung"
    reason = lead.failures[0][1]
    # The silence the leader itself measured, not this thread's clock.
    silent = float(re.search(r"sent no heartbeat for ([0-9.]+) s", reason).group(1))
    assert "limit 1.5 s" in reason and silent >= SATURATED_FACTOR * 0.5, reason


def test_a_leader_whose_beats_came_late_gets_more_silence_from_its_follower(leader, monkeypatch):
    lead = leader(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, startup_heartbeat_timeout_s=10)
    sent = threading.Event()

    def two_beats_then_silence() -> None:
        for gap in (0.0, 0.3):  # the second 3 intervals after the first: late
            time.sleep(gap)
            for link in list(lead.server.links.values()):
                link.channel.send(Heartbeat("ready", 0))
        sent.set()

    monkeypatch.setattr(lead.server, "_heartbeat_loop", two_beats_then_silence)
    f = lead.follower()
    f.join()
    f.status.set_state(NodeState.READY)  # serving: the strict limit, 3 x 0.5 s when calm
    lead.server.wait_for_followers(5)
    f.start_background()
    lead.server.start_unit(Start("127.0.0.1", lead.port + 1, "tcp://x"))
    f.wait_start()
    assert sent.wait(5)
    deadline = time.monotonic() + 15
    while not lead.follower_exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lead.follower_exits, "the follower kept a silent leader"
    code, msg = lead.follower_exits[0]
    assert code == ExitCode.LEADER_LOST and "limit 4.5 s" in msg, msg
    # The silence the follower itself measured: past the relaxed limit, not the calm 1.5 s.
    silent = float(re.search(r"no heartbeat from the leader for ([0-9.]+) s", msg).group(1))
    assert silent >= 4.5, msg


def test_a_slow_follower_is_judged_from_its_beats_and_can_fail_the_unit(monkeypatch):
    """The follower's step totals travel in its heartbeats; the leader's detector
    compares them with its own and, with the "fail" action, fails the unit for the
    slow rank. Round trips of the beats are measured on both sides."""
    for name, value in (("WINDOW_S", "0.3"), ("WINDOWS", "2"), ("MIN_STEPS", "2"),
                        ("ACTION", "fail")):  # fmt: skip
        monkeypatch.setenv(f"NEURON_SERVING_STRAGGLER_{name}", value)
    leader_timing, follower_timing = StepTiming(), StepTiming()
    lead = Leader(heartbeat_interval_s=0.05)
    lead.server.timing = leader_timing
    f = Follower(FollowerConfig("127.0.0.1", lead.port, 1, join_timeout_s=5),
                 exit_fn=lambda code, msg: None, timing=follower_timing)  # fmt: skip
    try:
        f.join()
        lead.server.wait_for_followers(5)
        f.start_background()
        lead.server.start_unit(Start("127.0.0.1", lead.port + 1, "tcp://x"))
        f.wait_start()
        deadline = time.monotonic() + 10
        while not lead.failures and time.monotonic() < deadline:
            # Rank 0 waits 40 ms of each 50 ms step for rank 1 (after the step's
            # first collective, its usual head start), which waits 1 ms.
            for timing, wait in ((leader_timing, 0.04), (follower_timing, 0.001)):
                timing.collective(0.002)
                timing.collective(wait)
                timing.step(0.05)
            time.sleep(0.01)
        assert lead.failures, "the slow rank did not fail the unit"
        rank, reason = lead.failures[0]
        assert rank == 1 and "rank 1 is slow: its peers waited 78% of each 50 ms step" in reason
        assert "NEURON_SERVING_STRAGGLER_ACTION=fail" in reason
        assert set(lead.server.heartbeat_rtts()) == {"1"}
        assert 0 <= lead.server.heartbeat_rtts()["1"] < 1.0
        assert set(f.heartbeat_rtts()) == {"0"}
    finally:
        lead.server.close(clean=False)
