"""Prometheus scrape targets of a fleet, as file-based service discovery groups.

A *job* is one kind of endpoint; each group one endpoint with the labels every series
scraped from it carries (Prometheus's ``file_sd_configs`` format: a JSON list of
``{"targets": ["host:port"], "labels": {...}}``):

- ``leaders``: each unit's leader metrics port, where Triton's, vLLM's (``vllm:*``) and
  the leader node's own (``neuron_serving_*``) metrics are served merged. vLLM's and
  Triton's series get the unit's labels from the group: unit, rank 0, role, host,
  model.
- ``followers``: each follower's node metrics (its health port + 1), labelled in the
  series themselves.
- ``proxies``: each proxy replica's admin port (``/metrics`` with the admin token).
- ``supervisor``: the supervisor's own endpoint (unit restarts and failures, the
  autoscaler's decisions).

The node metrics carry their own unit/rank/host/role/model/version labels; the jobs
scrape with ``honor_labels`` so those win over the group's where both are set.
``write_file_sd`` replaces a file whole (never half-written) and only when it changed,
so Prometheus, which watches the files, re-reads them only then.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JOBS = ("leaders", "followers", "proxies", "supervisor")


@dataclass(frozen=True)
class UnitTargets:
    """One unit's endpoints: its leader's metrics port and each follower's (rank
    1..N-1) node metrics port, with the labels its series share."""

    unit: str
    host: str  # the address Prometheus connects to
    hostname: str  # the machine's name, as the nodes label themselves
    model: str
    leader_metrics_port: int
    follower_metrics_ports: tuple[int, ...] = ()

    def groups(self) -> dict[str, list[dict[str, Any]]]:
        base = {"unit": self.unit, "host": self.hostname, "model": self.model}
        leaders = [_group(self.host, self.leader_metrics_port,
                          {**base, "rank": "0", "role": "leader"})]  # fmt: skip
        followers = [
            _group(self.host, port, {**base, "rank": str(rank), "role": "follower"})
            for rank, port in enumerate(self.follower_metrics_ports, start=1)
        ]
        return {"leaders": leaders, "followers": followers}


@dataclass
class FleetTargets:
    units: list[UnitTargets] = field(default_factory=list)
    proxies: list[tuple[str, str]] = field(default_factory=list)  # (replica id, host:port)
    supervisor: str | None = None  # host:port

    def groups(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {job: [] for job in JOBS}
        for u in self.units:
            for job, groups in u.groups().items():
                out[job] += groups
        out["proxies"] = [{"targets": [addr], "labels": {"replica": rid}}
                          for rid, addr in self.proxies]  # fmt: skip
        if self.supervisor:
            out["supervisor"] = [{"targets": [self.supervisor], "labels": {}}]
        return out


def _group(host: str, port: int, labels: dict[str, str]) -> dict[str, Any]:
    return {"targets": [f"{host}:{port}"], "labels": labels}


def file_sd_path(directory: Path, job: str) -> Path:
    return directory / f"{job}.json"


def write_file_sd(directory: Path, groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Write each job's groups to ``directory``/JOB.json when they changed; the jobs
    written. Raises OSError (a full disk): the caller decides whether that matters."""
    written = []
    for job, job_groups in groups.items():
        path = file_sd_path(directory, job)
        text = json.dumps(job_groups, indent=1, sort_keys=True)
        try:
            if path.read_text() == text:
                continue
        except OSError:
            pass
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # Prometheus never reads half a file
        written.append(job)
    return written


def ensure_files(directory: Path, jobs: Iterable[str] = JOBS) -> None:
    """Every job's file, empty where not written yet (Prometheus warns on a missing one)."""
    directory.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        path = file_sd_path(directory, job)
        if not path.exists():
            path.write_text("[]")
