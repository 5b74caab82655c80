"""`ClusterSupervisor`: the proxy replicas and K inference units of one `up`, started and
stopped together.

    prepare()   run dir (0700), ports free?, unit token + admin token + client API key
                (0600), proxy-<j>.yaml per replica
    start()     one group per proxy replica (replicas.py) + one GroupSupervisor per unit,
                all in parallel
    wait_ready  until every replica and every unit are ready at the same time (a unit that
                failed after its first ready is being recreated: not ready yet) and every
                replica routes to every unit; a group failing ``max_start_failures``
                times during start-up aborts it
    serve()     every second, write_state() keeps supervisor.json fresh for
                `neuron-serving status`; a failed write (full disk) is reported once
                and retried on the next tick: the units keep serving
    API         supervisor.sock (supervisor_api.py): `deploy` recreates a unit on another
                model directory through it (admin token required)
    shutdown()  drain through every replica's admin API (stop admitting, wait for
                in-flight up to drain_timeout_s), then stop every unit in parallel, then
                the replicas; finally check the process table: nothing of ours may remain.

Units are independent: one unit's crash loop never touches another unit or a
replica. Each replica is supervised as a group of one (restarted with backoff if it
dies, and ready again once it has a live sibling's drain states: replicas.py).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuron_serving.local import plan
from neuron_serving.local.group_supervisor import GroupPhase, GroupPlan, GroupSupervisor
from neuron_serving.local.proxy_config import write_proxy_config, write_secret
from neuron_serving.local.replicas import ProxyReplicas
from neuron_serving.local.spec import ClusterSpec
from neuron_serving.local.supervisor_api import SOCKET_NAME, SupervisorApiServer
from neuron_serving.logsafe import RateLimitedLog

# 2: "proxies" (every replica's client and admin address and group state) replaced
# "proxy" and "admin_url".
STATE_VERSION = 2


class StartupFailed(RuntimeError):
    pass


def check_ports_free(host: str, ports: list[int]) -> None:
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    if busy:
        raise StartupFailed(
            f"ports already in use on {host}: {busy} (another `neuron-serving up`? "
            "pick other ports with --port / --base-port)"
        )


class ClusterSupervisor:
    def __init__(
        self,
        spec: ClusterSpec,
        on_event: Callable[[str], None] = print,
        max_start_failures: int = 3,
    ) -> None:
        self.spec = spec
        self.on_event = on_event
        self.max_start_failures = max_start_failures
        self.admin_token = ""
        self.api_key = ""
        self.replicas: ProxyReplicas | None = None
        self.units: list[GroupSupervisor] = []
        self.started_at: float | None = None
        self.stopping = threading.Event()
        # Model directory of each unit: the cluster's, until a deploy recreates it.
        self.unit_models: dict[str, Path] = {}
        self.supervisor_api: SupervisorApiServer | None = None
        self._token_file: Path | None = None
        self._recreate_lock = threading.Lock()
        self._state_errors = RateLimitedLog(on_event, burst=1, interval_s=60.0)

    # ---- start ---------------------------------------------------------------------

    def prepare(self) -> None:
        spec = self.spec
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(spec.run_dir, 0o700)  # logs and secrets live here
        other = read_state(spec.state_file)
        if other and other.get("pid") != os.getpid() and _pid_alive(other.get("pid")):
            raise StartupFailed(
                f"another supervisor (pid {other['pid']}) is running in {spec.run_dir}"
            )
        check_ports_free(spec.host, spec.all_ports())
        token_file = spec.run_dir / "unit-token"
        write_secret(token_file)
        self._token_file = token_file
        self.unit_models = {spec.unit_id(i): spec.model_dir for i in range(spec.units)}
        configs, self.admin_token, self.api_key = write_proxy_config(spec)
        logs = spec.run_dir / "logs"
        self.replicas = ProxyReplicas(spec, configs, self.admin_token, self.on_event)
        self.units = [
            GroupSupervisor(
                GroupPlan(
                    spec.unit_id(i),
                    plan.unit_processes(spec, i, token_file),
                    logs / spec.unit_id(i),
                    ready=lambda i=i: plan.unit_ready(spec, i),
                    progress=lambda name, i=i: plan.unit_progress(spec, i, name),
                    ready_timeout_s=spec.ready_timeout_s,
                    stop_timeout_s=spec.stop_timeout_s,
                    backoff=plan.unit_backoff(spec),
                    log_max_bytes=spec.log_max_bytes,
                    log_backups=spec.log_backups,
                ),
                self.on_event,
            )
            for i in range(spec.units)
        ]

    def start(self) -> None:
        if self.replicas is None:
            self.prepare()
        assert self.replicas is not None
        self.started_at = time.time()
        self.replicas.start()
        for u in self.units:
            u.start()
        self.supervisor_api = SupervisorApiServer(
            self, self.spec.run_dir / SOCKET_NAME, self.admin_token
        )
        self.supervisor_api.start()
        self.write_state()

    def wait_ready(self, timeout_s: float) -> float:
        """Block until every proxy replica and every unit are ready, all at once, and
        every replica routes to every unit; returns seconds taken. "Were ready once"
        (``ever_ready``) is not enough: a unit that failed after its first ready is being
        recreated (about 30 s on 2 cores) and is not routable meanwhile, so `up` would say
        ready with a unit down. Nor is a unit's own readiness: a proxy routes by its own
        probes, which see a leader ready up to a probe interval later (longer when a
        probe times out on a busy host), and until then a request gets a 503.

        Raises StartupFailed naming the process and with its log tail when a group
        fails ``max_start_failures`` times during start-up, or on timeout.
        """
        assert self.started_at is not None and self.replicas is not None
        deadline = time.monotonic() + timeout_s
        groups = [*self.replicas.groups, *self.units]
        unit_ids = [u.group_id for u in self.units]
        while time.monotonic() < deadline and not self.stopping.is_set():
            if all(g.phase == GroupPhase.READY for g in groups) and self.replicas.routes_all(
                unit_ids
            ):
                return time.time() - self.started_at
            for g in groups:
                if g.restarts >= self.max_start_failures:
                    f = g.failures[-1]
                    raise StartupFailed(
                        f"{g.group_id} failed {g.restarts} times during start-up; "
                        f"last: {f.reason}\n--- last lines of its log:\n{f.log_tail}"
                    )
            self.write_state()
            time.sleep(0.5)
        if self.stopping.is_set():
            raise StartupFailed("interrupted during start-up")
        pending = [g.group_id for g in groups if g.phase != GroupPhase.READY]
        if not pending:
            pending = ["every proxy replica routing to every unit (see each one's admin /status)"]
        raise StartupFailed(f"not ready within {timeout_s:.0f} s: {pending}")

    # ---- serving -------------------------------------------------------------------

    def units_view(self) -> dict[str, Any]:
        """The supervisor API's GET /units: what a deploy needs to plan and to wait."""
        return {
            "tp": self.spec.tp,
            "device": "cpu",
            "stopping": self.stopping.is_set(),
            "units": [self._unit_snapshot(u) for u in self.units],
        }

    def _unit_snapshot(self, u: GroupSupervisor) -> dict[str, Any]:
        index = self.units.index(u)
        return {
            **u.snapshot(),
            "model_dir": str(self.unit_models.get(u.group_id, self.spec.model_dir)),
            "leader_http": f"http://127.0.0.1:{self.spec.unit_ports(index).http}",
        }

    def recreate_unit(
        self, unit_id: str, model_dir: Path, manifest_sha256: str | None = None
    ) -> int:
        """Recreate one unit on ``model_dir``; returns the generation that will serve it.
        KeyError for an unknown unit, RuntimeError while shutting down."""
        if self.stopping.is_set():
            raise RuntimeError("the cluster is shutting down")
        index = next((i for i, u in enumerate(self.units) if u.group_id == unit_id), None)
        if index is None:
            raise KeyError(unit_id)
        assert self._token_file is not None
        with self._recreate_lock:
            procs = plan.unit_processes(
                self.spec, index, self._token_file, Path(model_dir), manifest_sha256
            )
            generation = self.units[index].recreate(procs)
            self.unit_models[unit_id] = Path(model_dir)
        self.on_event(f"{unit_id} will be recreated on {model_dir}")
        return generation

    def snapshot(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "version": STATE_VERSION,
            "pid": os.getpid(),
            "updated_at": time.time(),
            "started_at": self.started_at,
            "stopping": self.stopping.is_set(),
            "run_dir": str(spec.run_dir),
            "model_dir": str(spec.model_dir),
            "served_model_name": spec.served_model_name,
            "units_requested": spec.units,
            "tp": spec.tp,
            "proxy_url": spec.proxy_url,
            "proxies": self.replicas.snapshot() if self.replicas else [],
            "units": [self._unit_snapshot(u) for u in self.units],
        }

    def write_state(self) -> bool:
        """Refresh supervisor.json; never raises on a failed write (full disk, removed
        run directory): reported once (then at most once a minute) and retried by the
        next call, since the state file is a view for `status`, not what keeps units up.
        Returns whether the write succeeded."""
        path = self.spec.state_file
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.snapshot(), indent=1))
            os.replace(tmp, path)  # readers never see half a file
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)  # a partial temp file holds space for nothing
            except OSError:
                pass
            self._state_errors.warning(
                f"cannot write {path}: {e}; still serving, retrying every tick "
                "(`neuron-serving status` shows stale supervisor state meanwhile)"
            )
            return False
        self._state_errors.recovered(f"{path} written again")
        return True

    def serve(self, stop: threading.Event, tick_s: float = 1.0) -> None:
        """The main loop of `up` once ready: keep the state file fresh until ``stop``.
        Nothing in it may end it but ``stop``: its ``finally`` would shut every unit down."""
        while not stop.wait(tick_s):
            self.write_state()

    def pids(self) -> list[int]:
        proxies = self.replicas.pids() if self.replicas else []
        return sorted({*proxies, *(pid for g in self.units for pid in g.pids())})

    # ---- stop ----------------------------------------------------------------------

    def drain(self, timeout_s: float) -> tuple[int, float]:
        """Stop admitting (every unit drained on every replica) and wait for in-flight
        requests to finish. Returns (requests still in flight, seconds waited)."""
        assert self.replicas is not None
        start = time.monotonic()
        self.replicas.drain([u.group_id for u in self.units])
        left = 0
        while time.monotonic() - start < timeout_s:
            # A replica that does not answer has nothing in flight through it.
            left = self.replicas.in_flight()
            if left == 0:
                break
            time.sleep(0.2)
        return left, time.monotonic() - start

    def shutdown(self, drain: bool = True) -> list[int]:
        """Drain, stop everything, and return the pids that survived (should be [])."""
        self.stopping.set()
        if self.supervisor_api is not None:
            self.supervisor_api.stop()
        if drain and self.replicas is not None and self.replicas.any_ready():
            self.on_event(f"draining (up to {self.spec.drain_timeout_s:.0f} s) ...")
            left, took = self.drain(self.spec.drain_timeout_s)
            if left:
                self.on_event(f"drain timed out after {took:.1f} s with {left} requests in flight")
            else:
                self.on_event(f"drained in {took:.1f} s")
        self.on_event("stopping units ...")
        # Units first (in parallel; each tears its own processes down in parallel), so
        # the replicas can still answer clients with a clean 503 meanwhile.
        threads = [threading.Thread(target=u.stop, daemon=True) for u in self.units]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.spec.stop_timeout_s + 30.0)
        if self.replicas is not None:
            self.replicas.stop()
        survivors = self.pids()
        try:
            self.write_state()
        except OSError:
            pass
        return survivors


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
