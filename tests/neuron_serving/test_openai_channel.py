"""The OpenAI channel's handshake and framing (both ends use these functions)."""

from __future__ import annotations

import msgspec
import pytest

from neuron_serving import openai_channel as oc

TOKEN = b"t" * 32


def test_handshake_proves_both_sides() -> None:
    greeting, leader_nonce = oc.hello()
    assert len(greeting) == oc.HELLO_BYTES and greeting.startswith(oc.MAGIC)
    proof, seen_nonce, proxy_nonce = oc.prove(TOKEN, greeting)
    assert seen_nonce == leader_nonce and len(proof) == oc.PROOF_BYTES
    answer = oc.check_proof(TOKEN, leader_nonce, proof)
    oc.check_leader(TOKEN, leader_nonce, proxy_nonce, answer)


def test_a_wrong_token_fails_either_way() -> None:
    greeting, leader_nonce = oc.hello()
    proof, _, proxy_nonce = oc.prove(b"x" * 32, greeting)
    with pytest.raises(oc.ChannelError, match="did not prove"):
        oc.check_proof(TOKEN, leader_nonce, proof)
    # A stranger posing as a leader cannot answer a real proxy's proof either.
    proof, _, proxy_nonce = oc.prove(TOKEN, greeting)
    fake_answer = oc.check_proof(b"y" * 32, leader_nonce, oc.prove(b"y" * 32, greeting)[0])
    with pytest.raises(oc.ChannelError, match="leader did not prove"):
        oc.check_leader(TOKEN, leader_nonce, proxy_nonce, fake_answer)


def test_a_proof_is_bound_to_its_nonces() -> None:
    """A recorded proof does not verify against another connection's leader nonce."""
    greeting, _ = oc.hello()
    proof, _, _ = oc.prove(TOKEN, greeting)
    _, other_nonce = oc.hello()
    with pytest.raises(oc.ChannelError):
        oc.check_proof(TOKEN, other_nonce, proof)


@pytest.mark.parametrize("hello", [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 12,
                                   b"NSOAIC01" + b"n" * 31,
                                   b"NSOAIC02" + b"n" * 32])  # fmt: skip
def test_a_peer_that_is_not_a_leader_is_refused(hello: bytes) -> None:
    """Also a leader of an older wire version (02: no KV messages), whose proxy would
    fail on the first KV message instead: it uses Triton."""
    with pytest.raises(oc.ChannelError, match="not a leader"):
        oc.prove(TOKEN, hello)


def test_frames_survive_any_split() -> None:
    payloads = [b"", b"a", b"x" * 70000, msgspec.msgpack.encode([1, 2, 3])]
    stream = b"".join(oc.frame(p) for p in payloads)
    for step in (1, 3, 4, 5, 1000, len(stream)):
        reader = oc.FrameReader(1 << 20)
        got = []
        for at in range(0, len(stream), step):
            got += reader.feed(stream[at : at + step])
        assert got == payloads and reader.buffered == 0


def test_a_hostile_length_is_refused_before_buffering() -> None:
    reader = oc.FrameReader(1024)
    with pytest.raises(oc.ChannelError, match="4294967295-byte frame"):
        reader.feed(b"\xff\xff\xff\xff" + b"x" * 10)
    assert oc.FrameReader(1024).feed((1024).to_bytes(4, "big")) == []  # at the bound: waits


def test_event_final_and_compact_encoding() -> None:
    assert not oc.Event(1, b"data: x\n\n", status=200).final
    assert oc.Event(1, finish_reason="stop").final
    assert oc.Event(1, status=400).final
    assert oc.Event(1, error="unavailable", error_code="UNAVAILABLE").final
    # An array on the wire (no field names): a middle event is its tag (0, one
    # byte), the id, the body and one byte per absent field.
    middle = msgspec.msgpack.encode(oc.Event(7, b"data: {}\n\n"))
    assert msgspec.msgpack.decode(middle) == [0, 7, b"data: {}\n\n"] + [None] * 11
    decoded = msgspec.msgpack.decode(middle, type=oc.Event)
    assert decoded.id == 7 and decoded.status is None


