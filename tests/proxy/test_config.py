import json
import subprocess
import sys

import pytest

from proxy.config import AdmissionConfig, ProxyConfig, UnitSpec, config_from_dict, load_config

YAML = """
port: 9000
health: {interval_s: 2, timeout_s: 1, unhealthy_threshold: 4}
outlier: {consecutive_errors: 3, base_ejection_s: 5, max_ejection_s: 60}
routing: {policy: session_affinity, session_header: x-chat-id}
models:
  - {name: shop, model_dir: /models/shop, max_model_len: 2048}
units:
  - unit_id: u0
    leader_grpc: 10.0.0.1:8001
    leader_http: 10.0.0.1:8000
    followers: [10.0.0.2:9100, 10.0.0.3:9100]
    model: shop
    model_version: "2026-11-30"
"""


def test_load_yaml_and_defaults(tmp_path):
    path = tmp_path / "proxy.yaml"
    path.write_text(YAML)
    cfg = load_config(path, admin_port=0)
    assert cfg.port == 9000 and cfg.admin_port == 0 and cfg.host == "127.0.0.1"
    assert cfg.health.unhealthy_threshold == 4 and cfg.health.healthy_threshold == 2
    assert cfg.routing.policy == "session_affinity"
    (unit,) = cfg.units
    assert unit.followers == ("10.0.0.2:9100", "10.0.0.3:9100") and unit.triton_model == "llm"
    assert cfg.model_spec("shop").max_model_len == 2048


def test_json_is_accepted(tmp_path):
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"units": [{"unit_id": "a", "leader_grpc": "h:1"}]}))
    assert load_config(path).units[0].unit_id == "a"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"health": {"unhealthy_treshold": 3}}, "unknown keys"),
        ({"health": {"interval_s": 1, "timeout_s": 2}}, "timeout_s"),
        ({"outlier": {"base_ejection_s": 10, "max_ejection_s": 5}}, "max_ejection_s"),
        ({"outlier": {"panic_threshold_pct": 120}}, "panic_threshold_pct"),
        ({"routing": {"policy": "fastest"}}, "routing.policy"),
        # Removed options say so, and what to use instead.
        ({"routing": {"home_load_factor": 1.25}}, "routing.home_load_factor was replaced"),
        ({"upstream_protocol": "http"}, "upstream_protocol was replaced: Triton's HTTP"),
        ({"units": [{"unit_id": "a", "leader_grpc": "nohost"}]}, "HOST:PORT"),
        ({"units": [{"unit_id": "a", "leader_grpc": "h:1", "followers": "h:2"}]}, "followers"),
        (
            {
                "units": [
                    {"unit_id": "a", "leader_grpc": "h:1"},
                    {"unit_id": "a", "leader_grpc": "h:2"},
                ]
            },
            "unique",
        ),
        ({"port": 70000}, "port"),
        ({"limits": {"header_timeout_s": 0}}, "limits.header_timeout_s"),
        ({"limits": {"write_timeout_s": float("inf")}}, "limits.write_timeout_s"),
        ({"limits": {"max_connections": 0}}, "limits.max_connections"),
        ({"limits": {"max_buffered_body_bytes": 4096}}, "max_buffered_body_bytes"),
        ({"limits": {"header_timeout": 5}}, "unknown keys"),
        ({"allow_unauthenticated": "yes"}, "allow_unauthenticated"),
    ],
)
def test_invalid_configs_name_the_field(raw, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(raw)


def test_admission_max_n_is_openais_limit_by_default_and_checked():
    assert AdmissionConfig().max_n == 128
    assert config_from_dict({"admission": {"max_n": 4}}).admission.max_n == 4
    for bad in (0, -1, 1.5, True, "8", None):
        with pytest.raises(ValueError, match="admission.max_n must be an integer >= 1"):
            config_from_dict({"admission": {"max_n": bad}})


def test_admin_token_env_overrides_file(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    cfg = ProxyConfig(admin_token_file=str(token_file))
    monkeypatch.delenv("NEURON_SERVING_PROXY_ADMIN_TOKEN", raising=False)
    assert cfg.admin_token() == "from-file"
    monkeypatch.setenv("NEURON_SERVING_PROXY_ADMIN_TOKEN", "from-env")
    assert cfg.admin_token() == "from-env"
    monkeypatch.delenv("NEURON_SERVING_PROXY_ADMIN_TOKEN")
    assert ProxyConfig().admin_token() is None


def test_unit_spec_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown keys"):
        UnitSpec.from_dict({"unit_id": "a", "leader_grpc": "h:1", "leader": "x"})


def test_cli_rejects_bad_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("routing: {policy: fastest}\n")
    out = subprocess.run(
        [sys.executable, "-m", "neuron_serving.cli", "proxy", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "routing.policy" in out.stderr


def test_readme_example_config_is_valid():
    import pathlib

    import yaml

    readme = (pathlib.Path(__file__).parents[2] / "proxy" / "README.md").read_text()
    block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = config_from_dict(yaml.safe_load(block))
    defaults = ProxyConfig()
    # The README documents the defaults: every section it shows equals the code's.
    for section in ("health", "outlier", "retry", "timeouts", "admission", "limits", "routing"):
        assert getattr(cfg, section) == getattr(defaults, section), section
