"""The interface every routing policy implements."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.registry import UnitState


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A prompt as the leader's vLLM will see it: its token ids (the chat template
    applied, special tokens as vLLM adds them; ``proxy/tokens/prompt.py``) and the
    request's ``cache_salt``, which vLLM mixes into the first block's hash."""

    token_ids: Sequence[int]
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    prompt: str  # the routing key: the prompt's text (chat: roles and texts in order)
    session_id: str | None = None  # from the configured session header, if any
    tokens: PromptTokens | None = None  # None: not computed (see PromptTokens)


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    unit: UnitState
    reason: str  # a small fixed vocabulary, used as a metrics label
    # Prompt tokens the policy predicts ``unit`` serves from its prefix cache (an
    # exact KV index's match), None when it cannot tell.
    cached_tokens: int | None = None


class RoutingPolicy(Protocol):
    name: str

    def choose(self, req: RouteRequest, candidates: Sequence[UnitState]) -> RoutingDecision:
        """Pick one of ``candidates`` (never empty). Must not await: routing is one step."""
        ...

    def on_unit_removed(self, unit_id: str) -> None:
        """Forget per-unit state (prefix index, ...) of a unit that left the registry."""
        ...

    def needs_prompt_tokens(self, units: Sequence[UnitState]) -> bool:
        """Whether routing among ``units`` would use ``RouteRequest.tokens`` (computing
        them costs a tokenization: skipped when no policy reads them)."""
        ...


def least_loaded(candidates: Sequence[UnitState], rng: random.Random) -> UnitState:
    """Fewest in-flight requests; ties broken at random so that proxies and bursts
    do not all herd onto the first unit in a list."""
    low = min(u.in_flight for u in candidates)
    return rng.choice([u for u in candidates if u.in_flight == low])


def rendezvous_order(key: bytes, candidates: Sequence[UnitState]) -> list[UnitState]:
    """The candidates by how high their ids score with ``key``, highest first
    (rendezvous, or highest random weight, hashing): every proxy orders them alike
    without a table or a word to the others, and when a unit leaves only the keys it
    held move (each to its second). ``session_affinity``'s sessions, ``kv_aware``'s
    home units."""

    return sorted(candidates, key=lambda u: _score(key, u), reverse=True)


def rendezvous(key: bytes, candidates: Sequence[UnitState]) -> UnitState:
    """The first of ``rendezvous_order``, without sorting the rest (session_affinity
    asks for it on every request)."""
    return max(candidates, key=lambda u: _score(key, u))


def _score(key: bytes, unit: UnitState) -> bytes:
    return hashlib.blake2b(key + b"\0" + unit.unit_id.encode(), digest_size=8).digest()
