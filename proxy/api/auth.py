"""Client API keys and their tenants (vLLM's ``--api-key`` semantics, plus a keys file).

The keys file is YAML::

    tenants:
      team-a:
        keys: ["<plaintext key>", ...]
        key_sha256: ["<hex sha256 of a key>", ...]
        traffic_class: near-real-time   # the most urgent class its requests may use
                                        # (real-time, the default; near-real-time; batch)
        weight: 2                       # its share of dispatches within a class
                                        # against other tenants waiting (default 1)

Only sha256 digests are kept in memory. A presented key is hashed and compared
with every configured digest by ``hmac.compare_digest`` (all of them, match or
not), so neither which tenant matched nor how much of a key was right shows in
the timing. Tenant names are the only values the ``tenant`` metric label can
take: a client cannot grow the label's cardinality.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from neuron_serving.bearer import bearer_token
from proxy.traffic_class import TrafficClass

log = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
DEFAULT_TENANT = "default"  # the tenant of --api-key / NEURON_SERVING_API_KEY
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant's keys and the most urgent traffic class its requests may use
    (``proxy/traffic_class.py``; a request can only lower it)."""

    keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    key_sha256: tuple[str, ...] = ()
    traffic_class: str = "real-time"
    weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("keys", "key_sha256"):
            v = getattr(self, name)
            if not isinstance(v, list | tuple) or not all(isinstance(k, str) for k in v):
                raise ValueError(f"{name} must be a list of strings")
            object.__setattr__(self, name, tuple(v))
        for k in self.keys:
            if len(k) < MIN_KEY_CHARS:
                raise ValueError(f"a key is shorter than {MIN_KEY_CHARS} characters")
        for h in self.key_sha256:
            if not _HEX64.fullmatch(h.lower()):
                raise ValueError("key_sha256 entries must be 64 hex digits")
        if not self.keys and not self.key_sha256:
            raise ValueError("no keys (set keys and/or key_sha256)")
        if not isinstance(self.traffic_class, str):
            raise ValueError("traffic_class must be a string")
        TrafficClass.parse(self.traffic_class)
        if (
            not isinstance(self.weight, int | float)
            or isinstance(self.weight, bool)
            or not 0 < self.weight <= 1000
        ):
            raise ValueError("weight must be a number in (0, 1000]")

    def digests(self) -> list[bytes]:
        return [key_digest(k) for k in self.keys] + [bytes.fromhex(h) for h in self.key_sha256]


class ApiKeys:
    """digest -> tenant; empty means the client API is unauthenticated."""

    def __init__(self, tenants: dict[str, TenantSpec] | None = None) -> None:
        self._entries: list[tuple[bytes, str]] = []
        self._classes: dict[str, TrafficClass] = {}
        self._weights: dict[str, float] = {}
        for name, spec in (tenants or {}).items():
            self._entries += [(d, name) for d in spec.digests()]
            self._classes[name] = TrafficClass.parse(spec.traffic_class)
            self._weights[name] = float(spec.weight)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def tenants(self) -> list[str]:
        return sorted({t for _, t in self._entries})

    def add(self, key: str, tenant: str = DEFAULT_TENANT) -> None:
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"the API key is shorter than {MIN_KEY_CHARS} characters")
        self._entries.append((key_digest(key), tenant))

    def class_of(self, tenant: str | None) -> TrafficClass:
        """The most urgent class ``tenant`` may use: real-time unless its entry in the
        keys file says otherwise (and for --api-key's tenant, or no key at all)."""
        return self._classes.get(tenant or "", TrafficClass.REAL_TIME)

    def weight_of(self, tenant: str) -> float:
        """The tenant's share of dispatches within a class (flow control); 1 by default."""
        return self._weights.get(tenant, 1.0)

    def tenant_of(self, key: str) -> str | None:
        digest = key_digest(key)
        found = None
        for d, tenant in self._entries:  # no early exit: constant time over the entries
            if hmac.compare_digest(d, digest) and found is None:
                found = tenant
        return found

    def tenant_of_header(self, authorization: str | None) -> str | None:
        """The tenant of ``Authorization: Bearer <key>``, or None."""
        key = bearer_token(authorization)
        return None if key is None else self.tenant_of(key)


def _tenant(name: Any, raw: Any) -> TenantSpec:
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant name {name!r}: expected [A-Za-z0-9_.-], at most 64 characters")
    if not isinstance(raw, dict):
        raise ValueError(f"tenant {name}: expected a mapping")
    unknown = set(raw) - {f.name for f in dataclasses.fields(TenantSpec)}
    if unknown:
        raise ValueError(f"tenant {name}: unknown keys {sorted(unknown)}")
    try:
        return TenantSpec(**raw)
    except ValueError as e:
        raise ValueError(f"tenant {name}: {e}") from None


def load_api_keys(path: str | None, extra_key: str | None = None) -> ApiKeys:
    """The keys file (if any) plus ``extra_key`` (tenant "default"); ValueError names the
    problem, never a key."""
    tenants: dict[str, TenantSpec] = {}
    if path:
        p = Path(path).expanduser()
        mode = p.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("api_keys_file %s is accessible by group/others (mode %o)", p, mode & 0o777)
        raw = yaml.safe_load(p.read_text()) or {}
        if not isinstance(raw, dict) or set(raw) - {"tenants"}:
            raise ValueError(f"{p}: expected a mapping with one key, 'tenants'")
        section = raw.get("tenants") or {}
        if not isinstance(section, dict):
            raise ValueError(f"{p}: 'tenants' must be a mapping")
        tenants = {name: _tenant(name, spec) for name, spec in section.items()}
    keys = ApiKeys(tenants)
    if extra_key:
        keys.add(extra_key, DEFAULT_TENANT)
    return keys
