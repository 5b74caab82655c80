"""The proxy's admin API on every replica: each change sent to all of them, the
outcome reported per replica.

K proxy replicas route alike only while each has the same units and drain states,
and only the admin API changes those. A load balancer in front of the replicas
would hand an admin call to one of them, so every caller (`up`'s supervisor, `deploy`,
the ECS registrar) sends each change to every replica's own admin address through
``AdminFanOut``: in parallel, every HTTP call bounded by ``timeout_s`` (the connect
and each read), and a ``FanOut`` saying which replicas applied it, which refused
it (an HTTP status) and which did not answer (status 0). What to make of a replica
that did not answer is the caller's: one that is down is given a live sibling's
state when it comes back (``sync_calls``; neuron_serving/local/README.md).

Standard library only: the CLI's commands import it and must start fast.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 5.0


class AdminError(RuntimeError):
    """A change some replica refused, or that no replica applied."""


@dataclass(frozen=True, slots=True)
class Replica:
    replica_id: str
    admin_url: str  # http://HOST:PORT of this replica's admin port


def replicas_from_urls(urls: Sequence[str]) -> list[Replica]:
    """Replicas given by their admin URLs (a spec's, ``--admin-url``), named by address."""
    return [Replica(urllib.parse.urlsplit(url).netloc or url, url) for url in urls]


@dataclass(frozen=True, slots=True)
class Answer:
    replica: Replica
    status: int  # the HTTP status; 0 = no answer (refused, reset, timed out)
    body: Any  # decoded JSON, else the text; without an answer, the error

    def describe(self) -> str:
        if self.status == 0:
            return f"{self.replica.replica_id}: no answer ({self.body})"
        return f"{self.replica.replica_id}: HTTP {self.status} {self.body}"


@dataclass(frozen=True, slots=True)
class FanOut:
    """One change's outcome on every replica."""

    what: str  # e.g. "drain unit-0"
    answers: tuple[Answer, ...]

    def failed(self, ok: Collection[int] = (200,)) -> list[Answer]:
        return [a for a in self.answers if a.status not in ok]

    def unanswered(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 0]

    def check(self, ok: Collection[int] = (200,), allow_unanswered: bool = False) -> None:
        """Raise AdminError naming each replica that refused the change (an HTTP status
        not in ``ok``), or that did not answer unless ``allow_unanswered``; and in any
        case when no replica applied it."""
        failed = self.failed(ok)
        refused = [a for a in failed if a.status != 0 or not allow_unanswered]
        if refused or len(failed) == len(self.answers):
            detail = "; ".join(a.describe() for a in failed) or "no proxy replica listed"
            raise AdminError(f"proxy admin {self.what}: {detail}")


def request(
    method: str, url: str, token: str, body: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[int, Any]:
    """One admin call with the bearer token: (status, decoded body or text); (0, error)
    when the replica did not answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (OSError, http.client.HTTPException) as e:
        return 0, str(getattr(e, "reason", e))
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def sync_calls(
    reference: Mapping[str, Mapping[str, Any]], current: Mapping[str, Mapping[str, Any]]
) -> list[tuple[str, str, Any]]:
    """The admin calls (method, path, body) that give a replica whose ``GET
    /admin/units`` is ``current`` the units and drain states of ``reference`` (both:
    unit id -> that listing's entry, with ``spec`` and ``draining``). A unit whose
    spec differs is removed and added again; one to add joins drained if it is
    drained in ``reference``, so it is never routable in between."""
    calls: list[tuple[str, str, Any]] = []
    for unit_id in sorted(set(current) - set(reference)):
        calls.append(("DELETE", f"/admin/units/{unit_id}", None))
    for unit_id in sorted(reference):
        want, have = reference[unit_id], current.get(unit_id)
        if have is not None and have["spec"] != want["spec"]:
            calls.append(("DELETE", f"/admin/units/{unit_id}", None))
            have = None
        if have is None:
            calls.append(("POST", "/admin/units", {**want["spec"], "draining": want["draining"]}))
        elif have["draining"] != want["draining"]:
            action = "drain" if want["draining"] else "undrain"
            calls.append(("POST", f"/admin/units/{unit_id}/{action}", None))
    return calls


class AdminFanOut:
    def __init__(
        self, replicas: Sequence[Replica], token: str, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        if not token:
            raise ValueError("the proxy admin API needs a bearer token")
        self.replicas = tuple(replicas)
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, replica: Replica, method: str, path: str, body: Any = None) -> Answer:
        url = replica.admin_url.rstrip("/") + path
        status, answer = request(method, url, self.token, body, self.timeout_s)
        return Answer(replica, status, answer)

    def each(self, what: str, call: Callable[[Replica], Answer]) -> FanOut:
        """``call`` on every replica at once (threads: each waits on its own socket)."""
        if not self.replicas:
            return FanOut(what, ())
        with ThreadPoolExecutor(max_workers=len(self.replicas)) as pool:
            return FanOut(what, tuple(pool.map(call, self.replicas)))

    def call(self, method: str, path: str, body: Any = None) -> FanOut:
        return self.each(f"{method} {path}", lambda r: self._call(r, method, path, body))

    def drain(self, unit_id: str) -> FanOut:
        return self.call("POST", f"/admin/units/{unit_id}/drain")

    def undrain(self, unit_id: str) -> FanOut:
        return self.call("POST", f"/admin/units/{unit_id}/undrain")

    def remove(self, unit_id: str) -> FanOut:
        return self.call("DELETE", f"/admin/units/{unit_id}")

    def add(self, unit: Mapping[str, Any], draining: bool = False) -> FanOut:
        """Every replica gets ``unit`` (a UnitSpec as a dict). A replica that already has
        a unit of that id keeps it when its spec is the same (drained if ``draining``;
        never undrained here: that is an explicit undrain), and has it replaced when it
        differs (a recreated unit's new addresses). 201 or 200 = applied."""

        def add_one(replica: Replica) -> Answer:
            body = {**unit, "draining": draining}
            answer = self._call(replica, "POST", "/admin/units", body)
            if answer.status != 409:
                return answer
            listed = self.units_of(replica)
            have = (listed or {}).get(unit["unit_id"])
            if have is None:  # gone meanwhile, or the listing failed: try once more
                return self._call(replica, "POST", "/admin/units", body)
            if have["spec"] == {**have["spec"], **unit}:
                if draining and not have["draining"]:
                    return self._call(replica, "POST", f"/admin/units/{unit['unit_id']}/drain")
                return Answer(replica, 200, have)
            self._call(replica, "DELETE", f"/admin/units/{unit['unit_id']}")
            return self._call(replica, "POST", "/admin/units", body)

        return self.each(f"add {unit['unit_id']}", add_one)

    def units_of(self, replica: Replica) -> dict[str, dict[str, Any]] | None:
        """A replica's ``GET /admin/units`` by unit id, or None without an answer."""
        answer = self._call(replica, "GET", "/admin/units")
        if answer.status != 200 or not isinstance(answer.body, dict):
            return None
        return {u["unit_id"]: u for u in answer.body.get("units", [])}

    def units(self) -> dict[str, dict[str, dict[str, Any]] | None]:
        """Every replica's units (replica id -> unit id -> entry; None: no answer)."""
        out = self.each("GET /admin/units", lambda r: self._call(r, "GET", "/admin/units"))
        return {
            a.replica.replica_id: {u["unit_id"]: u for u in a.body.get("units", [])}
            if a.status == 200 and isinstance(a.body, dict)
            else None
            for a in out.answers
        }

    def statuses(self) -> dict[str, dict[str, Any] | None]:
        """Every replica's own ``/status`` from its admin port (None: no answer)."""
        out = self.each("GET /status", lambda r: self._call(r, "GET", "/status"))
        return {
            a.replica.replica_id: a.body if a.status == 200 and isinstance(a.body, dict) else None
            for a in out.answers
        }

    def sync(self, replica: Replica, reference: Replica) -> list[str] | None:
        """Give ``replica`` the units and drain states ``reference`` has now; returns
        the calls made ([] = already alike), or None when either did not answer or a
        call was refused (the caller tries again later)."""
        want, have = self.units_of(reference), self.units_of(replica)
        if want is None or have is None:
            return None
        return self.make_alike(replica, want, have)

    def make_alike(
        self,
        replica: Replica,
        want: Mapping[str, Mapping[str, Any]],
        have: Mapping[str, Mapping[str, Any]],
    ) -> list[str] | None:
        """The calls that turn ``have`` (``replica``'s listing) into ``want`` (a
        listing, or any unit id -> {"spec", "draining"}), made in order; the calls
        made ([] = already alike), or None when one was refused or not answered."""
        done = []
        for method, path, body in sync_calls(want, have):
            answer = self._call(replica, method, path, body)
            if answer.status not in (200, 201):
                return None
            done.append(f"{method} {path}")
        return done
