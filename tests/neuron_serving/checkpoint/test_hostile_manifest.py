"""Hostile manifests are refused before any allocation: the byte size is bounded before
the file (or S3 object) is read, and every count and degree before it is used.

Each attack is measured with tracemalloc (peak of Python allocations during the call):
before the bounds, the 511-byte manifest with tp_degree 1e7 below cost 383 MiB."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from neuron_serving import cli
from neuron_serving.checkpoint.compat import CheckpointMismatch, UnitShape, check_unit
from neuron_serving.checkpoint.manifest import MAX_MANIFEST_BYTES, Manifest
from neuron_serving.checkpoint.store import S3Location, S3Store, StoreError
from neuron_serving.checkpoint.verify import verify
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint
from tests.procs import free_port_block, wait_for

# What refusing a hostile manifest may cost: a small multiple of the bound on its size
# (the bytes themselves plus parse state), never a function of the numbers inside it.
BUDGET = 4 * MAX_MANIFEST_BYTES

# The manifest of the finding: 511 bytes, tp_degree 1e7.
TP_1E7 = {
    "model_name": "m",
    "version": "v1",
    "architecture": "LlamaForCausalLM",
    "tp_degree": 10_000_000,
    "dtype": "float32",
    "layout": "vllm-sharded-state",
    "shard_pattern": "model-rank-{rank}-part-{part}.safetensors",
    "files": {"config.json": {"sha256": "0" * 64, "size": 2}},
    "rank_files": {"0": ["model-rank-0-part-0.safetensors"]},
    "config_files": ["config.json"],
    "tokenizer_files": [],
    "source": {"path": "/src", "sha256": "0" * 64, "files": 1},
    "canaries": [],
    "neuron": {"layout": "nxdi", "files": [], "generated": False, "note": ""},
    "format_version": 1,
}


def peak_of(fn: Callable[[], object]) -> tuple[int, BaseException | None]:
    """Peak bytes Python allocated while ``fn`` ran, and what it raised."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    err = None
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 (the caller asserts on it)
        err = e
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak, err


def _refused_cheaply(fn: Callable[[], object], match: str, budget: int = BUDGET) -> None:
    peak, err = peak_of(fn)
    assert err is not None, "the hostile manifest was accepted"
    assert isinstance(err, ValueError | StoreError), f"not a clean refusal: {err!r}"
    assert match in str(err), str(err)
    assert peak < budget, (
        f"refusing it allocated {peak / 2**20:.1f} MiB (budget {budget >> 20} MiB)"
    )


def _write(tmp_path: Path, data: bytes) -> Path:
    d = tmp_path / "v"
    d.mkdir(exist_ok=True)
    (d / "manifest.json").write_bytes(data)
    return d


def test_tp_degree_1e7_is_refused_before_allocating(tmp_path):
    raw = json.dumps(TP_1E7, separators=(",", ":")).encode()
    assert len(raw) < 1024  # a few hundred bytes
    _refused_cheaply(lambda: Manifest.from_json(raw), "tp_degree must be an integer in 1..1024")
    d = _write(tmp_path, raw)
    _refused_cheaply(lambda: Manifest.read(d), "tp_degree")
    # Every reader of a local manifest goes through the same bounds.
    _refused_cheaply(lambda: check_unit(d, UnitShape(2)), "tp_degree")
    report = verify(d)
    assert not report.ok and "tp_degree" in report.render()


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tp_degree": 2.0}, "Expected `int`, got `float` - at `$.tp_degree`"),
        ({"tp_degree": "2"}, "Expected `int`, got `str`"),
        ({"tp_degree": True}, "Expected `int`, got `bool`"),
        ({"tp_degree": 0}, "tp_degree must be an integer in 1..1024"),
        ({"files": {"config.json": {"sha256": "0" * 64, "size": 1 << 50}}}, "size must be"),
        ({"files": {"config.json": {"sha256": "0" * 64, "size": -1}}}, "size must be"),
        ({"rank_files": {str(r): ["x"] for r in range(1100)}}, "rank_files has 1100 entries"),
        ({"canaries": [{"prompt": "p", "token_ids": [1], "max_tokens": 10**6}]}, "max_tokens"),
        ({"canaries": [{"prompt": "p", "token_ids": [-1], "max_tokens": 1}]}, "token id"),
        ({"source": {"path": "/s", "sha256": "0" * 64, "files": 10**9}}, "source files"),
        ({"model_name": "m" * 10_000}, "model_name is 10000 characters"),
    ],
)
def test_absurd_fields_are_refused(change, match):
    raw = json.dumps({**TP_1E7, "tp_degree": 1, **change}).encode()
    _refused_cheaply(lambda: Manifest.from_json(raw), match)


