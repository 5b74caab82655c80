"""The proxy's config and the cluster's secrets, written into the run directory.

Secrets are fresh per `up` (``secrets.token_hex``) and written 0600 before any
process that reads them starts: the unit token authenticates ranks of one unit
to each other (so two local clusters cannot cross-join), the admin token guards
the proxy's admin API (drain on shutdown goes through it).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import yaml

from neuron_serving.local.spec import ClusterSpec


def write_secret(path: Path) -> str:
    token = secrets.token_hex(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    # O_EXCL + mode: the file never exists with wider permissions, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def proxy_config(spec: ClusterSpec, admin_token_file: Path) -> dict[str, Any]:
    units = []
    for i in range(spec.units):
        ports = spec.unit_ports(i)
        units.append(
            {
                "unit_id": spec.unit_id(i),
                "leader_grpc": f"127.0.0.1:{ports.grpc}",
                "leader_http": f"127.0.0.1:{ports.http}",
                "followers": [f"127.0.0.1:{ports.health(r)}" for r in range(1, spec.tp)],
                "model": spec.served_model_name,
                "triton_model": "llm",
                "model_version": spec.model_dir.resolve().name,
            }
        )
    return {
        "host": spec.host,
        "port": spec.port,
        "admin_host": spec.host,
        "admin_port": spec.admin_port,
        "admin_token_file": str(admin_token_file),
        # A dead unit leaves rotation within unhealthy_threshold x interval (+ timeout);
        # one success brings a recreated unit back (never-seen-healthy rule), then two.
        "health": {
            "interval_s": spec.health_interval_s,
            "timeout_s": spec.health_timeout_s,
            "jitter_s": 0.05,
            "unhealthy_threshold": spec.unhealthy_threshold,
            "healthy_threshold": 2,
        },
        # Units here are recreated within a minute; a 30 s ejection (the proxy's
        # default) would keep a recreated unit out of rotation for no reason.
        "outlier": {"consecutive_errors": 5, "base_ejection_s": 5.0, "max_ejection_s": 60.0},
        # A local cluster has few streams; let all of a dead unit's streams migrate
        # (the default budget allows 3 concurrent retries, which would turn the rest
        # of a killed unit's streams into client-visible errors).
        "retry": {"max_migrations": 3, "budget_pct": 100.0, "min_retry_concurrency": 64},
        "models": [
            {
                "name": spec.served_model_name,
                "model_dir": str(spec.model_dir.resolve()),
                "max_model_len": spec.max_model_len,
            }
        ],
        "units": units,
    }


def write_proxy_config(spec: ClusterSpec) -> tuple[Path, str]:
    """Write ``proxy.yaml`` and ``admin-token``; returns (config path, admin token)."""
    token_file = spec.run_dir / "admin-token"
    token = write_secret(token_file)
    path = spec.run_dir / "proxy.yaml"
    path.write_text(yaml.safe_dump(proxy_config(spec, token_file), sort_keys=False))
    return path, token
