"""ClusterSpec port layout, the generated proxy config (checked by the proxy's own
loader), secrets' permissions, the unit's process plan, and the status merge."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from neuron_serving.commands.status import merge
from neuron_serving.local import plan
from neuron_serving.local.proxy_config import write_proxy_config, write_secret
from neuron_serving.local.spec import ClusterSpec, stride
from proxy.api.auth import load_api_keys
from proxy.config import load_config


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return d


def test_ports_of_every_unit_are_distinct(model_dir: Path, tmp_path: Path) -> None:
    spec = ClusterSpec(model_dir, tmp_path / "run", units=3, tp=4, port=18080, base_port=30000)
    ports = spec.all_ports()
    assert len(ports) == len(set(ports))
    assert spec.admin_port == 18081 and spec.served_model_name == "my-model"
    u1 = spec.unit_ports(1)
    assert u1.control == 30000 + stride(4) and u1.http == u1.control + 4
    assert u1.health(3) + 1 < spec.unit_ports(2).control  # /healthz of the last rank fits
    assert all(len(spec.unit_cpu_bind(i).split("|")) == 4 for i in range(3))


def test_units_are_dealt_cpus_round_robin(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    tp1 = ClusterSpec(model_dir, tmp_path, units=2, tp=1, base_port=30000)
    assert [tp1.unit_cpu_bind(i) for i in range(2)] == ["0", "1"]
    tp2 = ClusterSpec(model_dir, tmp_path, units=2, tp=2, base_port=30000)
    assert [tp2.unit_cpu_bind(i) for i in range(2)] == ["0|1", "0|1"]
    tp3 = ClusterSpec(model_dir, tmp_path, units=2, tp=3, base_port=30000)
    assert [tp3.unit_cpu_bind(i) for i in range(2)] == ["0|1|0", "1|0|1"]
    given = ClusterSpec(model_dir, tmp_path, units=2, tp=1, base_port=30000, cpu_bind="1")
    assert [given.unit_cpu_bind(i) for i in range(2)] == ["1", "1"]


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"units": 0}, "--units"),
        ({"tp": 0}, "--tp"),
        ({"port": 30005}, "collide"),
        ({"cpu_bind": "0"}, "entry per rank"),
        ({"health_timeout_s": 2.0}, "health_timeout_s"),
        ({"proxies": 0}, "--proxies"),
        ({"proxies": 17}, "--proxies"),
        ({"port": 18080, "admin_port": 18079, "proxies": 2}, "admin ports"),
        ({"port": 29998, "proxies": 3}, "collide"),  # admin ports 29999..30001
    ],
)
def test_spec_rejects(model_dir: Path, tmp_path: Path, kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        ClusterSpec(model_dir, tmp_path, base_port=30000, **kw)


def test_spec_needs_a_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        ClusterSpec(tmp_path / "missing", tmp_path)


def test_proxy_config_is_accepted_by_the_proxy(model_dir: Path, tmp_path: Path) -> None:
    spec = ClusterSpec(model_dir, tmp_path / "run", units=2, tp=3, port=18080, base_port=30000)
    (path,), token, api_key = write_proxy_config(spec)
    assert path.name == "proxy-0.yaml"
    cfg = load_config(path)
    assert (cfg.admin_port, cfg.batch.replica_id, cfg.reuse_port) == (18081, "proxy-0", False)
    assert cfg.admin_token() == token
    # The generated client key is the "local" tenant's, read by the proxy's own loader.
    keys = load_api_keys(cfg.api_keys_file)
    assert keys.tenant_of(api_key) == "local" and keys.tenant_of(api_key[:-1] + "x") is None
    assert spec.api_key_file.read_text().strip() == api_key
    for f in (Path(cfg.api_keys_file), spec.api_key_file):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert [u.unit_id for u in cfg.units] == ["unit-0", "unit-1"]
    u0 = cfg.units[0]
    ports = spec.unit_ports(0)
    assert u0.leader_grpc == f"127.0.0.1:{ports.grpc}"
    assert u0.followers == (f"127.0.0.1:{ports.health(1)}", f"127.0.0.1:{ports.health(2)}")
    assert cfg.models[0].model_dir == str(model_dir.resolve())
    # A dead unit must leave rotation well within 3 s.
    h = cfg.health
    assert h.unhealthy_threshold * h.interval_s + h.timeout_s + h.jitter_s < 3.0
    assert cfg.host == "127.0.0.1" and cfg.admin_host == "127.0.0.1"
    assert cfg.routing.policy == "prefix_cache_aware"  # one replica: the approximate index
    chosen = ClusterSpec(model_dir, tmp_path / "run2", units=1, tp=1, port=18090,
                         base_port=30100, routing="round_robin")  # fmt: skip
    (path,), _, _ = write_proxy_config(chosen)
    assert load_config(path).routing.policy == "round_robin"


def test_proxy_replicas_share_the_client_port_and_store_with_their_own_admin_port_and_id(
    model_dir: Path, tmp_path: Path
) -> None:
    spec = ClusterSpec(model_dir, tmp_path / "run", units=2, tp=1, port=18080, proxies=3,
                       base_port=30000)  # fmt: skip
    assert spec.admin_ports() == [18081, 18082, 18083]
    assert [(r.replica_id, r.admin_url) for r in spec.replicas()] == [
        (f"proxy-{j}", f"http://127.0.0.1:{18081 + j}") for j in range(3)
    ]
    ports = spec.all_ports()
    assert len(ports) == len(set(ports)) and {18080, 18081, 18082, 18083} <= set(ports)
    paths, token, _key = write_proxy_config(spec)
    configs = [load_config(p) for p in paths]
    assert [p.name for p in paths] == ["proxy-0.yaml", "proxy-1.yaml", "proxy-2.yaml"]
    assert [c.admin_port for c in configs] == [18081, 18082, 18083]
    assert [c.batch.replica_id for c in configs] == ["proxy-0", "proxy-1", "proxy-2"]
    for c in configs:
        # One client port (SO_REUSEPORT), one batch store, the same units and token.
        assert (c.port, c.reuse_port, c.admin_token()) == (18080, True, token)
        assert c.batch.data_dir == str(spec.run_dir / "proxy-data")
        assert c.units == configs[0].units and c.health == configs[0].health
        # Several replicas route by the engines' own KV events, so they route alike.
        assert c.routing.policy == "kv_aware"


def test_secrets_are_private_and_fresh(tmp_path: Path) -> None:
    a = write_secret(tmp_path / "token")
    mode = stat.S_IMODE((tmp_path / "token").stat().st_mode)
    b = write_secret(tmp_path / "token")
    assert mode == 0o600 and a != b and len(a) >= 32


def test_unit_plan(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", "users-own-token")
    spec = ClusterSpec(model_dir, tmp_path / "run", units=2, tp=2, base_port=30000)
    leader, follower = plan.unit_processes(spec, 1, tmp_path / "unit-token")
    ports = spec.unit_ports(1)
    assert leader.name == "leader" and follower.name == "follower-1"
    assert f"{ports.control}" in leader.argv and f"127.0.0.1:{ports.control}" in follower.argv
    assert leader.env["NEURON_SERVING_LEADER_HEALTH_PORT"] == str(ports.health(0))
    for p in (leader, follower):
        assert p.env["NEURON_SERVING_UNIT_ID"] == "unit-1"
        assert p.env["NEURON_SERVING_TOKEN_FILE"] == str(tmp_path / "unit-token")
        assert "NEURON_SERVING_UNIT_TOKEN" not in p.env
        assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == spec.unit_cpu_bind(1)


def test_status_merges_proxy_and_supervisor() -> None:
    proxy = {"units": [{"unit_id": "unit-0", "state": "unhealthy", "in_flight": 2,
                        "requests_total": 9, "errors_total": 1, "model_version": "v1",
                        "nodes": [{"node_id": "unit-0/leader", "state": "healthy"},
                                  {"node_id": "unit-0/follower-1", "state": "unhealthy",
                                   "last_error": "connection refused\nmore"}]}]}  # fmt: skip
    state = {"units": [
        {"unit_id": "unit-0", "phase": "backoff", "restarts": 2,
         "last_failure": {"reason": "follower-1 exited with code -9", "at": 1.0},
         "processes": [{"name": "leader", "pid": 10, "running": True, "node_state": "ready"},
                       {"name": "follower-1", "pid": 11, "running": False}]},
        {"unit_id": "unit-1", "phase": "starting", "restarts": 0, "processes": [
            {"name": "leader", "pid": 12, "running": True, "node_state": "loading"}]},
    ]}  # fmt: skip
    rows = merge(proxy, state)
    assert [r["unit_id"] for r in rows] == ["unit-0", "unit-1"]
    r0 = rows[0]
    assert (r0["health"], r0["phase"], r0["restarts"], r0["in_flight"]) == (
        "unhealthy", "backoff", 2, 2)  # fmt: skip
    assert r0["last_failure"].startswith("follower-1 exited")
    assert r0["nodes"][0] == {"name": "leader", "health": "healthy", "node_state": "ready",
                              "pid": 10, "running": True, "last_error": [], "probe_ms": None}  # fmt: skip
    assert r0["nodes"][1]["last_error"] == ["connection refused"]
    # A unit only the supervisor knows (not yet in the proxy) still shows its nodes.
    assert rows[1]["health"] is None and rows[1]["nodes"][0]["node_state"] == "loading"
    assert merge(None, None) == []
    # A warm spare: drained on the proxy on purpose.
    spare = merge({"units": [{"unit_id": "unit-2", "state": "draining"}]},
                  {"units": [{"unit_id": "unit-2", "phase": "ready", "standby": True}]})  # fmt: skip
    assert spare[0]["health"] == "spare"


def test_sharded_checkpoint_is_served_under_its_manifest_name(tmp_path: Path) -> None:
    # A deploy swaps the version directory; the name clients use must not follow it.
    from tests.neuron_serving.checkpoint.synthetic import make_checkpoint

    make_checkpoint(tmp_path / "v3", tp=1, version="v3")
    spec = ClusterSpec(tmp_path / "v3", tmp_path / "run", units=1, tp=1)
    assert spec.served_model_name == "synthetic"
    named = ClusterSpec(tmp_path / "v3", tmp_path / "run", units=1, tp=1, served_model_name="x")
    assert named.served_model_name == "x"
