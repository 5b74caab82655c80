"""Typed configuration of the health-probing proxy.

Every section is a frozen dataclass checked in ``__post_init__`` so that a bad
file fails at start-up with a message naming the field, never mid-traffic.
``load_config`` reads YAML or JSON (JSON is a subset of YAML) and rejects
unknown keys: a typo such as ``unhealthy_treshold`` must not silently fall back
to a default. Defaults and the reasons for them are in ``proxy/README.md``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from neuron_serving import envs
from neuron_serving.openai_channel import PROGRESS_INTERVAL_S


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_addr(addr: str, what: str) -> None:
    host, sep, port = addr.rpartition(":")
    _check(
        bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65536,
        f"{what}: expected HOST:PORT, got {addr!r}",
    )


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    """Active probing (Envoy ``health_checks`` semantics)."""

    interval_s: float = 1.0
    timeout_s: float = 0.5
    jitter_s: float = 0.2
    unhealthy_threshold: int = 3
    healthy_threshold: int = 2

    def __post_init__(self) -> None:
        _check(self.interval_s > 0, "health.interval_s must be > 0")
        _check(0 < self.timeout_s <= self.interval_s, "health.timeout_s must be in (0, interval_s]")
        _check(self.jitter_s >= 0, "health.jitter_s must be >= 0")
        _check(self.unhealthy_threshold >= 1, "health.unhealthy_threshold must be >= 1")
        _check(self.healthy_threshold >= 1, "health.healthy_threshold must be >= 1")


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """Passive ejection (Envoy ``outlier_detection`` + the load balancer's panic threshold)."""

    consecutive_errors: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    # Below this percentage of routable units the proxy routes to every non-draining
    # unit instead (Envoy's healthy_panic_threshold); 0 disables panic mode.
    panic_threshold_pct: float = 50.0

    def __post_init__(self) -> None:
        _check(self.consecutive_errors >= 1, "outlier.consecutive_errors must be >= 1")
        _check(self.base_ejection_s > 0, "outlier.base_ejection_s must be > 0")
        _check(
            self.max_ejection_s >= self.base_ejection_s,
            "outlier.max_ejection_s must be >= base_ejection_s",
        )
        _check(
            0 <= self.panic_threshold_pct <= 100, "outlier.panic_threshold_pct must be in [0, 100]"
        )


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retries before the first token, and request migration after it."""

    max_attempts: int = 3  # attempts before the first token, the first one included
    backoff_base_s: float = 0.025
    backoff_max_s: float = 0.5
    max_migrations: int = 2  # mid-stream resumptions on another unit
    # Envoy retry budget: retries in flight may not exceed this share of active
    # requests (but at least min_retry_concurrency), so retries cannot amplify an outage.
    budget_pct: float = 20.0
    min_retry_concurrency: int = 3

    def __post_init__(self) -> None:
        _check(self.max_attempts >= 1, "retry.max_attempts must be >= 1")
        _check(self.backoff_base_s >= 0, "retry.backoff_base_s must be >= 0")
        _check(self.backoff_max_s >= self.backoff_base_s, "retry.backoff_max_s must be >= base")
        _check(self.max_migrations >= 0, "retry.max_migrations must be >= 0")
        _check(0 <= self.budget_pct <= 100, "retry.budget_pct must be in [0, 100]")
        _check(self.min_retry_concurrency >= 0, "retry.min_retry_concurrency must be >= 0")


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """How long an attempt may be silent, and how long a request may last.

    A slow answer is not a dead unit: a leader sends a progress report for every
    request that has had nothing to send for ``openai_channel.PROGRESS_INTERVAL_S``
    (2 s), so an attempt fails on silence only when no response and no report came
    for ``silence_s``: a leader gone, stuck, or cut off. A request queued in vLLM, a
    non-streamed answer of thousands of tokens or ``n`` of hundreds lasts as long as
    it takes, unless ``request_s`` caps it."""

    # Most a request may last, all attempts and migrations included; past it the
    # engine request is aborted and the client gets a 504 (OpenAI's error format).
    # 0 = no maximum (the default, as vllm serve has none).
    request_s: float = 0.0
    # One attempt: the longest gap between two things heard from the leader
    # (responses or progress reports). Several progress intervals, so that a leader
    # busy for a moment (a long prefill step, a GC pause) is not taken for a dead one.
    silence_s: float = 30.0

    def __post_init__(self) -> None:
        _check(
            self.request_s >= 0 and math.isfinite(self.request_s),
            "timeouts.request_s must be >= 0 (0 = no maximum)",
        )
        # Below a few progress intervals a healthy leader's request would look silent
        # between two reports; allowed (tests use fake leaders) but never a default.
        _check(
            self.silence_s > 0 and math.isfinite(self.silence_s),
            f"timeouts.silence_s must be a positive number (leaders report progress "
            f"every {PROGRESS_INTERVAL_S:g} s; use several times that)",
        )

    @property
    def max_request_s(self) -> float:
        """``request_s``, or infinity when there is no maximum."""
        return self.request_s or math.inf


@dataclass(frozen=True, slots=True)
class ClassConfig:
    """Flow control of one traffic class (``proxy/serving/flow_control.py``)."""

    queue_size: int  # waiting requests of the class; beyond it: 429
    queue_timeout_s: float  # a request that cannot start within this: 429 + Retry-After
    # After waiting this long a request ranks one class higher (again after each
    # further aging_s), so a lower class cannot starve forever; 0 = never.
    aging_s: float = 0.0
    # The share of a unit's slots (its max_num_seqs) this class may fill: the rest is
    # kept for more urgent classes, which then start at once on a unit running it.
    unit_share: float = 1.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        _check(self.queue_size >= 0, "queue_size must be >= 0")
        _check(
            self.queue_timeout_s > 0 and math.isfinite(self.queue_timeout_s),
            "queue_timeout_s must be a positive number",
        )
        _check(self.aging_s >= 0 and math.isfinite(self.aging_s), "aging_s must be >= 0")
        _check(0 < self.unit_share <= 1, "unit_share must be in (0, 1]")
        _check(self.retry_after_s >= 1, "retry_after_s must be >= 1")


# Real-time waits seconds at most; near-real-time ages into real-time after 10 s;
# batch waits as long as a request may live and leaves a quarter of every unit to
# the other classes.
CLASS_DEFAULTS: dict[str, ClassConfig] = {
    "real-time": ClassConfig(queue_size=512, queue_timeout_s=30.0),
    "near-real-time": ClassConfig(
        queue_size=1024, queue_timeout_s=120.0, aging_s=10.0, retry_after_s=5
    ),
    "batch": ClassConfig(queue_size=4096, queue_timeout_s=600.0, unit_share=0.75, retry_after_s=30),
}


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Flow control: which request starts next, and on which unit's room."""

    max_concurrent: int = 256  # requests streaming upstream at once, all units
    # Waiting requests of all classes together; past it the lowest class is shed first.
    queue_size: int = 4096
    # A unit's room: this many requests at once; 0 = its engine's max_num_seqs as its
    # leader reports it (unbounded while it has not reported).
    unit_max_in_flight: int = 0
    # A unit whose KV cache is at least this full takes only real-time requests.
    unit_max_kv_usage: float = 0.95
    # An engine report older than this is not trusted (the proxy's count alone).
    load_max_age_s: float = 5.0
    # Most choices a request may ask for (``n``, and ``best_of``): above it, a 400
    # before it waits or reaches a unit. 128 is OpenAI's documented limit of ``n``.
    # vLLM sets none and runs each choice as a sequence of its own, so without it one
    # request could queue thousands of sequences in a unit's engine.
    max_n: int = 128
    # Per class, over CLASS_DEFAULTS: {"batch": {"unit_share": 0.5}, ...}; after
    # construction, every class's ClassConfig.
    classes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.max_concurrent >= 1, "admission.max_concurrent must be >= 1")
        _check(self.queue_size >= 0, "admission.queue_size must be >= 0")
        _check(self.unit_max_in_flight >= 0, "admission.unit_max_in_flight must be >= 0")
        _check(0 < self.unit_max_kv_usage <= 1, "admission.unit_max_kv_usage must be in (0, 1]")
        _check(self.load_max_age_s > 0, "admission.load_max_age_s must be > 0")
        _check(
            isinstance(self.max_n, int) and not isinstance(self.max_n, bool) and self.max_n >= 1,
            "admission.max_n must be an integer >= 1",
        )
        _check(isinstance(self.classes, dict), "admission.classes must be a mapping")
        built = dict(CLASS_DEFAULTS)  # every class, so the effective values show
        for name, raw in self.classes.items():
            _check(name in CLASS_DEFAULTS, f"admission.classes: unknown class {name!r}")
            if isinstance(raw, ClassConfig):
                built[name] = raw
                continue
            _check(isinstance(raw, dict), f"admission.classes.{name}: expected a mapping")
            known = {f.name for f in dataclasses.fields(ClassConfig)}
            unknown = set(raw) - known
            _check(not unknown, f"admission.classes.{name}: unknown keys {sorted(unknown)}")
            try:
                built[name] = dataclasses.replace(CLASS_DEFAULTS[name], **raw)
            except ValueError as e:
                raise ValueError(f"admission.classes.{name}: {e}") from None
        object.__setattr__(self, "classes", built)

    def class_config(self, name: str) -> ClassConfig:
        return self.classes[name]


