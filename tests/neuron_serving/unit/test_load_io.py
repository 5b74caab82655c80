"""Hook 3 of checkpoint loading: each rank's load_model measured (time, /proc/self/io)
and served as gauges on the node's /metrics."""

from __future__ import annotations

import os
import urllib.request
from types import SimpleNamespace

import pytest

from neuron_serving.checkpoint.errors import CheckpointUntrusted
from neuron_serving.unit.health_server import HealthServer
from neuron_serving.unit.load_io import LoadStats, measured_load_model, read_proc_io
from neuron_serving.unit.node_metrics import NodeCollector
from neuron_serving.unit.node_status import NodeStatus
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint
from tests.neuron_serving.unit.exposition import samples
from tests.procs import free_port_block


class FileReadingWorker:
    """Stands in for vLLM's WorkerWrapperBase: load_model reads a weights file."""

    rpc_rank = 1

    def __init__(self, path, model_dir=None):
        self.path = path
        self.loaded = False
        model = str(model_dir or path.parent)  # no manifest: nothing to check
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=model))

    def load_model(self):
        self.loaded = True
        with open(self.path, "rb") as f:
            while f.read(1 << 20):
                pass


def test_measured_load_model_counts_bytes_read(tmp_path):
    weights = tmp_path / "w.bin"
    weights.write_bytes(os.urandom(3 << 20))
    assert {"rchar", "read_bytes"} <= set(read_proc_io())
    st = measured_load_model(FileReadingWorker(weights))
    assert st.rank == 1 and st.seconds > 0
    # rchar counts page-cache hits too (the file was just written: all cached).
    assert 3 << 20 <= st.rchar < (3 << 20) + (1 << 20)
    assert st.read_bytes >= 0
    assert "rank 1" in st.render() and "rchar 3.1 MB" in st.render()


def test_every_rank_hashes_its_files_before_load_model(tmp_path, monkeypatch):
    monkeypatch.delenv("NEURON_SERVING_MODEL_MANIFEST_SHA256", raising=False)
    m = make_checkpoint(tmp_path / "v")
    shard = tmp_path / "v" / m.rank_files[1][0]
    st = measured_load_model(FileReadingWorker(shard, tmp_path / "v"))
    want = sum(m.files[n].size for n in m.rank_files[1] + m.config_files)
    assert st.verified_bytes == want and "sha256 of" in st.render()
    # One byte flipped, same size: refused naming the file, and load_model never runs.
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    worker = FileReadingWorker(shard, tmp_path / "v")
    with pytest.raises(CheckpointUntrusted, match=f"{shard.name}: sha256 .* the manifest says"):
        measured_load_model(worker)
    assert not worker.loaded


def test_read_proc_io_tolerates_a_kernel_without_it(tmp_path):
    assert read_proc_io(str(tmp_path / "absent")) == {}


def test_load_gauges_on_metrics():
    status = NodeStatus("unit-l", 0, 2)
    stats = [LoadStats(0, "h0", 1.5, 5_500_000, 4096), LoadStats(1, "h1", 1.25, 5_400_000, 0)]
    collector = NodeCollector(status, load_stats=lambda: stats)
    server = HealthServer(status, "127.0.0.1", free_port_block(), collector=collector)
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port + 1}/metrics", timeout=2) as r:
            text = r.read().decode()
    finally:
        server.stop()
    assert samples(text, "neuron_serving_model_load_seconds", load_rank="1", rank="0",
                   unit="unit-l") == [1.25]  # fmt: skip
    assert samples(text, "neuron_serving_model_load_bytes", counter="rchar", load_rank="0",
                   rank="0", unit="unit-l") == [5.5e6]  # fmt: skip
    assert samples(text, "neuron_serving_model_load_bytes", counter="read_bytes", load_rank="1")
