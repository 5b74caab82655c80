"""Typed configuration of an inference unit's control plane.

The leader's copy travels to the unit executor inside vLLM's own config
(``VllmConfig.additional_config["neuron_serving"]``), because vLLM constructs
the executor itself (possibly in a spawned EngineCore process) and hands it
nothing but the ``VllmConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from neuron_serving import envs

ADDITIONAL_CONFIG_KEY = "neuron_serving"


@dataclass(slots=True)
class UnitConfig:
    """What the leader's unit executor needs beyond vLLM's own config.

    Ports: the control server listens on ``control_port``; the control-plane
    Gloo group rendezvouses on a TCPStore at ``control_port + 1`` and vLLM's own
    torch.distributed world (tensor-parallel groups) at ``control_port + 2``.
    Fixed offsets keep firewall / ECS port mappings declarative.
    """

    control_port: int = 29500
    # Address the leader binds and advertises to followers (loopback by default:
    # a unit spanning hosts must set it explicitly).
    control_host: str = "127.0.0.1"
    unit_id: str = "unit-0"
    # Shared-secret file; None = NEURON_SERVING_UNIT_TOKEN, NEURON_SERVING_TOKEN_FILE or the
    # default file (see neuron_serving.unit.auth). The secret itself never enters VllmConfig,
    # which vLLM logs.
    token_file: str | None = None
    join_timeout_s: float = 600.0
    # Whole join handshake of one connection up to the Hello's verdict, and again
    # for the follower's checkpoint check after Welcome: a connection that never
    # sends, or trickles, frees its handshake slot by then.
    handshake_timeout_s: float = 10.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0
    # Until a peer reports READY it may hold the GIL for seconds at a time
    # (weight loading, torch.compile, tokenizer set-up), so silence is tolerated
    # longer; the strict timeout applies to a serving unit.
    startup_heartbeat_timeout_s: float = 60.0
    abort_grace_s: float = 0.5
    rpc_timeout_s: float = 1800.0
    device: str = "cpu"
    # Leader node health server (gRPC health on this port, HTTP /healthz on port+1); 0 = off.
    health_port: int = 0
    health_host: str = "127.0.0.1"
    # Inline capacity of one control broadcast; larger messages take a second broadcast.
    broadcast_inline_bytes: int = 4096

    def __post_init__(self) -> None:
        if not 0 < self.control_port < 65534:
            raise ValueError(f"control_port must be in 1..65533, got {self.control_port}")
        if self.join_timeout_s <= 0:
            raise ValueError(f"join_timeout_s must be > 0, got {self.join_timeout_s}")
        if self.handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(
                "heartbeat_interval_s must be > 0 and < heartbeat_timeout_s, got "
                f"{self.heartbeat_interval_s} and {self.heartbeat_timeout_s}"
            )
        if self.startup_heartbeat_timeout_s < self.heartbeat_timeout_s:
            raise ValueError("startup_heartbeat_timeout_s must be >= heartbeat_timeout_s")
        if self.device not in ("cpu", "neuron"):
            raise ValueError(f"device must be 'cpu' or 'neuron', got {self.device!r}")
        if self.broadcast_inline_bytes < 1024:
            raise ValueError("broadcast_inline_bytes must be >= 1024")

    @property
    def store_port(self) -> int:
        return self.control_port + 1

    @property
    def dist_port(self) -> int:
        return self.control_port + 2

    @classmethod
    def from_env(cls, **overrides: Any) -> UnitConfig:
        base = dict(
            unit_id=envs.NEURON_SERVING_UNIT_ID,
            token_file=envs.NEURON_SERVING_TOKEN_FILE,
            join_timeout_s=envs.NEURON_SERVING_JOIN_TIMEOUT_S,
            heartbeat_interval_s=envs.NEURON_SERVING_HEARTBEAT_INTERVAL_S,
            heartbeat_timeout_s=envs.NEURON_SERVING_HEARTBEAT_TIMEOUT_S,
            abort_grace_s=envs.NEURON_SERVING_ABORT_GRACE_S,
            rpc_timeout_s=envs.NEURON_SERVING_RPC_TIMEOUT_S,
            device=envs.NEURON_SERVING_DEVICE,
            health_port=envs.NEURON_SERVING_LEADER_HEALTH_PORT,
            health_host=envs.NEURON_SERVING_HEALTH_HOST,
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def compile_identity(self) -> dict[str, Any]:
        """What of this config may change a compiled graph: the device, nothing else.

        vLLM keys its torch.compile cache (``$VLLM_CACHE_ROOT/torch_compile_cache/
        torch_aot_compile/<hash>/rank_<r>_0``) on ``VllmConfig.compute_hash()``, which
        covers ``additional_config``. The control plane (ports, unit id, token file,
        timeouts) changes no graph; left in the key, it made every unit, every
        ``up --port`` compile the same model again. The executor
        puts this in its place once it has read the whole config (``take_unit_config``)."""
        return {"device": self.device}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UnitConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown unit config keys: {sorted(unknown)}")
        return cls(**data)


def take_unit_config(additional_config: Any) -> UnitConfig | None:
    """The unit's config from vLLM's ``additional_config`` (None if absent), leaving
    only its ``compile_identity`` there. The executor calls it before anything
    compiles and before the config travels to the followers with ``init_worker``, so
    every rank of every unit keys vLLM's compile cache alike: units, restarts and
    other ports reuse one set of artifacts. Nothing reads the control plane from the
    VllmConfig afterwards; the executor holds it."""
    extra = additional_config.get(ADDITIONAL_CONFIG_KEY) if additional_config else None
    if not extra:
        return None
    unit = UnitConfig.from_dict(dict(extra))
    additional_config[ADDITIONAL_CONFIG_KEY] = unit.compile_identity()
    return unit
