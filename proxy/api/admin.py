"""Admin API on its own port: list, add, remove, drain and undrain units.

Every request needs ``Authorization: Bearer <token>``; anything else gets 401
before the handler runs, so a rejected request changes nothing. With no token
configured the API refuses everything (fail closed). The token is compared in
constant time (neuron_serving/bearer.py).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web

from neuron_serving.bearer import bearer_matches
from proxy.api.front_end import read_json
from proxy.api.http_guard import BODY_GUARD, BodyGuard
from proxy.config import UnitSpec
from proxy.errors import APIError, invalid
from proxy.registry import Registry, UnitState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _unauthorized(message: str) -> web.Response:
    err = APIError(
        401, message, "authentication_error", None, "invalid_token", {"WWW-Authenticate": "Bearer"}
    )
    return err.response()


def unit_summary(unit: UnitState) -> dict[str, Any]:
    return {
        "unit_id": unit.unit_id,
        "model": unit.spec.model,
        "model_version": unit.model_version,
        "draining": unit.draining,
        "healthy": unit.nodes_healthy(),
        "in_flight": unit.in_flight,
    }


class AdminAPI:
    """The admin port's routes over the proxy's registry: one method per route, the
    token checked by one middleware before any handler reads a body, and every
    ``APIError`` a handler raises answered in OpenAI's error format."""

    def __init__(
        self, registry: Registry, token: str | None, body_guard: BodyGuard, max_body_bytes: int
    ) -> None:
        self.registry = registry
        self._token = token
        self._body_guard = body_guard
        self._max_body_bytes = max_body_bytes

    def app(self) -> web.Application:
        # aiohttp treats a middleware without web.middleware's mark as old-style
        # (deprecated); a bound method cannot carry the mark, a partial of it can.
        auth = web.middleware(functools.partial(self._authorized))
        app = web.Application(middlewares=[auth], client_max_size=self._max_body_bytes)
        app[BODY_GUARD] = self._body_guard
        app.add_routes(
            [
                web.get("/admin/units", self.list_units),
                web.post("/admin/units", self.add_unit),
                web.delete("/admin/units/{unit_id}", self.remove_unit),
                web.post("/admin/units/{unit_id}/drain", self.drain),
                web.post("/admin/units/{unit_id}/undrain", self.undrain),
            ]
        )
        return app

    async def _authorized(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._token is None:
            return _unauthorized("admin API disabled: no admin token configured")
        if not bearer_matches(request.headers.get("Authorization"), self._token):
            return _unauthorized("missing or invalid bearer token")
        try:
            return await handler(request)
        except APIError as e:
            return e.response()

    def _unit_or_404(self, request: web.Request) -> UnitState:
        unit_id = request.match_info["unit_id"]
        unit = self.registry.get(unit_id)
        if unit is None:
            raise APIError(
                404, f"unit {unit_id!r} not found", param="unit_id", code="unit_not_found"
            )
        return unit

    async def list_units(self, request: web.Request) -> web.Response:
        # With each unit's spec: what POST /admin/units takes, so a replica that restarted
        # can be given a sibling's units as they are (neuron_serving/proxy_admin.py).
        units = [{**unit_summary(u), "spec": asdict(u.spec)} for u in self.registry.units.values()]
        return web.json_response({"units": units})

    async def add_unit(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        # "draining": true adds the unit drained: no request reaches it before an explicit
        # undrain (a deploy re-registers a recreated unit this way, then runs canaries).
        # Added and drained in one step of the event loop: no probe can make it routable
        # in between.
        draining = body.pop("draining", False) if isinstance(body, dict) else False
        if not isinstance(draining, bool):
            raise invalid("'draining' must be true or false")
        try:
            spec = UnitSpec.from_dict(body)
        except (TypeError, ValueError) as e:
            raise invalid(f"invalid unit: {e}") from None
        if self.registry.get(spec.unit_id) is not None:
            raise APIError(409, f"unit {spec.unit_id!r} already exists", code="unit_exists")
        unit = self.registry.add(spec)
        if draining:
            self.registry.set_draining(spec.unit_id, True)
        return web.json_response(unit_summary(unit), status=201)

    async def remove_unit(self, request: web.Request) -> web.Response:
        unit = self._unit_or_404(request)
        self.registry.remove(unit.unit_id)
        return web.json_response({"removed": unit.unit_id, "in_flight": unit.in_flight})

    async def drain(self, request: web.Request) -> web.Response:
        unit = self.registry.set_draining(self._unit_or_404(request).unit_id, True)
        return web.json_response(unit_summary(unit))

    async def undrain(self, request: web.Request) -> web.Response:
        unit = self.registry.set_draining(self._unit_or_404(request).unit_id, False)
        return web.json_response(unit_summary(unit))
