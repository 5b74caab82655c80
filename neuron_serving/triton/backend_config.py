"""Typed settings of the Triton ``llm`` model, read from ``model.json``.

``model_repository/llm/1/model.json`` holds the defaults; the leader launcher renders
a copy into its run directory with the command line's overrides (model path, tp,
control port, ...). vllm_backend treats model.json as raw ``AsyncEngineArgs``; we
do not, because every unit must build its engine through
``neuron_serving.unit.engine.engine_kwargs`` (one engine recipe for ``generate``,
Triton and the benchmarks), so model.json names only what that recipe takes, plus
``engine_args``: any other engine argument, vllm_backend style (engine_args.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.manifest import VERSION_RE, is_version
from neuron_serving.triton.engine_args import check_engine_args
from neuron_serving.triton.kv_events import DEFAULT_BUFFER_STEPS

# vLLM's own executor for single-process development; "unit" is the project's
# UnitExecutor. Switching is one model.json field (or `leader --executor`).
EXECUTORS = ("unit", "uni", "mp")


@dataclass(slots=True)
class BackendConfig:
    model: str = ""
    tensor_parallel_size: int = 1
    max_model_len: int = 1024
    kv_cache_bytes: int = 512 << 20
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    seed: int = 0
    # Skip torch.compile warm-up: startup in seconds instead of ~30 s per rank
    # on CPU, at some cost in step time (tests and crash-loop recovery use it).
    enforce_eager: bool = False
    dtype: str = "auto"
    # Tokens per streamed response (vLLM's stream_interval). Each response is a
    # stub-to-server IPC plus a gRPC message, so 1 (every token) costs throughput.
    stream_interval: int = 1
    executor: str = "unit"
    # Control plane of the unit (see neuron_serving.unit.config.UnitConfig).
    control_port: int = 29500
    control_host: str = "127.0.0.1"
    unit_id: str = ""  # "" = NEURON_SERVING_UNIT_ID (what `neuron-serving up` sets)
    # Unit shared-secret file ("" = NEURON_SERVING_UNIT_TOKEN / _TOKEN_FILE / default
    # file, see neuron_serving.unit.auth). The secret itself never goes in model.json.
    token_file: str = ""
    # Readiness: AsyncLLM.check_health() every health_interval_s; when no request
    # has run for canary_interval_s, a one-token greedy generation goes through every
    # rank and must finish within canary_timeout_s.
    health_interval_s: float = 1.0
    canary_interval_s: float = 5.0
    canary_timeout_s: float = 30.0
    # vLLM's Prometheus registry lives in the model (stub) process; it is served
    # here so the launcher can merge it into the metrics port. 0 = off.
    vllm_metrics_port: int = 0
    vllm_metrics_host: str = "127.0.0.1"
    # File written when initialize() has finished; the launcher uses it to notice a
    # tritonserver that abandoned the load anyway (see launcher.wait_ready). "" = off.
    init_marker: str = ""
    # The checkpoint version this unit serves: the manifest's for a sharded
    # checkpoint, else what `leader --model-version` says ("" = unversioned). Sent
    # with every request's first response and published as the Triton model config
    # parameter "model_version", which the proxy reads to route and tag responses.
    model_version: str = ""
    # The model name of the OpenAI API (vLLM's --served-model-name; what responses
    # carry in "model"). "" = the manifest's model name, else the directory's name
    # (checkpoint/served_name.py, the function `neuron-serving up` uses too).
    served_model_name: str = ""
    # vLLM's --tool-call-parser with --enable-auto-tool-choice; "" = neither (tool_choice
    # "auto" is refused, as by vllm serve without them). "pythonic" needs no special
    # tokens, so it works with any tokenizer, the demo model's included.
    tool_call_parser: str = "pythonic"
    # Any other vLLM engine argument (`leader --engine-args JSON`), applied last to
    # what engine_kwargs() builds; keys the unit sets itself are refused (engine_args.py).
    engine_args: dict[str, Any] = field(default_factory=dict)
    # The OpenAI channel (neuron_serving/openai_channel.py): the proxy's multiplexed
    # connection to this leader, served on the engine loop. The launcher picks a free
    # port and announces it as the model config parameter "openai_channel_port";
    # None = no channel (the proxy then uses Triton's gRPC or HTTP front end). The
    # host is Triton's own bind address: the channel is as reachable as Triton.
    openai_channel_port: int | None = None
    openai_channel_host: str = "127.0.0.1"
    # vLLM's KV cache events (kv_events.py, kv_events_relay.py), relayed to the proxies
    # over the OpenAI channel for exact KV-aware routing. On whenever prefix caching
    # is (the events are the prefix cache's); `leader --no-kv-events` or
    # NEURON_SERVING_KV_EVENTS=0 turns them off.
    kv_events: bool = True
    # The private directory (0700) of the publisher's ipc:// sockets; the launcher
    # renders <run dir>/kv-events. "" (or a path too long for a Unix socket) = a
    # private temporary directory the backend makes; engine_kwargs() sets no KV
    # events config without one.
    kv_events_dir: str = ""
    # How many of the newest event batches vLLM keeps for a proxy's replay.
    kv_events_buffer_steps: int = DEFAULT_BUFFER_STEPS

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.executor == "uni" and self.tensor_parallel_size != 1:
            raise ValueError("executor 'uni' runs one process: it needs tensor_parallel_size 1")
        for name in ("health_interval_s", "canary_interval_s", "canary_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        # A checkpoint's version, rendered into config.pbtxt (repository.py).
        if self.model_version and not is_version(self.model_version):
            raise ValueError(
                f"model_version must match {VERSION_RE.pattern}, got {self.model_version!r}"
            )
        if not 0 <= self.vllm_metrics_port < 65536:
            raise ValueError(f"vllm_metrics_port must be in 0..65535, got {self.vllm_metrics_port}")
        if self.openai_channel_port is not None and not 0 <= self.openai_channel_port < 65536:
            raise ValueError(
                f"openai_channel_port must be in 0..65535, got {self.openai_channel_port}"
            )
        if self.kv_events_buffer_steps < 1:
            raise ValueError(
                f"kv_events_buffer_steps must be >= 1, got {self.kv_events_buffer_steps}"
            )
        if self.engine_args:
            check_engine_args(self.engine_args)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackendConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown model.json keys: {unknown} (known: {sorted(names)})")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> BackendConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved_unit_id(self) -> str:
        from neuron_serving import envs

        return self.unit_id or envs.NEURON_SERVING_UNIT_ID

    def engine_kwargs(self) -> dict[str, Any]:
        """AsyncEngineArgs keyword arguments, always via the unit's one recipe."""
        from neuron_serving.unit.config import UnitConfig
        from neuron_serving.unit.engine import engine_kwargs

        unit = UnitConfig.from_env(
            control_port=self.control_port,
            control_host=self.control_host,
            unit_id=self.unit_id or None,
            token_file=self.token_file or None,
        )
        overrides: dict[str, Any] = {"stream_interval": self.stream_interval}
        if self.executor != "unit":
            overrides["distributed_executor_backend"] = self.executor
        kwargs = engine_kwargs(
            self.model,
            self.tensor_parallel_size,
            unit,
            max_model_len=self.max_model_len,
            kv_cache_bytes=self.kv_cache_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager,
            dtype=self.dtype,
            **overrides,
        )
        # Last, over the recipe's defaults (enable_prefix_caching, seed...); never an
        # OWNED key (checked in __post_init__), so the unit's own settings stand.
        kwargs.update(self.engine_args)
        # After engine_args: the events are the prefix cache's, so they follow the
        # prefix caching that is finally asked for. kv_events_config is OWNED: the
        # endpoints are always the private ipc:// ones (kv_events.py, "Security").
        if self.kv_events and self.kv_events_dir and kwargs.get("enable_prefix_caching"):
            from neuron_serving.triton.kv_events import engine_config

            kwargs["kv_events_config"] = engine_config(
                self.kv_events_dir, self.kv_events_buffer_steps
            )
        return kwargs
