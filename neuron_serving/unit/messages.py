"""Typed, versioned messages on a unit's control connection (leader <-> follower TCP).

The control connection carries the join handshake, heartbeats, replies of
gathered calls and failure reports; the per-step calls themselves travel on the
Gloo control broadcast (``broadcast.py``). Messages are msgspec structs encoded
as msgpack in length-prefixed frames: decoding them never executes code, so the
handshake is safe against an unauthenticated peer. Only ``Reply.payload`` is a
pickle, and it is only unpickled from a follower that has authenticated.
"""

from __future__ import annotations

import msgspec

# Bump when a message changes incompatibly; checked first in the handshake.
PROTOCOL_VERSION = 2  # 2: Welcome.checkpoint, Joined


class Challenge(msgspec.Struct, tag="challenge"):
    """Leader -> follower, first message on a new connection."""

    protocol: int
    unit_id: str
    nonce: bytes


class Hello(msgspec.Struct, tag="hello"):
    """Follower -> leader: who I am, what I run, and proof that I hold the token."""

    protocol: int
    rank: int
    host: str
    pid: int
    versions: dict[str, str]
    nonce: bytes
    mac: bytes  # HMAC(token, "hello", leader nonce, follower nonce, rank)


class CheckpointRef(msgspec.Struct):
    """The weights the leader loads: its model path (followers load the same path)
    and, when that directory is a sharded checkpoint version, the version name and
    the sha256 of its manifest.json (both empty otherwise)."""

    model: str
    version: str = ""
    manifest_sha256: str = ""


class Welcome(msgspec.Struct, tag="welcome"):
    """Leader -> follower: accepted; proof that the leader holds the token too.

    The follower answers ``Joined`` once its local checkpoint matches
    ``checkpoint`` (same version and manifest, its rank's files present), or
    ``Failure`` naming the difference; only then does the leader count it."""

    world_size: int
    unit_id: str
    session_nonce: bytes  # seeds the broadcast MAC key for this unit session
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    startup_heartbeat_timeout_s: float
    broadcast_inline_bytes: int
    device: str
    mac: bytes  # HMAC(token, "welcome", follower nonce, session nonce, rank)
    checkpoint: CheckpointRef | None = None


class Joined(msgspec.Struct, tag="joined"):
    """Follower -> leader, after ``Welcome``: checked and ready to start."""


class Reject(msgspec.Struct, tag="reject"):
    """Leader -> follower: not admitted; ``field`` names what was wrong."""

    field: str
    reason: str


class Start(msgspec.Struct, tag="start"):
    """Leader -> follower: every rank joined; build the Gloo groups now."""

    store_host: str
    store_port: int
    dist_init_method: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    state: str
    steps: int


class Reply(msgspec.Struct, tag="reply"):
    """Follower -> leader: result of a gathered call (pickled by an authenticated peer)."""

    seq: int
    ok: bool
    payload: bytes = b""
    error: str = ""


class Failure(msgspec.Struct, tag="failure"):
    """Either direction: the sender is failing; ``reason`` says why."""

    reason: str


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
