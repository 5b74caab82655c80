"""The leader's OpenAI channel: one multiplexed connection per proxy and leader.

Why it exists (measured in bench/README.md, "cpu"): over
Triton's per-request streams the proxy pays one upstream message per token per
stream, each with its own wake-up, read and parse, and a request set-up per
request (an HTTP/2 call or an HTTP/1.1 request). vLLM's own API server receives one
message per engine step for all its requests. On this channel the leader sends,
per iteration of its engine loop (one engine step's outputs for every stream), one
frame with every stream's events; the proxy opens a request with one small frame
on a connection it already holds.

Both ends import this module (the leader's ``triton/channel_server.py``, the
proxy's ``upstream/channel.py``): the handshake, the framing and the typed messages
are defined once.

Handshake (mutual proof of the channel token, which never crosses the wire; fixed
sizes, so nothing from an unauthenticated peer is parsed or sized by it)::

    leader -> proxy   MAGIC (8 bytes) + leader nonce (32)
    proxy  -> leader  proxy nonce (32) + HMAC(token, "client", both nonces) (32)
    leader -> proxy   HMAC(token, "server", both nonces) (32)

Then frames in both directions: a 4-byte big-endian length, then that many bytes
of msgpack. A length above the receiver's bound ends the connection before anything
is allocated. Proxy -> leader: a list of ``Open`` (an OpenAI call), ``Generate`` (a
text request of Triton's generate route), ``Cancel`` and ``KvReplay``; leader -> proxy:
a list of ``Event`` (one response of one call), ``Progress`` (a call that has sent
nothing for ``PROGRESS_INTERVAL_S`` is still held by the leader), ``Load`` (the unit's
engine load: sent right after the handshake, then when it changes, at most every
~100 ms, and again unchanged every ~2 s) and the KV cache event stream (``KvInfo``, ``KvEvents``,
``KvReplayMiss``; below). Every message is a tagged msgpack array (the tag first),
decoded into these types only.

KV cache events (``triton/kv_events_relay.py``): the leader's vLLM publishes its
prefix cache's block events (``vllm/distributed/kv_events.py``, ``KVEventBatch``) on a
ZMQ socket in the leader's private directory; the leader relays each batch to every
connected proxy as ``KvEvents(seq, payload)``: the publisher's sequence number and
vLLM's msgpack bytes, unchanged. The stream, per connection:

- ``KvInfo`` first, right after the handshake (before any ``KvEvents``; a leader with
  KV events off sends none): how the engine hashes blocks and the newest ``seq`` the
  leader has relayed, so the proxy knows where the live stream starts;
- then ``KvEvents`` in increasing ``seq``. A jump is a gap (the proxy read too slowly
  and the leader dropped events for it, or the leader itself missed some);
- ``KvReplay(from_seq)`` (proxy -> leader) asks for the events from ``from_seq`` on:
  the leader sends, in order, a ``KvReplayMiss`` if ``from_seq`` is no longer in
  vLLM's replay buffer (the proxy resets that unit's index), every buffered event from
  ``from_seq`` (or the oldest it still holds) to the newest, then live events after
  the last one replayed. So a proxy that applies an event only when its ``seq`` is
  the next one expected, skips older ones, and on a newer one asks for a replay from
  the one it expects, applies every event exactly once and in order
  (``proxy/upstream/kv_stream.py``, ``InOrderKvSink``).
Frames after the handshake carry no MAC: the channel has the
trust of the leader's Triton inference API (reachable on the same address, with no
key at all); the handshake keeps strangers off it.

The token: ``NEURON_SERVING_CHANNEL_TOKEN``, else ``NEURON_SERVING_CHANNEL_TOKEN_FILE``,
else ``~/.config/neuron-serving/channel-token`` (``secret_file.py``; processes of
one user on one host share it with no setup). A proxy that cannot prove it uses
Triton's transport instead.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path
from typing import Annotated, final

import msgspec

from neuron_serving import envs
from neuron_serving.secret_file import resolve_secret

# The version is in the magic: a peer of another wire version fails the handshake
# ("bad hello") and the proxy uses Triton for it, instead of failing on a frame.
# 02: leader -> proxy messages are tagged (``Load`` joined ``Event``).
# 03: the KV cache event stream (``KvInfo``, ``KvEvents``, ``KvReplayMiss``,
# ``KvReplay``): a peer of 02 would fail on the first of them, so it fails the
# handshake instead and uses Triton.
# 04: ``Progress``, the leader's word that a call it holds is alive although it has
# nothing to send yet; a proxy of 03 would fail on it.
MAGIC = b"NSOAIC04"
NONCE_BYTES = 32
MAC_BYTES = 32
HELLO_BYTES = len(MAGIC) + NONCE_BYTES  # leader -> proxy
PROOF_BYTES = NONCE_BYTES + MAC_BYTES  # proxy -> leader
HANDSHAKE_TIMEOUT_S = 5.0
# A request that has sent nothing for this long gets a progress report (``Progress`` on
# the channel, a ``progress`` response over Triton): the default of the leader's
# ``NEURON_SERVING_PROGRESS_INTERVAL_S``. A proxy's silence budget
# (``timeouts.silence_s``, 30 s by default) must be several of these.
PROGRESS_INTERVAL_S = 2.0
LENGTH_BYTES = 4
# Proxy -> leader: an envelope is at most MAX_ENVELOPE_BYTES (64 MiB, the leader's
# bound on ``openai_request``) plus msgpack framing. Leader -> proxy: one event is
# one response body; a non-streamed answer with n > 1 or logprobs of thousands of
# tokens is megabytes, and several streams' events share a frame.
MAX_TO_LEADER = (64 << 20) + (64 << 10)
MAX_TO_PROXY = 256 << 20
# The largest KV event batch (vLLM's msgpack bytes) a leader relays. One batch is one
# engine step's block events: a step's stored blocks carry their token ids (at most
# max_num_batched_tokens of them) and a step's evictions their hashes (at most the
# cache's blocks), so real batches are kilobytes to a few megabytes; a larger one is
# dropped, and the proxies told (``KvReplayMiss``), rather than buffered.
MAX_KV_PAYLOAD = 16 << 20
DEFAULT_TOKEN_FILE = Path("~/.config/neuron-serving/channel-token")
# The model config parameter that announces the channel's port (read by the
# proxy's probes with the checkpoint version; the host is the leader's).
CONFIG_PARAMETER = "openai_channel_port"


class ChannelError(Exception):
    """The peer broke the protocol or failed the handshake."""


def resolve_token() -> bytes:
    return resolve_secret(
        "channel token",
        envs.NEURON_SERVING_CHANNEL_TOKEN,
        "NEURON_SERVING_CHANNEL_TOKEN",
        envs.NEURON_SERVING_CHANNEL_TOKEN_FILE,
        DEFAULT_TOKEN_FILE,
    )


def _mac(token: bytes, role: bytes, leader_nonce: bytes, proxy_nonce: bytes) -> bytes:
    return hmac.new(
        token, b"neuron-serving/openai-channel/v1 " + role + leader_nonce + proxy_nonce,
        hashlib.sha256,
    ).digest()  # fmt: skip


def hello() -> tuple[bytes, bytes]:
    """Leader: (the bytes to send first, its nonce)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return MAGIC + nonce, nonce


