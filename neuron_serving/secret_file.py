"""Shared secrets read from the environment or a private file, created on first use.

One recipe for every secret a process pair proves to each other (the unit token of
``unit/auth.py``, the OpenAI channel token of ``openai_channel.py``). Resolution
order (first found wins):

1. the environment variable (ECS injects it from Secrets Manager),
2. an explicit file (a flag or a ``*_FILE`` variable),
3. a default file under ``~/.config/neuron-serving/``, created with mode 0600 on
   first use. Processes of one user on one host then share it with no setup;
   processes on different hosts must be given one secret (and not rely on this).
   It is created atomically (written to a private temporary file, then hard-linked
   into place), so a process starting at the same instant reads either no file or
   the whole secret, never an empty one.

A secret shorter than ``MIN_TOKEN_CHARS`` is refused wherever it comes from: a
recorded handshake lets an attacker test guesses offline, so the secret must not be
guessable (``openssl rand -hex 32``).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

# 24 characters: 96 bits as hex, the least we accept for an offline-guessable secret.
MIN_TOKEN_CHARS = 24


class SecretError(Exception):
    """A secret is missing, unreadable or too short."""


def resolve_secret(
    kind: str,
    env_value: str | None,
    env_name: str,
    explicit_file: str | os.PathLike | None,
    default_file: Path,
) -> bytes:
    """``kind`` names the secret in errors ("unit token"). ``explicit_file`` None:
    the default file, created if missing."""
    if env_value is not None:
        return _checked(kind, env_value.strip(), env_name)
    path = Path(explicit_file or default_file).expanduser()
    if explicit_file is None and not path.exists():
        try:
            _create(path)
        except OSError as e:  # e.g. a read-only home in a container
            raise SecretError(f"cannot create {kind} file {path}: {e.strerror or e}") from e
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise SecretError(f"cannot read {kind} file {path}: {e.strerror}") from e
    return _checked(kind, token, f"{kind} file {path}")


def _checked(kind: str, token: str, source: str) -> bytes:
    if len(token) < MIN_TOKEN_CHARS:
        raise SecretError(
            f"the {kind} from {source} is {len(token)} characters, shorter than "
            f"{MIN_TOKEN_CHARS}; use a random secret (e.g. `openssl rand -hex 32`)"
        )
    return token.encode()


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Write the whole secret to a private temporary file first and hard-link it
    # into place: link() fails if the name exists, so racing processes agree on one
    # secret, and the name never points at a partly written file (O_EXCL on the
    # final name would let a second process read it empty between open and write).
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process won the race; its file is complete
    finally:
        os.unlink(tmp)