def test_events_and_loads_share_the_leaders_frames() -> None:
    messages = [oc.Event(3, b"x", finish_reason="stop"), oc.Load(5, 2, 0.375, 8)]
    raw = msgspec.msgpack.encode(messages)
    assert msgspec.msgpack.decode(raw)[1] == [1, 5, 2, 0.375, 8, 0, []]  # tag 1, then the fields
    decoded = msgspec.msgpack.decode(raw, type=oc.ToProxy)
    assert decoded == messages and type(decoded[1]) is oc.Load
    assert not oc.Event(3).final  # Load has no ``final``; it is not a call's


@pytest.mark.parametrize(
    "hostile",
    [
        [[7, b"untagged event"]],  # the format before tags: refused, not misread
        [[9, 1, 2]],  # an unknown tag
        [[1, "five", 2, 0.5, 8]],  # a Load with a string for a count
        [[1, 5, 2, 0.5]],  # a Load missing a field
        [["load", 5, 2, 0.5, 8]],  # a string tag
        {"running": 5},  # not a list of messages
    ],
)
def test_messages_to_the_proxy_are_typed(hostile) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(hostile), type=oc.ToProxy)


def test_trailing_fields_are_ignored_as_msgspec_does_for_every_message() -> None:
    """A later wire version may append fields to a message; this one reads its own."""
    raw = msgspec.msgpack.encode([[1, 5, 2, 0.5, 8, 36, [1], "a later field"]])
    assert msgspec.msgpack.decode(raw, type=oc.ToProxy) == [oc.Load(5, 2, 0.5, 8, 36, (1,))]
    # A leader from before degraded_ranks: its Load reads with none.
    older = msgspec.msgpack.encode([[1, 5, 2, 0.5, 8, 36]])
    assert msgspec.msgpack.decode(older, type=oc.ToProxy)[0].degraded_ranks == ()


def test_the_proxys_frame_bound_holds() -> None:
    reader = oc.FrameReader(oc.MAX_TO_PROXY)
    with pytest.raises(oc.ChannelError, match="-byte frame"):
        reader.feed((oc.MAX_TO_PROXY + 1).to_bytes(4, "big"))


def test_messages_to_the_leader_are_typed() -> None:
    raw = msgspec.msgpack.encode([oc.Open(1, b"{}"), oc.Cancel(1)])
    assert msgspec.msgpack.decode(raw, type=oc.ToLeader) == [oc.Open(1, b"{}"), oc.Cancel(1)]
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode([["exec", "rm -rf /"]]), type=oc.ToLeader)


def test_the_token_comes_from_the_environment_or_a_private_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NEURON_SERVING_CHANNEL_TOKEN", "e" * 30)
    assert oc.resolve_token() == b"e" * 30
    monkeypatch.delenv("NEURON_SERVING_CHANNEL_TOKEN")
    monkeypatch.setenv("NEURON_SERVING_CHANNEL_TOKEN_FILE", str(tmp_path / "short"))
    (tmp_path / "short").write_text("short\n")
    with pytest.raises(Exception, match="channel token .* shorter than"):
        oc.resolve_token()


def test_an_uncreatable_default_token_file_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """No token anywhere and no writable home (a read-only container): a SecretError
    naming the file, which the proxy and the leader turn into "channel off"."""
    from neuron_serving.secret_file import SecretError

    home = tmp_path / "not-a-directory"
    home.write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("NEURON_SERVING_CHANNEL_TOKEN", raising=False)
    monkeypatch.delenv("NEURON_SERVING_CHANNEL_TOKEN_FILE", raising=False)
    with pytest.raises(SecretError, match="cannot create channel token file .*channel-token"):
        oc.resolve_token()


def test_generate_priority_is_a_compatible_trailing_field() -> None:
    """``Generate.priority`` (the traffic class) was appended with a default: a
    three-field Generate from an older proxy decodes as priority 0, and a leader that
    predates the field reads the first three and ignores it."""

    class OldGenerate(msgspec.Struct, tag="generate", array_like=True, frozen=True):
        id: int
        text_input: str
        sampling_parameters: str

    decoder = msgspec.msgpack.Decoder(oc.ToLeader)
    old = decoder.decode(msgspec.msgpack.encode([OldGenerate(1, "hi", "{}")]))
    assert old == [oc.Generate(1, "hi", "{}", 0)]
    new = msgspec.msgpack.encode([oc.Generate(2, "hi", "{}", 2)])
    assert decoder.decode(new)[0].priority == 2
    older = msgspec.msgpack.Decoder(list[oc.Open | OldGenerate | oc.Cancel])
    assert older.decode(new) == [OldGenerate(2, "hi", "{}")]