def prove(token: bytes, hello_bytes: bytes) -> tuple[bytes, bytes, bytes]:
    """Proxy: the leader's hello -> (the proof to send, leader nonce, proxy nonce)."""
    if len(hello_bytes) != HELLO_BYTES or not hello_bytes.startswith(MAGIC):
        raise ChannelError("the peer is not a leader's OpenAI channel (bad hello)")
    leader_nonce = hello_bytes[len(MAGIC) :]
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + _mac(token, b"client", leader_nonce, nonce), leader_nonce, nonce


def check_proof(token: bytes, leader_nonce: bytes, proof: bytes) -> bytes:
    """Leader: the proxy's proof -> the leader's own proof to send back; raises
    ``ChannelError`` for a wrong one (compared in constant time)."""
    nonce, tag = proof[:NONCE_BYTES], proof[NONCE_BYTES:]
    if len(proof) != PROOF_BYTES or not hmac.compare_digest(
        tag, _mac(token, b"client", leader_nonce, nonce)
    ):
        raise ChannelError("the peer did not prove the channel token")
    return _mac(token, b"server", leader_nonce, nonce)


def check_leader(token: bytes, leader_nonce: bytes, proxy_nonce: bytes, tag: bytes) -> None:
    """Proxy: the leader's proof, so a stranger cannot pose as a leader."""
    if not hmac.compare_digest(tag, _mac(token, b"server", leader_nonce, proxy_nonce)):
        raise ChannelError("the leader did not prove the channel token")


# ---- messages ------------------------------------------------------------------------


