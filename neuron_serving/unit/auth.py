"""Shared-secret authentication between the ranks of a unit.

Peers prove knowledge of the unit token with HMAC-SHA256 over fresh nonces
from both sides (mutual challenge-response), so the token never crosses the
wire and a recorded handshake cannot be replayed. Only after that does either
side accept anything that will be unpickled. Keys derived from the token (HKDF,
RFC 5869, with HMAC-SHA256) authenticate everything after the handshake:

- each control connection (a *link*) has one key per direction, derived from
  both handshake nonces and the rank; every frame on it carries a MAC and a
  sequence number (``channel.py``), so frames cannot be forged, replayed,
  reordered, reflected back to their sender or moved to another link;
- every control broadcast is MAC'ed with a key derived from the leader's
  session nonce (``broadcast.py``).

A token shorter than ``MIN_TOKEN_CHARS`` is refused wherever it comes from: a
recorded handshake lets an attacker test guesses offline, so the secret must
not be guessable (``openssl rand -hex 32``).

Resolution order of the token (first found wins):
1. ``NEURON_SERVING_UNIT_TOKEN`` (ECS injects it from Secrets Manager),
2. an explicit token file (``--token-file`` / ``NEURON_SERVING_TOKEN_FILE``),
3. ``~/.config/neuron-serving/unit-token``, created with mode 0600 on first use
   (``secret_file.py``, the recipe of every shared secret here). A unit that
   spans hosts must distribute one secret (and not rely on this default).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from neuron_serving import envs
from neuron_serving.secret_file import MIN_TOKEN_CHARS as MIN_TOKEN_CHARS  # re-exported
from neuron_serving.secret_file import SecretError, resolve_secret

DEFAULT_TOKEN_FILE = Path("~/.config/neuron-serving/unit-token")
NONCE_BYTES = 32
MAC_BYTES = 32


class AuthError(Exception):
    """A peer failed to authenticate."""


def resolve_token(token_file: str | os.PathLike | None = None) -> bytes:
    try:
        return resolve_secret(
            "unit token",
            envs.NEURON_SERVING_UNIT_TOKEN,
            "NEURON_SERVING_UNIT_TOKEN",
            token_file or envs.NEURON_SERVING_TOKEN_FILE,
            DEFAULT_TOKEN_FILE,
        )
    except SecretError as e:
        raise AuthError(str(e)) from e.__cause__


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    """A memoryview part must be of bytes (format "B"): its length is the prefix."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        # Length-prefix every part so that ("ab","c") and ("a","bc") differ.
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def verify(key: bytes, tag: bytes, *parts: bytes | memoryview) -> bool:
    return hmac.compare_digest(mac(key, *parts), tag)


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    """HKDF (RFC 5869) with HMAC-SHA256, one 32-byte output block."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def broadcast_key(token: bytes, session_nonce: bytes) -> bytes:
    """Key for MACs on control broadcasts of one unit session."""
    return mac(token, b"neuron-serving/broadcast/v1", session_nonce)


LEADER_TO_FOLLOWER = b"leader->follower"
FOLLOWER_TO_LEADER = b"follower->leader"


def link_key(
    token: bytes, leader_nonce: bytes, follower_nonce: bytes, rank: int, direction: bytes
) -> bytes:
    """Key for the frames of one direction of one control connection.

    Both nonces are fresh per connection, so a recorded frame verifies on no
    other connection; the direction in the key stops a frame being reflected
    back to its sender; the rank binds the link to the rank that proved it."""
    salt = leader_nonce + follower_nonce
    return hkdf_sha256(token, salt, b"neuron-serving/link/v1 " + direction + b" %d" % rank)
