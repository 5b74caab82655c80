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
                model directory through it (admin token required); the capacity
                controller adds and removes units through it
    add_unit    a new unit-N (the smallest free index: its port block and CPUs as if
                `up` had started it) started as its own group at once; once ready it is
                registered with every replica (POST /admin/units), and counted routable
                when every replica's /status shows it so
    remove_unit refused mid-deploy or for the last ready unit; else at once: drain on
                every replica, wait until none has a request in flight on it (bounded),
                stop the group (orderly), DELETE it on every replica, forget it
    warm pool   add_unit(standby=True) starts a unit that is registered with every
                replica drained: started, probed, never routed to (a warm spare);
                promote_unit undrains it on every replica (routable within a probe
                interval instead of a whole start-up); hold_unit drains a serving unit,
                waits for its in-flight requests and keeps it running as a spare
    shutdown()  drain through every replica's admin API (stop admitting, wait for
                in-flight up to drain_timeout_s), then stop every unit in parallel, then
                the replicas; finally check the process table: nothing of ours may remain.

Units are independent: one unit's crash loop never touches another unit or a
replica. Each replica is supervised as a group of one (restarted with backoff if it
dies, and ready again once it has a live sibling's drain states: replicas.py).

Threads: the serve loop, the API thread, wait_ready, the add and remove workers and
shutdown all read the unit list; every change to it and to the per-unit facts
(``_UnitInfo``, models, registrations) is made under ``_lock``, and readers iterate
over a copy (``groups()``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.compat import manifest_identity, model_label
from neuron_serving.checkpoint.errors import CheckpointMismatch
from neuron_serving.local import plan
from neuron_serving.local.group_supervisor import GroupPhase, GroupPlan, GroupSupervisor
from neuron_serving.local.process import ProcessSpec
from neuron_serving.local.proxy_config import unit_entry, write_proxy_config, write_secret
from neuron_serving.local.replicas import ProxyReplicas
from neuron_serving.local.spec import MAX_UNITS, ClusterSpec
from neuron_serving.local.supervisor_api import SOCKET_NAME, SupervisorApiServer
from neuron_serving.logsafe import RateLimitedLog
from neuron_serving.monitoring.targets import FleetTargets, UnitTargets

# 2: "proxies" (every replica's client and admin address and group state) replaced
# "proxy" and "admin_url".
STATE_VERSION = 2


# Why a unit was added (the capacity controller's Purpose): batch capacity is given
# back first. Units `up` started are "interactive".
PURPOSES = ("interactive", "batch")
_ADMIT_POLL_S = 0.25
_READD_S = 2.0  # a unit not routable yet is registered again this often (idempotent)


class StartupFailed(RuntimeError):
    pass


@dataclass
class _UnitInfo:
    """What the supervisor knows of a unit beyond its group: why it runs, whether the
    proxy replicas have it, whether it is being removed. Changed under the cluster's
    lock; ``admit`` serialises a registration against a removal of the same unit."""

    index: int
    purpose: str = "interactive"
    added: bool = False  # by add_unit (else started by `up`)
    registered: bool = True  # in the replicas' unit sets (`up`'s are, from their configs)
    routable: bool = True  # every replica's /status showed it routable (`up`: wait_ready)
    routable_at: float | None = None  # time.time()
    removing: bool = False
    removing_since: float | None = None
    # A warm spare (add_unit(standby=True) or hold_unit): registered drained with every
    # replica, never routed to until promote_unit. ``warm``: ready and registered
    # everywhere (promotable at once); ``holding``: a serving unit being drained into one.
    standby: bool = False
    warm: bool = False
    holding: bool = False
    standby_since: float | None = None  # time.time()
    admitting: bool = False  # an _admit thread runs for it
    admit: threading.Lock = field(default_factory=threading.Lock)


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
        # The deploy's manifest pin of each unit recreated by one (None: the environment's).
        self.unit_pins: dict[str, str | None] = {}
        self.supervisor_api: SupervisorApiServer | None = None
        self._token_file: Path | None = None
        self._recreate_lock = threading.Lock()
        self._state_errors = RateLimitedLog(on_event, burst=1, interval_s=60.0)
        # Guards the unit list and every per-unit dict below (see the module doc).
        self._lock = threading.RLock()
        self._write_lock = threading.Lock()
        self._info: dict[str, _UnitInfo] = {}
        # The UnitSpec each replica has of each unit (its config's, or add_unit's): what
        # a replica that restarts with no ready sibling is given (replicas.py).
        self._registered: dict[str, dict[str, Any]] = {}
        # unit id -> the generation a deploy's recreation will serve; cleared once that
        # generation is ready and no replica has the unit drained (the deploy admitted it).
        self._deploy_target: dict[str, int] = {}
        self.serving = threading.Event()  # wait_ready returned: units may be added/removed
        # The capacity controller's view (`up --autoscale`), in supervisor.json as
        # "capacity"; None without one. A callable: local sits below capacity.
        self.capacity_view: Callable[[], dict[str, Any]] | None = None
        # Called on every tick of serve(), after the state file (the local Prometheus
        # keeps its scrape targets current from it); each must not raise.
        self.tick_hooks: list[Callable[[], None]] = []
        # The supervisor's metrics endpoint (monitoring/endpoint.py), once up started it.
        self.metrics_url: str | None = None
        self.prometheus_url: str | None = None  # the cluster's Prometheus, once started

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
        self.replicas = ProxyReplicas(
            spec, configs, self.admin_token, self.on_event, units=self.registered_units
        )
        with self._lock:
            self.units = [
                self._new_group(i, plan.unit_processes(spec, i, token_file))
                for i in range(spec.units)
            ]
            self._info = {spec.unit_id(i): _UnitInfo(i) for i in range(spec.units)}
            self._registered = {spec.unit_id(i): unit_entry(spec, i) for i in range(spec.units)}

    def _new_group(self, index: int, processes: list[ProcessSpec]) -> GroupSupervisor:
        """Unit ``index``'s group (not started): what `up` starts, and add_unit."""
        spec = self.spec
        return GroupSupervisor(
            GroupPlan(
                spec.unit_id(index),
                processes,
                spec.run_dir / "logs" / spec.unit_id(index),
                ready=lambda: plan.unit_ready(spec, index),
                progress=lambda name: plan.unit_progress(spec, index, name),
                ready_timeout_s=spec.ready_timeout_s,
                stop_timeout_s=spec.stop_timeout_s,
                backoff=plan.unit_backoff(spec),
                log_max_bytes=spec.log_max_bytes,
                log_backups=spec.log_backups,
            ),
            self.on_event,
        )

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
        groups = [*self.replicas.groups, *self.groups()]
        unit_ids = [u.group_id for u in self.groups()]
        while time.monotonic() < deadline and not self.stopping.is_set():
            if all(g.phase == GroupPhase.READY for g in groups) and self.replicas.routes_all(
                unit_ids
            ):
                now = time.time()
                with self._lock:
                    for unit_id in unit_ids:
                        self._info_of(unit_id).routable_at = now
                self.serving.set()
                return now - self.started_at
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

    def groups(self) -> list[GroupSupervisor]:
        """The unit groups now (a copy: add and remove change the list meanwhile)."""
        with self._lock:
            return list(self.units)

    def _info_of(self, unit_id: str) -> _UnitInfo:
        """The unit's facts (callers hold ``_lock``); a unit without any (a test's stub
        group) is one `up` started, at the index of its id."""
        info = self._info.get(unit_id)
        if info is None:
            info = self._info[unit_id] = _UnitInfo(int(unit_id.rsplit("-", 1)[1]))
        return info

    def _group(self, unit_id: str) -> GroupSupervisor | None:
        with self._lock:
            return next((u for u in self.units if u.group_id == unit_id), None)

    def registered_units(self) -> dict[str, dict[str, Any]]:
        """Every unit the replicas should have (unit id -> {"spec", "draining"}): what a
        replica that restarts with no ready sibling is made alike (replicas.py). Drained:
        the units being removed and the warm spares (any other drain is a deploy's,
        which a lone restarted replica loses, as before units could be added)."""
        with self._lock:
            return {
                unit_id: {"spec": spec, "draining": self._drained_by_us(self._info_of(unit_id))}
                for unit_id, spec in self._registered.items()
            }

    @staticmethod
    def _drained_by_us(info: _UnitInfo) -> bool:
        return info.removing or info.standby or info.holding

    def units_view(self) -> dict[str, Any]:
        """The supervisor API's GET /units: what a deploy needs to plan and to wait, and
        what the capacity controller reads (purpose, routable, removing, mid_deploy)."""
        return {
            "tp": self.spec.tp,
            "device": "cpu",
            "stopping": self.stopping.is_set(),
            "served_model_name": self.spec.served_model_name,
            "units": [self._unit_snapshot(u) for u in self.groups()],
        }

    def _unit_snapshot(self, u: GroupSupervisor) -> dict[str, Any]:
        snap = u.snapshot()
        with self._lock:
            info = self._info_of(u.group_id)
            mid_deploy = u.group_id in self._deploy_target
            model_dir = self.unit_models.get(u.group_id, self.spec.model_dir)
            if (info.removing or info.holding) and snap["phase"] in (
                GroupPhase.STARTING,
                GroupPhase.READY,
            ):
                snap["phase"] = "draining"  # until its group stops / it is a spare
            return {
                **snap,
                "model_dir": str(model_dir),
                "leader_http": f"http://127.0.0.1:{self.spec.unit_ports(info.index).http}",
                "purpose": info.purpose,
                "added": info.added,
                "registered": info.registered,
                "routable": info.routable,
                "routable_at": info.routable_at,
                "removing": info.removing,
                "removing_since": info.removing_since,
                "standby": info.standby or info.holding,
                "warm": info.warm,
                "standby_since": info.standby_since,
                "mid_deploy": mid_deploy,
            }

    def recreate_unit(
        self, unit_id: str, model_dir: Path, manifest_sha256: str | None = None
    ) -> int:
        """Recreate one unit on ``model_dir``; returns the generation that will serve it.
        KeyError for an unknown unit, RuntimeError while shutting down or removing it."""
        if self.stopping.is_set():
            raise RuntimeError("the cluster is shutting down")
        group = self._group(unit_id)
        if group is None:
            raise KeyError(unit_id)
        assert self._token_file is not None
        with self._recreate_lock, self._lock:
            info = self._info_of(unit_id)
            if info.removing:
                raise RuntimeError(f"{unit_id} is being removed")
            if info.standby or info.holding:
                # A deploy admits (undrains) what it recreated: a spare would serve
                # afterwards while counted as one.
                raise RuntimeError(f"{unit_id} is a warm spare; promote or remove it first")
            procs = plan.unit_processes(
                self.spec, info.index, self._token_file, Path(model_dir), manifest_sha256
            )
            generation = group.recreate(procs)
            self.unit_models[unit_id] = Path(model_dir)
            self.unit_pins[unit_id] = manifest_sha256
            self._deploy_target[unit_id] = generation
        self.on_event(f"{unit_id} will be recreated on {model_dir}")
        return generation

    # ---- adding and removing units -------------------------------------------------

    def _check_changes_allowed(self) -> None:
        if self.stopping.is_set():
            raise RuntimeError("the cluster is shutting down")
        if not self.serving.is_set() or self.replicas is None or self._token_file is None:
            raise RuntimeError("the cluster is still starting")

    def _fleet_model(self) -> tuple[Path, str | None]:
        """What a new unit runs: the model directory (and deploy pin) most units run
        now, the cluster's own on a tie (a deploy half done moves the others later)."""
        counts = Counter(
            (self.unit_models.get(u.group_id, self.spec.model_dir), self.unit_pins.get(u.group_id))
            for u in self.units
            if not self._info_of(u.group_id).removing
        )
        top = max(counts.values(), default=0)
        if counts.get((self.spec.model_dir, None), -1) == top or not counts:
            return self.spec.model_dir, None
        return next(k for k, n in counts.items() if n == top)

    def add_unit(self, purpose: str = "interactive", standby: bool = False) -> str:
        """Start one more unit and return its id at once (see the module doc). It is
        registered with every replica once ready and counted routable once every
        replica's /status shows it so (``routable`` in its view); with ``standby`` it
        is registered drained and waits, ``warm``, for promote_unit. ValueError for an
        unknown purpose; RuntimeError while starting or stopping, or with no port
        block left."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}")
        self._check_changes_allowed()
        assert self._token_file is not None
        spec = self.spec
        with self._lock:
            used = {self._info_of(u.group_id).index for u in self.units}
            why = "every index in use"
            for index in range(MAX_UNITS):
                if index in used:
                    continue
                problem = spec.added_unit_problem(index)
                if problem is None:
                    try:
                        check_ports_free(spec.host, spec.unit_ports(index).all())
                        break
                    except StartupFailed as e:
                        problem = str(e)
                why = problem
            else:
                raise RuntimeError(f"no room for another unit: {why}")
            model_dir, pin = self._fleet_model()
            procs = plan.unit_processes(spec, index, self._token_file, model_dir, pin)
            group = self._new_group(index, procs)
            unit_id = group.group_id
            info = _UnitInfo(index, purpose, added=True, registered=False, routable=False,
                             standby=standby, admitting=True)  # fmt: skip
            if standby:
                info.standby_since = time.time()
            self.units.append(group)
            self._info[unit_id] = info
            self.unit_models[unit_id] = model_dir
            if pin is not None:
                self.unit_pins[unit_id] = pin
            group.start()
        ports = spec.unit_ports(index)
        self.on_event(
            f"{unit_id} added ({'warm spare' if standby else purpose}): "
            f"ports {ports.base}..{ports.all()[-1]}, "
            f"CPU binding {spec.unit_cpu_bind(index)!r}, model {model_dir}"
        )
        threading.Thread(
            target=self._admit, args=(group, info, model_dir), name=f"admit-{unit_id}", daemon=True
        ).start()
        self.write_state()
        return unit_id

    def _gone(self, info: _UnitInfo) -> bool:
        return self.stopping.is_set() or info.removing

    def _admit(self, group: GroupSupervisor, info: _UnitInfo, model_dir: Path) -> None:
        """An added unit's way into rotation: ready -> registered with every replica ->
        routable on every replica. Ends early when the unit is removed or the cluster
        stops; a unit that fails meanwhile is recreated by its group (and waited for).
        A warm spare's way ends once it is ready and registered (drained) with every
        replica (``warm``); promote_unit undrains it and runs this again to see it
        routable (the registration is then a no-op: an add never undrains)."""
        assert self.replicas is not None
        unit_id, started = group.group_id, time.monotonic()
        what = "promoted" if info.registered else "added"
        handed_off = False  # a warm spare's end: ``admitting`` cleared with ``warm``
        try:
            entry = unit_entry(self.spec, info.index, model_dir)
            while not self._gone(info) and group.phase != GroupPhase.READY:
                time.sleep(_ADMIT_POLL_S)
            next_add = 0.0
            while not self._gone(info):
                if time.monotonic() >= next_add:
                    next_add = time.monotonic() + _READD_S
                    # Under ``admit``: a removal waits for a registration in progress, so
                    # it never deletes the unit on a replica before the add reaches it;
                    # a promotion sees ``standby`` and ``registered`` change together.
                    with info.admit:
                        if self._gone(info):
                            return
                        with self._lock:  # before the calls: a replica restarting meanwhile
                            self._registered[unit_id] = entry  # with no sibling gets it too
                        out = self.replicas.admin.add(entry, draining=info.standby)
                        first = not info.registered
                        with self._lock:
                            info.registered = True
                        everywhere = not out.failed((200, 201))
                        if info.standby and everywhere and group.phase == GroupPhase.READY:
                            with self._lock:
                                # Together, under ``admit``: a promotion from now on
                                # starts its own _admit; this one must not clear it.
                                info.warm, info.admitting, handed_off = True, False, True
                            self.on_event(
                                f"{unit_id} warm (ready, held drained on every proxy replica) "
                                f"{time.monotonic() - started:.1f} s after it was added"
                            )
                            self.write_state()
                            return
                    if first:
                        self.on_event(
                            f"{unit_id} ready after {time.monotonic() - started:.1f} s; "
                            f"registered with {len(out.answers) - len(out.failed((200, 201)))} "
                            f"of {len(out.answers)} proxy replicas"
                        )
                    for answer in out.failed((200, 201)):
                        # A replica down now gets the unit from a sibling (or from
                        # registered_units) when it is back; the others are asked again.
                        self.on_event(f"register {unit_id}: {answer.describe()}")
                if (
                    not info.standby
                    and group.phase == GroupPhase.READY
                    and self.replicas.routes(unit_id)
                ):
                    with self._lock:
                        info.routable, info.routable_at = True, time.time()
                    self.on_event(
                        f"{unit_id} routable on every proxy replica "
                        f"{time.monotonic() - started:.1f} s after it was {what}"
                    )
                    self.write_state()
                    return
                time.sleep(_ADMIT_POLL_S)
        finally:
            if not handed_off:
                with info.admit, self._lock:
                    info.admitting = False

    def promote_unit(self, unit_id: str, purpose: str = "interactive") -> None:
        """A warm spare into rotation: undrained on every replica (bounded calls), then
        counted routable once every replica routes to it (in the background, as an
        added unit). A spare still starting is promoted too: it is registered
        undrained when ready. KeyError for an unknown unit; ValueError for an unknown
        purpose; RuntimeError when it is not a spare (or being drained into one)."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}")
        self._check_changes_allowed()
        assert self.replicas is not None
        group = self._group(unit_id)
        if group is None:
            raise KeyError(unit_id)
        with self._lock:
            info = self._info_of(unit_id)
        with info.admit:
            with self._lock:
                if info.removing:
                    raise RuntimeError(f"{unit_id} is being removed")
                if info.holding:
                    raise RuntimeError(f"{unit_id} is still being drained into a spare")
                if not info.standby:
                    raise RuntimeError(f"{unit_id} is not a warm spare")
                info.standby, info.warm, info.purpose = False, False, purpose
                info.standby_since = None
                registered, running = info.registered, info.admitting
                info.admitting = True
            if registered:
                for answer in self.replicas.admin.undrain(unit_id).failed():
                    # Down now: it gets the unit's state from a sibling when back.
                    self.on_event(f"undrain {unit_id}: {answer.describe()}")
        self.on_event(f"{unit_id} promoted from the warm pool ({purpose})")
        if not running:
            model_dir = self.unit_models.get(unit_id, self.spec.model_dir)
            threading.Thread(
                target=self._admit, args=(group, info, model_dir), name=f"admit-{unit_id}",
                daemon=True,
            ).start()  # fmt: skip
        self.write_state()

    def hold_unit(self, unit_id: str) -> None:
        """A serving unit into the warm pool, without losing a request: refused as
        remove_unit refuses; else drained on every replica and, once none has a request
        in flight there (bounded), kept running as a warm spare. Returns at once."""
        self._drain_out(unit_id, holding=True)

    def _hold(self, group: GroupSupervisor, info: _UnitInfo) -> None:
        unit_id, start = group.group_id, time.monotonic()
        self._drain_and_wait(group, info, start)
        with self._lock:
            info.holding = False
            info.standby, info.warm = True, True
            info.routable, info.routable_at = False, None
            info.standby_since = time.time()
        self.on_event(f"{unit_id} warm spare after {time.monotonic() - start:.1f} s")
        self.write_state()

    def _held_by_others(self, unit_id: str) -> list[str]:
        """The replicas that have ``unit_id`` drained although this supervisor is not
        removing it: a deploy (drained before its recreate call, admitted after its
        canaries) or an operator holds it."""
        assert self.replicas is not None
        return sorted(
            replica_id
            for replica_id, units in self.replicas.admin.units().items()
            if units and units.get(unit_id, {}).get("draining")
        )

    def _refresh_deploys(self) -> None:
        """Forget a deploy's hold on a unit once its new generation is ready and no
        replica has it drained any more (the deploy admitted it)."""
        with self._lock:
            pending = dict(self._deploy_target)
        for unit_id, target in pending.items():
            group = self._group(unit_id)
            done = group is None or (
                group.generation >= target
                and group.phase == GroupPhase.READY
                and not self._held_by_others(unit_id)
            )
            if done:
                with self._lock:
                    if self._deploy_target.get(unit_id) == target:
                        del self._deploy_target[unit_id]

    def remove_unit(self, unit_id: str) -> None:
        """Take ``unit_id`` out without losing a request; returns at once, the unit shows
        ``removing`` (phase "draining") until it is gone from the view. KeyError for an
        unknown unit; RuntimeError when refused: mid-deploy (recreated by a deploy not
        yet admitted again, or drained by someone else), the last ready unit, the last
        unit, or while starting or stopping. Removing a unit already being removed is
        accepted (nothing more is done)."""
        self._drain_out(unit_id, holding=False)

    def _drain_out(self, unit_id: str, holding: bool) -> None:
        """remove_unit's and hold_unit's start: claim the unit (or refuse), then drain it
        and retire it (or keep it as a spare) on a thread of its own."""
        self._check_changes_allowed()
        claimed = self._claim_for_drain(unit_id, holding)
        if claimed is None:  # already being removed
            return
        group, info = claimed
        what, steps, name = (
            ("into the warm pool", self._hold, "hold") if holding
            else ("removing", self._retire, "retire")
        )  # fmt: skip
        self.on_event(f"{unit_id} {what}: draining on every proxy replica")
        threading.Thread(
            target=steps, args=(group, info), name=f"{name}-{unit_id}", daemon=True
        ).start()
        self.write_state()

    def _claim_for_drain(
        self, unit_id: str, holding: bool
    ) -> tuple[GroupSupervisor, _UnitInfo] | None:
        """remove_unit's and hold_unit's refusals; marks the unit removing (or holding)
        and returns (group, info), or None when it is already being removed."""
        if self._group(unit_id) is None:
            raise KeyError(unit_id)
        self._refresh_deploys()
        held = self._held_by_others(unit_id)
        with self._lock:
            group = next((u for u in self.units if u.group_id == unit_id), None)
            if group is None:
                raise KeyError(unit_id)
            info = self._info_of(unit_id)
            if info.removing:
                if holding:
                    raise RuntimeError(f"{unit_id} is being removed")
                return None
            if holding and (info.standby or info.holding):
                raise RuntimeError(f"{unit_id} is already a warm spare")
            if holding and not self._counts_ready(group):
                raise RuntimeError(f"{unit_id} is not serving (only a routable unit is held)")
            if info.holding:
                raise RuntimeError(f"{unit_id} is being drained into a spare; wait for it")
            if unit_id in self._deploy_target:
                raise RuntimeError(f"{unit_id} is mid-deploy (being recreated by a deploy)")
            if held and not info.standby:  # a spare is drained by this supervisor
                raise RuntimeError(
                    f"{unit_id} is drained on {', '.join(held)} by someone else "
                    "(a deploy in progress?); undrain it first"
                )
            others = [u for u in self.units if u is not group
                      and not self._info_of(u.group_id).removing]  # fmt: skip
            if not others:
                raise RuntimeError(f"{unit_id} is the last unit")
            if self._counts_ready(group) and not any(self._counts_ready(u) for u in others):
                raise RuntimeError(f"{unit_id} is the last ready unit")
            if holding:
                info.holding, info.removing_since = True, time.time()
            else:
                info.removing, info.removing_since = True, time.time()
        return group, info

    def _counts_ready(self, u: GroupSupervisor) -> bool:
        """Ready and routable (callers hold ``_lock``)."""
        info = self._info_of(u.group_id)
        return (
            u.phase == GroupPhase.READY
            and info.routable
            and not (info.removing or info.holding or info.standby)
        )

    def _drain_and_wait(self, group: GroupSupervisor, info: _UnitInfo, start: float) -> bool:
        """Drain the unit on every replica and wait (bounded by drain_timeout_s) until
        none has a request in flight on it; whether it was registered at all."""
        assert self.replicas is not None
        unit_id = group.group_id
        with info.admit:  # a registration in progress finishes first
            registered = info.registered
        if not registered:
            return False
        for answer in self.replicas.admin.drain(unit_id).failed():
            self.on_event(f"drain {unit_id}: {answer.describe()}")
        timeout = self.spec.drain_timeout_s
        while True:
            left, unknown = self.replicas.unit_in_flight(unit_id)
            if left == 0 and not unknown:
                self.on_event(f"{unit_id} drained in {time.monotonic() - start:.1f} s")
                return True
            if time.monotonic() - start > timeout:
                self.on_event(
                    f"{unit_id}: {left} request(s) in flight after {timeout:.0f} s"
                    + (f" (no answer from {', '.join(unknown)})" if unknown else "")
                    + "; going on anyway (the proxy migrates its streams)"
                )
                return True
            time.sleep(0.1)

    def _retire(self, group: GroupSupervisor, info: _UnitInfo) -> None:
        """A removal's steps, in order; each proxy call bounded, the wait too."""
        assert self.replicas is not None
        unit_id, start = group.group_id, time.monotonic()
        registered = self._drain_and_wait(group, info, start)
        stopped_at = time.monotonic()
        group.stop()
        stop_s = time.monotonic() - stopped_at
        with self._lock:  # before the calls: a replica restarting meanwhile drops it too
            self._registered.pop(unit_id, None)
        if registered:
            for _ in range(2):
                out = self.replicas.admin.remove(unit_id)
                failed = [a for a in out.failed() if a.status not in (0, 404)]
                if not failed:
                    break
            for answer in out.failed((200, 404)):
                self.on_event(f"unregister {unit_id}: {answer.describe()}")
        with self._lock:
            if group in self.units:
                self.units.remove(group)
            for d in (self._info, self.unit_models, self.unit_pins, self._deploy_target):
                d.pop(unit_id, None)
        self.on_event(
            f"{unit_id} removed in {time.monotonic() - start:.1f} s (stopped in {stop_s:.1f} s)"
        )
        self.write_state()

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
            "units": [self._unit_snapshot(u) for u in self.groups()],
            "capacity": self._capacity(),
            "metrics_url": self.metrics_url,
            "prometheus_url": self.prometheus_url,
        }

    def scrape_targets(self) -> FleetTargets:
        """Every endpoint Prometheus scrapes in this cluster, as it is now: each unit's
        leader and followers (units come, go and are recreated on the same ports),
        each proxy replica's admin port, the supervisor's own endpoint."""
        spec, hostname = self.spec, socket.gethostname()
        units = []
        for u in self.groups():
            with self._lock:
                index = self._info_of(u.group_id).index
                model_dir = self.unit_models.get(u.group_id, spec.model_dir)
            ports = spec.unit_ports(index)
            try:
                version = manifest_identity(Path(model_dir))[0]
            except CheckpointMismatch:  # an unreadable manifest: the unit's own failure
                version = ""
            units.append(UnitTargets(
                u.group_id, "127.0.0.1", hostname, model_label(str(model_dir), version),
                ports.metrics,
                tuple(ports.health(r) + 1 for r in range(1, spec.tp)),
            ))  # fmt: skip
        proxies = [(r.replica_id, r.admin_url.removeprefix("http://")) for r in spec.replicas()]
        supervisor = self.metrics_url.removeprefix("http://") if self.metrics_url else None
        return FleetTargets(units, proxies, supervisor)

    def _capacity(self) -> dict[str, Any] | None:
        view = self.capacity_view
        if view is None:
            return None
        try:
            return view()
        except Exception as e:  # noqa: BLE001 - a view must not stop the state file
            return {"enabled": True, "error": f"{type(e).__name__}: {e}"}

    def write_state(self) -> bool:
        """Refresh supervisor.json; never raises on a failed write (full disk, removed
        run directory): reported once (then at most once a minute) and retried by the
        next call, since the state file is a view for `status`, not what keeps units up.
        Returns whether the write succeeded."""
        path = self.spec.state_file
        tmp = path.with_suffix(".tmp")
        try:
            # One writer at a time (the serve loop, add and remove workers): they share
            # the temp file.
            with self._write_lock:
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
            for hook in list(self.tick_hooks):
                try:
                    hook()
                except Exception as e:  # noqa: BLE001 - a view's refresh must not end serving
                    self._state_errors.warning(f"a monitoring refresh failed: {e}")
            try:
                self._refresh_deploys()
            except Exception as e:  # noqa: BLE001 - a view's refresh must not end serving
                self._state_errors.warning(f"cannot refresh deploy holds: {e}")

    def pids(self) -> list[int]:
        proxies = self.replicas.pids() if self.replicas else []
        return sorted({*proxies, *(pid for g in self.groups() for pid in g.pids())})

    # ---- stop ----------------------------------------------------------------------

    def drain(self, timeout_s: float) -> tuple[int, float]:
        """Stop admitting (every unit drained on every replica) and wait for in-flight
        requests to finish. Returns (requests still in flight, seconds waited)."""
        assert self.replicas is not None
        start = time.monotonic()
        self.replicas.drain([u.group_id for u in self.groups()])
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
        threads = [threading.Thread(target=u.stop, daemon=True) for u in self.groups()]
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
