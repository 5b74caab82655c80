"""Attacks on a unit's control port and control connections, against real processes.

The leader's control server runs in its own process (``control_server_proc``)
where that is the subject, so what an attack costs it (threads, memory, file
descriptors, log lines) is read from the process itself; the attacker is this
test process on loopback. The tampering tests put an on-path relay
(``relay.py``) between a real ``ControlServer`` and a real ``Follower``.
Every test ends by showing the legitimate path still works, or that the unit
failed as a whole naming the rank, and every wait is bounded.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import psutil
import pytest

from neuron_serving.exitcodes import ExitCode
from neuron_serving.unit.auth import AuthError
from neuron_serving.unit.calls import decode_result
from neuron_serving.unit.channel import _HEAD, PLAIN, SEALED, Channel, ChannelClosed, LinkBroken
from neuron_serving.unit.config import UnitConfig
from neuron_serving.unit.control_server import (
    HANDSHAKES_PER_PEER,
    SPARE_HANDSHAKE_SLOTS,
    ControlServer,
)
from neuron_serving.unit.follower import Follower, FollowerConfig
from neuron_serving.unit.messages import (
    PROTOCOL_VERSION,
    Failure,
    Heartbeat,
    Hello,
    Reject,
    Reply,
    Shutdown,
    Start,
    Welcome,
    encode,
)
from neuron_serving.versions import runtime_versions
from tests.neuron_serving.unit.relay import TO_FOLLOWER, TO_LEADER, Frame, Relay
from tests.procs import REPO, TEST_TOKEN, free_port_block, unit_env, wait_for

# A Hello as large as the message bounds allow (about 6.6 KiB), with a host
# name that would forge a log line and colour the operator's terminal.
EVIL_HOST = ("evil\n2026-01-01 INFO rank 1 joined unit\x1b[31m" + "A" * 255)[:255]
BIG_VERSIONS = {f"{i:02d}".ljust(64, "k"): "v" * 128 for i in range(32)}
SLOTS = 1 + SPARE_HANDSHAKE_SLOTS  # handshake slots of a 2-rank unit
# The attacker's host; real followers connect from 127.0.0.1.
ATTACKER = "127.0.0.2"


@pytest.fixture(autouse=True)
def token_env(monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", TEST_TOKEN)


# -- the control server in its own process ------------------------------------
class ServerProc:
    def __init__(self, tmp_path: Path, handshake_timeout: float = 10.0) -> None:
        self.port = free_port_block()
        self.log = tmp_path / "control-server.log"
        self._log_f = open(self.log, "wb")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.neuron_serving.unit.control_server_proc",
             "--port", str(self.port), "--handshake-timeout", str(handshake_timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_f,
            env=unit_env(), cwd=REPO, text=True,
        )  # fmt: skip
        try:
            assert self._read(30)["ready"]
        except BaseException:
            self.stop()  # a server that never came up is not left running
            raise
        self.ps = psutil.Process(self.popen.pid)

    def _read(self, timeout: float) -> dict:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.popen.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        assert box and box[0], f"control server did not answer within {timeout} s"
        return json.loads(box[0])

    def ask(self, cmd: str, timeout: float = 30.0) -> dict:
        self.popen.stdin.write(cmd + "\n")
        self.popen.stdin.flush()
        return self._read(timeout)

    def stderr(self) -> str:
        self._log_f.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)
        for f in (self.popen.stdin, self.popen.stdout, self._log_f):
            try:
                f.close()
            except OSError:
                pass  # stdin: a flush into the dead process's pipe


@pytest.fixture
def server_proc(tmp_path):
    made: list[ServerProc] = []

    def make(**kw) -> ServerProc:
        made.append(ServerProc(tmp_path, **kw))
        return made[-1]

    yield make
    for s in made:
        s.stop()


class PeakThreads:
    """Samples a process's OS thread count while an attack runs."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc, self.peak, self._stop = proc, proc.num_threads(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, self.proc.num_threads())
            except psutil.NoSuchProcess:
                return  # a test failed before stop() and its server is gone

    def stop(self) -> int:
        self._stop.set()
        self._t.join(5)
        return self.peak


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the leader on 127.0.0.1 from ``source``: any 127.0.0.0/8
    address works on Linux's loopback, so one machine plays several hosts."""
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def _idle(port: int, source: str = "127.0.0.1") -> socket.socket | None:
    """A connection that never sends; None if the server refused it so fast
    that the reset arrived before ``connect`` returned."""
    try:
        return _connect(port, source)
    except ConnectionResetError:
        return None


