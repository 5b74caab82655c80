"""Shared-secret authentication between the ranks of a unit.

Peers prove knowledge of the unit token with HMAC-SHA256 over fresh nonces
from both sides (mutual challenge-response), so the token never crosses the
wire and a recorded handshake cannot be replayed. Only after that does either
side accept anything that will be unpickled, and every control broadcast is
MAC'ed with a key derived from the token and the leader's session nonce.

Resolution order of the token (first found wins):
1. ``NEURON_SERVING_UNIT_TOKEN`` (ECS injects it from Secrets Manager),
2. an explicit token file (``--token-file`` / ``NEURON_SERVING_TOKEN_FILE``),
3. ``~/.config/neuron-serving/unit-token``, created with mode 0600 on first use.
   Processes of one user on one host share it with no setup; a unit that spans
   hosts must distribute one secret (and not rely on this default).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from neuron_serving import envs

DEFAULT_TOKEN_FILE = Path("~/.config/neuron-serving/unit-token")
NONCE_BYTES = 32
MAC_BYTES = 32


class AuthError(Exception):
    """A peer failed to authenticate."""


def resolve_token(token_file: str | os.PathLike | None = None) -> bytes:
    env_token = envs.NEURON_SERVING_UNIT_TOKEN
    if env_token:
        return env_token.encode()
    path = Path(token_file or envs.NEURON_SERVING_TOKEN_FILE or DEFAULT_TOKEN_FILE).expanduser()
    if token_file is None and envs.NEURON_SERVING_TOKEN_FILE is None and not path.exists():
        _create_default_token(path)
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise AuthError(f"cannot read unit token file {path}: {e.strerror}") from e
    if len(token) < 16:
        raise AuthError(f"unit token in {path} is shorter than 16 characters")
    return token.encode()


def _create_default_token(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        # O_EXCL: two processes racing to create it must end up with one secret.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        # Length-prefix every part so that ("ab","c") and ("a","bc") differ.
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def verify(key: bytes, tag: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(mac(key, *parts), tag)


def broadcast_key(token: bytes, session_nonce: bytes) -> bytes:
    """Key for MACs on control broadcasts of one unit session."""
    return mac(token, b"neuron-serving/broadcast/v1", session_nonce)
