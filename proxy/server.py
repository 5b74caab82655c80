"""The proxy process: wires registry, probes, outlier detection, routing,
admission and the HTTP front ends together, and owns their lifecycle.

Two listeners: the client port (OpenAI API, ``/status``, ``/metrics``) and the
admin port (bearer-token API). Both bind 127.0.0.1 unless configured otherwise.
Client disconnects cancel the handler (``handler_cancellation``), which closes
the dispatcher's generator and so cancels the upstream gRPC call at once.

Client authentication (proxy/api/auth.py) runs as the innermost middleware, before any
handler reads a body: an unauthenticated request costs its headers and nothing
else. Both listeners run on ``GuardedAppRunner`` (proxy/api/http_guard.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from neuron_serving import envs
from neuron_serving.bearer import bearer_matches
from neuron_serving.netaddr import is_loopback
from neuron_serving.openai_channel import CONFIG_PARAMETER as CHANNEL_PARAMETER
from neuron_serving.openai_channel import resolve_token as resolve_channel_token
from neuron_serving.s3 import s3_client
from neuron_serving.secret_file import SecretError
from proxy.api.admin import AdminAPI
from proxy.api.auth import ApiKeys, load_api_keys
from proxy.api.dashboard import routes as dashboard_routes
from proxy.api.http_guard import (
    BODY_GUARD,
    TENANT,
    TRAFFIC_CLASS,
    AccessLogger,
    BodyGuard,
    GuardedAppRunner,
    access_log,
)
from proxy.api.openai_api import OpenAIFrontEnd
from proxy.api.pipeline import FrontEndDeps, Pipeline
from proxy.api.status import build_status
from proxy.api.triton_api import TritonFrontEnd
from proxy.batch.api import BatchAPI
from proxy.batch.blobs import Blobs, LocalBlobs, S3Blobs
from proxy.batch.runner import BatchRunner
from proxy.batch.store import BatchDB
from proxy.config import ProxyConfig
from proxy.errors import APIError
from proxy.registry import NodeHealth, Registry, RegistryEvent, UnitState
from proxy.routing import KvFleet, make_policy
from proxy.routing.kv.index import DEFAULT_MAX_BLOCKS_PER_UNIT
from proxy.routing.kv.metrics import KvIndexCollector
from proxy.routing.kv.sink import KvIndexSink
from proxy.serving.dispatch import Dispatcher, GenerationJob, OpenAIJob
from proxy.serving.flow_control import FlowController
from proxy.serving.history import PrometheusHistory, ProxyHistory, history_view
from proxy.serving.metrics import REQUEST_UNIT, ProxyMetrics
from proxy.serving.outlier import OutlierDetector
from proxy.upstream.channel import ChannelUpstream
from proxy.upstream.health_checker import HealthChecker
from proxy.upstream.leader_client import TritonClientPool
from proxy.upstream.transport import UnitTransport
from proxy.upstream.triton_grpc import TritonUpstream

log = logging.getLogger(__name__)

# Routes any caller may use: liveness, the dashboard page (static; the data it shows
# comes from /status) and /status (redacted without a key).
PUBLIC_PATHS = frozenset(("/health", "/healthz", "/dashboard", "/status"))
# The dashboard's vendored chart library: loaded by a <script> tag, which sends no key.
PUBLIC_PREFIX = "/dashboard/vendor/"


def unauthorized(message: str = "") -> APIError:
    return APIError(
        401,
        message or "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
        "invalid_request_error",
        None,
        "invalid_api_key",
        {"WWW-Authenticate": "Bearer"},
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves in OpenAI's format; an unexpected one is a logged 500, and the
    proxy keeps serving."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return APIError(e.status, e.reason, kind, None, None, allow).response()
    except (ConnectionResetError, TimeoutError) as e:
        log.info("client connection lost: %s", e)
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(
            500, "internal proxy error", "server_error", None, "internal_error"
        ).response()


class ProxyServer:
    def __init__(self, config: ProxyConfig, seed: int | None = None) -> None:
        self.config = config
        self.registry = Registry()
        self.metrics = ProxyMetrics()
        self.clients = TritonClientPool()
        self.outlier = OutlierDetector(config.outlier)
        triton = TritonUpstream(self.clients, config.timeouts)
        # The exact KV view kv_aware reads, fed by the leaders' KV events (with the
        # OpenAI channel: _openai_channel); the other policies do not read it.
        self.kv_fleet: KvFleet | None = None
        if config.routing.policy == "kv_aware":
            self.kv_fleet = KvFleet(DEFAULT_MAX_BLOCKS_PER_UNIT)
        policy = make_policy(
            config.routing,
            seed=seed,
            kv=self.kv_fleet,
            load_max_age_s=config.admission.load_max_age_s,
        )
        # The KV event streams into kv_fleet (set with the OpenAI channel).
        self.kv_index: KvIndexSink | None = None
        channel = self._openai_channel(config, triton)
        self.transport = UnitTransport(triton, channel)
        self.dispatcher = Dispatcher(
            self.registry,
            self.outlier,
            policy,
            self.transport,
            config.retry,
            self.metrics,
        )
        envs_key = envs.NEURON_SERVING_API_KEY
        # Loaded here, not at start: a bad keys file fails construction, before any port.
        self.api_keys: ApiKeys = load_api_keys(config.api_keys_file, config.api_key or envs_key)
        self.admission: FlowController[GenerationJob | OpenAIJob] = FlowController(
            config.admission,
            self.dispatcher.place,
            self.dispatcher.release_first,
            self.metrics,
            self.api_keys.weight_of,
        )
        self._admin_token: str | None = None
        self._exposure_checked = False
        self.body_guard = BodyGuard(
            config.max_body_bytes,
            config.limits.max_buffered_body_bytes,
            config.limits.body_timeout_s,
        )
        self.health = HealthChecker(
            self.registry,
            config.health,
            self.clients,
            self._on_probe,
            on_leader_config=None if channel is None else self._on_leader_config,
        )
        self.registry.subscribe(self._on_registry_change)
        # What the front ends use, handed to them: none of them imports this module.
        self.pipeline = Pipeline(
            FrontEndDeps(config, self.registry, self.admission, self.dispatcher, self.metrics)
        )
        self._runners: list[web.AppRunner] = []
        self.batch_api: BatchAPI | None = None
        self.batch_runner: BatchRunner | None = None
        self._batch_db: BatchDB | None = None
        self._background: set[asyncio.Task[None]] = set()
        # The dashboard's time series: this proxy's own window, and the fleet's
        # Prometheus when configured (serving/history.py).
        self.history = ProxyHistory(self.metrics.registry, self._units_now,
                                    self._queued_now, config.history)  # fmt: skip
        self.prometheus_history = (
            PrometheusHistory(config.history) if config.history.prometheus_url else None
        )
        self._history_session: aiohttp.ClientSession | None = None
        self.port = config.port
        self.admin_port = config.admin_port
        for spec in config.units:
            self.registry.add(spec)

    def _openai_channel(
        self, config: ProxyConfig, triton: TritonUpstream
    ) -> ChannelUpstream | None:
        if not config.openai_channel:
            return None
        try:
            token = resolve_channel_token()
        except SecretError as e:
            log.warning("OpenAI channel off, OpenAI calls go over Triton: %s", e)
            return None
        # The leaders' KV cache events into the exact KV index (the channel delivers
        # them in order per unit, gaps replayed).
        if self.kv_fleet is not None:
            self.kv_index = KvIndexSink(self.kv_fleet)
        upstream = ChannelUpstream(
            token,
            config.timeouts,
            triton,
            self.metrics.channel_fallbacks.inc,
            registry=self.registry,
            kv_sink=self.kv_index,
        )
        if self.kv_index is not None and upstream.kv_order is not None:
            self.metrics.registry.register(
                KvIndexCollector(
                    self.kv_index, upstream.kv_order, lambda: sorted(self.registry.units)
                )
            )
        return upstream

    def _on_leader_config(self, unit: UnitState, parameters: Mapping[str, str]) -> None:
        """A leader's model config, read by a probe: where its OpenAI channel is."""
        raw = parameters.get(CHANNEL_PARAMETER, "")
        port = int(raw) if raw.isdigit() and 0 < int(raw) < 65536 else None
        channel = self.transport.channel
        assert channel is not None  # registered only with a channel (__init__)
        channel.announce(unit.spec, port)

    def _on_registry_change(self, event: RegistryEvent, unit: UnitState) -> None:
        if event == "removed":
            self.dispatcher.policy.on_unit_removed(unit.unit_id)
            if self.transport.channel is not None:
                self.transport.channel.forget(unit.unit_id)  # ends its KV stream
            if self.kv_index is not None:
                # A unit re-added under this id starts over from its KvInfo.
                self.kv_index.remove_unit(unit.unit_id)
            task = asyncio.get_running_loop().create_task(self._close_client_when_idle(unit))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _close_client_when_idle(self, unit: UnitState) -> None:
        """A removed unit's requests finish on its channel; then the channel is closed,
        unless another unit (re-added under a new id) uses the same leader."""
        addr = unit.spec.leader_grpc
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeouts.max_request_s
        while unit.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.2)
        if all(u.spec.leader_grpc != addr for u in self.registry.units.values()):
            await self.clients.discard(addr)

    def _on_probe(self, unit: UnitState, node: NodeHealth, ok: bool, latency_s: float) -> None:
        self.metrics.probe_latency.labels(node.role).observe(latency_s)
        if not ok:
            self.metrics.probe_failures.labels(unit.unit_id, node.node_id).inc()

    # -- client-port handlers ---------------------------------------------------------

    def is_admin(self, request: web.Request) -> bool:
        return bearer_matches(request.headers.get("Authorization"), self._admin_token)

    def is_trusted(self, request: web.Request) -> bool:
        """A caller who may see internal detail: a client key, the admin token, or (with
        no client keys configured) anyone, if the proxy listens on loopback only."""
        if TENANT in request or self.is_admin(request):
            return True
        return not self.api_keys.enabled and is_loopback(self.config.host)

    async def status(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        panic = [
            m
            for m in self.registry.models()
            if self.outlier.eligible(self.registry.for_model(m), now).panic
        ]
        body = build_status(
            self.registry,
            policy=self.dispatcher.policy.name,
            queued=self.admission.queued,
            active=self.admission.active,
            panic_models=panic,
            classes=self.admission.snapshot(),
            redact=not self.is_trusted(request),
            upstream_of=self.transport.name_for,
            kv_of=None if self.kv_fleet is None else self.kv_fleet.describe,
            prefix_cache_of=self.metrics.kv_accuracy.snapshot,
        )
        if self.batch_runner is not None and not body["redacted"]:
            body["batches"] = await self.batch_runner.status()
        return web.json_response(body)

    def _units_now(self) -> list[tuple[str, str, float | None]]:
        now = time.monotonic()
        return [(u.unit_id, u.routing_state(now),
                 None if u.engine_load is None else u.engine_load.kv_usage)
                for u in self.registry.units.values()]  # fmt: skip

    def _queued_now(self) -> dict[str, int]:
        return {name: int(c["queued"]) for name, c in self.admission.snapshot().items()}

    async def history_handler(self, request: web.Request) -> web.Response:
        """``GET /status/history``: the dashboard's time series (the full view only, as
        /status's detail: queue depths and KV usage per unit are not for strangers)."""
        if not self.is_trusted(request):
            return web.json_response({"redacted": True})
        if self.prometheus_history is not None and self._history_session is None:
            self._history_session = aiohttp.ClientSession()
        view = await history_view(self.history, self.prometheus_history, self._history_session)
        return web.json_response(view, headers={"Cache-Control": "no-store"})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.refresh(
            self.registry,
            time.monotonic(),
            self.admission.queued,
            self.admission.active,
            self.transport.name_for,
            self.admission.snapshot(),
        )
        if self.batch_runner is not None:
            self.metrics.batches_active.set(len((await self.batch_runner.status())["active"]))
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def make_app(self) -> web.Application:
        keys = self.api_keys

        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            resp = await handler(request)
            endpoint = (
                request.match_info.route.resource.canonical
                if request.match_info.route.resource
                else "unmatched"
            )
            unit = request.get(REQUEST_UNIT, "")
            tenant = request.get(TENANT, "")
            cls = request.get(TRAFFIC_CLASS)
            m = self.metrics
            label = "" if cls is None else cls.label
            m.child(m.requests, endpoint, str(resp.status), unit, tenant, label).inc()
            return resp

        @web.middleware
        async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
            # Before the handler, hence before any body is read or parsed.
            if keys.enabled:
                tenant = keys.tenant_of_header(request.headers.get("Authorization"))
                if tenant is not None:
                    request[TENANT] = tenant
                    request[TRAFFIC_CLASS] = keys.class_of(tenant)
                elif (
                    request.path not in PUBLIC_PATHS and not request.path.startswith(PUBLIC_PREFIX)
                ) and not (request.path == "/metrics" and self.is_admin(request)):
                    raise unauthorized()
            return await handler(request)

        app = web.Application(
            middlewares=[count, error_middleware, authenticate],
            client_max_size=self.config.max_body_bytes,
        )
        app[BODY_GUARD] = self.body_guard
        app.add_routes(OpenAIFrontEnd(self.pipeline).routes())
        app.add_routes(TritonFrontEnd(self.pipeline).routes())
        app.add_routes(dashboard_routes())
        if self.batch_api is not None:
            app.add_routes(self.batch_api.routes())
        app.add_routes(
            [
                web.get("/status", self.status),
                web.get("/status/history", self.history_handler),
                web.get("/metrics", self.metrics_handler),
                web.get("/health", self.healthz),  # vLLM's name
                web.get("/healthz", self.healthz),
            ]
        )
        return app

    # -- lifecycle --------------------------------------------------------------------

    def check_exposure(self) -> None:
        """No client keys: serve like ``vllm serve`` does, but never by accident on a
        non-loopback address. Idempotent (the CLI checks before the event loop runs)."""
        if not self.api_keys.enabled and not (
            is_loopback(self.config.host) or self.config.allow_unauthenticated
        ):
            raise ValueError(
                f"refusing to serve the client API on {self.config.host} without an API key: "
                "set api_keys_file, --api-key or NEURON_SERVING_API_KEY "
                "(or --allow-unauthenticated)"
            )
        if self._exposure_checked:
            return
        self._exposure_checked = True
        if self.api_keys.enabled:
            log.info("client API keys configured for tenants %s", self.api_keys.tenants())
        else:
            log.warning("no client API key configured: the client API is unauthenticated")

    async def start(self) -> None:
        self.check_exposure()
        token = self._admin_token = self.config.admin_token()
        if token is None:
            log.warning("no admin token configured: the admin API refuses every request")
        self.health.start()
        task = asyncio.get_running_loop().create_task(self.history.run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if self.config.batch.enabled:
            await self._open_batch()
        admin_app = AdminAPI(
            self.registry, token, self.body_guard, self.config.max_body_bytes
        ).app()
        # This replica's own view, behind the admin token: with replicas sharing the client
        # port (reuse_port), the client port's /status and /metrics are whichever replica
        # the kernel picked.
        admin_app.add_routes(
            [
                web.get("/status", self.status),
                web.get("/status/history", self.history_handler),
                web.get("/metrics", self.metrics_handler),
            ]  # fmt: skip
        )
        for app, host, port, attr, reuse_port in (
            (self.make_app(), self.config.host, self.config.port, "port", self.config.reuse_port),
            (admin_app, self.config.admin_host, self.config.admin_port, "admin_port", False),
        ):
            runner = GuardedAppRunner(
                app,
                self.config.limits,
                handler_cancellation=True,
                access_log=access_log,
                access_log_class=AccessLogger,
            )
            await runner.setup()
            # A burst of connects waits in the kernel, not in SYN retransmits (default 128).
            site = web.TCPSite(runner, host, port, backlog=1024, reuse_port=reuse_port)
            await site.start()
            self._runners.append(runner)
            setattr(self, attr, runner.addresses[0][1])
        if self.batch_runner is not None:
            cfg = self.config.batch
            await self.batch_runner.start(cfg.replica_id or f"{socket.gethostname()}:{self.port}")
        log.info(
            "proxy listening on %s:%d (admin %s:%d)",
            self.config.host,
            self.port,
            self.config.admin_host,
            self.admin_port,
        )

    async def _open_batch(self) -> None:
        """The Batch API's store, file store, runner and endpoints (proxy/batch/)."""
        cfg = self.config.batch
        data = Path(cfg.data_dir).expanduser()
        db = await asyncio.to_thread(BatchDB, data / "batch.sqlite3")
        if cfg.files_url:
            blobs: Blobs = S3Blobs(cfg.files_url, s3_client())
        else:
            blobs = LocalBlobs(data / "files")
        self.batch_runner = BatchRunner(db, blobs, self.pipeline, cfg, self.metrics)
        (data / "tmp").mkdir(parents=True, exist_ok=True)
        self.batch_api = BatchAPI(cfg, db, blobs, self.batch_runner, self.pipeline.deps.model_names)
        self._batch_db = db
        log.info(
            "batch API: store %s, files %s", data / "batch.sqlite3", cfg.files_url or data / "files"
        )

    async def stop(self) -> None:
        if self.batch_runner is not None:
            await self.batch_runner.stop()
            self.batch_runner = None
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self._batch_db is not None:
            await asyncio.to_thread(self._batch_db.close)
            self._batch_db = None
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.health.stop()
        if self._history_session is not None:
            await self._history_session.close()
            self._history_session = None
        await self.transport.close()
        await self.clients.close()
