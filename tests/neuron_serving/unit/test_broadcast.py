"""The Gloo control broadcast between two real ranks (threads of this process)."""

from __future__ import annotations

import threading

import psutil
import pytest

from neuron_serving.unit import auth
from neuron_serving.unit.broadcast import (
    HEADER,
    KIND_CALL,
    MAGIC,
    WIRE_VERSION,
    BroadcastError,
    ControlBroadcast,
    GroupAddress,
    make_group,
    open_control_broadcast,
)
from tests.procs import free_port_block


def _both_ranks(make):
    """``make(rank, where)`` on both ranks at once: a group forms only when both join."""
    where = GroupAddress(2, "127.0.0.1", free_port_block(), "127.0.0.1")
    ends = {}
    t = threading.Thread(target=lambda: ends.setdefault(1, make(1, where)))
    t.start()
    ends[0] = make(0, where)
    t.join(timeout=30)
    return ends[0], ends[1]


def _pair(key0=b"k" * 32, key1=b"k" * 32, inline=1024):
    def end(rank, where):
        group = make_group(rank, where, timeout_s=20)
        return ControlBroadcast(group, rank, (key0, key1)[rank], inline)

    return _both_ranks(end)


def _exchange(sender, receiver, payloads):
    got, errors = [], []

    def recv():
        try:
            for _ in payloads:
                got.append(receiver.recv())
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    t = threading.Thread(target=recv)
    t.start()
    for p in payloads:
        sender.send(KIND_CALL, p)
    t.join(timeout=30)
    assert not t.is_alive()
    return got, errors


def test_inline_and_overflow_messages_roundtrip():
    leader, follower = _pair()
    payloads = [b"", b"small", bytes(range(256)) * 3, b"x" * 100_000]
    got, errors = _exchange(leader, follower, payloads)
    assert not errors
    assert [g[2] for g in got] == payloads
    assert [g[1] for g in got] == [1, 2, 3, 4]
    # One Gloo broadcast per small message, a second only for the large one.
    assert leader.stats.wire_bytes == 4 * 1024 + (100_000 - (1024 - 56))


def test_message_with_wrong_key_is_refused_before_decoding():
    leader, follower = _pair(key0=b"a" * 32, key1=b"b" * 32)
    got, errors = _exchange(leader, follower, [b"cos\nsystem\n(S'echo pwned'\ntR."])
    assert not got
    assert isinstance(errors[0], BroadcastError) and "failed authentication" in str(errors[0])


def test_replayed_sequence_is_refused():
    leader, follower = _pair()
    _exchange(leader, follower, [b"one"])
    leader._seq = 0  # a replay of seq 1
    got, errors = _exchange(leader, follower, [b"one"])
    assert isinstance(errors[0], BroadcastError) and "out of order" in str(errors[0])


def test_only_leader_sends():
    leader, follower = _pair()
    with pytest.raises(AssertionError):
        follower.send(KIND_CALL, b"x")


def test_oversized_length_in_header_is_refused_before_allocation():
    # A forged first frame announcing 1 GiB: the follower must refuse it from the
    # header alone, not allocate the rest and wait for a second broadcast.
    leader, follower = _pair()
    follower.max_payload = 1 << 20
    announced = 1 << 30
    forged = HEADER.pack(MAGIC, WIRE_VERSION, KIND_CALL, 1, announced, b"\0" * 32)
    view = leader._buf.numpy()
    view[: HEADER.size] = memoryview(forged)
    rss_before = psutil.Process().memory_info().rss
    errors = []

    def recv():
        try:
            follower.recv()
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=recv)
    t.start()
    leader._bcast(leader._buf)
    t.join(timeout=30)
    assert not t.is_alive(), "the follower waited for the announced second broadcast"
    grown = psutil.Process().memory_info().rss - rss_before
    assert isinstance(errors[0], BroadcastError) and "over the limit" in str(errors[0]), errors
    assert grown < 64 << 20, f"RSS grew {grown >> 20} MiB for a {announced >> 20} MiB header"


def test_leader_refuses_to_send_over_the_limit_and_stays_in_lockstep():
    leader, follower = _pair()
    leader.max_payload = follower.max_payload = 4096
    with pytest.raises(BroadcastError, match="exceeds the limit"):
        leader.send(KIND_CALL, b"x" * 4097)
    # Nothing went on the wire: the next message is seq 1 and arrives intact.
    got, errors = _exchange(leader, follower, [b"y" * 4096])
    assert not errors and got == [(KIND_CALL, 1, b"y" * 4096)]


def test_leader_store_listens_on_the_store_host_only():
    leader, _ = _pair()
    port = leader._store.port
    listening = [
        c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN
    ]
    mine = [a for a in listening if a.port == port]
    assert [a.ip for a in mine] == ["127.0.0.1"], f"store port {port} listens on {mine}"


def _session_pair(nonce0: bytes, nonce1: bytes):
    """Both ends as the executor and the follower's worker loop open them."""
    return _both_ranks(
        lambda rank, where: open_control_broadcast(
            rank, where, auth.broadcast_key(b"t" * 32, (nonce0, nonce1)[rank]), 1024
        )
    )


def test_ranks_of_one_session_exchange_and_another_session_is_refused():
    leader, follower = _session_pair(b"n" * 16, b"n" * 16)
    got, errors = _exchange(leader, follower, [b"step"])
    assert not errors and got == [(KIND_CALL, 1, b"step")]
    leader, stranger = _session_pair(b"n" * 16, b"m" * 16)
    got, errors = _exchange(leader, stranger, [b"step"])
    assert not got
    assert isinstance(errors[0], BroadcastError) and "failed authentication" in str(errors[0])