def default_data_dir() -> str:
    """$XDG_DATA_HOME/neuron-serving/proxy (~/.local/share/neuron-serving/proxy)."""
    base = envs.XDG_DATA_HOME or str(Path.home() / ".local" / "share")
    return str(Path(base) / "neuron-serving" / "proxy")


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """The OpenAI Batch API (``proxy/batch/``): state in SQLite, files local or in S3."""

    enabled: bool = True
    data_dir: str = ""  # "" = default_data_dir(); holds batch.sqlite3 (and files/)
    files_url: str = ""  # "" = <data_dir>/files; or s3://BUCKET/PREFIX
    max_file_bytes: int = 200 * 1000 * 1000  # OpenAI's limit for a batch input file
    max_lines: int = 50_000  # OpenAI's limit of requests per batch
    max_files_per_tenant: int = 10_000
    max_uploads: int = 4  # uploads received at once (each streamed to disk)
    upload_timeout_s: float = 600.0
    lines_in_flight: int = 64  # lines this proxy has in flow control at once
    lease_s: float = 60.0  # a line's lease; renewed while it runs
    max_attempts: int = 3  # unit faults before a line fails
    poll_s: float = 1.0  # how often the store is looked at for work with nothing woken
    replica_id: str = ""  # "" = <hostname>:<port>; distinct per replica sharing a store

    def __post_init__(self) -> None:
        _check(isinstance(self.enabled, bool), "batch.enabled must be a boolean")
        _check(
            not self.files_url or self.files_url.startswith("s3://"),
            "batch.files_url must be empty (local files) or s3://BUCKET[/PREFIX]",
        )
        _check(self.max_file_bytes >= 1024, "batch.max_file_bytes must be >= 1024")
        _check(self.max_lines >= 1, "batch.max_lines must be >= 1")
        _check(self.max_files_per_tenant >= 1, "batch.max_files_per_tenant must be >= 1")
        _check(self.max_uploads >= 1, "batch.max_uploads must be >= 1")
        _check(self.upload_timeout_s > 0, "batch.upload_timeout_s must be > 0")
        _check(self.lines_in_flight >= 1, "batch.lines_in_flight must be >= 1")
        _check(self.lease_s >= 1, "batch.lease_s must be >= 1")
        _check(self.max_attempts >= 1, "batch.max_attempts must be >= 1")
        _check(self.poll_s > 0, "batch.poll_s must be > 0")
        if not self.data_dir:
            object.__setattr__(self, "data_dir", default_data_dir())


