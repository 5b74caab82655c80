"""`ProxyReplicas`: the K proxy processes of one `up`, each supervised as a group of one.

Replica ``j`` (``proxy-j``) runs ``neuron-serving proxy --config proxy-j.yaml``: the
same units, keys, probes and batch store as its siblings, its own admin port, log
(``logs/proxy-j/proxy.log``) and batch replica id. They share the client port
(SO_REUSEPORT). Nothing passes between them: each probes every unit and has its own
channel to every leader, so each sees the same health, load reports and KV events
and routes alike; admin changes reach all of them because every caller fans them out
(neuron_serving/proxy_admin.py).

A replica that dies is restarted like any group (no backoff the first time). It
starts from its config, which lists the run's units, none drained; a deploy may have
drained one since. So a replica is *ready* only once it answers on its admin port and
has the units and drain states of a sibling that is ready (``AdminFanOut.sync``: the
calls that make it alike, then one more probe to confirm). With no sibling ready (one
replica, or all restarting at once) there is nothing to copy and it is ready as
configured, except for the unit set: units added or removed while the cluster runs
(ClusterSupervisor.add_unit / remove_unit) are not in any config, so a replica with no
ready sibling is made alike the supervisor's own registry of units instead (``units``:
every registered unit's spec, drained when the supervisor is removing it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuron_serving.local import plan
from neuron_serving.local.backoff import RestartBackoff
from neuron_serving.local.group_supervisor import GroupPhase, GroupPlan, GroupSupervisor
from neuron_serving.local.process import ProcessSpec
from neuron_serving.local.spec import ClusterSpec
from neuron_serving.proxy_admin import AdminFanOut, Replica

# Admin calls of the supervisor: a replica on this host answers in milliseconds, and a
# readiness probe (one sync) must not hold its group's thread for long.
ADMIN_TIMEOUT_S = 2.0
READY_TIMEOUT_S = 60.0


def _process(config: Path) -> ProcessSpec:
    return ProcessSpec("proxy", plan.cli("proxy", "--config", str(config)), plan.child_env({}))


class ProxyReplicas:
    def __init__(
        self,
        spec: ClusterSpec,
        configs: list[Path],
        admin_token: str,
        on_event: Callable[[str], None],
        units: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
    ) -> None:
        self.spec = spec
        self.on_event = on_event
        # The supervisor's registry: unit id -> {"spec", "draining"} (see the module doc).
        self.units = units
        self.admin = AdminFanOut(spec.replicas(), admin_token, ADMIN_TIMEOUT_S)
        self.groups = [
            GroupSupervisor(
                GroupPlan(
                    replica.replica_id,
                    [_process(config)],
                    spec.run_dir / "logs" / replica.replica_id,
                    ready=functools.partial(self._ready, j),
                    ready_timeout_s=READY_TIMEOUT_S,
                    stop_timeout_s=spec.stop_timeout_s,
                    backoff=RestartBackoff(spec.backoff_base_s, spec.backoff_max_s, spec.stable_s),
                    log_max_bytes=spec.log_max_bytes,
                    log_backups=spec.log_backups,
                ),
                on_event,
            )
            for j, (replica, config) in enumerate(zip(self.admin.replicas, configs, strict=True))
        ]

    def _ready(self, j: int) -> bool:
        """Replica ``j`` answers on its admin port and is alike a ready sibling (see the
        module doc); called by its group's thread while it starts."""
        replica = self.admin.replicas[j]
        sibling = self._ready_sibling(j)
        if sibling is None:
            have = self.admin.units_of(replica)
            if have is None or self.units is None:
                return have is not None
            want = self.units()
            done = self.admin.make_alike(replica, want, _compared(have, want))
            source = "the supervisor's"
        else:
            done = self.admin.sync(replica, sibling)
            source = f"{sibling.replica_id}'s"
        if done:
            self.on_event(
                f"{replica.replica_id} given {source} units and drain states: " + ", ".join(done)
            )
        return done == []  # made alike just now: confirmed by the next probe

    def _ready_sibling(self, j: int) -> Replica | None:
        for k, g in enumerate(self.groups):
            if k != j and g.phase == GroupPhase.READY:
                return self.admin.replicas[k]
        return None

    def start(self) -> None:
        for g in self.groups:
            g.start()

    def stop(self) -> None:
        for g in self.groups:
            g.stop()

    def any_ready(self) -> bool:
        return any(g.phase == GroupPhase.READY for g in self.groups)

    def routes_all(self, unit_ids: list[str]) -> bool:
        """Every replica's own /status shows every unit routable."""
        for status in self.admin.statuses().values():
            if status is None:
                return False
            states = {u.get("unit_id"): u.get("state") for u in status.get("units", [])}
            if any(states.get(u) != "routable" for u in unit_ids):
                return False
        return True

    def routes(self, unit_id: str) -> bool:
        """Every replica's own /status shows ``unit_id`` routable."""
        return self.routes_all([unit_id])

    def unit_in_flight(self, unit_id: str) -> tuple[int, list[str]]:
        """Requests in flight on ``unit_id`` through each replica that answers, and the
        replicas that did not answer although their group is ready (so whether they
        have any is unknown; one that is down has none)."""
        left, unknown = 0, []
        statuses = self.admin.statuses()
        for replica, g in zip(self.admin.replicas, self.groups, strict=True):
            status = statuses.get(replica.replica_id)
            if status is None:
                if g.phase == GroupPhase.READY:
                    unknown.append(replica.replica_id)
                continue
            units = status.get("units", [])
            left += sum(int(u.get("in_flight", 0)) for u in units if u.get("unit_id") == unit_id)
        return left, unknown

    def drain(self, unit_ids: list[str]) -> None:
        """Drain every unit on every replica; a replica that refuses or does not answer is
        reported (one that is down has nothing in flight; it stops with the rest)."""
        for unit_id in unit_ids:
            out = self.admin.drain(unit_id)
            for answer in out.failed():
                self.on_event(f"drain {unit_id}: {answer.describe()}")

    def in_flight(self) -> int:
        """Requests in flight or queued on every replica that answers."""
        left = 0
        for status in self.admin.statuses().values():
            if status is not None:
                left += sum(int(u.get("in_flight", 0)) for u in status.get("units", []))
                left += int(status.get("admission", {}).get("queued", 0))
        return left

    def snapshot(self) -> list[dict[str, Any]]:
        """The state file's ``proxies``: each replica's addresses and its group's state."""
        out = []
        for replica, g in zip(self.admin.replicas, self.groups, strict=True):
            snap = g.snapshot()
            snap.pop("unit_id")  # the group's id, under the name units use
            out.append(
                {
                    "replica_id": replica.replica_id,
                    "client_url": self.spec.proxy_url,
                    "admin_url": replica.admin_url,
                    **snap,
                }
            )
        return out

    def pids(self) -> list[int]:
        return sorted({pid for g in self.groups for pid in g.pids()})


def _compared(
    have: Mapping[str, Mapping[str, Any]], want: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``have`` with each spec cut to the fields ``want`` gives for that unit, so a field
    the proxy fills with its default does not count as a difference."""
    out = {}
    for unit_id, entry in have.items():
        fields = want.get(unit_id, {}).get("spec")
        spec = entry["spec"]
        if fields is not None:
            spec = {k: spec.get(k) for k in fields}
        out[unit_id] = {**entry, "spec": spec}
    return out