class Open(msgspec.Struct, tag="open", array_like=True, frozen=True):
    """Start one OpenAI call. ``id``: the proxy's, unique on its connection.
    ``envelope``: the ``openai_request`` envelope (UTF-8 JSON,
    ``triton/openai_envelope.py``), exactly as Triton's input carries it."""

    id: int
    envelope: bytes


class Generate(msgspec.Struct, tag="generate", array_like=True, frozen=True):
    """Start one text request of Triton's generate route: vllm_backend's inputs as
    the proxy sends them over Triton (``stream`` and ``exclude_input_in_output``
    always true). ``sampling_parameters``: a JSON object, as Triton's input.
    ``priority``: the ``priority`` input, vLLM's request priority (the traffic class;
    the leader refuses one outside [0, 16) as that input's, with INVALID_ARG for the
    call, not by dropping the connection). Appended with a default: a proxy that
    sends the three fields before it asks for 0, and a leader that predates it
    ignores it (msgspec ignores an array-like struct's extra trailing elements)."""

    id: int
    text_input: str
    sampling_parameters: str
    priority: int = 0


class Cancel(msgspec.Struct, tag="cancel", array_like=True, frozen=True):
    """The client went away: abort the call (vLLM frees its KV blocks)."""

    id: int


class KvReplay(msgspec.Struct, tag="kv_replay", array_like=True, frozen=True):
    """Resend the KV event batches from ``from_seq`` on (see the module's KV section).
    A request while one of this connection's is pending merges into it (the lower
    ``from_seq`` wins); the leader serves one replay at a time."""

    # vLLM's replay request is the seq as 8 bytes, big-endian (ZmqEventPublisher).
    from_seq: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


ToLeader = list[Open | Generate | Cancel | KvReplay]


# The messages to the proxy are final: it tells them apart by exact class
# (proxy/upstream/channel.py), which a type checker narrows only for final classes.
@final
class Event(msgspec.Struct, tag=0, array_like=True):
    """One response of one call: the fields of the Triton ``llm`` model's outputs
    (the OpenAI path's ``openai_status``, ``openai_body``, ``token_ids``...; a text
    request's ``text_output`` as ``body``, UTF-8; the same first/middle/last rules),
    or an error. A call's last event has a ``finish_reason``, a non-200 ``status``
    or an ``error``."""

    id: int
    body: bytes = b""
    status: int | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    model_version: str | None = None
    logprobs: list[float] | None = None  # text requests that asked for them
    # A Triton error's message and code name (UNAVAILABLE, INVALID_ARG, CANCELLED,
    # INTERNAL): the same errors the Triton transports carry, classified alike.
    error: str | None = None
    error_code: str | None = None
    # The prompt tokens vLLM found in its prefix cache for this call
    # (``RequestOutput.num_cached_tokens``, vllm/outputs.py), on the last event only;
    # None: not one fresh prompt (a resumed call, batched prompts) or not known. The
    # proxy compares it with the hit it predicted when routing (proxy/routing/kv/accuracy.py).
    # Appended with a default, so the magic stays: a proxy that predates it ignores
    # the extra trailing element (msgspec ignores an array-like struct's extra
    # trailing elements), and a leader that predates it sends none (None).
    cached_tokens: int | None = None

    @property
    def final(self) -> bool:
        return (
            self.finish_reason is not None
            or self.error is not None
            or (self.status is not None and self.status != 200)
        )


@final
class Progress(msgspec.Struct, tag=5, array_like=True, frozen=True):
    """Call ``id`` is alive on the leader: its engine request is queued or running, but
    it has produced nothing to send for ``PROGRESS_INTERVAL_S`` (a prompt waiting for
    its turn, a non-streamed answer being generated, a stream held back by a tool-call
    or structured-output buffer). So a call's silence can only mean a leader that is
    gone or stuck, never a long answer (``triton/progress.py``)."""

    id: int


@final
class Load(msgspec.Struct, tag=1, array_like=True, frozen=True):
    """The unit's load, from its leader's vLLM scheduler stats (the proxy keeps it as
    ``registry.EngineLoad``). Counts every request the engine holds, whichever proxy
    (or Triton client) sent it; ``kv_usage`` is the fraction of KV cache blocks in
    use, 0..1; ``max_num_seqs`` the engine's bound on running sequences, ``num_blocks`` its KV
    cache size in blocks. Sent when it
    changes (at most every ``LOAD_INTERVAL_S``) and, unchanged, every
    ``LOAD_REFRESH_S`` (``triton/channel_server.py``)."""

    running: int
    waiting: int
    kv_usage: float
    max_num_seqs: int
    # The engine's KV cache size in blocks (vLLM's num_gpu_blocks; 0 = unknown). Last
    # and defaulted: msgspec fills a missing trailing field of an array-like struct
    # with its default and ignores an extra one, so leaders and proxies of either
    # version understand each other.
    num_blocks: int = 0
    # Ranks the leader judges persistently slower than their peers (unit/straggler.py),
    # trailing and defaulted as num_blocks is.
    degraded_ranks: tuple[int, ...] = ()