def _wrong_mac_hello(port: int, source: str = ATTACKER) -> str:
    """One attacker connection: 'rejected', 'refused' (closed unread) or 'welcomed'."""
    try:
        with _connect(port, source) as sock:
            ch = Channel(sock, "leader")
            ch.recv(timeout=10)  # the challenge
            ch.send(Hello(PROTOCOL_VERSION, 1, EVIL_HOST, 666, BIG_VERSIONS, os.urandom(32), os.urandom(32)))  # fmt: skip
            answer = ch.recv(timeout=10)
            return "rejected" if isinstance(answer, Reject) else "welcomed"
    except (ChannelClosed, ConnectionError):
        return "refused"


def _follower(port: int, rank: int = 1, timeout: float = 10.0, exits=None) -> Follower:
    exits = exits if exits is not None else []
    return Follower(
        FollowerConfig("127.0.0.1", port, rank, join_timeout_s=timeout),
        exit_fn=lambda code, msg: exits.append((code, msg)),
    )


def test_flood_of_wrong_mac_hellos_is_bounded_and_a_real_follower_still_joins(server_proc):
    n = 3000
    srv = server_proc()
    for _ in range(100):  # warm the allocator so growth below is the flood's own
        _wrong_mac_hello(srv.port)
    before = srv.ask("stats")
    peak = PeakThreads(srv.ps)
    legit = _follower(srv.port, timeout=120)
    joined: list[object] = []
    with ThreadPoolExecutor(32) as pool:
        results = pool.map(lambda _: _wrong_mac_hello(srv.port), range(n))
        # A real follower on another host joins in the middle of the flood: the
        # flood holds at most HANDSHAKES_PER_PEER slots.
        joiner = threading.Thread(target=lambda: joined.append(legit.join()), daemon=True)
        joiner.start()
        outcomes = list(results)
    joiner.join(120)
    threads_peak = peak.stop()
    after = wait_for(
        lambda: (s := srv.ask("stats"))["threads"] <= before["threads"] + 1 and s,
        timeout=30, what="handshake threads to finish",
    )  # fmt: skip
    counts = {k: outcomes.count(k) for k in ("rejected", "refused", "welcomed")}
    growth = after["rss"] - before["rss"]
    report = (
        f"{n} wrong-MAC Hellos: {counts}; server threads {before['threads']} -> peak "
        f"{threads_peak} (OS) -> {after['threads']}; RSS {before['rss'] >> 10} -> "
        f"{after['rss'] >> 10} KiB (+{growth >> 10} KiB); fds {before['fds']} -> "
        f"{after['fds']}; kept {after['rejections_kept']} rejections "
        f"({after['rejections_chars']} chars) of {after['rejected_total']}; "
        f"refused at accept {after['dropped_at_accept']}"
    )
    print(report)
    assert counts["welcomed"] == 0, report
    assert counts["rejected"] > 0, report
    assert after["rejections_kept"] <= 8 and after["rejections_chars"] <= 8 * 400, report
    # One thread per handshake slot at most, plus the accept loop and the main thread.
    assert threads_peak <= before["threads"] + SLOTS + 2, report
    # Before the fix every rejected Hello was kept (~4-7 KiB each: 12 MB for 3000).
    assert growth < 4 << 20, report
    assert after["fds"] <= before["fds"] + 2, report
    # Rate-limited, escaped logging: a handful of lines, no forged line, no escape code.
    log = srv.stderr()
    lines = [ln for ln in log.splitlines() if "rejected rank" in ln or "refused connection" in ln]
    print(f"{len(lines)} warning lines for {n + 100} hostile connections")
    assert len(lines) <= 40, f"{len(lines)} log lines for {n} attempts\n" + "\n".join(lines[-5:])
    assert "suppressed" in log
    assert "\x1b" not in log, log[-2000:]
    assert not [ln for ln in log.splitlines() if ln.startswith("2026-01-01")], log[-2000:]
    # The legitimate follower joined despite the flood; the unit forms.
    assert joined and isinstance(joined[0], Welcome), report
    assert srv.ask("wait 10") == {"ok": True}
    legit.start_background()
    assert srv.ask("start") == {"ok": True}
    assert legit.wait_start().store_port == srv.port + 1
    # Formed: the port no longer accepts anything.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()
    assert srv.ask("stats")["links"] == [1]


