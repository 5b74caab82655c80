"""vLLM's KV cache events on the leader: where they are published, and what the
proxies are told about the engine's block hashing (the relay is ``kv_events_relay.py``).

Security: vLLM's publisher (``ZmqEventPublisher``, ``vllm/distributed/kv_events.py``)
has no authentication, and its events carry token ids (request content). Its default
endpoint, ``tcp://*:5557``, binds every interface. So the leader sets the endpoints
itself (``kv_events_config`` is a key ``--engine-args`` refuses, engine_args.py): two
``ipc://`` sockets in a directory only the leader's user can enter (0700), where the
publisher binds and the relay, in the same leader, connects. The proxies get the
events from the relay, over the authenticated OpenAI channel.

Data parallelism: vLLM offsets each DP rank's endpoints
(``ZmqEventPublisher.offset_endpoint_port``): rank 0 keeps them as given, and an
``ipc://`` endpoint of another rank is refused ("must contain 'inproc' or 'tcp'").
The leader runs one engine (``data_parallel_size`` is refused, engine_args.py), whose
scheduler publishes as DP rank 0 (``Scheduler.__init__``:
``parallel_config.data_parallel_index``, 0 without DP), so the paths stand as given.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PUB_SOCKET = "kv-events"  # vLLM's PUB socket (the live stream)
REPLAY_SOCKET = "kv-replay"  # vLLM's ROUTER socket (replay requests)
# The longest path a Unix socket can bind (sockaddr_un.sun_path, 108 bytes with the NUL;
# libzmq refuses longer ipc paths).
IPC_PATH_MAX = 107
# How many of the newest batches vLLM keeps for replay (``buffer_steps``; vLLM's
# default is 10 000). A replay sends all of them at once from EngineCore's publisher
# thread through a ROUTER socket that drops what its peer cannot take (send HWM 1000
# plus the relay's receive HWM): measured here, 2048 buffered batches replayed whole
# to a reader that stalled for a second, 4096 lost some. A proxy asks for a replay
# within moments of a gap, which 1024 steps (tens of seconds of a busy engine) covers.
DEFAULT_BUFFER_STEPS = 1024
# vLLM's PUB high-water mark (``hwm``, default 100 000): batches queued in EngineCore
# for a relay that does not read before the PUB socket drops them (the proxies then
# see a gap and ask for a replay). Bounds what a stalled relay costs EngineCore.
PUB_HWM = 4096


def endpoints(directory: str | Path) -> tuple[str, str]:
    """(live, replay) ZMQ endpoints of the publisher in ``directory``."""
    d = Path(directory)
    return f"ipc://{d / PUB_SOCKET}", f"ipc://{d / REPLAY_SOCKET}"


def engine_config(directory: str | Path, buffer_steps: int) -> dict[str, Any]:
    """``AsyncEngineArgs.kv_events_config``, as a dict of ``KVEventsConfig`` fields
    (``vllm/config/kv_events.py``; ``VllmConfig`` validates it into one), so the
    engine arguments stay JSON and the caller imports no vLLM."""
    live, replay = endpoints(directory)
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # ipc:// is a bind endpoint for vLLM (ZmqEventPublisher._is_bind_endpoint);
        # the replay socket is always bound (_bind).
        "endpoint": live,
        "replay_endpoint": replay,
        "buffer_steps": buffer_steps,
        "hwm": PUB_HWM,
        # One publisher per socket: no topic to filter on.
        "topic": "",
    }


def usable_dir(path: Path) -> bool:
    """Whether both sockets' paths fit a Unix socket address."""
    return len(str(path / max(PUB_SOCKET, REPLAY_SOCKET, key=len))) <= IPC_PATH_MAX


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory of the current user that nobody else may enter (created
    0700; an existing one is tightened to 0700); ValueError if another user owns it or
    it is not a directory (a symbolic link included: it could lead anywhere)."""
    p = Path(path)
    try:
        p.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass  # checked below: a directory (not a link to one) of this user
    st = p.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{p} is not a directory")
    if st.st_uid != os.getuid():
        raise ValueError(f"{p} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(p, 0o700)
    return p


def resolve_dir(configured: str) -> tuple[Path, bool]:
    """The directory the publisher's sockets go in: ``configured`` (the launcher's
    ``<run dir>/kv-events``) when its socket paths fit, else a fresh private temporary
    directory. Returns (directory, whether it is a temporary one the caller removes)."""
    if configured:
        path = Path(configured)
        if usable_dir(path):
            return private_dir(path), False
        log.warning(
            "%s is too long for a Unix socket path (%d bytes at most); the KV event "
            "sockets go in a private temporary directory",
            path,
            IPC_PATH_MAX,
        )
    return Path(tempfile.mkdtemp(prefix="ns-kv-")), True  # mkdtemp: 0700


def remove_dir(path: Path) -> None:
    """Remove a temporary socket directory (``resolve_dir``): the sockets, then it."""
    for name in (PUB_SOCKET, REPLAY_SOCKET):
        (path / name).unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:
        log.debug("could not remove %s", path, exc_info=True)


# ---- what the proxies are told -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvSource:
    """Where the engine's KV event publisher is (``KVEventsConfig``'s fields)."""

    endpoint: str
    replay_endpoint: str | None
    buffer_steps: int
    topic: str = ""


def published(engine: Any) -> KvSource | None:
    """The engine's KV event publisher, as vLLM resolved it
    (``AsyncLLM.get_kv_event_sources()``: each DP rank's ``KVEventsConfig``, from
    EngineCore's ready response), else as configured (an in-process EngineCore, whose
    client reports none, or a vLLM without that method); None when it publishes none
    (events off, or an engine that cannot say)."""
    sources = getattr(engine, "get_kv_event_sources", None)
    found = (sources() or {}) if callable(sources) else {}
    config = found.get(0) or next(iter(found.values()), None)
    if config is None:
        config = getattr(getattr(engine, "vllm_config", None), "kv_events_config", None)
    if config is None or not getattr(config, "enable_kv_cache_events", False):
        return None
    if getattr(config, "publisher", "") != "zmq":
        return None
    return KvSource(
        config.endpoint, config.replay_endpoint, int(config.buffer_steps), config.topic or ""
    )


def hashing(engine: Any) -> dict[str, Any]:
    """``openai_channel.KvInfo``'s hashing fields for the engine: what a proxy needs to
    compute the block hashes this engine's KV events carry.

    The NONE_HASH seed is resolved as vLLM 0.32 resolves it in EngineCore
    (``vllm/v1/core/kv_cache_utils.py``, ``resolve_none_hash_seed``, called by
    ``init_none_hash`` in ``EngineCore.__init__``): ``PYTHONHASHSEED`` if set, else for
    the cryptographic algorithms the fixed ``DEFAULT_NONE_HASH_SEED``
    ("vllm-none-hash"), else (xxhash) a random per-process seed, which the leader cannot
    know: then None. EngineCore inherits this process's environment, so
    ``PYTHONHASHSEED`` here is EngineCore's. vLLM releases without
    ``DEFAULT_NONE_HASH_SEED`` (0.11, the Neuron build) draw a random seed whenever
    ``PYTHONHASHSEED`` is unset: None too.
    """
    import vllm.envs as vllm_envs
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    cache = engine.vllm_config.cache_config
    algo = str(cache.prefix_caching_hash_algo)
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None and algo in ("sha256", "sha256_cbor"):
        seed = getattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED", None)
    # init_none_hash: NONE_HASH = BlockHash(hash_fn(seed)), the seed a str.
    none_hash = None if seed is None else bytes(get_hash_fn_by_name(algo)(seed))
    return {
        # The hashing granularity (``hash_block_size``: the block size for a model
        # with one KV cache group); the front end's copy of the config has the block
        # size EngineCore resolved (its ready response) but not always hash_block_size.
        "block_size": int(getattr(cache, "hash_block_size", None) or cache.block_size),
        "hash_algo": algo,
        "none_hash_seed": seed,
        "none_hash": none_hash,
        # maybe_convert_block_hash; a vLLM without the switch publishes the digests.
        "int_block_hashes": bool(getattr(vllm_envs, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", False)),
    }
