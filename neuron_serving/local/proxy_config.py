"""The proxy's config and the cluster's secrets, written into the run directory.

Secrets are fresh per `up` and written 0600 (``O_EXCL``) before any process that
reads them starts: the unit token authenticates ranks of one unit to each other
(so two local clusters cannot cross-join), the admin token guards the proxy's
admin API (drain on shutdown goes through it), and the client API key (tenant
"local") is what every client of the cluster sends as ``Authorization: Bearer``.
The key is in two files: ``api-keys.yaml`` (the proxy's ``api_keys_file``) and
``api-key`` (plain, for `neuron-serving status`, tests and scripts).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import yaml

from neuron_serving.local.spec import ClusterSpec

API_KEYS_FILE = "api-keys.yaml"
LOCAL_TENANT = "local"


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    # O_EXCL + mode: the file never exists with wider permissions, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def write_secret(path: Path) -> str:
    token = secrets.token_hex(24)
    _write_private(path, token + "\n")
    return token


def write_api_key(spec: ClusterSpec) -> tuple[Path, str]:
    """A fresh client API key: ``api-keys.yaml`` (tenant "local") and ``api-key``.
    Returns (keys file path, key)."""
    key = secrets.token_urlsafe(32)  # 43 URL-safe characters: pastes into curl as is
    keys_file = spec.run_dir / API_KEYS_FILE
    _write_private(keys_file, yaml.safe_dump({"tenants": {LOCAL_TENANT: {"keys": [key]}}}))
    _write_private(spec.api_key_file, key + "\n")
    return keys_file, key


def read_api_key(path: Path) -> str | None:
    """The key in an ``api-key`` file, or None when there is none to read."""
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return key or None


def unit_entry(spec: ClusterSpec, index: int, model_dir: Path | None = None) -> dict[str, Any]:
    """Unit ``index`` as the proxy knows it (a ``UnitSpec``, every field): in each
    replica's config, and the body of ``POST /admin/units`` for a unit added while
    the cluster runs, so a listing (``GET /admin/units``) compares equal to it."""
    ports = spec.unit_ports(index)
    return {
        "unit_id": spec.unit_id(index),
        "leader_grpc": f"127.0.0.1:{ports.grpc}",
        "leader_http": f"127.0.0.1:{ports.http}",
        "followers": [f"127.0.0.1:{ports.health(r)}" for r in range(1, spec.tp)],
        "model": spec.served_model_name,
        "triton_model": "llm",
        "model_version": Path(model_dir or spec.model_dir).resolve().name,
    }


def proxy_config(
    spec: ClusterSpec, admin_token_file: Path, api_keys_file: Path | None = None, replica: int = 0
) -> dict[str, Any]:
    """Replica ``replica``'s config. Replicas differ only in their admin port and
    replica id: the same units, keys, probes and batch store, so they route alike."""
    units = [unit_entry(spec, i) for i in range(spec.units)]
    return {
        "host": spec.host,
        "port": spec.port,
        # Several replicas share the client port: the kernel spreads new connections and
        # stops giving any to a replica as soon as it dies (its socket closes with it).
        "reuse_port": spec.proxies > 1,
        "admin_host": spec.host,
        "admin_port": spec.admin_ports()[replica],
        "admin_token_file": str(admin_token_file),
        **({"api_keys_file": str(api_keys_file)} if api_keys_file else {}),
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
        "routing": {"policy": spec.routing_policy},
        **({"admission": dict(spec.admission)} if spec.admission else {}),
        **({"timeouts": dict(spec.timeouts)} if spec.timeouts else {}),
        # The dashboard's time series from the cluster's Prometheus when it runs one.
        **({"history": {"prometheus_url": spec.prometheus_url}} if spec.prometheus_url else {}),
        # The Batch API's store and files live with the cluster's run dir, shared by the
        # replicas (SQLite in WAL mode on one host; a lease per line, owned by a replica
        # id). Ids are fixed, so a restarted replica takes its own leased lines back at once.
        "batch": {
            "data_dir": str(spec.run_dir / "proxy-data"),
            "replica_id": spec.replica_id(replica),
        },
        "models": [
            {
                "name": spec.served_model_name,
                "model_dir": str(spec.model_dir.resolve()),
                "max_model_len": spec.max_model_len,
            }
        ],
        "units": units,
    }


def write_proxy_config(spec: ClusterSpec) -> tuple[list[Path], str, str]:
    """Write each replica's ``proxy-<j>.yaml``, ``admin-token`` and the API key files;
    returns (config path of each replica, admin token, client API key)."""
    token_file = spec.run_dir / "admin-token"
    token = write_secret(token_file)
    keys_file, api_key = write_api_key(spec)
    paths = []
    for j in range(spec.proxies):
        path = spec.run_dir / f"{spec.replica_id(j)}.yaml"
        config = proxy_config(spec, token_file, keys_file, replica=j)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        paths.append(path)
    return paths, token, api_key
