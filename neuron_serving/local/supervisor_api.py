"""The supervisor API: what `neuron-serving deploy` uses to recreate a unit, and the
capacity controller (capacity/local_actuator.py) to add and remove units.

A running `neuron-serving up` serves a small HTTP API on a Unix socket in its run
directory (``supervisor.sock``):

    GET  /units                       every unit: phase, generation, model dir, restarts
    POST /units/{unit_id}/recreate    {"model_dir": DIR, "manifest_sha256": PIN?}
                                      -> {"generation": G, ...}
                                      (planned: graceful stop, start on DIR, no backoff;
                                      ready when phase is "ready" at generation >= G)
    POST /units                       {"purpose": "interactive"|"batch"} (default
                                      interactive), "standby": bool (default false)
                                      -> 202 {"unit_id": U}: a new unit, starting;
                                      "routable" in GET /units once every proxy replica
                                      routes to it; a standby one is registered drained
                                      and shows "warm" once ready everywhere
    POST /units/{unit_id}/promote     {"purpose": ...} -> 202: a warm spare undrained on
                                      every replica ("routable" once they route to it);
                                      409 when it is not a spare
    POST /units/{unit_id}/hold        -> 202: a serving unit drained, waited for and kept
                                      running as a warm spare; 409 as DELETE
    DELETE /units/{unit_id}           -> 202: drained, waited for, stopped, unregistered
                                      in the background ("removing" until gone from
                                      GET /units); 409 mid-deploy or the last ready unit

Bodies are bounded (64 KiB), must be JSON objects and may hold only the fields
above (anything else is a 400 and changes nothing); an unknown unit is a 404.

Who may call it: the socket lives in the 0700 run directory and is itself 0600, so
only the user running `up` can connect; every request must also carry the proxy's
admin token (``Authorization: Bearer``, checked by neuron_serving/bearer.py in
constant time), the same credential that drains units. A Unix socket rather than a loopback port: nothing
else on the machine can even reach it, and no port has to be allocated.

The server is aiohttp on its own thread and event loop (the supervisor itself is
threads). The client is the standard library's ``http.client`` over ``AF_UNIX``,
so `deploy` starts fast and needs no event loop.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import os
import socket
import threading
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from neuron_serving.bearer import bearer_matches
from neuron_serving.checkpoint.pin import is_sha256_hex

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aiohttp import web

    _Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SOCKET_NAME = "supervisor.sock"


class Recreatable(Protocol):
    """What the API needs from the cluster (ClusterSupervisor implements it)."""

    def units_view(self) -> dict[str, Any]: ...

    def recreate_unit(
        self, unit_id: str, model_dir: Path, manifest_sha256: str | None = None
    ) -> int: ...

    # ValueError: bad purpose (400); RuntimeError: refused (409); KeyError: unknown (404).
    def add_unit(self, purpose: str = "interactive", standby: bool = False) -> str: ...

    def promote_unit(self, unit_id: str, purpose: str = "interactive") -> None: ...

    def hold_unit(self, unit_id: str) -> None: ...

    def remove_unit(self, unit_id: str) -> None: ...


_ADD_FIELDS = frozenset({"purpose", "standby"})
_PROMOTE_FIELDS = frozenset({"purpose"})
_MAX_BODY_BYTES = 64 << 10  # aiohttp answers a larger body 413 as it reads it


class _Refusal(Exception):
    """A request refused (bad input, or the cluster said no): the middleware answers
    ``{"error": message}`` with ``status``. Input is checked in full before the cluster
    is asked, so a bad request changes nothing."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _reply(payload: Any, status: int = 200) -> web.Response:
    # aiohttp is imported where the server needs it, never at the top: `deploy` and the
    # capacity controller import this module for the client alone.
    from aiohttp import web

    return web.json_response(payload, status=status)


def _refusal(e: Exception, unit_id: str = "") -> _Refusal:
    """The cluster's refusal as the caller sees it (the exceptions Recreatable names)."""
    if isinstance(e, KeyError):
        return _Refusal(404, f"unit {unit_id[:64]!r} not found")
    return _Refusal(400 if isinstance(e, ValueError) else 409, str(e))


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise _Refusal(400, "body must be JSON") from None


