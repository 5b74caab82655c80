"""Routing policies: pick one unit among the eligible ones for a request.

Every policy implements ``RoutingPolicy`` (``base.py``); ``make_policy`` builds
the one named in the config. The dispatcher filters candidates first (health,
draining, ejection, panic, units already tried), so a policy only ranks.
"""

from __future__ import annotations

from proxy.config import RoutingConfig
from proxy.routing.base import PromptTokens, RouteRequest, RoutingDecision, RoutingPolicy
from proxy.routing.cache_aware import PrefixCacheAwarePolicy
from proxy.routing.kv.fleet import KvFleet
from proxy.routing.kv_aware import KvAwarePolicy
from proxy.routing.least_loaded import LeastLoadedPolicy
from proxy.routing.round_robin import RoundRobinPolicy
from proxy.routing.session_affinity import SessionAffinityPolicy

__all__ = [
    "KvFleet",
    "PromptTokens",
    "RouteRequest",
    "RoutingDecision",
    "RoutingPolicy",
    "make_policy",
]


def make_policy(
    cfg: RoutingConfig,
    seed: int | None = None,
    kv: KvFleet | None = None,
    load_max_age_s: float = 5.0,
) -> RoutingPolicy:
    """``kv``: the exact KV view ``kv_aware`` reads (None: every unit approximate);
    ``load_max_age_s``: how old a unit's load report may be to be used."""
    if cfg.policy == "kv_aware":
        return KvAwarePolicy(cfg, kv, seed=seed, load_max_age_s=load_max_age_s)
    if cfg.policy == "prefix_cache_aware":
        return PrefixCacheAwarePolicy(cfg, seed=seed)
    if cfg.policy == "least_loaded":
        return LeastLoadedPolicy(seed=seed)
    if cfg.policy == "round_robin":
        return RoundRobinPolicy()
    if cfg.policy == "session_affinity":
        return SessionAffinityPolicy(cfg.session_header, fallback=LeastLoadedPolicy(seed=seed))
    raise ValueError(f"unknown routing policy {cfg.policy!r}")