def _raw_frame(length: int, kind: int = PLAIN, body: bytes = b"") -> bytes:
    return _HEAD.pack(length, kind) + body


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Reads (and discards) until the peer closes; False if it is still open at ``timeout``."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def test_half_open_trickling_and_oversized_connections_are_freed(server_proc):
    srv = server_proc(handshake_timeout=1.0)
    # A message whose unknown tag would forge a log line through the decode
    # error (msgspec quotes the tag): escaped and cut in the log.
    forged = msgspec.msgpack.encode({"type": "x\n2026-01-01 FORGED\x1b[31m" + "y" * 4000})
    with _connect(srv.port) as s:
        s.recv(4096)  # the challenge
        s.sendall(_raw_frame(len(forged), body=forged))
        assert _closed_by_peer(s, timeout=5)
    log = wait_for(lambda: "malformed" in (text := srv.stderr()) and text, timeout=5, what="log")
    assert "\x1b" not in log and "\n2026-01-01 FORGED" not in log, log[-2000:]
    assert "x\\n2026-01-01 FORGED\\x1b[31myyy" in log, log[-2000:]
    before = srv.ask("stats")
    peak = PeakThreads(srv.ps)
    t0 = time.monotonic()

    # Phase 1, on an idle server (every slot free, so each connection gets a
    # handshake and the limits under test are the ones that cut it). Each
    # connection is closed by the server before the next one opens.
    # A slow-loris: a valid-looking frame header, then one byte every 0.2 s:
    # cut by the handshake deadline while still sending ("stalled mid-frame").
    loris = _connect(srv.port)
    body = encode(Hello(PROTOCOL_VERSION, 1, "h", 1, {}, b"n" * 32, b"m" * 32))
    loris.sendall(_raw_frame(len(body)))
    trickle_open = True
    for byte in body:
        try:
            loris.send(bytes([byte]))
        except OSError:
            trickle_open = False
            break
        time.sleep(0.2)
        if time.monotonic() - t0 > 6:
            break
    freed = [_closed_by_peer(loris, timeout=5)]
    # Oversized lengths before authentication: refused before any allocation.
    for length in (0xFFFFFFFF, 64 << 20, 8193):
        with _connect(srv.port) as s:
            s.sendall(_raw_frame(length) + b"x" * 1024)
            freed.append(_closed_by_peer(s, timeout=5))
    mid = wait_for(
        lambda: (s := srv.ask("stats"))["failed_handshakes"] >= before["failed_handshakes"] + 4
        and s,
        timeout=10, what="4 failed handshakes",
    )  # fmt: skip
    log = srv.stderr()

    # Phase 2: 40 connections that never send a byte, from one address: the
    # address's HANDSHAKES_PER_PEER are timed out after 1 s, the rest are
    # refused at accept.
    idle = [_idle(srv.port) for _ in range(40)]
    freed += [s is None or _closed_by_peer(s, timeout=5) for s in idle]
    elapsed = time.monotonic() - t0
    threads_peak = peak.stop()
    after = wait_for(
        lambda: (s := srv.ask("stats"))["threads"] <= before["threads"] and s,
        timeout=10, what="handshake threads to finish",
    )  # fmt: skip
    report = (
        f"{sum(freed)}/{len(freed)} hostile connections closed by the server within "
        f"{elapsed:.1f} s (trickler still sending when cut: {not trickle_open}); threads "
        f"{before['threads']} -> peak {threads_peak} -> {after['threads']}; RSS "
        f"{before['rss'] >> 10} -> {after['rss'] >> 10} KiB; fds {before['fds']} -> {after['fds']}; "
        f"timed out/malformed {before['failed_handshakes']} -> {mid['failed_handshakes']} "
        f"(phase 1) -> {after['failed_handshakes']}, refused {before['dropped_at_accept']} -> "
        f"{mid['dropped_at_accept']} -> {after['dropped_at_accept']}"
    )
    print(report)
    for s in [*idle, loris]:
        if s is not None:
            s.close()
    assert all(freed), report
    # Phase 1: each of the 4 reached its handshake and was cut by its own limit.
    assert not trickle_open, report  # cut by the 1 s handshake deadline while still sending
    assert mid["failed_handshakes"] == before["failed_handshakes"] + 4, report
    assert mid["dropped_at_accept"] == before["dropped_at_accept"], report
    assert "stalled mid-frame" in log, log[-2000:]
    assert "-byte frame (limit 8192)" in log, log[-2000:]
    # Phase 2: the 40 were timed out or refused, and at most one address's share
    # of slots was ever taken.
    phase2 = (
        after["failed_handshakes"] + after["dropped_at_accept"]
        - mid["failed_handshakes"] - mid["dropped_at_accept"]
    )  # fmt: skip
    assert phase2 == 40, report
    assert after["failed_handshakes"] - mid["failed_handshakes"] <= HANDSHAKES_PER_PEER, report
    assert threads_peak <= before["threads"] + SLOTS + 2, report
    assert after["rss"] - before["rss"] < 4 << 20, report
    assert after["fds"] <= before["fds"], report
    # A real follower still joins.
    f = _follower(srv.port)
    assert isinstance(f.join(), Welcome)
    assert srv.ask("wait 10") == {"ok": True}