async def _body_of(request: web.Request, fields: frozenset[str]) -> dict[str, Any]:
    """The request's JSON object holding only ``fields``; no body at all is ``{}``."""
    body = await _json(request) if request.body_exists else {}
    if not isinstance(body, dict):
        raise _Refusal(400, "body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise _Refusal(400, f"unknown fields: {', '.join(map(str, unknown))[:200]}")
    if not isinstance(body.get("purpose", ""), str):
        raise _Refusal(400, "'purpose' must be a string")
    if not isinstance(body.get("standby", False), bool):
        raise _Refusal(400, "'standby' must be true or false")
    return body


def _recreate_args(body: Any) -> tuple[str, dict[str, str]]:
    """A recreate body's ``model_dir`` and pin keyword (none when the body has no pin)."""
    model_dir = body.get("model_dir") if isinstance(body, dict) else None
    if not isinstance(model_dir, str) or not Path(model_dir).is_absolute():
        raise _Refusal(400, "'model_dir' must be an absolute path")
    if not Path(model_dir).is_dir():
        raise _Refusal(400, f"{model_dir} is not a directory")
    # The deploy's pin (checkpoint/pin.py): the unit's processes refuse any other
    # manifest, restarts included; "" = unpinned (an unversioned directory).
    pin = body.get("manifest_sha256")
    if pin is not None and (not isinstance(pin, str) or (pin and not is_sha256_hex(pin))):
        raise _Refusal(400, "'manifest_sha256' must be 64 lowercase hex digits")
    return model_dir, ({} if pin is None else {"manifest_sha256": pin})


class SupervisorApiServer:
    """The API over ``socket_path``, served for ``cluster`` to holders of ``token``.

    One method a route, the route table in ``_app``; the token check is the app's
    middleware, so it runs before any handler reads a body. A handler refuses by
    raising ``_Refusal``, which the middleware answers."""

    def __init__(self, cluster: Recreatable, socket_path: Path, token: str) -> None:
        if not token:
            raise ValueError("the supervisor API needs a token")
        self.cluster = cluster
        self.socket_path = Path(socket_path)
        self._token = token
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._runner: Any = None

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="supervisor-api", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"supervisor API did not start within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"supervisor API failed to start: {self._error}") from self._error

    def stop(self, timeout_s: float = 5.0) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            try:
                fut.result(timeout_s)
            except Exception:  # noqa: BLE001 - stopping must not raise
                pass
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.socket_path.unlink(missing_ok=True)

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _serve(self) -> None:
        from aiohttp import web

        self.socket_path.unlink(missing_ok=True)
        runner = web.AppRunner(self._app(), access_log=None)
        await runner.setup()
        old = os.umask(0o177)  # the socket is created 0600: no window with wider access
        try:
            await web.UnixSite(runner, str(self.socket_path)).start()
        finally:
            os.umask(old)
        self._runner = runner

    def _app(self) -> web.Application:
        from aiohttp import web

        # aiohttp treats a middleware without web.middleware's mark as old-style
        # (deprecated); a bound method cannot carry the mark, a partial of it can.
        auth = web.middleware(functools.partial(self._authorized))
        app = web.Application(middlewares=[auth], client_max_size=_MAX_BODY_BYTES)
        app.add_routes(
            [
                web.get("/units", self._units),
                web.post("/units", self._add),
                web.delete("/units/{unit_id}", self._remove),
                web.post("/units/{unit_id}/promote", self._promote),
                web.post("/units/{unit_id}/hold", self._hold),
                web.post("/units/{unit_id}/recreate", self._recreate),
            ]
        )
        return app

    async def _authorized(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        if not bearer_matches(request.headers.get("Authorization"), self._token):
            return _reply({"error": "missing or invalid bearer token"}, 401)
        try:
            return await handler(request)
        except _Refusal as e:
            return _reply({"error": e.message}, e.status)

    async def _units(self, request: web.Request) -> web.Response:
        return _reply(self.cluster.units_view())

    async def _recreate(self, request: web.Request) -> web.Response:
        unit_id = request.match_info["unit_id"]
        model_dir, pinned = _recreate_args(await _json(request))
        try:
            generation = self.cluster.recreate_unit(unit_id, Path(model_dir), **pinned)
        except KeyError:
            # The id in full, unlike the other routes' 404s (_refusal cuts it to 64).
            raise _Refusal(404, f"unit {unit_id!r} not found") from None
        except RuntimeError as e:
            raise _refusal(e) from None
        reply = {"unit_id": unit_id, "generation": generation, "model_dir": model_dir}
        return _reply(reply, 202)

    async def _add(self, request: web.Request) -> web.Response:
        body = await _body_of(request, _ADD_FIELDS)
        purpose = body.get("purpose", "interactive")
        standby = body.get("standby", False)
        try:
            # Quick (picks ports, spawns the group's thread), but off the event loop.
            unit_id = await asyncio.to_thread(self.cluster.add_unit, purpose, standby)
        except (ValueError, RuntimeError) as e:
            raise _refusal(e) from None
        return _reply({"unit_id": unit_id, "purpose": purpose, "standby": standby}, 202)

    async def _promote(self, request: web.Request) -> web.Response:
        unit_id = request.match_info["unit_id"]
        purpose = (await _body_of(request, _PROMOTE_FIELDS)).get("purpose", "interactive")
        try:
            # Undrains on every replica: bounded, blocking.
            await asyncio.to_thread(self.cluster.promote_unit, unit_id, purpose)
        except (KeyError, ValueError, RuntimeError) as e:
            raise _refusal(e, unit_id) from None
        return _reply({"unit_id": unit_id, "purpose": purpose}, 202)

    async def _hold(self, request: web.Request) -> web.Response:
        unit_id = request.match_info["unit_id"]
        await _body_of(request, frozenset())  # no fields: any body but {} is a 400
        try:
            await asyncio.to_thread(self.cluster.hold_unit, unit_id)
        except (KeyError, RuntimeError) as e:
            raise _refusal(e, unit_id) from None
        return _reply({"unit_id": unit_id, "holding": True}, 202)

    async def _remove(self, request: web.Request) -> web.Response:
        unit_id = request.match_info["unit_id"]
        try:
            # Asks every replica whether someone else holds the unit: bounded, blocking.
            await asyncio.to_thread(self.cluster.remove_unit, unit_id)
        except (KeyError, RuntimeError) as e:
            raise _refusal(e, unit_id) from None
        return _reply({"unit_id": unit_id, "removing": True}, 202)


class SupervisorApiError(RuntimeError):
    pass


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class SupervisorApiClient:
    """Blocking client of a SupervisorApiServer; every call bounded by ``timeout_s``."""

    def __init__(self, socket_path: Path, token: str, timeout_s: float = 10.0) -> None:
        self.socket_path = Path(socket_path)
        self._token = token
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        conn = _UnixConnection(self.socket_path, self.timeout_s)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Authorization": f"Bearer {self._token}"}
            if data is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise SupervisorApiError(
                f"supervisor API at {self.socket_path} unreachable: {e} "
                "(is `neuron-serving up` running for this proxy?)"
            ) from e
        finally:
            conn.close()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = {"error": raw.decode(errors="replace")}
        if resp.status >= 300:
            raise SupervisorApiError(
                f"{method} {path}: {resp.status} {payload.get('error', payload)}"
            )
        return payload

    def units(self) -> dict[str, Any]:
        return self._call("GET", "/units")

    def recreate(self, unit_id: str, model_dir: Path, manifest_sha256: str | None = None) -> int:
        body = {"model_dir": str(Path(model_dir).resolve())}
        if manifest_sha256 is not None:
            body["manifest_sha256"] = manifest_sha256
        return int(self._call("POST", f"/units/{unit_id}/recreate", body)["generation"])

    def add_unit(self, purpose: str = "interactive", standby: bool = False) -> str:
        """Start one more unit (a warm spare with ``standby``); its id at once."""
        body = {"purpose": purpose, **({"standby": True} if standby else {})}
        return str(self._call("POST", "/units", body)["unit_id"])

    def promote_unit(self, unit_id: str, purpose: str = "interactive") -> None:
        """Put warm spare ``unit_id`` into rotation (undrained on every replica)."""
        path = f"/units/{urllib.parse.quote(unit_id, safe='')}/promote"
        self._call("POST", path, {"purpose": purpose})

    def hold_unit(self, unit_id: str) -> None:
        """Have serving ``unit_id`` drained and kept running as a warm spare."""
        self._call("POST", f"/units/{urllib.parse.quote(unit_id, safe='')}/hold")

    def remove_unit(self, unit_id: str) -> None:
        """Have ``unit_id`` drained, stopped and unregistered (in the background)."""
        self._call("DELETE", f"/units/{urllib.parse.quote(unit_id, safe='')}")
