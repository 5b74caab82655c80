"""The leader's watch loop against a real (tiny) HTTP server standing in for Triton."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from neuron_serving.exitcodes import ExitCode
from neuron_serving.triton import launcher
from neuron_serving.triton.launcher import LeaderSettings, TritonLeader


class FakeTriton:
    """Answers /v2/models/llm/ready with ``status`` (200 ready, 400 unloaded)."""

    def __init__(self) -> None:
        self.status = 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(fake.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def leader(tmp_path: Path):
    fake = FakeTriton()
    settings = LeaderSettings(model=str(tmp_path), http_port=fake.port, drain_s=0.1)
    ldr = TritonLeader(settings)
    # Stands in for tritonserver: alive until killed.
    ldr.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield ldr, fake
    ldr.proc.kill()
    ldr.proc.wait()
    fake.close()


def _monitor_in_thread(ldr: TritonLeader) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(ldr.monitor()), daemon=True)
    t.start()
    return t, result


def test_model_going_not_ready_is_a_unit_failure(leader) -> None:
    ldr, fake = leader
    assert ldr.probe_model() is True
    t, result = _monitor_in_thread(ldr)
    time.sleep(0.5)
    assert not result  # healthy: still watching
    fake.status = 400  # the model unloaded itself
    t.join(timeout=10)
    assert result == [ExitCode.UNIT_FAILED]


def test_stop_request_ends_the_watch_cleanly(leader) -> None:
    ldr, _ = leader
    t, result = _monitor_in_thread(ldr)
    ldr.stop_requested.set()
    t.join(timeout=10)
    assert result == [ExitCode.OK]


def test_unanswered_probes_fail_the_unit_only_after_a_while(leader, monkeypatch) -> None:
    ldr, fake = leader
    monkeypatch.setattr(launcher, "UNRESPONSIVE_S", 1.0)
    fake.close()  # nobody answers any more
    assert ldr.probe_model() is None
    t, result = _monitor_in_thread(ldr)
    t.join(timeout=20)
    assert result == [ExitCode.UNIT_FAILED]


def test_abandoned_load_is_noticed(leader, tmp_path: Path, monkeypatch) -> None:
    ldr, fake = leader
    fake.status = 400  # never ready
    monkeypatch.setattr(launcher, "LOAD_GRACE_S", 0.5)
    marker = tmp_path / "llm.initialized"
    marker.write_text("0.1\n")
    old = time.time() - 5
    os.utime(marker, (old, old))
    ldr._marker = marker
    assert ldr.wait_ready() is False


def test_rank0_placement_counts_nodes_on_neuron(tmp_path: Path, monkeypatch) -> None:
    """--tp is NxDI's global tp_degree on neuron: rank 0's placement is one rank per
    node (unit/engine.py unit_ranks), so a --tp that no node count gives is refused."""
    monkeypatch.setenv("NEURON_SERVING_DEVICE", "neuron")
    monkeypatch.setenv("NEURON_SERVING_NEURON_CORES_PER_NODE", "32")
    env = TritonLeader(LeaderSettings(model=str(tmp_path), tp=64))._rank0_env()
    assert env["NEURON_RT_ROOT_COMM_ID"] == "127.0.0.1:29503"
    with pytest.raises(ValueError, match="multiple of the 32 NeuronCores"):
        TritonLeader(LeaderSettings(model=str(tmp_path), tp=2))._rank0_env()


def test_served_model_name_defaults_like_the_local_cluster(tmp_path: Path) -> None:
    from neuron_serving.checkpoint.served_name import default_served_name

    model = tmp_path / "shoes"
    model.mkdir()
    assert LeaderSettings(model=str(model)).served_model_name == default_served_name(model)
    assert LeaderSettings(model=str(model), served_model_name="x").served_model_name == "x"


def test_port_draws_stay_clear_of_what_the_unit_binds_later(tmp_path: Path, monkeypatch) -> None:
    # A deploy's new leader once drew vLLM's metrics port on its own health port
    # (EngineCore binds that later) and failed to start.
    monkeypatch.setenv("NEURON_SERVING_LEADER_HEALTH_PORT", "18230")
    monkeypatch.setenv("NEURON_SERVING_LEADER_CHANNEL_PORT", "18240")
    leader = TritonLeader(LeaderSettings(model=str(tmp_path), control_port=18223,
                                         http_port=18227, grpc_port=18228, metrics_port=18229))  # fmt: skip
    reserved = leader.reserved_ports()
    assert reserved == {18223, 18224, 18225, 18226, 18227, 18228, 18229, 18230, 18231, 18240}
    monkeypatch.delenv("NEURON_SERVING_LEADER_CHANNEL_PORT")
    taken = set(reserved) - {18240}
    overrides = leader.model_json(tmp_path, 0, taken)
    assert overrides["openai_channel_port"] not in reserved - {18240}
    assert launcher.free_port_pair(exclude=taken) not in {p - 1 for p in taken} | taken
