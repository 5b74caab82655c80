"""The proxy process: wires registry, probes, outlier detection, routing,
admission and the HTTP front ends together, and owns their lifecycle.

Two listeners: the client port (OpenAI API, ``/status``, ``/metrics``) and the
admin port (bearer-token API). Both bind 127.0.0.1 unless configured otherwise.
Client disconnects cancel the handler (``handler_cancellation``), which closes
the dispatcher's generator and so cancels the upstream gRPC call at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from proxy.admin import make_admin_app
from proxy.admission import AdmissionController
from proxy.config import ProxyConfig
from proxy.dashboard import routes as dashboard_routes
from proxy.dispatch import Dispatcher
from proxy.errors import APIError
from proxy.health import HealthChecker
from proxy.http_upstream import TritonHttpUpstream
from proxy.metrics import REQUEST_UNIT, ProxyMetrics
from proxy.openai_api import BODY_LIMIT, OpenAIFrontEnd
from proxy.outlier import OutlierDetector
from proxy.registry import NodeState, Registry, RegistryEvent, UnitState
from proxy.routing import make_policy
from proxy.status import build_status
from proxy.tokenizer import ModelTokenizer
from proxy.transport import UnitTransport
from proxy.triton_api import TritonFrontEnd
from proxy.upstream import TritonClientPool, TritonUpstream

log = logging.getLogger(__name__)


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
        return APIError(e.status, e.reason, kind, None, None).response()
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
        self.admission = AdmissionController(config.admission)
        self.transport = UnitTransport(
            TritonUpstream(self.clients, config.timeouts),
            TritonHttpUpstream(config.timeouts) if config.upstream_protocol == "http" else None,
        )
        self.dispatcher = Dispatcher(
            self.registry,
            self.outlier,
            make_policy(config.routing, seed=seed),
            self.transport,
            config.retry,
            self.metrics,
        )
        self.health = HealthChecker(self.registry, config.health, self.clients, self._on_probe)
        self.registry.subscribe(self._on_registry_change)
        self._tokenizers: dict[str, ModelTokenizer] = {}
        self._runners: list[web.AppRunner] = []
        self._background: set[asyncio.Task[None]] = set()
        self.port = config.port
        self.admin_port = config.admin_port
        for spec in config.units:
            self.registry.add(spec)

    # -- helpers shared by the front ends ---------------------------------------------

    def model_names(self) -> list[str]:
        return sorted(set(self.registry.models()) | {m.name for m in self.config.models})

    def tokenizer(self, model: str) -> ModelTokenizer:
        tok = self._tokenizers.get(model)
        if tok is None:
            spec = self.config.model_spec(model)
            tok = self._tokenizers[model] = ModelTokenizer(spec.model_dir if spec else None)
        return tok

    def unit_summary(self, unit: UnitState) -> dict[str, Any]:
        return {
            "unit_id": unit.unit_id,
            "model": unit.spec.model,
            "model_version": unit.model_version,
            "draining": unit.draining,
            "healthy": unit.nodes_healthy(),
            "in_flight": unit.in_flight,
        }

    def _on_registry_change(self, event: RegistryEvent, unit: UnitState) -> None:
        if event == "removed":
            self.dispatcher.policy.on_unit_removed(unit.unit_id)
            task = asyncio.get_running_loop().create_task(self._close_client_when_idle(unit))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _close_client_when_idle(self, unit: UnitState) -> None:
        """A removed unit's requests finish on its channel; then the channel is closed,
        unless another unit (re-added under a new id) uses the same leader."""
        addr = unit.spec.leader_grpc
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeouts.request_s
        while unit.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.2)
        if all(u.spec.leader_grpc != addr for u in self.registry.units.values()):
            await self.clients.discard(addr)

    def _on_probe(self, unit: UnitState, node: NodeState, ok: bool, latency_s: float) -> None:
        self.metrics.probe_latency.labels(node.role).observe(latency_s)
        if not ok:
            self.metrics.probe_failures.labels(unit.unit_id, node.node_id).inc()

    # -- client-port handlers ---------------------------------------------------------

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
        )
        return web.json_response(body)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.refresh(
            self.registry, time.monotonic(), self.admission.queued, self.admission.active
        )
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def make_app(self) -> web.Application:
        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            resp = await handler(request)
            endpoint = (
                request.match_info.route.resource.canonical
                if request.match_info.route.resource
                else "unmatched"
            )
            unit = request.get(REQUEST_UNIT, "")
            self.metrics.requests.labels(endpoint, str(resp.status), unit).inc()
            return resp

        app = web.Application(
            middlewares=[count, error_middleware], client_max_size=self.config.max_body_bytes
        )
        app[BODY_LIMIT] = self.config.max_body_bytes
        app.add_routes(OpenAIFrontEnd(self).routes())
        app.add_routes(TritonFrontEnd(self).routes())
        app.add_routes(dashboard_routes())
        app.add_routes(
            [
                web.get("/status", self.status),
                web.get("/metrics", self.metrics_handler),
                web.get("/healthz", self.healthz),
            ]
        )
        return app

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        token = self.config.admin_token()
        if token is None:
            log.warning("no admin token configured: the admin API refuses every request")
        for model in self.config.models:
            self.tokenizer(
                model.name
            )  # a broken tokenizer_config.json fails start-up, not requests
        self.health.start()
        for app, host, port, attr in (
            (self.make_app(), self.config.host, self.config.port, "port"),
            (
                make_admin_app(self, token),
                self.config.admin_host,
                self.config.admin_port,
                "admin_port",
            ),
        ):
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            await site.start()
            self._runners.append(runner)
            setattr(self, attr, runner.addresses[0][1])
        log.info(
            "proxy listening on %s:%d (admin %s:%d)",
            self.config.host,
            self.port,
            self.config.admin_host,
            self.admin_port,
        )

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.health.stop()
        await self.transport.close()
        await self.clients.close()