def test_idle_connections_from_a_few_hosts_cannot_keep_a_follower_out(server_proc):
    # The handshake slots are shared: before the per-address cap, 9 idle
    # connections (reopened every handshake_timeout_s) held every slot of a
    # 2-rank unit and a real follower was refused until its join timed out.
    # Now each address holds at most HANDSHAKES_PER_PEER: four attacker
    # addresses hold 8 of the 9 slots, and the follower joins through the last
    # one well within its join timeout, itself far shorter than the time the
    # idle connections are allowed.
    srv = server_proc(handshake_timeout=60.0)
    before = srv.ask("stats")
    hosts = [f"127.0.0.{i}" for i in range(2, 6)]
    idle = [_idle(srv.port, host) for host in hosts for _ in range(4)]
    held = len(hosts) * HANDSHAKES_PER_PEER
    refused = len(idle) - held
    wait_for(
        lambda: srv.ask("stats")["dropped_at_accept"] >= before["dropped_at_accept"] + refused,
        timeout=10, what=f"{refused} connections refused at accept",
    )  # fmt: skip
    f = _follower(srv.port, timeout=10)
    welcome = f.join()
    # One thread per held handshake, plus the follower's control reader (its
    # handshake thread ends just after the follower's join returns).
    stats = wait_for(
        lambda: (s := srv.ask("stats"))["threads"] <= before["threads"] + held + 1 and s,
        timeout=10, what="the follower's handshake thread to end",
    )  # fmt: skip
    report = (
        f"{len(idle)} idle connections from {len(hosts)} addresses: refused at accept "
        f"{stats['dropped_at_accept'] - before['dropped_at_accept']}, threads "
        f"{before['threads']} -> {stats['threads']}; follower joined: {welcome is not None}"
    )
    print(report)
    assert isinstance(welcome, Welcome), report
    assert stats["dropped_at_accept"] - before["dropped_at_accept"] == refused, report
    assert srv.ask("wait 10") == {"ok": True}
    for s in idle:
        if s is not None:
            s.close()


# -- an on-path relay between a real leader and a real follower ----------------
class Evil:
    """A pickle whose unpickling has a visible side effect: it creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class RelayedUnit:
    """A real ControlServer and real Followers joined through an attacker's relay."""

    def __init__(self, mutate, world_size: int = 2) -> None:
        self.port = free_port_block()
        self.failures: list[tuple[int, str]] = []
        self.exits: list[tuple[int, str]] = []
        self.server = ControlServer(
            UnitConfig(control_port=self.port, join_timeout_s=10, startup_heartbeat_timeout_s=30),
            world_size,
            TEST_TOKEN.encode(),
            runtime_versions(),
            lambda rank, why: self.failures.append((rank, why)),
        )
        self.server.listen()
        self.relay = Relay(self.port, mutate)
        self.followers: list[Follower] = []

    def follower(self, rank: int = 1) -> Follower:
        f = _follower(self.relay.port, rank, exits=self.exits)
        self.followers.append(f)
        return f

    def form(self) -> Follower:
        f = self.follower()
        f.join()
        self.server.wait_for_followers(10)
        # Started before the follower heartbeats: a link that fails before the
        # start only leaves (it may rejoin); after it, it fails the unit.
        self.server.start_unit(Start("127.0.0.1", self.port + 1, "tcp://127.0.0.1:1"))
        f.start_background()
        return f

    def failure(self) -> str:
        wait_for(lambda: self.failures, timeout=10, what="the leader to fail the unit")
        rank, reason = self.failures[0]
        assert rank == 1, self.failures
        return reason

    def close(self) -> None:
        self.server.close(clean=False)
        self.relay.close()
        for f in self.followers:
            f._shutdown.set()  # stops its heartbeat thread
            if f.channel is not None:
                f.channel.close()