@dataclass(frozen=True, slots=True)
class HistoryConfig:
    """The dashboard's time series (``GET /status/history``, ``serving/history.py``):
    read from a Prometheus that scrapes the fleet when ``prometheus_url`` is set (`up`
    sets its own), else from a window this proxy keeps in memory."""

    prometheus_url: str = ""  # "" = the proxy's own window
    interval_s: float = 5.0  # one point every interval (both sources)
    window_s: float = 900.0  # how far back the series go
    prometheus_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        _check(
            not self.prometheus_url or self.prometheus_url.startswith(("http://", "https://")),
            "history.prometheus_url must be empty or an http(s) URL",
        )
        _check(1.0 <= self.interval_s <= 60.0, "history.interval_s must be in [1, 60]")
        _check(
            self.interval_s * 2 <= self.window_s <= self.interval_s * 2000,
            "history.window_s must hold 2 to 2000 intervals",
        )
        _check(
            0 < self.prometheus_timeout_s <= 30, "history.prometheus_timeout_s must be in (0, 30]"
        )


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Bounds of the client-facing HTTP server against slow or hostile clients.

    Memory held for request bodies is at most ``max_buffered_body_bytes`` plus aiohttp's
    per-connection read buffer (about 128 KiB) times ``max_connections``; a connection
    that sends nothing useful is closed after ``header_timeout_s``.
    """

    # From accepting a connection (or finishing its last response) to a complete set of
    # request headers; also the keep-alive idle time (aiohttp's keepalive_timeout).
    header_timeout_s: float = 15.0
    body_timeout_s: float = 30.0  # from the handler asking for the body to its last byte
    # A streamed chunk the client does not take within this long ends the stream and
    # frees its admission slot (a client that stopped reading).
    write_timeout_s: float = 30.0
    max_connections: int = 1024  # open client connections; beyond it: 503 and close
    # Bodies being received at once, in bytes (Content-Length, or max_body_bytes when
    # chunked); beyond it: 503 + Retry-After without reading the body.
    max_buffered_body_bytes: int = 64 << 20
    max_line_size: int = 8190  # request line and each header line (aiohttp's default)
    max_headers: int = 128  # header count (aiohttp's default)

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "write_timeout_s"):
            v = getattr(self, name)
            _check(
                isinstance(v, int | float) and v > 0 and math.isfinite(v),
                f"limits.{name} must be a positive number",
            )
        _check(self.max_connections >= 1, "limits.max_connections must be >= 1")
        _check(
            self.max_buffered_body_bytes >= 1024, "limits.max_buffered_body_bytes must be >= 1024"
        )
        _check(self.max_line_size >= 1024, "limits.max_line_size must be >= 1024")
        _check(self.max_headers >= 16, "limits.max_headers must be >= 16")


POLICIES = ("kv_aware", "prefix_cache_aware", "least_loaded", "round_robin", "session_affinity")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    # kv_aware (exact where the leaders' KV events allow, else prefix_cache_aware) is
    # opt-in. As the default it sent every stream of the local cluster's failover test
    # to one unit (a stale load report; fixed by UnitState.load_now, checked with the
    # real policy, not yet by that e2e test under kv_aware); `bench routing` measures
    # it against prefix_cache_aware (bench/README.md, "routing").
    policy: str = "prefix_cache_aware"
    block_chars: int = 64  # prefix-index block size, in prompt characters
    max_blocks_per_unit: int = 65536  # LRU bound of the approximate prefix index
    # A cached prefix counts only if it covers at least this fraction of the prompt's blocks
    # (SGLang's cache_threshold): a shared BOS + role header must not pull everything to one unit.
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 4  # in-flight requests; see README for the why
    balance_rel_threshold: float = 1.5
    session_header: str = "x-session-id"
    # kv_aware: uncached prompt tokens that weigh as much as one more running or
    # waiting sequence on a unit (proxy/routing/kv_aware.py).
    prefill_tokens_per_seq: float = 256.0
    # kv_aware: a unit's KV usage weighs nothing up to this fraction, then rises to a
    # whole running batch at a full cache (proxy/routing/kv_aware.py).
    kv_usage_high: float = 0.8
    # kv_aware: a prompt's first home_prefix_tokens tokens pick its home unit
    # (rendezvous hashing); another unit that does not hold them yet pays home_weight
    # times their prefill again (proxy/routing/kv_aware.py, "Home units"). 0: off.
    home_prefix_tokens: int = 512
    home_weight: float = 1.0

    def __post_init__(self) -> None:
        _check(self.policy in POLICIES, f"routing.policy must be one of {POLICIES}")
        _check(self.home_prefix_tokens >= 0, "routing.home_prefix_tokens must be >= 0")
        _check(self.home_weight >= 0, "routing.home_weight must be >= 0")
        _check(self.prefill_tokens_per_seq > 0, "routing.prefill_tokens_per_seq must be > 0")
        _check(0 <= self.kv_usage_high < 1, "routing.kv_usage_high must be in [0, 1)")
        _check(self.block_chars >= 1, "routing.block_chars must be >= 1")
        _check(self.max_blocks_per_unit >= 1, "routing.max_blocks_per_unit must be >= 1")
        _check(0 <= self.cache_threshold <= 1, "routing.cache_threshold must be in [0, 1]")
        _check(self.balance_abs_threshold >= 0, "routing.balance_abs_threshold must be >= 0")
        _check(self.balance_rel_threshold >= 1.0, "routing.balance_rel_threshold must be >= 1")
        _check(bool(self.session_header), "routing.session_header must not be empty")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A served model: what the client names, and where its tokenizer files live."""

    name: str
    model_dir: str | None = None  # holds tokenizer.json (Triton's route: prompt-length check)
    max_model_len: int | None = None  # bounds Triton's route's prompt + max_tokens
    default_max_tokens: int = 16  # Triton's route without max_tokens (vllm_backend's 16)

    def __post_init__(self) -> None:
        _check(bool(self.name), "models[].name must not be empty")
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            f"model {self.name}: max_model_len must be >= 1",
        )
        _check(self.default_max_tokens >= 1, f"model {self.name}: default_max_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """One inference unit: a Triton+vLLM leader and its followers."""

    unit_id: str
    leader_grpc: str
    leader_http: str = ""
    followers: tuple[str, ...] = ()  # grpc.health.v1 addresses, service "" is the node
    model: str = "llm"  # the OpenAI model name clients use
    triton_model: str = "llm"  # the model name in the leader's Triton repository
    # Deployment label shown in /status and metrics (for canaries); not a Triton version:
    # the proxy always asks Triton for the latest loaded version.
    model_version: str = ""

    def __post_init__(self) -> None:
        _check(
            isinstance(self.unit_id, str) and bool(self.unit_id),
            "unit_id must be a non-empty string",
        )
        for name in ("leader_grpc", "leader_http", "model", "triton_model", "model_version"):
            _check(
                isinstance(getattr(self, name), str),
                f"unit {self.unit_id}: {name} must be a string",
            )
        _check(
            isinstance(self.followers, list | tuple)
            and all(isinstance(f, str) for f in self.followers),
            f"unit {self.unit_id}: followers must be a list of HOST:PORT strings",
        )
        _check_addr(self.leader_grpc, f"unit {self.unit_id}: leader_grpc")
        if self.leader_http:
            _check_addr(self.leader_http, f"unit {self.unit_id}: leader_http")
        object.__setattr__(self, "followers", tuple(self.followers))
        for f in self.followers:
            _check_addr(f, f"unit {self.unit_id}: follower")
        _check(bool(self.model) and bool(self.triton_model), f"unit {self.unit_id}: empty model")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> UnitSpec:
        return _build(cls, raw, "unit")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # SO_REUSEPORT on the client port: several proxy replicas on one host bind the same
    # port and the kernel spreads new connections among them (`up --proxies K`). Each
    # replica keeps its own admin_port.
    reuse_port: bool = False
    admin_host: str = "127.0.0.1"
    admin_port: int = 8081
    admin_token_file: str | None = None
    # Client API keys by tenant (proxy/api/auth.py); with none here, from --api-key or
    # NEURON_SERVING_API_KEY, the client API is unauthenticated (and then the proxy
    # refuses a non-loopback host unless allow_unauthenticated).
    api_keys_file: str | None = None
    api_key: str | None = field(default=None, repr=False)  # --api-key; tenant "default"
    allow_unauthenticated: bool = False
    max_body_bytes: int = 1 << 20
    # OpenAI calls over each leader's OpenAI channel when it announces one (one
    # multiplexed connection per leader; proxy/upstream/channel.py); false = always
    # Triton's gRPC. Needs the channel token (NEURON_SERVING_CHANNEL_TOKEN or its
    # file, the same as the leaders'); without it the proxy uses gRPC.
    openai_channel: bool = True
    health: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)
    models: tuple[ModelSpec, ...] = ()
    units: tuple[UnitSpec, ...] = ()

    def __post_init__(self) -> None:
        for name in ("port", "admin_port"):
            p = getattr(self, name)
            _check(0 <= p < 65536, f"{name} must be in [0, 65535] (0 = any free port)")
        _check(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        _check(
            self.limits.max_buffered_body_bytes >= self.max_body_bytes,
            "limits.max_buffered_body_bytes must be >= max_body_bytes",
        )
        _check(
            isinstance(self.allow_unauthenticated, bool), "allow_unauthenticated must be a boolean"
        )
        _check(isinstance(self.reuse_port, bool), "reuse_port must be a boolean")
        ids = [u.unit_id for u in self.units]
        _check(len(ids) == len(set(ids)), "unit ids must be unique")
        names = [m.name for m in self.models]
        _check(len(names) == len(set(names)), "model names must be unique")

    def admin_token(self) -> str | None:
        """The env variable wins over the file; None means the admin API refuses everything."""
        token = envs.NEURON_SERVING_PROXY_ADMIN_TOKEN
        if not token and self.admin_token_file:
            token = Path(self.admin_token_file).expanduser().read_text().strip()
        return token or None

    def model_spec(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - known
    for key in sorted(unknown):
        replaced = _REPLACED.get(f"{where}.{key}")
        _check(replaced is None, f"{where}.{key} was replaced: {replaced}")
    _check(not unknown, f"{where}: unknown keys {sorted(unknown)}")
    return cls(**raw)


# Keys that no longer exist, and what took their place.
_SILENCE = (
    "leaders report progress while a request has nothing to send, so one budget "
    "(timeouts.silence_s) bounds every silence, before the first token and after it"
)
_REPLACED = {
    "timeouts.first_token_s": _SILENCE,
    "timeouts.inter_token_s": _SILENCE,
    "proxy config.upstream_protocol": "Triton's HTTP transport was removed; the fallback "
    "to the OpenAI channel is always gRPC (proxy/upstream/transport.py says why)",
    "routing.home_load_factor": "bounded homes were removed (they did not hold up in "
    "bench routing, bench/README.md); home_weight alone moves a prompt off a busy home",
}

_SECTIONS = {
    "health": HealthCheckConfig,
    "outlier": OutlierConfig,
    "retry": RetryConfig,
    "timeouts": TimeoutConfig,
    "admission": AdmissionConfig,
    "limits": LimitsConfig,
    "routing": RoutingConfig,
    "batch": BatchConfig,
    "history": HistoryConfig,
}


def section_from_dict(name: str, raw: Any) -> Any:
    """One section of the config (``admission``, ``routing``...) from its mapping, with
    the checks ``config_from_dict`` applies to it: for a tool that writes a section
    into a proxy's config and wants it refused before any proxy starts."""
    return _build(_SECTIONS[name], raw or {}, name)


def config_from_dict(raw: dict[str, Any]) -> ProxyConfig:
    if not isinstance(raw, dict):
        raise ValueError("proxy config: expected a mapping at the top level")
    raw = dict(raw)
    for key in _SECTIONS:
        if key in raw:
            raw[key] = section_from_dict(key, raw[key])
    raw["models"] = tuple(_build(ModelSpec, m, "models[]") for m in raw.get("models") or ())
    raw["units"] = tuple(UnitSpec.from_dict(u) for u in raw.get("units") or ())
    return _build(ProxyConfig, raw, "proxy config")


def load_config(path: str | Path, **overrides: Any) -> ProxyConfig:
    """Read YAML or JSON; ``overrides`` (e.g. port from the command line) win over the file."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return config_from_dict(raw)
