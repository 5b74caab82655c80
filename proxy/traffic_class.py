"""Traffic classes: real-time, near-real-time and batch on one fleet.

A request's class is the lowest of:

- what its API key's tenant may use (``TenantSpec.traffic_class``; real-time when the
  keys file says nothing, or with no keys at all),
- the ``X-Traffic-Class`` header, if sent (a class name),
- OpenAI's ``service_tier`` in the body, if sent: ``priority`` asks for real-time,
  ``flex`` for batch, ``default``/``auto`` leave the class as it is (``scale`` is
  OpenAI's and not ours: refused, as an unknown header value is).

A request can lower its class, never raise it above its key's: a batch tenant that
sends ``service_tier: priority`` stays batch. The class is on every request's metric
line and access-log line, and reaches the engine as vLLM's per-request priority
(``TrafficClass`` values: lower is scheduled first; the leaders run vLLM with
``scheduling_policy="priority"``, and the leader takes the priority from the
proxy's envelope on the OpenAI route and from its ``priority`` input on Triton's
generate route, never from the client's body).
"""

from __future__ import annotations

import enum
from typing import Any

HEADER = "X-Traffic-Class"


class TrafficClass(enum.IntEnum):
    """Ordered from the most urgent; the value is vLLM's request priority."""

    REAL_TIME = 0
    NEAR_REAL_TIME = 1
    BATCH = 2

    @property
    def label(self) -> str:
        return _NAMES[self]

    @classmethod
    def parse(cls, name: str) -> TrafficClass:
        found = _BY_NAME.get(name.strip().lower())
        if found is None:
            raise ValueError(
                f"unknown traffic class {name!r}; expected one of {', '.join(_BY_NAME)}"
            )
        return found


_NAMES = {
    TrafficClass.REAL_TIME: "real-time",
    TrafficClass.NEAR_REAL_TIME: "near-real-time",
    TrafficClass.BATCH: "batch",
}
_BY_NAME = {name: c for c, name in _NAMES.items()}
# OpenAI's service tiers: None = the class stays what the key and header made it.
_SERVICE_TIERS: dict[str, TrafficClass | None] = {
    "priority": TrafficClass.REAL_TIME,
    "default": None,
    "auto": None,
    "flex": TrafficClass.BATCH,
}


def lowered(allowed: TrafficClass, requested: TrafficClass | None) -> TrafficClass:
    """``requested`` if it is not above ``allowed``, else ``allowed``."""
    return allowed if requested is None else max(allowed, requested)


def header_class(value: str | None) -> TrafficClass | None:
    """The ``X-Traffic-Class`` header's class; ValueError for an unknown one."""
    return None if value is None else TrafficClass.parse(value)


def service_tier_class(value: Any) -> TrafficClass | None:
    """OpenAI's ``service_tier``; ValueError for a value we do not serve."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in _SERVICE_TIERS:
        raise ValueError(f"service_tier must be one of {', '.join(_SERVICE_TIERS)} (got {value!r})")
    return _SERVICE_TIERS[value]