def test_huge_integer_literal_is_refused():
    raw = json.dumps({**TP_1E7, "tp_degree": 1}).encode()
    raw = raw.replace(b'"tp_degree": 1', b'"tp_degree": ' + b"9" * 100_000)
    _refused_cheaply(lambda: Manifest.from_json(raw), "malformed manifest")


def test_deep_nesting_is_a_clean_refusal():
    # json.loads would raise RecursionError (not a ValueError) on this.
    raw = b'{"files": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    _refused_cheaply(lambda: Manifest.from_json(raw), "malformed manifest")


def test_oversized_manifest_file_is_refused_without_reading_it(tmp_path):
    d = tmp_path / "v"
    d.mkdir()
    big = d / "manifest.json"
    # 256 MiB of valid JSON (whitespace), sparse on disk: reading it would cost 256 MiB.
    with open(big, "wb") as f:
        f.write(b"{")
        f.truncate(256 << 20)
    _refused_cheaply(lambda: Manifest.read(d), f"at most {MAX_MANIFEST_BYTES}", budget=1 << 20)
    _refused_cheaply(lambda: Manifest.from_json(b" " * (MAX_MANIFEST_BYTES + 1)), "at most")


def test_a_fifo_manifest_does_not_hang(tmp_path):
    d = tmp_path / "v"
    d.mkdir()
    os.mkfifo(d / "manifest.json")
    done: list[BaseException] = []

    def read() -> None:
        try:
            Manifest.read(d)
        except BaseException as e:  # noqa: BLE001
            done.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=5)
    assert not t.is_alive(), "reading a FIFO manifest blocked"
    assert done and "not a regular file" in str(done[0])


@pytest.fixture(scope="module")
def s3_process(tmp_path_factory):
    """moto's S3 server as its own process: tracemalloc then sees only the client."""
    port = free_port_block(1)
    work = tmp_path_factory.mktemp("moto")
    argv = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    with open(work / "moto.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    try:
        wait_for(lambda: _listening(port), 30, what="moto server")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def test_oversized_manifest_object_in_s3_is_refused_before_its_body(
    s3_process, monkeypatch, tmp_path
):
    """An S3 object named manifest.json of 64 MiB: fetch refuses it from Content-Length."""
    for key, value in (("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = S3Store.from_env(endpoint_url=s3_process)
    bucket = "hostile"
    store.client.create_bucket(Bucket=bucket)
    store.client.put_object(Bucket=bucket, Key="big/v1/manifest.json", Body=b" " * (64 << 20))
    loc = S3Location(bucket, "big/v1")
    _refused_cheaply(lambda: store.fetch(loc, tmp_path / "out"), f"at most {MAX_MANIFEST_BYTES}")
    assert not (tmp_path / "out" / "manifest.json").exists()
    # The tp_degree 1e7 manifest as an S3 object: refused as cheaply.
    store.client.put_object(
        Bucket=bucket, Key="tp/v1/manifest.json", Body=json.dumps(TP_1E7).encode()
    )
    _refused_cheaply(lambda: store.fetch(S3Location(bucket, "tp/v1"), tmp_path / "o2"), "tp_degree")


def test_cli_refuses_a_hostile_manifest_cleanly(tmp_path, capsys):
    d = _write(tmp_path, json.dumps(TP_1E7).encode())
    assert cli.main(["checkpoint", "verify", str(d)]) == 1
    err = capsys.readouterr().err
    assert "tp_degree must be an integer in 1..1024" in err and "Traceback" not in err


def test_legitimate_manifest_still_reads(tmp_path):
    m = make_checkpoint(tmp_path / "ok")
    assert Manifest.read(tmp_path / "ok") == m
    with pytest.raises(CheckpointMismatch, match="sharded for tp=2"):
        check_unit(tmp_path / "ok", UnitShape(1))
