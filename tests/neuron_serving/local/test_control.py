"""The supervisor control API over its real Unix socket: auth, permissions, errors."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from neuron_serving.local.control import ControlClient, ControlError, ControlServer

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
    srv = ControlServer(cluster, sock, TOKEN)
    srv.start()
    yield srv, cluster
    srv.stop()
    assert not sock.exists()


def test_units_and_recreate(server, tmp_path: Path) -> None:
    srv, cluster = server
    mode = stat.S_IMODE(os.stat(srv.socket_path).st_mode)
    assert mode == 0o600, oct(mode)
    client = ControlClient(srv.socket_path, TOKEN, timeout_s=5)
    assert client.units()["units"][0]["unit_id"] == "unit-0"
    assert client.recreate("unit-0", tmp_path) == 2
    assert cluster.recreated == [("unit-0", tmp_path.resolve())]


def test_refusals_change_nothing(server, tmp_path: Path) -> None:
    srv, cluster = server
    with pytest.raises(ControlError, match="401"):
        ControlClient(srv.socket_path, "wrong", timeout_s=5).recreate("unit-0", tmp_path)
    client = ControlClient(srv.socket_path, TOKEN, timeout_s=5)
    with pytest.raises(ControlError, match="404 unit 'unit-9' not found"):
        client.recreate("unit-9", tmp_path)
    with pytest.raises(ControlError, match="400 .*is not a directory"):
        client.recreate("unit-0", tmp_path / "missing")
    cluster.stopping = True
    with pytest.raises(ControlError, match="409 the cluster is shutting down"):
        client.recreate("unit-0", tmp_path)
    assert cluster.recreated == []


def test_unreachable_socket_is_a_clear_error(tmp_path: Path) -> None:
    client = ControlClient(tmp_path / "none.sock", TOKEN, timeout_s=2)
    with pytest.raises(ControlError, match="unreachable.*neuron-serving up"):
        client.units()