@final
class KvInfo(msgspec.Struct, tag=2, array_like=True, frozen=True):
    """What a proxy needs to hash prompts as this leader's vLLM hashes blocks, and
    where the KV event stream starts. Sent once, right after the handshake, before any
    ``KvEvents``; only by a leader that relays KV events.

    vLLM's block hash (``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``): block
    i of a prompt (``block_size`` tokens, full blocks only) is
    ``hash_fn((parent, tuple(token_ids), extra_keys))``, where ``parent`` is block
    i-1's hash and, for block 0, ``none_hash`` (= ``hash_fn(none_hash_seed)``), and
    ``extra_keys`` is None for a plain text prompt (LoRA, multimodal inputs and
    ``cache_salt`` add keys). ``hash_fn`` is ``hash_algo``
    (``vllm/utils/hashing.py``: ``sha256`` = SHA-256 of ``pickle.dumps(x,
    protocol=pickle.HIGHEST_PROTOCOL)``, ``sha256_cbor`` = SHA-256 of canonical CBOR,
    ``xxhash``/``xxhash_cbor`` the same with xxh3_128). With ``int_block_hashes``
    (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default) the events carry
    each hash as the digest's low 64 bits, big-endian, as an int
    (``maybe_convert_block_hash``); the chain itself uses the full digest.

    ``none_hash_seed``/``none_hash`` None: the engine drew a random seed of its own
    (an ``xxhash`` algorithm without ``PYTHONHASHSEED``; ``resolve_none_hash_seed``),
    so its hashes cannot be reproduced; the events still say which blocks exist.
    ``seq``: the newest batch the leader has relayed (-1: none yet).
    ``buffer_steps``: how many of the newest batches a ``KvReplay`` can still get."""

    seq: int
    block_size: int
    hash_algo: str
    none_hash_seed: str | None
    none_hash: bytes | None
    int_block_hashes: bool
    buffer_steps: int


@final
class KvEvents(msgspec.Struct, tag=3, array_like=True, frozen=True):
    """One of vLLM's KV event batches: ``seq``, the publisher's sequence number, and
    ``payload``, the msgpack bytes of its ``KVEventBatch`` exactly as vLLM published them
    (``vllm/distributed/kv_events.py``; decode with ``msgspec.msgpack.Decoder(
    KVEventBatch)`` or an equivalent schema: an array ``[ts, events, dp_rank]`` whose
    events are tagged arrays ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``)."""

    seq: int
    payload: bytes


@final
class KvReplayMiss(msgspec.Struct, tag=4, array_like=True, frozen=True):
    """The batches from ``from_seq`` up to ``oldest_seq - 1`` cannot be delivered: a
    ``KvReplay`` asked for batches vLLM's replay buffer no longer holds, a batch was
    over ``MAX_KV_PAYLOAD``, or the replay endpoint did not answer (``oldest_seq`` -1:
    unknown). The proxy's index of the unit misses them: reset it, then take what
    follows as a fresh start."""

    from_seq: int
    oldest_seq: int


# Integer tags (``Event`` 0, ``Load`` 1, the KV stream 2-4, ``Progress`` 5): one byte
# per message, and events are one per stream per engine step.
ToProxy = list[Event | Load | KvInfo | KvEvents | KvReplayMiss | Progress]


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(LENGTH_BYTES, "big") + payload


class FrameReader:
    """Cuts a byte stream into frames. The length prefix is checked against ``limit``
    before the frame is buffered, so a hostile length allocates nothing."""

    __slots__ = ("_buf", "_limit")

    def __init__(self, limit: int) -> None:
        self._buf = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        frames = []
        at = 0
        while len(buf) - at >= LENGTH_BYTES:
            n = int.from_bytes(buf[at : at + LENGTH_BYTES], "big")
            if n > self._limit:
                raise ChannelError(f"a {n}-byte frame; the bound is {self._limit}")
            end = at + LENGTH_BYTES + n
            if len(buf) < end:
                break
            frames.append(bytes(buf[at + LENGTH_BYTES : end]))
            at = end
        if at:
            del buf[:at]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)