@pytest.fixture
def relayed():
    made: list[RelayedUnit] = []

    def make(mutate, **kw) -> RelayedUnit:
        made.append(RelayedUnit(mutate, **kw))
        return made[-1]

    yield make
    for unit in made:
        unit.close()


def _on_first(direction: str, msg_type: type, change):
    """A mutator that applies ``change(frame, state)`` to the first matching frame
    (and to later frames while ``change`` keeps returning None for them)."""
    state: dict = {"done": False}

    def mutate(d: str, frame: Frame) -> list[Frame]:
        if state["done"] or d != direction:
            return [frame]
        if "held" not in state and not isinstance(_decoded(frame), msg_type):
            return [frame]
        out = change(frame, state)
        if out is None:
            return []
        state["done"] = True
        return out

    return mutate


def _decoded(frame: Frame):
    try:
        return frame.message()
    except msgspec.DecodeError:
        return None


def _flip_last_byte(frame: Frame, _state) -> list[Frame]:
    return [Frame(frame.kind, frame.seal, frame.body[:-1] + bytes([frame.body[-1] ^ 1]))]


def _swap_with_next(frame: Frame, state) -> list[Frame] | None:
    if "held" not in state:
        state["held"] = frame
        return None
    return [frame, state["held"]]


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        (_flip_last_byte, "failed authentication"),
        (lambda f, _: [f, f], "out of sequence"),  # replayed
        (_swap_with_next, "out of sequence"),  # reordered
        (lambda f, _: [], "out of sequence"),  # dropped (the next one arrives)
        (lambda f, _: [Frame(PLAIN, b"", encode(Failure("forged by the relay"))), f], "kind 0"),
        (lambda f, _: [Frame(SEALED, f.seal, b"", claimed_len=65 << 20)], "limit"),
    ],
    ids=["flipped", "replayed", "reordered", "dropped", "forged-plain-failure", "oversized"],
)
def test_tampered_follower_frames_fail_the_link(relayed, change, expect):
    unit = relayed(_on_first(TO_LEADER, Heartbeat, change))
    unit.form()
    reason = unit.failure()
    assert "rank 1" in reason and "failed verification" in reason and expect in reason, reason
    assert "forged by the relay" not in reason
    assert unit.server.links[1].channel.sock.fileno() == -1  # the leader closed the link


def test_tampered_reply_is_never_unpickled(relayed, tmp_path):
    legit, forged = tmp_path / "unpickled-legit", tmp_path / "unpickled-forged"

    def swap_payload(frame: Frame, _state) -> list[Frame]:
        reply = frame.message()
        evil = Reply(seq=reply.seq, ok=True, payload=pickle.dumps(Evil(forged)))
        return [Frame(frame.kind, frame.seal, encode(evil))]  # the follower's MAC, kept

    tampered = _on_first(TO_LEADER, Reply, swap_payload)
    replies = {"n": 0}

    def second_reply_only(d: str, frame: Frame) -> list[Frame]:
        if d == TO_LEADER and isinstance(_decoded(frame), Reply):
            replies["n"] += 1
            if replies["n"] == 1:
                return [frame]
        return tampered(d, frame)

    unit = relayed(second_reply_only)
    f = unit.form()
    failed = lambda: unit.failures and unit.failures[0][1]  # noqa: E731
    # Control: an authenticated follower's reply is unpickled (the marker works).
    f.reply(1, ok=True, result=Evil(legit))
    (reply,) = unit.server.gather(1, 10, failed)
    decode_result(reply.payload)
    assert legit.exists()
    # Attack: the relay swaps the payload of the next reply for the same pickle.
    f.reply(2, ok=True, result="harmless")
    with pytest.raises(RuntimeError, match="failed authentication"):
        unit.server.gather(2, 10, failed)
    assert not forged.exists()
    assert unit.server.links[1].replies.empty()


