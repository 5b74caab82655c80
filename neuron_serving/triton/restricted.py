"""Which of tritonserver's HTTP/gRPC API groups a leader exposes, and the secret of the rest.

Triton 2.51's ``--http-restricted-api`` / ``--grpc-restricted-protocol`` take
``<groups>:<header>=<value>``: a request to a listed group is refused unless it carries
the header (HTTP ``<header>``, gRPC metadata ``triton-grpc-protocol-<header>``) with
that value. A leader leaves open only what the proxy and the unit's supervisors use:

- ``health`` (server live/ready, model ready: the launcher, the proxy, ``local``),
- ``inference`` (ModelStreamInfer / ``generate_stream``: the proxy; ``generate``: canaries),
- ``model-config`` (the proxy reads the served ``model_version`` from it; it holds the
  rendered config.pbtxt only, no paths or secrets).

Everything else (model control and the repository index, shared memory, statistics,
trace, logging, server/model metadata) needs the admin key. An unset
NEURON_SERVING_TRITON_ADMIN_KEY means a random key per start that is never written
anywhere: those APIs are then off for everyone. The model's own unload on a unit
failure (``pb_utils.unload_model``) is not affected: the Python backend stub asks
tritonserver over its shared-memory IPC and the backend calls
``TRITONSERVER_ServerUnloadModel`` in process; it never goes through HTTP or gRPC.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

# Triton's own group names (tritonserver --help, "Allowed APIs").
OPEN_APIS = ("health", "inference", "model-config")
RESTRICTED_APIS = (
    "model-repository",
    "shared-memory",
    "statistics",
    "trace",
    "logging",
    "metadata",
)
# HTTP header of the admin key; over gRPC Triton expects it as metadata with the
# prefix below (its restricted-protocol convention).
ADMIN_HEADER = "neuron-serving-admin-key"
GRPC_METADATA_PREFIX = "triton-grpc-protocol-"
# Triton splits the flag at ':' and '=', and the key travels in a header: keep it to
# URL-safe base64 (what secrets.token_urlsafe gives) and long enough not to be guessed.
_KEY = re.compile(r"^[A-Za-z0-9_-]{24,256}$")


@dataclass(frozen=True, slots=True)
class AdminKey:
    value: str

    def __post_init__(self) -> None:
        if not _KEY.match(self.value):
            raise ValueError(
                "NEURON_SERVING_TRITON_ADMIN_KEY must be 24-256 characters of "
                "[A-Za-z0-9_-] (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )

    @classmethod
    def resolve(cls, configured: str | None) -> AdminKey:
        """The configured key, or a random one nobody learns (the APIs are then off)."""
        return cls(configured if configured else secrets.token_urlsafe(32))

    def server_args(self) -> list[str]:
        groups = ",".join(RESTRICTED_APIS)
        return [
            f"--http-restricted-api={groups}:{ADMIN_HEADER}={self.value}",
            f"--grpc-restricted-protocol={groups}:{ADMIN_HEADER}={self.value}",
        ]

    def http_headers(self) -> dict[str, str]:
        return {ADMIN_HEADER: self.value}

    def grpc_metadata(self) -> dict[str, str]:
        return {GRPC_METADATA_PREFIX + ADMIN_HEADER: self.value}

    def __repr__(self) -> str:  # never in a log line or a traceback
        return "AdminKey(<redacted>)"
