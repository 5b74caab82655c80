"""The leader's KV event settings: the engine arguments a default leader builds (vLLM's
publisher on private ipc:// sockets), the switches, and the hashing it announces
(checked against vLLM's own block hashes). The relay: test_kv_events_relay.py."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import ZmqEventPublisher
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils

from neuron_serving.cli import build_parser
from neuron_serving.commands.leader import settings_from_args
from neuron_serving.triton import kv_events
from neuron_serving.triton.backend_config import BackendConfig
from neuron_serving.triton.engine_args import check_engine_args
from neuron_serving.triton.launcher import TritonLeader
from neuron_serving.triton.repository import MODEL_NAME, render_model_repository


@pytest.fixture
def run_dir():
    # Short, as a leader's run directory is: Unix socket paths are at most 107 bytes.
    d = Path(tempfile.mkdtemp(prefix="ns-run-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def rendered(run_dir: Path, model: Path, *flags: str) -> BackendConfig:
    """The model.json a leader started with ``flags`` renders, as the backend reads it,
    with the socket directory resolved as the backend's initialize() does."""
    args = build_parser().parse_args(
        ["leader", "--model", str(model), "--control-port", "29500", *flags]
    )
    leader = TritonLeader(settings_from_args(args))
    repo = render_model_repository(run_dir, leader.model_json(run_dir))
    config = BackendConfig.load(repo / MODEL_NAME / "1" / "model.json")
    if config.kv_events:
        directory, temporary = kv_events.resolve_dir(config.kv_events_dir)
        assert not temporary
        config.kv_events_dir = str(directory)
    return config


