"""model.json settings and the run directory the launcher renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_serving.triton.backend_config import BackendConfig
from neuron_serving.triton.repository import (
    TritonInstall,
    assemble_backend_dir,
    import_root,
    model_repository,
    render_model_repository,
    stub_env,
)
from neuron_serving.unit.engine import UNIT_EXECUTOR


def test_shipped_model_json_is_valid() -> None:
    cfg = BackendConfig.load(model_repository() / "llm" / "1" / "model.json")
    assert cfg.executor == "unit" and cfg.enable_prefix_caching


def test_rejects_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown model.json keys: \\['tp'\\]"):
        BackendConfig.from_dict({"tp": 2})
    with pytest.raises(ValueError, match="executor must be one of"):
        BackendConfig(executor="ray")
    with pytest.raises(ValueError, match="needs tensor_parallel_size 1"):
        BackendConfig(executor="uni", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="canary_timeout_s must be > 0"):
        BackendConfig(canary_timeout_s=0)


def test_engine_kwargs_go_through_the_unit_recipe() -> None:
    cfg = BackendConfig(model="/m", tensor_parallel_size=2, control_port=29900, max_model_len=512)
    kw = cfg.engine_kwargs()
    assert kw["distributed_executor_backend"] == UNIT_EXECUTOR
    assert kw["tensor_parallel_size"] == 2 and kw["max_model_len"] == 512
    assert kw["additional_config"]["neuron_serving"]["control_port"] == 29900
    assert kw["enable_prefix_caching"] is True
    # The development switch is one field.
    assert (
        BackendConfig(model="/m", executor="uni").engine_kwargs()["distributed_executor_backend"]
        == "uni"
    )


def test_render_model_repository_applies_overrides(tmp_path: Path) -> None:
    repo = render_model_repository(tmp_path, {"model": "/models/x", "tensor_parallel_size": 2})
    settings = json.loads((repo / "llm" / "1" / "model.json").read_text())
    assert settings["model"] == "/models/x" and settings["tensor_parallel_size"] == 2
    assert (repo / "llm" / "config.pbtxt").is_file() and (repo / "llm" / "1" / "model.py").is_file()
    # The source tree is untouched.
    src = json.loads((model_repository() / "llm" / "1" / "model.json").read_text())
    assert src["model"] == ""
    with pytest.raises(ValueError, match="unknown model.json keys"):
        render_model_repository(tmp_path, {"modle": "/x"})


def test_backend_dir_and_env(tmp_path: Path) -> None:
    install = TritonInstall.find()
    python = assemble_backend_dir(install, tmp_path) / "python"
    for name in (
        "libtriton_python.so",
        "triton_python_backend_utils.py",
        "triton_python_backend_stub",
    ):
        assert (python / name).resolve().is_file(), name
    assert "python_backend_stubs/3.11" in str((python / "triton_python_backend_stub").resolve())
    env = stub_env(install, {"PATH": "/bin"})
    assert str(install.libs) in env["LD_LIBRARY_PATH"]
    assert env["PYTHONPATH"].split(":")[0] == str(import_root())
    assert "site-packages" in env["PYTHONPATH"]


def test_model_version_is_published_in_the_model_config(tmp_path: Path) -> None:
    repo = render_model_repository(tmp_path, {"model": "/m", "model_version": "v2.1"})
    pbtxt = (repo / "llm" / "config.pbtxt").read_text()
    assert 'key: "model_version"' in pbtxt and 'string_value: "v2.1"' in pbtxt
    # The parsed config is what tritonserver will see: exactly one such parameter.
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    cfg = text_format.Parse(pbtxt, model_config_pb2.ModelConfig())
    assert cfg.parameters["model_version"].string_value == "v2.1"
    # Unversioned: no parameter at all.
    repo = render_model_repository(tmp_path / "b", {"model": "/m"})
    assert (
        "model_version"
        not in text_format.Parse(
            (repo / "llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
        ).parameters
    )
    # The value is spliced into protobuf text, so only the manifest's charset passes.
    with pytest.raises(ValueError, match="model_version must match"):
        render_model_repository(tmp_path / "c", {"model": "/m", "model_version": 'v"} x'})
    with pytest.raises(ValueError, match="model_version must match"):  # no trailing newline
        render_model_repository(tmp_path / "d", {"model": "/m", "model_version": "v2\n"})


def test_leader_announces_the_manifest_version(tmp_path: Path) -> None:
    from neuron_serving.triton.launcher import LeaderSettings
    from tests.neuron_serving.checkpoint.synthetic import make_checkpoint

    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, tp=1, version="v7")
    assert LeaderSettings(model=str(ckpt)).model_version == "v7"
    with pytest.raises(ValueError, match="contradicts"):
        LeaderSettings(model=str(ckpt), model_version="v8")
    plain = tmp_path / "hf"
    plain.mkdir()
    assert LeaderSettings(model=str(plain), model_version="exp-1").model_version == "exp-1"
    assert LeaderSettings(model=str(plain)).model_version == ""


def test_leader_refuses_an_unknown_tool_call_parser_before_starting(tmp_path: Path) -> None:
    from neuron_serving.triton.launcher import LeaderSettings

    with pytest.raises(ValueError, match="not one of vLLM's tool parsers: .*hermes"):
        LeaderSettings(model=str(tmp_path), model_overrides={"tool_call_parser": "nope"})
    for name in ("hermes", "pythonic", ""):
        LeaderSettings(model=str(tmp_path), model_overrides={"tool_call_parser": name})


def test_the_priority_input_is_declared(tmp_path: Path) -> None:
    """The proxy's traffic class reaches the backend as the optional INT32 ``priority``
    input of shape [1] (Triton refuses an input its config does not declare)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    pbtxt = render_model_repository(tmp_path, {"model": "/m"}) / "llm" / "config.pbtxt"
    cfg = text_format.Parse(pbtxt.read_text(), model_config_pb2.ModelConfig())
    (priority,) = [i for i in cfg.input if i.name == "priority"]
    assert priority.data_type == model_config_pb2.TYPE_INT32
    assert list(priority.dims) == [1] and priority.optional
