"""The Gloo control broadcast between two real ranks (threads of this process)."""

from __future__ import annotations

import threading

import pytest

from neuron_serving.unit.broadcast import KIND_CALL, BroadcastError, ControlBroadcast, make_group
from tests.procs import free_port_block


def _pair(key0=b"k" * 32, key1=b"k" * 32, inline=1024):
    port = free_port_block()
    groups = {}

    def mk(rank):
        groups[rank] = make_group(
            rank=rank,
            world_size=2,
            store_host="127.0.0.1",
            store_port=port,
            local_host="127.0.0.1",
            timeout_s=20,
            is_master=rank == 0,
        )

    t = threading.Thread(target=mk, args=(1,))
    t.start()
    mk(0)
    t.join(timeout=30)
    return (
        ControlBroadcast(groups[0], 0, key0, inline),
        ControlBroadcast(groups[1], 1, key1, inline),
    )


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