@pytest.mark.parametrize(
    ("msg_type", "change"),
    [
        (Start, _flip_last_byte),
        (Heartbeat, lambda f, _: [Frame(PLAIN, b"", encode(Shutdown())), f]),
        (Heartbeat, lambda f, _: [Frame(PLAIN, b"", encode(Failure("forged"))), f]),
    ],
    ids=["flipped-start", "forged-shutdown", "forged-failure"],
)
def test_tampered_leader_frames_fail_the_follower(relayed, msg_type, change):
    unit = relayed(_on_first(TO_FOLLOWER, msg_type, change))
    f = unit.form()
    wait_for(lambda: unit.exits, timeout=10, what="the follower to give up on its leader")
    code, msg = unit.exits[0]
    assert code == ExitCode.LEADER_LOST, unit.exits
    assert "lost the leader" in msg and "forged" not in msg, msg
    assert not f._shutdown.is_set()  # a forged Shutdown is not a clean shutdown
    if msg_type is Start:
        assert f._starts.empty()


def test_tampered_or_replayed_welcome_is_not_trusted(relayed):
    recorded: dict[str, Frame] = {}

    def mutate(d: str, frame: Frame) -> list[Frame]:
        if d != TO_FOLLOWER or not isinstance(_decoded(frame), Welcome):
            return [frame]
        if "welcome" not in recorded:
            recorded["welcome"] = frame  # rank 1 joins untouched
            return [frame]
        if "replayed" not in recorded:
            recorded["replayed"] = frame
            return [recorded["welcome"]]  # rank 2 gets rank 1's Welcome
        if "flipped" not in recorded:
            recorded["flipped"] = frame
            return _flip_last_byte(frame, None)
        # A sealed frame claiming 60 MiB: the follower has not verified a
        # Welcome yet, so its limit is still the unauthenticated one.
        return [Frame(SEALED, frame.seal, b"", claimed_len=60 << 20)]

    unit = relayed(mutate, world_size=3)
    unit.follower(1).join()
    for expect in ("failed authentication", "failed authentication", "limit 8192"):
        f = unit.follower(2)
        with pytest.raises(AuthError, match="could not prove it holds the unit token") as e:
            f.join()
        assert expect in str(e.value)
        assert f.channel is None
    assert sorted(unit.server.links) == [1]
    # The real rank 2 joins once the relay stops interfering.
    unit.relay.mutate = lambda d, frame: [frame]
    unit.follower(2).join()
    unit.server.wait_for_followers(10)


def test_timed_out_send_closes_the_link_as_lost_not_tampered(relayed):
    # A peer that stops reading (stopped, hung, or a path that stalls) makes a
    # send time out with part of its frame on the wire. Before, the channel
    # stayed open and the heartbeat loop kept sending behind the half frame, so
    # the follower later read an oversized or out-of-sequence frame and the unit
    # failed as if tampered with; meanwhile the leader, still getting the
    # follower's heartbeats, did not notice at all. Now the link is closed at
    # once and both ends report a lost connection.
    stall, stalled = threading.Event(), threading.Event()
    release = threading.Event()

    def stop_reading_the_leader(d: str, frame: Frame) -> list[Frame]:
        if d == TO_FOLLOWER and stall.is_set():
            stalled.set()
            release.wait(30)  # the relay stops reading the leader's socket
        return [frame]

    unit = relayed(stop_reading_the_leader)
    unit.form()
    link = unit.server.links[1]
    stall.set()
    wait_for(stalled.is_set, timeout=10, what="the next leader heartbeat to stall the relay")
    # Larger than every socket buffer on the way (loopback autotuning stays
    # below 16 MiB), so the send cannot complete while nobody reads.
    big = Reply(seq=1, ok=True, payload=b"x" * (24 << 20))
    with pytest.raises(LinkBroken, match="closed after a failed send"):
        link.channel.send(big, timeout=0.5)
    assert link.channel.sock.fileno() == -1
    with pytest.raises(LinkBroken):  # the heartbeat loop's next beat goes nowhere
        link.channel.send(Heartbeat("ready", 0), timeout=0.5)
    reason = unit.failure()
    assert "is unreachable" in reason and "failed send" in reason, reason
    assert "failed verification" not in reason, reason
    # The follower, once the path moves again, reads the frames that were
    # complete and then the end of the stream: a lost leader, not a forged frame.
    release.set()
    wait_for(lambda: unit.exits, timeout=10, what="the follower to give up on its leader")
    code, msg = unit.exits[0]
    assert code == ExitCode.LEADER_LOST, unit.exits
    assert "lost the leader" in msg, msg
    for tampering in ("limit", "authentication", "out of sequence", "kind"):
        assert tampering not in msg, msg
