"""The one registry of environment variables read by neuron-serving.

Nobody else calls ``os.getenv``/``os.environ.get`` for our variables: add a
line here (name, type, default, meaning) and read it as ``envs.NAME``. Values are
read at access time, so tests and launchers may set them after import.

Variables owned by other projects (``VLLM_*``, ``OMP_*``, ``NEURON_RT_*``,
``FI_*``) are *written* by our device backends for the processes they configure;
they are listed in ``neuron_serving/devices`` where they are produced.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _float(name: str, default: float) -> Callable[[], float]:
    return lambda: float(os.environ.get(name, default))


def _int(name: str, default: int) -> Callable[[], int]:
    return lambda: int(os.environ.get(name, default))


_REGISTRY: dict[str, tuple[Callable[[], Any], str]] = {
    "NEURON_SERVING_UNIT_TOKEN": (
        _str("NEURON_SERVING_UNIT_TOKEN", None),
        "Shared secret of an inference unit (overrides --token-file and the default token file).",
    ),
    "NEURON_SERVING_TOKEN_FILE": (
        _str("NEURON_SERVING_TOKEN_FILE", None),
        "Path of the unit's shared-secret file (default ~/.config/neuron-serving/unit-token).",
    ),
    "NEURON_SERVING_JOIN_TIMEOUT_S": (
        _float("NEURON_SERVING_JOIN_TIMEOUT_S", 600.0),
        "How long a leader waits for all followers to join (and a follower for its leader).",
    ),
    "NEURON_SERVING_HEARTBEAT_INTERVAL_S": (
        _float("NEURON_SERVING_HEARTBEAT_INTERVAL_S", 0.5),
        "Interval of heartbeats between leader and followers on the control connection.",
    ),
    "NEURON_SERVING_HEARTBEAT_TIMEOUT_S": (
        _float("NEURON_SERVING_HEARTBEAT_TIMEOUT_S", 2.0),
        "Silence after which a peer is declared hung (must stay well under 5 s).",
    ),
    "NEURON_SERVING_ABORT_GRACE_S": (
        _float("NEURON_SERVING_ABORT_GRACE_S", 0.5),
        "After a rank fails, how long the engine may take to unwind before the process aborts.",
    ),
    "NEURON_SERVING_PROGRESS_INTERVAL_S": (
        _float("NEURON_SERVING_PROGRESS_INTERVAL_S", 2.0),
        "How often a leader reports progress for a request with nothing to send "
        "(triton/progress.py); the proxies' timeouts.silence_s must be several times it.",
    ),
    "NEURON_SERVING_RPC_TIMEOUT_S": (
        _float("NEURON_SERVING_RPC_TIMEOUT_S", 1800.0),
        "Upper bound on one gathered collective_rpc (model load, profiling, warm-up).",
    ),
    "NEURON_SERVING_HEALTH_HOST": (
        _str("NEURON_SERVING_HEALTH_HOST", "127.0.0.1"),
        "Address the node health servers (gRPC health, HTTP /healthz) bind to.",
    ),
    "NEURON_SERVING_LEADER_HEALTH_PORT": (
        _int("NEURON_SERVING_LEADER_HEALTH_PORT", 0),
        "Port of the leader's health server (gRPC + HTTP on port and port+1); 0 disables it.",
    ),
    "NEURON_SERVING_UNIT_ID": (
        _str("NEURON_SERVING_UNIT_ID", "unit-0"),
        "Identifier of the inference unit, reported in health and metrics.",
    ),
    "NEURON_SERVING_PROXY_ADMIN_TOKEN": (
        _str("NEURON_SERVING_PROXY_ADMIN_TOKEN", None),
        "Bearer token of the proxy's admin API (overrides admin_token_file in its config).",
    ),
    "NEURON_SERVING_CACHE_DIR": (
        _str("NEURON_SERVING_CACHE_DIR", None),
        "Cache of `neuron-serving up` (demo model, run directories); default "
        "$XDG_CACHE_HOME/neuron-serving or ~/.cache/neuron-serving.",
    ),
    "XDG_CACHE_HOME": (
        _str("XDG_CACHE_HOME", None),
        "Base of the default cache directory (XDG Base Directory spec).",
    ),
    "VLLM_CPU_OMP_THREADS_BIND": (
        _str("VLLM_CPU_OMP_THREADS_BIND", None),
        "vLLM's CPU binding list, read per rank by the cpu backend: '0|1' gives rank r entry r; "
        "'auto' binds a rank to every allowed CPU but the last (one rank per host); "
        "'nobind' or unset leaves OpenMP alone.",
    ),
    "NEURON_SERVING_CPU_ALLREDUCE": (
        _str("NEURON_SERVING_CPU_ALLREDUCE", "shm"),
        "How the TP ranks of one unit on one host all-reduce on the cpu backend: 'shm' "
        "(vLLM's shared-memory all-reduce, the default: the fastest, but it waits by "
        "polling, so units whose ranks share cores stall each other) or 'gloo' "
        "(torch.distributed Gloo over loopback TCP, as between hosts: waits by blocking). "
        "Ranks on different hosts always use Gloo.",
    ),
    "NEURON_SERVING_NEURON_CORES_PER_NODE": (
        _int("NEURON_SERVING_NEURON_CORES_PER_NODE", 32),
        "NeuronCores per node for the neuron backend (32 on trn1.32xlarge, 64 on trn2.48xlarge).",
    ),
    # Set per task by the ECS task definitions and RunTask overrides (neuron_serving/ecs);
    # the node container's command reads them (see ecs/README.md).
    "NEURON_SERVING_LEADER_ADDR": (
        _str("NEURON_SERVING_LEADER_ADDR", None),
        "HOST:PORT of the unit leader's control port, given to a follower task on ECS.",
    ),
    "NEURON_SERVING_RANK": (
        _int("NEURON_SERVING_RANK", 0),
        "Rank of this node in its unit (0 = leader), set per ECS task.",
    ),
    "NEURON_SERVING_WORLD_SIZE": (
        _int("NEURON_SERVING_WORLD_SIZE", 1),
        "Nodes in this node's unit, set by the ECS task definition.",
    ),
    "NEURON_SERVING_MODEL_VERSION": (
        _str("NEURON_SERVING_MODEL_VERSION", None),
        "Deployment version label of the ECS deployment that started this node.",
    ),
    "NEURON_SERVING_MODEL_URI": (
        _str("NEURON_SERVING_MODEL_URI", None),
        "s3:// prefix of the checkpoint version an ECS node fetches (its rank's shards) into "
        "the model directory before it starts; set by the task definition (spec model_uri).",
    ),
    "XDG_DATA_HOME": (
        _str("XDG_DATA_HOME", None),
        "Base of the proxy's default data directory ($XDG_DATA_HOME/neuron-serving/proxy; "
        "default ~/.local/share): the Batch API's SQLite store and files.",
    ),
    "NEURON_SERVING_S3_ENDPOINT_URL": (
        _str("NEURON_SERVING_S3_ENDPOINT_URL", None),
        "S3 endpoint of `checkpoint publish/fetch` (e.g. http://127.0.0.1:9000 for minio or "
        "moto); unset = AWS S3. Credentials and region come from boto3's usual chain.",
    ),
    "NEURON_SERVING_DEVICE": (
        _str("NEURON_SERVING_DEVICE", "cpu"),
        "Device backend of this node: cpu or neuron.",
    ),
    "NEURON_SERVING_MODEL_MANIFEST_SHA256": (
        _str("NEURON_SERVING_MODEL_MANIFEST_SHA256", None),
        "sha256 (hex) of the checkpoint manifest a deploy checked; every rank refuses to load "
        "a manifest with another digest (set by the task definition from the deploy's pin).",
    ),
    "NEURON_SERVING_API_KEY": (
        _str("NEURON_SERVING_API_KEY", None),
        "Client API key of the proxy (as vLLM's --api-key / VLLM_API_KEY): requests must send "
        "`Authorization: Bearer <key>`; the key's tenant is 'default'. --api-key overrides it.",
    ),
    "NEURON_SERVING_TRITON_ADMIN_KEY": (
        _str("NEURON_SERVING_TRITON_ADMIN_KEY", None),
        "Secret of the leader's restricted Triton APIs (model control, repository, logging, "
        "trace, statistics, shared memory); unset = a random key per leader start.",
    ),
    "NEURON_SERVING_HEALTH_TOKEN": (
        _str("NEURON_SERVING_HEALTH_TOKEN", None),
        "Bearer token for full node /healthz detail (host, versions, failure text) from "
        "outside loopback; unset = only loopback callers see detail, others the state alone.",
    ),
    "NEURON_SERVING_BROADCAST_MAX_BYTES": (
        _int("NEURON_SERVING_BROADCAST_MAX_BYTES", 64 << 20),
        "Largest control broadcast payload a rank sends or accepts (bytes); checked from the "
        "header before any allocation. Must be the same on every rank of a unit.",
    ),
    "NEURON_SERVING_PROXY_EVENT_LOOP": (
        _str("NEURON_SERVING_PROXY_EVENT_LOOP", "uvloop"),
        "Event loop of `neuron-serving proxy`: uvloop (default; less CPU per token) or asyncio "
        "(the standard library's, for debugging or if uvloop misbehaves).",
    ),
    "NEURON_SERVING_MODELS_DIR": (
        _str("NEURON_SERVING_MODELS_DIR", None),
        "Where `neuron-serving models pull` caches converted catalog models (one directory "
        "per name); default <cache dir>/models, the cache dir as NEURON_SERVING_CACHE_DIR.",
    ),
    "NEURON_SERVING_COMPILE_LOCK_WAIT_S": (
        _float("NEURON_SERVING_COMPILE_LOCK_WAIT_S", 600.0),
        "How long a unit's leader waits for the host's compile lock (units on one host "
        "compile one after another, the later ones from the earlier one's kernel cache; "
        "unit/compile_lock.py) before compiling anyway; 0 = no lock.",
    ),
    "NEURON_SERVING_CHANNEL_TOKEN": (
        _str("NEURON_SERVING_CHANNEL_TOKEN", None),
        "Shared secret of the leaders' OpenAI channel (openai_channel.py): a proxy that proves "
        "it gets one multiplexed connection per leader; overrides the token file.",
    ),
    "NEURON_SERVING_LEADER_CHANNEL_PORT": (
        _int("NEURON_SERVING_LEADER_CHANNEL_PORT", 0),
        "Port of the leader's OpenAI channel (on Triton's bind address); 0 = a free port. "
        "Announced in the model config either way; fixed on ECS (8003) for the security group.",
    ),
    "NEURON_SERVING_CHANNEL_TOKEN_FILE": (
        _str("NEURON_SERVING_CHANNEL_TOKEN_FILE", None),
        "Path of the OpenAI channel's secret file (default ~/.config/neuron-serving/channel-token, "
        "created on first use: processes of one user on one host share it).",
    ),
    "NEURON_SERVING_KV_EVENTS": (
        _int("NEURON_SERVING_KV_EVENTS", 1),
        "1 (default): a leader with prefix caching publishes vLLM's KV cache events on private "
        "ipc:// sockets and relays them to its proxies over the OpenAI channel; 0 = off "
        "(`leader --no-kv-events` says the same).",
    ),
    "NEURON_SERVING_UNIT_RESTARTS": (
        _int("NEURON_SERVING_UNIT_RESTARTS", 0),
        "Set by the local supervisor on a unit's processes: how many times it restarted "
        "the unit before (exported as neuron_serving_node_restarts).",
    ),
    "NEURON_SERVING_STRAGGLER_WINDOW_S": (
        _float("NEURON_SERVING_STRAGGLER_WINDOW_S", 10.0),
        "Slow-rank detection: the window over which the leader compares its ranks.",
    ),
    "NEURON_SERVING_STRAGGLER_WINDOWS": (
        _int("NEURON_SERVING_STRAGGLER_WINDOWS", 3),
        "Slow-rank detection: consecutive windows over the threshold before a rank is "
        "degraded (and under it before it is cleared).",
    ),
    "NEURON_SERVING_STRAGGLER_SHARE": (
        _float("NEURON_SERVING_STRAGGLER_SHARE", 0.25),
        "Slow-rank detection: a rank is slow when its peers wait for it, in the TP "
        "collectives, at least this share of each step more than it waits for them.",
    ),
    "NEURON_SERVING_STRAGGLER_MIN_STEPS": (
        _int("NEURON_SERVING_STRAGGLER_MIN_STEPS", 20),
        "Slow-rank detection: a window with fewer steps gives no verdict (an idle unit).",
    ),
    "NEURON_SERVING_STRAGGLER_ACTION": (
        _str("NEURON_SERVING_STRAGGLER_ACTION", "report"),
        "What the leader does with a degraded rank: report (metrics, /healthz, the "
        "proxy's status) or fail (the unit fails as if the rank had died, and its "
        "supervisor recreates it).",
    ),
    # --- add new variables above this line; helpers editing in parallel: small edits only ---
}


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        return _REGISTRY[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(_REGISTRY)


def describe() -> dict[str, str]:
    """Name -> meaning, for ``neuron-serving env`` and the README."""
    return {name: doc for name, (_, doc) in _REGISTRY.items()}
