"""The supervisor API over its real Unix socket: auth, permissions, errors."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from neuron_serving.local.supervisor_api import (
    SupervisorApiClient,
    SupervisorApiError,
    SupervisorApiServer,
)
from tests.neuron_serving.test_bearer import hostile_authorizations

TOKEN = "control-test-token"


class FakeCluster:
    def __init__(self) -> None:
        self.recreated: list[tuple[str, Path]] = []
        self.stopping = False

    def units_view(self) -> dict[str, Any]:
        return {"tp": 2, "units": [{"unit_id": "unit-0", "phase": "ready", "generation": 1}]}

    def recreate_unit(self, unit_id: str, model_dir: Path) -> int:
        if self.stopping:
            raise RuntimeError("the cluster is shutting down")
        if unit_id != "unit-0":
            raise KeyError(unit_id)
        self.recreated.append((unit_id, model_dir))
        return 2


@pytest.fixture
def server(tmp_path: Path):
    cluster = FakeCluster()
    # Unix socket paths are limited to ~100 bytes; pytest's tmp paths can be long.
    sock = Path(f"/tmp/ns-ctl-{os.getpid()}.sock")
    srv = SupervisorApiServer(cluster, sock, TOKEN)
    srv.start()
    yield srv, cluster
    srv.stop()
    assert not sock.exists()


def test_units_and_recreate(server, tmp_path: Path) -> None:
    srv, cluster = server
    mode = stat.S_IMODE(os.stat(srv.socket_path).st_mode)
    assert mode == 0o600, oct(mode)
    client = SupervisorApiClient(srv.socket_path, TOKEN, timeout_s=5)
    assert client.units()["units"][0]["unit_id"] == "unit-0"
    assert client.recreate("unit-0", tmp_path) == 2
    assert cluster.recreated == [("unit-0", tmp_path.resolve())]


def test_refusals_change_nothing(server, tmp_path: Path) -> None:
    srv, cluster = server
    with pytest.raises(SupervisorApiError, match="401"):
        SupervisorApiClient(srv.socket_path, "wrong", timeout_s=5).recreate("unit-0", tmp_path)
    client = SupervisorApiClient(srv.socket_path, TOKEN, timeout_s=5)
    with pytest.raises(SupervisorApiError, match="404 unit 'unit-9' not found"):
        client.recreate("unit-9", tmp_path)
    with pytest.raises(SupervisorApiError, match="400 .*is not a directory"):
        client.recreate("unit-0", tmp_path / "missing")
    cluster.stopping = True
    with pytest.raises(SupervisorApiError, match="409 the cluster is shutting down"):
        client.recreate("unit-0", tmp_path)
    assert cluster.recreated == []


def test_unreachable_socket_is_a_clear_error(tmp_path: Path) -> None:
    client = SupervisorApiClient(tmp_path / "none.sock", TOKEN, timeout_s=2)
    with pytest.raises(SupervisorApiError, match="unreachable.*neuron-serving up"):
        client.units()


def _raw_status(socket_path: Path, authorization: bytes) -> int:
    """GET /units with raw header bytes no HTTP client would send; the status code."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(socket_path))
        s.sendall(
            b"GET /units HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Authorization: " + authorization + b"\r\n\r\n"
        )
        head = s.recv(64)
    return int(head.split()[1])


def test_token_check_survives_hostile_headers(server) -> None:
    """Any case of the scheme is accepted; invalid UTF-8, non-ASCII, a huge token and
    other schemes are each a 401, never a 500 (neuron_serving/bearer.py)."""
    srv, _ = server
    assert _raw_status(srv.socket_path, b"bearer " + TOKEN.encode()) == 200
    for value in hostile_authorizations(TOKEN):
        assert _raw_status(srv.socket_path, value) == 401, value[:40]
