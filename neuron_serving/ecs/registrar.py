"""Registration of a ready unit with the proxy: pluggable, so tests use a real proxy.

``ProxyRegistrar`` is what the controller calls; ``AdminApiRegistrar`` speaks the
proxy's admin API (proxy/admin.py: bearer token, ``/admin/units``) with the
standard library, bounded by a timeout; ``NullRegistrar`` is for deployments
without a proxy (clients find leaders some other way).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Protocol

from neuron_serving.ecs.spec import TRITON_GRPC_PORT, TRITON_HTTP_PORT, DeploymentSpec


class RegistrarError(RuntimeError):
    """The proxy refused or did not answer."""


class ProxyRegistrar(Protocol):
    def units(self) -> set[str]: ...
    # draining=True: the unit joins drained (no request before an explicit undrain).
    def add(self, unit: dict[str, Any], draining: bool = False) -> None: ...
    def drain(self, unit_id: str) -> None: ...
    def remove(self, unit_id: str) -> None: ...


def proxy_unit(spec: DeploymentSpec, unit_id: str, ips: dict[int, str]) -> dict[str, Any]:
    """The proxy's ``UnitSpec`` (proxy/config.py) of a unit whose node IPs are known."""
    leader = ips[0]
    return {
        "unit_id": unit_id,
        "leader_grpc": f"{leader}:{TRITON_GRPC_PORT}",
        "leader_http": f"{leader}:{TRITON_HTTP_PORT}",
        "followers": [f"{ips[r]}:{spec.health_port}" for r in sorted(ips) if r != 0],
        "model": spec.model,
        "model_version": spec.version,
    }


class NullRegistrar:
    def units(self) -> set[str]:
        return set()

    def add(self, unit: dict[str, Any], draining: bool = False) -> None:
        pass

    def drain(self, unit_id: str) -> None:
        pass

    def remove(self, unit_id: str) -> None:
        pass


class AdminApiRegistrar:
    def __init__(self, base_url: str, token: str, timeout_s: float = 10.0) -> None:
        if not token:
            raise ValueError("the proxy admin API needs a bearer token")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            payload = e.read()
            try:
                return e.code, json.loads(payload)
            except ValueError:
                return e.code, payload.decode(errors="replace")
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise RegistrarError(f"proxy admin {method} {path}: {e}") from None

    def _check(self, method: str, path: str, status: int, body: Any, ok: tuple[int, ...]) -> None:
        if status not in ok:
            raise RegistrarError(f"proxy admin {method} {path}: HTTP {status}: {body}")

    def units(self) -> set[str]:
        status, body = self._call("GET", "/admin/units")
        self._check("GET", "/admin/units", status, body, (200,))
        return {u["unit_id"] for u in body["units"]}

    def add(self, unit: dict[str, Any], draining: bool = False) -> None:
        body_in = {**unit, "draining": True} if draining else unit
        status, body = self._call("POST", "/admin/units", body_in)
        if status == 409:  # a predecessor with old addresses: replace it
            self.remove(unit["unit_id"])
            status, body = self._call("POST", "/admin/units", body_in)
        self._check("POST", "/admin/units", status, body, (200, 201))

    def drain(self, unit_id: str) -> None:
        path = f"/admin/units/{unit_id}/drain"
        status, body = self._call("POST", path)
        self._check("POST", path, status, body, (200, 404))

    def remove(self, unit_id: str) -> None:
        path = f"/admin/units/{unit_id}"
        status, body = self._call("DELETE", path)
        self._check("DELETE", path, status, body, (200, 404))


def registrar_for(spec: DeploymentSpec) -> ProxyRegistrar:
    """The spec's proxy, or none."""
    if not spec.proxy_admin_url:
        return NullRegistrar()
    return AdminApiRegistrar(spec.proxy_admin_url, admin_token(spec))


def admin_token(spec: DeploymentSpec) -> str:
    """The proxy's admin token: the spec's file, else the env registry."""
    from pathlib import Path

    from neuron_serving import envs

    token = envs.NEURON_SERVING_PROXY_ADMIN_TOKEN
    if spec.proxy_admin_token_file:
        token = Path(spec.proxy_admin_token_file).expanduser().read_text().strip()
    if not token:
        raise ValueError(
            "proxy_admin_url is set but no admin token: set proxy_admin_token_file "
            "or NEURON_SERVING_PROXY_ADMIN_TOKEN"
        )
    return token
