"""Typed, versioned messages on a unit's control connection (leader <-> follower TCP).

The control connection carries the join handshake, heartbeats, replies of
gathered calls and failure reports; the per-step calls themselves travel on the
Gloo control broadcast (``broadcast.py``). Messages are msgspec structs encoded
as msgpack in length-prefixed frames: decoding them never executes code, so the
handshake is safe against an unauthenticated peer. Every frame after the
follower's ``Hello`` (from ``Welcome`` on, both directions) is sealed with the
link's MAC and sequence number and verified before it is decoded
(``channel.py``). Only ``Reply.payload`` is a pickle, unpickled by the leader
only after its frame verified.

Every variable-size field has a bound (``msgspec.Meta``): a peer's strings,
dicts and byte strings are checked while decoding, so an oversized one fails
as a malformed message rather than reaching logs, lists or errors.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

# Bump when a message changes incompatibly; checked first in the handshake.
# 2: Welcome.checkpoint, Joined; 3: sealed frames (per-link MAC + seq), Welcome.mac dropped.
PROTOCOL_VERSION = 3

MAX_TEXT = 16 << 10  # failure reasons and errors
Nonce = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Tag = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Name = Annotated[str, msgspec.Meta(max_length=255)]  # host names, ids, fields
PathStr = Annotated[str, msgspec.Meta(max_length=4096)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Versions = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=128)]],
    msgspec.Meta(max_length=32),
]


class Challenge(msgspec.Struct, tag="challenge"):
    """Leader -> follower, first message on a new connection."""

    protocol: int
    unit_id: Name
    nonce: Nonce


class Hello(msgspec.Struct, tag="hello"):
    """Follower -> leader: who I am, what I run, and proof that I hold the token."""

    protocol: int
    rank: int
    host: Name
    pid: int
    versions: Versions
    nonce: Nonce
    mac: Tag  # HMAC(token, "hello", leader nonce, follower nonce, rank)


class CheckpointRef(msgspec.Struct):
    """The weights the leader loads: its model path (followers load the same path)
    and, when that directory is a sharded checkpoint version, the version name and
    the sha256 of its manifest.json (both empty otherwise)."""

    model: PathStr
    version: Name = ""
    manifest_sha256: Name = ""


class Welcome(msgspec.Struct, tag="welcome"):
    """Leader -> follower: accepted. The first sealed frame: its link MAC, keyed
    from the token and both nonces, proves the leader holds the token too and
    covers the whole message.

    The follower answers ``Joined`` once its local checkpoint matches
    ``checkpoint`` (same version and manifest, its rank's files present), or
    ``Failure`` naming the difference; only then does the leader count it."""

    world_size: int
    unit_id: Name
    session_nonce: Nonce  # seeds the broadcast MAC key for this unit session
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    startup_heartbeat_timeout_s: float
    broadcast_inline_bytes: int
    device: Name
    checkpoint: CheckpointRef | None = None


class Joined(msgspec.Struct, tag="joined"):
    """Follower -> leader, after ``Welcome``: checked and ready to start."""


class Reject(msgspec.Struct, tag="reject"):
    """Leader -> follower: not admitted; ``field`` names what was wrong."""

    field: Name
    reason: Text


class Start(msgspec.Struct, tag="start"):
    """Leader -> follower: every rank joined; build the Gloo groups now."""

    store_host: Name
    store_port: int
    dist_init_method: PathStr


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Both ways, every heartbeat interval. ``sent`` is the sender's monotonic clock;
    ``echo`` the last ``sent`` it received from the peer and ``held`` how long ago:
    the peer's round trip is its clock now - echo - held (0: nothing to echo yet).
    A follower's beat carries its step totals (``step_timing.StepTiming``): the
    leader compares its ranks with them (``straggler.py``)."""

    state: Name
    steps: int
    sent: float = 0.0
    echo: float = 0.0
    held: float = 0.0
    step_s: float = 0.0
    wait_s: float = 0.0


class Reply(msgspec.Struct, tag="reply"):
    """Follower -> leader: result of a gathered call (pickled by an authenticated peer)."""

    seq: int
    ok: bool
    payload: bytes = b""  # bounded by the frame limit (channel.MAX_FRAME_BYTES)
    error: Text = ""


class Failure(msgspec.Struct, tag="failure"):
    """Either direction: the sender is failing; ``reason`` says why."""

    reason: Text


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Leader -> follower: clean shutdown; exit 0."""


ControlMessage = (
    Challenge | Hello | Welcome | Joined | Reject | Start | Heartbeat | Reply | Failure | Shutdown
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMessage)


def encode(msg: ControlMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> ControlMessage:
    return _decoder.decode(data)


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to fit a bounded field (our own reasons can be long tracebacks)."""
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"