def test_the_kv_stream_shares_the_leaders_frames() -> None:
    info = oc.KvInfo(41, 16, "sha256", "vllm-none-hash", b"h" * 32, True, 1024)
    messages = [info, oc.KvEvents(42, b"\x93\xcb"), oc.KvReplayMiss(3, 40), oc.Load(1, 0, 0.5, 8)]
    raw = msgspec.msgpack.encode(messages)
    assert [m[:2] for m in msgspec.msgpack.decode(raw)] == [[2, 41], [3, 42], [4, 3], [1, 1]]
    assert msgspec.msgpack.decode(raw, type=oc.ToProxy) == messages
    # A seed vLLM drew at random: no seed, no NONE_HASH to announce.
    unknown = oc.KvInfo(-1, 16, "xxhash", None, None, True, 1024)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([unknown]), type=oc.ToProxy) == [unknown]


@pytest.mark.parametrize(
    "hostile",
    [
        [[3, "seven", b"x"]],  # a seq that is not an int
        [[3, 7, "not bytes"]],  # a payload that is not bytes
        [[2, 0, 16, "sha256"]],  # a KvInfo missing fields
    ],
)
def test_kv_messages_to_the_proxy_are_typed(hostile) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(hostile), type=oc.ToProxy)


def test_a_replay_request_is_bounded_as_vllms_8_byte_seq() -> None:
    decoder = msgspec.msgpack.Decoder(oc.ToLeader)
    ok = decoder.decode(msgspec.msgpack.encode([oc.KvReplay(0), oc.KvReplay((1 << 63) - 1)]))
    assert ok == [oc.KvReplay(0), oc.KvReplay((1 << 63) - 1)]
    for bad in (-1, 1 << 63, (1 << 64) - 1, "5", None):
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(msgspec.msgpack.encode([["kv_replay", bad]]))


def test_event_cached_tokens_is_a_compatible_trailing_field() -> None:
    """``Event.cached_tokens`` (vLLM's prefix cache hit, on a call's last event) was
    appended with a default, so the magic did not change: an event of a leader that
    predates it decodes with None, and a proxy that predates it reads the fields it
    knows."""
    decoder = msgspec.msgpack.Decoder(oc.ToProxy)
    fields = [0, 4, b"", None, "stop", None, None, 3, 1, None, None, None, None]
    (old,) = decoder.decode(msgspec.msgpack.encode([fields]))
    assert old.finish_reason == "stop" and old.cached_tokens is None
    event = oc.Event(4, finish_reason="stop", prompt_tokens=3, completion_tokens=1)
    event.cached_tokens = 2
    new = msgspec.msgpack.encode([event])
    assert msgspec.msgpack.decode(new)[0] == [*fields, 2]
    assert decoder.decode(new)[0].cached_tokens == 2

    class Older(msgspec.Struct, tag=0, array_like=True):  # the fields an old proxy knows
        id: int
        body: bytes
        status: int | None
        finish_reason: str | None

    assert msgspec.msgpack.decode(new, type=list[Older]) == [Older(4, b"", None, "stop")]


def test_a_load_without_num_blocks_and_one_with_it_both_decode() -> None:
    """``Load.num_blocks`` was added last with a default: a leader of the previous
    version (4 fields) and a proxy of the previous version (reading 5) still agree."""

    class OldLoad(msgspec.Struct, tag=1, array_like=True, frozen=True):
        running: int
        waiting: int
        kv_usage: float
        max_num_seqs: int

    new = msgspec.msgpack.Decoder(oc.ToProxy)
    old = msgspec.msgpack.Decoder(list[OldLoad])
    assert new.decode(msgspec.msgpack.encode([OldLoad(1, 2, 0.5, 8)])) == [oc.Load(1, 2, 0.5, 8, 0)]
    assert old.decode(msgspec.msgpack.encode([oc.Load(1, 2, 0.5, 8, 36)])) == [
        OldLoad(1, 2, 0.5, 8)
    ]
