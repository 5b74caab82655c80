"""`leader --engine-args JSON`: checked before tritonserver starts, carried through
model.json, applied to the engine arguments the backend builds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from neuron_serving.cli import build_parser
from neuron_serving.commands.leader import settings_from_args
from neuron_serving.triton.backend_config import BackendConfig
from neuron_serving.triton.engine_args import (
    OWNED,
    check_engine_args,
    parse_engine_args,
    vllm_engine_arg_names,
)
from neuron_serving.triton.repository import MODEL_NAME, render_model_repository


def test_field_names_read_from_source_are_vllms_own() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    assert vllm_engine_arg_names() == {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_refuses_keys_the_leader_sets_naming_its_flag() -> None:
    with pytest.raises(ValueError, match="'tensor_parallel_size' is set by the leader: use --tp"):
        parse_engine_args('{"tensor_parallel_size": 2}')
    with pytest.raises(ValueError, match="'distributed_executor_backend' .* use --executor"):
        check_engine_args({"distributed_executor_backend": "mp"})
    with pytest.raises(ValueError, match="'kv_cache_memory_bytes' .* use --kv-cache-bytes"):
        check_engine_args({"kv_cache_memory_bytes": 1 << 20})
    # Every owned key is a real engine argument: the table names no stale field.
    assert set(OWNED) <= vllm_engine_arg_names()


def test_refuses_unknown_keys_and_non_objects_with_a_hint() -> None:
    with pytest.raises(
        ValueError, match="'max_num_batched_token' \\(did you mean 'max_num_batched_tokens'"
    ):
        parse_engine_args('{"max_num_batched_token": 512}')
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        parse_engine_args("[1]")
    with pytest.raises(ValueError, match="is not JSON"):
        parse_engine_args("{max_num_batched_tokens: 512}")
    assert parse_engine_args('{"enable_prefix_caching": false}') == {"enable_prefix_caching": False}


def test_backend_config_applies_them_last_and_refuses_owned_keys() -> None:
    cfg = BackendConfig(
        model="/m", engine_args={"enable_prefix_caching": False, "max_num_batched_tokens": 512}
    )
    kw = cfg.engine_kwargs()
    assert kw["enable_prefix_caching"] is False and kw["max_num_batched_tokens"] == 512
    with pytest.raises(ValueError, match="use --max-model-len"):
        BackendConfig(engine_args={"max_model_len": 64})
    with pytest.raises(ValueError, match="not vLLM engine arguments"):
        BackendConfig.from_dict({"engine_args": {"nope": 1}})


def test_leader_engine_args_reach_vllms_engine_config(tmp_path: Path, demo_model: Path) -> None:
    """From the command line to the VllmConfig vLLM builds (the backend's own calls:
    BackendConfig.load, engine_kwargs, AsyncEngineArgs), without starting tritonserver."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = build_parser("leader").parse_args(
        ["leader", "--model", str(demo_model), "--tensor-parallel-size", "1",
         "--control-port", "29950", "--kv-cache-memory-bytes", str(64 << 20),
         "--engine-args", '{"max_num_batched_tokens": 512, "enable_prefix_caching": false}']
    )  # fmt: skip
    settings = settings_from_args(args)
    # What TritonLeader.start renders (plus the run-time ports it picks).
    repo = render_model_repository(
        tmp_path, {**settings.model_overrides, "model": settings.model, "tensor_parallel_size": 1}
    )
    model_json = repo / MODEL_NAME / "1" / "model.json"
    assert json.loads(model_json.read_text())["engine_args"]["max_num_batched_tokens"] == 512
    kw = BackendConfig.load(model_json).engine_kwargs()
    vllm_config = AsyncEngineArgs(**kw).create_engine_config()
    assert vllm_config.scheduler_config.max_num_batched_tokens == 512
    assert vllm_config.cache_config.enable_prefix_caching is False
    assert vllm_config.cache_config.kv_cache_memory_bytes == 64 << 20


def test_leader_refuses_bad_engine_args_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from neuron_serving.cli import main
    from neuron_serving.exitcodes import ExitCode

    argv = ["leader", "--model", str(tmp_path), "--control-port", "29950"]
    rc = main([*argv, "--engine-args", '{"model": "/other"}'])
    assert rc == ExitCode.START_FAILED
    assert "'model' is set by the leader: use --model" in capsys.readouterr().err