def test_a_default_leader_publishes_on_private_ipc_sockets(run_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("NEURON_SERVING_KV_EVENTS", raising=False)
    config = rendered(run_dir, tmp_path)
    assert config.kv_events and config.kv_events_dir == str(run_dir / "kv-events")
    kw = config.engine_kwargs()
    assert kw["enable_prefix_caching"] is True
    events = kw["kv_events_config"]
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    assert events["endpoint"] == f"ipc://{run_dir}/kv-events/kv-events"
    assert events["replay_endpoint"] == f"ipc://{run_dir}/kv-events/kv-replay"
    assert events["buffer_steps"] == kv_events.DEFAULT_BUFFER_STEPS
    # Only the leader's user may enter the directory of the sockets.
    mode = (run_dir / "kv-events").stat().st_mode
    assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700
    # vLLM's own config class takes the dict as it is (VllmConfig validates it so).
    assert KVEventsConfig(**events).endpoint == events["endpoint"]


def test_vllms_dp_offset_keeps_the_ipc_endpoints_of_the_one_engine(run_dir) -> None:
    """vLLM offsets each DP rank's endpoint; the leader's one engine is rank 0, whose
    endpoints stand as given (an ipc:// one of another rank would be refused)."""
    live, replay = kv_events.endpoints(run_dir)
    assert ZmqEventPublisher.offset_endpoint_port(live, 0) == live
    assert ZmqEventPublisher.offset_endpoint_port(replay, 0) == replay
    with pytest.raises(ValueError, match="must contain 'inproc' or 'tcp'"):
        ZmqEventPublisher.offset_endpoint_port(live, 1)
    with pytest.raises(ValueError, match="data_parallel_size"):
        check_engine_args({"data_parallel_size": 2})


def test_switches_turn_the_events_off(run_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("NEURON_SERVING_KV_EVENTS", raising=False)
    config = rendered(run_dir, tmp_path, "--no-kv-events")
    assert config.kv_events is False
    assert "kv_events_config" not in config.engine_kwargs()
    monkeypatch.setenv("NEURON_SERVING_KV_EVENTS", "0")
    assert rendered(run_dir, tmp_path).kv_events is False
    # The flag wins over the environment either way; prefix caching off: no events
    # (they are the prefix cache's), whatever the switch says.
    monkeypatch.setenv("NEURON_SERVING_KV_EVENTS", "1")
    config = rendered(run_dir, tmp_path, "--engine-args", '{"enable_prefix_caching": false}')
    assert config.kv_events and "kv_events_config" not in config.engine_kwargs()


def test_engine_args_cannot_move_the_endpoints() -> None:
    with pytest.raises(ValueError, match="'kv_events_config' is set by the leader"):
        check_engine_args({"kv_events_config": {"endpoint": "tcp://*:5557"}})


def test_no_directory_no_events_config() -> None:
    """engine_kwargs() alone (a BackendConfig the backend has not prepared) sets no
    endpoints: never vLLM's default tcp://*:5557."""
    kw = BackendConfig(model="/m").engine_kwargs()
    assert "kv_events_config" not in kw


def test_a_run_dir_too_long_for_a_socket_falls_back_to_a_private_temp_dir(tmp_path) -> None:
    long_dir = tmp_path / ("x" * 120) / "kv-events"
    directory, temporary = kv_events.resolve_dir(str(long_dir))
    try:
        assert temporary and kv_events.usable_dir(directory)
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    finally:
        kv_events.remove_dir(directory)
    assert not directory.exists()


def test_an_open_directory_is_closed_to_others(run_dir) -> None:
    d = run_dir / "kv-events"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert kv_events.resolve_dir(str(d)) == (d, False)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (run_dir / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        kv_events.private_dir(run_dir / "file")


def engine(algo: str = "sha256", block_size: int = 16) -> SimpleNamespace:
    cache = SimpleNamespace(block_size=block_size, prefix_caching_hash_algo=algo)
    return SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))


def test_the_announced_hashing_reproduces_vllms_block_hashes(monkeypatch) -> None:
    """From the announced fields alone (standard library only, as a proxy would), the
    block hashes vLLM's EngineCore computes and its KV events carry."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    info = kv_events.hashing(engine())
    assert info["none_hash_seed"] == kv_cache_utils.DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert info["int_block_hashes"] is True and info["block_size"] == 16
    kv_cache_utils.init_none_hash(sha256)  # what EngineCore.__init__ does
    assert info["none_hash"] == kv_cache_utils.NONE_HASH

    tokens = list(range(1000, 1000 + 3 * 16))
    vllm_hashes, parent = [], None
    for i in range(3):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[16 * i : 16 * i + 16])
        vllm_hashes.append(parent)
    ours, parent = [], info["none_hash"]
    for i in range(3):
        block = (parent, tuple(tokens[16 * i : 16 * i + 16]), None)
        parent = hashlib.sha256(pickle.dumps(block, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        ours.append(parent)
    assert ours == vllm_hashes
    # In the events: the digest's low 64 bits, as an int.
    assert [int.from_bytes(h, "big") & (2**64 - 1) for h in ours] == [
        kv_cache_utils.maybe_convert_block_hash(h) for h in vllm_hashes
    ]


def test_the_seed_follows_pythonhashseed_and_is_unknown_when_random(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    info = kv_events.hashing(engine())
    assert info["none_hash_seed"] == "1234" and info["none_hash"] == sha256("1234")
    monkeypatch.delenv("PYTHONHASHSEED")
    # xxhash without PYTHONHASHSEED: a random seed per EngineCore, not reproducible.
    info = kv_events.hashing(engine("xxhash"))
    assert info["none_hash_seed"] is None and info["none_hash"] is None
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert kv_events.hashing(engine())["int_block_hashes"] is False


def test_the_published_endpoints_come_from_vllm() -> None:
    resolved = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="ipc:///x/a", replay_endpoint="ipc:///x/b",
        buffer_steps=7,
    )  # fmt: skip
    with_sources = SimpleNamespace(get_kv_event_sources=lambda: {0: resolved})
    assert kv_events.published(with_sources) == kv_events.KvSource(
        "ipc:///x/a", "ipc:///x/b", 7, ""
    )
    # Events off, or prefix caching off (EngineCore then reports none).
    assert kv_events.published(SimpleNamespace(get_kv_event_sources=lambda: {})) is None
    off = SimpleNamespace(vllm_config=SimpleNamespace(kv_events_config=KVEventsConfig()))
    assert kv_events.published(off) is None
    assert kv_events.published(SimpleNamespace()) is None  # a test's fake engine
