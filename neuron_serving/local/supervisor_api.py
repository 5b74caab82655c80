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
import http.client
import json
import os
import socket
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Protocol

from neuron_serving.bearer import bearer_matches
from neuron_serving.checkpoint.pin import is_sha256_hex

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


class SupervisorApiServer:
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

        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            if not bearer_matches(request.headers.get("Authorization"), self._token):
                return web.json_response({"error": "missing or invalid bearer token"}, status=401)
            return await handler(request)

        async def units(request: web.Request) -> web.Response:
            return web.json_response(self.cluster.units_view())

        async def recreate(request: web.Request) -> web.Response:
            unit_id = request.match_info["unit_id"]
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": "body must be JSON"}, status=400)
            model_dir = body.get("model_dir") if isinstance(body, dict) else None
            if not isinstance(model_dir, str) or not Path(model_dir).is_absolute():
                return web.json_response(
                    {"error": "'model_dir' must be an absolute path"}, status=400
                )
            if not Path(model_dir).is_dir():
                return web.json_response({"error": f"{model_dir} is not a directory"}, status=400)
            # The deploy's pin (checkpoint/pin.py): the unit's processes refuse any other
            # manifest, restarts included; "" = unpinned (an unversioned directory).
            pin = body.get("manifest_sha256")
            if pin is not None and (not isinstance(pin, str) or (pin and not is_sha256_hex(pin))):
                return web.json_response(
                    {"error": "'manifest_sha256' must be 64 lowercase hex digits"}, status=400
                )
            pinned = {} if pin is None else {"manifest_sha256": pin}
            try:
                generation = self.cluster.recreate_unit(unit_id, Path(model_dir), **pinned)
            except KeyError:
                return web.json_response({"error": f"unit {unit_id!r} not found"}, status=404)
            except RuntimeError as e:
                return web.json_response({"error": str(e)}, status=409)
            return web.json_response(
                {"unit_id": unit_id, "generation": generation, "model_dir": model_dir},
                status=202,
            )

        def refused(e: Exception, unit_id: str = "") -> web.Response:
            if isinstance(e, KeyError):
                return web.json_response({"error": f"unit {unit_id[:64]!r} not found"}, status=404)
            status = 400 if isinstance(e, ValueError) else 409
            return web.json_response({"error": str(e)}, status=status)

        async def body_of(request: web.Request, fields: frozenset[str]) -> Any:
            """The request's JSON object with only ``fields``, or a 400 response."""
            body: Any = {}
            if request.body_exists:
                try:
                    body = await request.json()
                except ValueError:
                    return web.json_response({"error": "body must be JSON"}, status=400)
            if not isinstance(body, dict):
                return web.json_response({"error": "body must be a JSON object"}, status=400)
            unknown = sorted(set(body) - fields)
            if unknown:
                return web.json_response(
                    {"error": f"unknown fields: {', '.join(map(str, unknown))[:200]}"}, status=400
                )
            if not isinstance(body.get("purpose", ""), str):
                return web.json_response({"error": "'purpose' must be a string"}, status=400)
            if not isinstance(body.get("standby", False), bool):
                return web.json_response({"error": "'standby' must be true or false"}, status=400)
            return body

        async def add(request: web.Request) -> web.Response:
            body = await body_of(request, _ADD_FIELDS)
            if isinstance(body, web.Response):
                return body
            purpose = body.get("purpose", "interactive")
            standby = body.get("standby", False)
            try:
                # Quick (picks ports, spawns the group's thread), but off the event loop.
                unit_id = await asyncio.to_thread(self.cluster.add_unit, purpose, standby)
            except (ValueError, RuntimeError) as e:
                return refused(e)
            return web.json_response(
                {"unit_id": unit_id, "purpose": purpose, "standby": standby}, status=202
            )

        async def promote(request: web.Request) -> web.Response:
            unit_id = request.match_info["unit_id"]
            body = await body_of(request, _PROMOTE_FIELDS)
            if isinstance(body, web.Response):
                return body
            purpose = body.get("purpose", "interactive")
            try:
                # Undrains on every replica: bounded, blocking.
                await asyncio.to_thread(self.cluster.promote_unit, unit_id, purpose)
            except (KeyError, ValueError, RuntimeError) as e:
                return refused(e, unit_id)
            return web.json_response({"unit_id": unit_id, "purpose": purpose}, status=202)

        async def hold(request: web.Request) -> web.Response:
            unit_id = request.match_info["unit_id"]
            body = await body_of(request, frozenset())
            if isinstance(body, web.Response):
                return body
            try:
                await asyncio.to_thread(self.cluster.hold_unit, unit_id)
            except (KeyError, RuntimeError) as e:
                return refused(e, unit_id)
            return web.json_response({"unit_id": unit_id, "holding": True}, status=202)

        async def remove(request: web.Request) -> web.Response:
            unit_id = request.match_info["unit_id"]
            try:
                # Asks every replica whether someone else holds the unit: bounded, blocking.
                await asyncio.to_thread(self.cluster.remove_unit, unit_id)
            except (KeyError, RuntimeError) as e:
                return refused(e, unit_id)
            return web.json_response({"unit_id": unit_id, "removing": True}, status=202)

        app = web.Application(middlewares=[auth], client_max_size=64 << 10)
        app.add_routes(
            [
                web.get("/units", units),
                web.post("/units", add),
                web.delete("/units/{unit_id}", remove),
                web.post("/units/{unit_id}/promote", promote),
                web.post("/units/{unit_id}/hold", hold),
                web.post("/units/{unit_id}/recreate", recreate),
            ]
        )
        self.socket_path.unlink(missing_ok=True)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        old = os.umask(0o177)  # the socket is created 0600: no window with wider access
        try:
            await web.UnixSite(runner, str(self.socket_path)).start()
        finally:
            os.umask(old)
        self._runner = runner


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
