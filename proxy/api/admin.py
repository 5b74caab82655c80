"""Admin API on its own port: list, add, remove, drain and undrain units.

Every request needs ``Authorization: Bearer <token>``; anything else gets 401
before the handler runs, so a rejected request changes nothing. With no token
configured the API refuses everything (fail closed). The token is compared in
constant time (neuron_serving/bearer.py).
"""

from __future__ import annotations

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


def make_admin_app(
    registry: Registry, token: str | None, body_guard: BodyGuard, max_body_bytes: int
) -> web.Application:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is None:
            return _unauthorized("admin API disabled: no admin token configured")
        if not bearer_matches(request.headers.get("Authorization"), token):
            return _unauthorized("missing or invalid bearer token")
        try:
            return await handler(request)
        except APIError as e:
            return e.response()

    def unit_or_404(request: web.Request):
        unit_id = request.match_info["unit_id"]
        unit = registry.get(unit_id)
        if unit is None:
            raise APIError(
                404, f"unit {unit_id!r} not found", param="unit_id", code="unit_not_found"
            )
        return unit

    async def list_units(request: web.Request) -> web.Response:
        # With each unit's spec: what POST /admin/units takes, so a replica that restarted
        # can be given a sibling's units as they are (neuron_serving/proxy_admin.py).
        units = [{**unit_summary(u), "spec": asdict(u.spec)} for u in registry.units.values()]
        return web.json_response({"units": units})

    async def add_unit(request: web.Request) -> web.Response:
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
        if registry.get(spec.unit_id) is not None:
            raise APIError(409, f"unit {spec.unit_id!r} already exists", code="unit_exists")
        unit = registry.add(spec)
        if draining:
            registry.set_draining(spec.unit_id, True)
        return web.json_response(unit_summary(unit), status=201)

    async def remove_unit(request: web.Request) -> web.Response:
        unit = unit_or_404(request)
        registry.remove(unit.unit_id)
        return web.json_response({"removed": unit.unit_id, "in_flight": unit.in_flight})

    async def drain(request: web.Request) -> web.Response:
        unit = registry.set_draining(unit_or_404(request).unit_id, True)
        return web.json_response(unit_summary(unit))

    async def undrain(request: web.Request) -> web.Response:
        unit = registry.set_draining(unit_or_404(request).unit_id, False)
        return web.json_response(unit_summary(unit))

    app = web.Application(middlewares=[auth], client_max_size=max_body_bytes)
    app[BODY_GUARD] = body_guard
    app.add_routes(
        [
            web.get("/admin/units", list_units),
            web.post("/admin/units", add_unit),
            web.delete("/admin/units/{unit_id}", remove_unit),
            web.post("/admin/units/{unit_id}/drain", drain),
            web.post("/admin/units/{unit_id}/undrain", undrain),
        ]
    )
    return app
