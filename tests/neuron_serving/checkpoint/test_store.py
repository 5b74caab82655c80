"""publish / fetch against a real S3-compatible server (moto's ThreadedMotoServer)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neuron_serving import cli
from neuron_serving.checkpoint.layout import vllm_shard_name
from neuron_serving.checkpoint.store import (
    S3Location,
    S3Store,
    StoreError,
    TransferConfig,
    parse_s3_url,
)
from neuron_serving.checkpoint.verify import verify
from tests.neuron_serving.checkpoint.conftest import PART
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint


class Interrupted(Exception):
    pass


def _store(on_part=None) -> S3Store:
    return S3Store.from_env(transfer=TransferConfig(PART), on_part=on_part)


def _interrupt_after(n: int):
    seen = []

    def on_part(key: str, part: int) -> None:
        seen.append((key, part))
        if len(seen) == n:
            raise Interrupted(f"interrupted after {key} part {part}")

    return on_part, seen


def _keys(bucket: str, prefix: str) -> set[str]:
    resp = _store().client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"] for o in resp.get("Contents", [])}


@pytest.fixture
def ckpt(tmp_path) -> Path:
    make_checkpoint(tmp_path / "v1")
    return tmp_path / "v1"


def test_parse_s3_url():
    assert parse_s3_url("s3://b/models/demo/v1/") == S3Location("b", "models/demo/v1")
    assert parse_s3_url("s3://b").key("manifest.json") == "manifest.json"
    with pytest.raises(ValueError):
        parse_s3_url("http://b/x")


def test_round_trip_publish_fetch_verify(ckpt, bucket, tmp_path):
    loc = S3Location(bucket, "demo/v1")
    pub = _store().publish(ckpt, loc)
    assert pub.parts_transferred > len(pub.files_transferred)  # shards went multipart
    assert _keys(bucket, "demo/v1") == {f"demo/v1/{p.name}" for p in ckpt.iterdir()}
    head = _store().client.head_object(Bucket=bucket, Key=f"demo/v1/{vllm_shard_name(0, 0)}")
    assert head["ETag"].strip('"').endswith("-2")  # 2 parts of 64 KiB

    out = tmp_path / "fetched"
    got = _store().fetch(loc, out)
    assert sorted(got.files_transferred) == sorted(
        p.name for p in ckpt.iterdir() if p.name != "manifest.json"
    )
    assert verify(out).ok
    for p in ckpt.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes()
    assert not (out / ".partial").exists()
    # Both directions are idempotent.
    assert _store().publish(ckpt, loc).already_complete
    assert _store().fetch(loc, out).already_complete


def test_interrupted_publish_is_invisible_and_resumes(ckpt, bucket, tmp_path):
    loc = S3Location(bucket, "demo/v1")
    # config.json (1), rank-0 part-0 (2 parts), then part 1 of rank-0 part-1.
    on_part, seen = _interrupt_after(4)
    with pytest.raises(Interrupted):
        _store(on_part).publish(ckpt, loc)
    assert f"demo/v1/{vllm_shard_name(0, 0)}" in _keys(bucket, "demo/v1")
    assert "demo/v1/manifest.json" not in _keys(bucket, "demo/v1")
    # Readers cannot see the half-published version.
    with pytest.raises(StoreError, match="no manifest.json"):
        _store().fetch(loc, tmp_path / "early")
    assert not (tmp_path / "early" / "manifest.json").exists()

    resumed = _store().publish(ckpt, loc)
    assert not resumed.already_complete
    assert f"demo/v1/{vllm_shard_name(0, 0)}" in resumed.files_skipped
    assert resumed.parts_skipped == 1  # the uploaded part of the unfinished multipart upload
    assert "demo/v1/manifest.json" in _keys(bucket, "demo/v1")
    uploads = _store().client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert uploads == []
    assert verify(_fetch_ok(loc, tmp_path / "out")).ok


def _fetch_ok(loc: S3Location, out: Path) -> Path:
    _store().fetch(loc, out)
    return out


def test_fetch_of_tampered_object_fails_naming_it(ckpt, bucket, tmp_path):
    loc = S3Location(bucket, "demo/v1")
    _store().publish(ckpt, loc)
    key = f"demo/v1/{vllm_shard_name(1, 0)}"
    data = bytearray((ckpt / vllm_shard_name(1, 0)).read_bytes())
    data[-5] ^= 0xFF  # same size; its metadata even keeps the old sha256
    _store().client.put_object(
        Bucket=bucket, Key=key, Body=bytes(data), Metadata={"sha256": "0" * 64}
    )
    out = tmp_path / "out"
    with pytest.raises(StoreError, match=f"s3://{bucket}/{key}: sha256 .* tampered"):
        _store().fetch(loc, out)
    assert not (out / vllm_shard_name(1, 0)).exists()  # never given its final name
    assert not (out / "manifest.json").exists()  # the local copy is not a version


def test_fetch_of_replaced_object_with_other_size_fails(ckpt, bucket, tmp_path):
    loc = S3Location(bucket, "demo/v1")
    _store().publish(ckpt, loc)
    key = f"demo/v1/{vllm_shard_name(0, 1)}"
    _store().client.put_object(Bucket=bucket, Key=key, Body=b"short")
    with pytest.raises(StoreError, match=f"{key}: 5 bytes, manifest says"):
        _store().fetch(loc, tmp_path / "out")


def test_interrupted_fetch_resumes(ckpt, bucket, tmp_path):
    loc = S3Location(bucket, "demo/v1")
    _store().publish(ckpt, loc)
    out = tmp_path / "out"
    on_part, _ = _interrupt_after(4)
    with pytest.raises(Interrupted):
        _store(on_part).fetch(loc, out)
    assert not (out / "manifest.json").exists()
    assert not verify(out).ok
    resumed = _store().fetch(loc, out)
    assert resumed.files_skipped  # files completed before the interruption
    assert verify(out).ok


def test_publish_refuses_broken_checkpoint(ckpt, bucket):
    os.truncate(ckpt / vllm_shard_name(0, 0), 100)
    with pytest.raises(StoreError, match="truncated"):
        _store().publish(ckpt, S3Location(bucket, "demo/v1"))
    assert _keys(bucket, "demo") == set()


def test_published_version_is_immutable(ckpt, bucket, tmp_path):
    loc = S3Location(bucket, "demo/v1")
    _store().publish(ckpt, loc)
    make_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(StoreError, match="immutable"):
        _store().publish(tmp_path / "other", loc)


def test_cli_publish_fetch_verify(ckpt, bucket, tmp_path, capsys):
    url = f"s3://{bucket}/cli/v1"
    assert cli.main(["checkpoint", "publish", str(ckpt), url, "--part-size", str(PART)]) == 0
    assert "version v1" in capsys.readouterr().out
    out = tmp_path / "out"
    assert cli.main(["checkpoint", "fetch", url, str(out), "--part-size", str(PART)]) == 0
    assert cli.main(["checkpoint", "verify", str(out)]) == 0
    assert cli.main(["checkpoint", "fetch", f"s3://{bucket}/cli/v2", str(tmp_path / "x")]) == 1
    assert "no manifest.json" in capsys.readouterr().err


def test_fetch_one_rank_for_a_follower_host(ckpt, bucket, tmp_path, capsys):
    from neuron_serving.checkpoint.compat import check_follower, manifest_identity
    from neuron_serving.checkpoint.manifest import Manifest

    url = f"s3://{bucket}/demo/v1"
    assert cli.main(["checkpoint", "publish", str(ckpt), url, "--part-size", str(PART)]) == 0
    out = tmp_path / "host1"
    fetch = ["checkpoint", "fetch", url, str(out), "--rank", "1", "--part-size", str(PART)]
    assert cli.main(fetch) == 0
    m = Manifest.read(out)
    want = set(m.rank_files[1]) | set(m.config_files) | set(m.tokenizer_files) | {"manifest.json"}
    assert {p.name for p in out.iterdir()} == want  # no rank-0 shard crossed the wire
    capsys.readouterr()
    assert cli.main(["checkpoint", "verify", str(out), "--rank", "1"]) == 0
    assert "(rank 1 only)" in capsys.readouterr().out
    assert cli.main(["checkpoint", "verify", str(out)]) == 1  # the whole version is not here
    # What the follower's join check (hook 2) accepts for rank 1.
    assert check_follower(out, *manifest_identity(ckpt), 1) is not None
    # Idempotent; a damaged rank file is re-fetched; a rank outside tp is refused.
    assert _store().fetch(parse_s3_url(url), out, rank=1).already_complete
    (out / m.rank_files[1][0]).write_bytes(b"x")
    again = _store().fetch(parse_s3_url(url), out, rank=1)
    assert again.files_transferred == [m.rank_files[1][0]]
    with pytest.raises(StoreError, match="no rank 2"):
        _store().fetch(parse_s3_url(url), tmp_path / "h2", rank=2)


def test_fetch_refuses_a_manifest_swapped_after_the_deploy(ckpt, bucket, tmp_path, monkeypatch):
    """The attack: v1 is deployed (pinned), then s3://.../v1/manifest.json and the shards
    are replaced by another self-consistent version. A task restarted later runs
    `checkpoint fetch` with the pin in its environment: refused, nothing downloaded."""
    from neuron_serving.checkpoint.manifest import sha256_bytes

    loc = S3Location(bucket, "demo/v1")
    _store().publish(ckpt, loc)
    pin = sha256_bytes((ckpt / "manifest.json").read_bytes())
    other = tmp_path / "other"
    make_checkpoint(other, seed=5)
    client = _store().client
    for p in sorted(other.iterdir()):  # shards first, manifest last, as an attacker would
        if p.name != "manifest.json":
            client.put_object(Bucket=bucket, Key=loc.key(p.name), Body=p.read_bytes())
    client.put_object(
        Bucket=bucket, Key=loc.key("manifest.json"), Body=(other / "manifest.json").read_bytes()
    )
    # Unpinned, the swap is invisible: the new manifest matches the new shards.
    assert verify(_fetch_ok(loc, tmp_path / "unpinned")).ok
    out = tmp_path / "pinned"
    with pytest.raises(StoreError, match=f"is not the deployed manifest's \\({pin}\\)"):
        _store().fetch(loc, out, pin=pin)
    assert not out.exists() or not any(out.iterdir())  # nothing downloaded
    # The task's command: the pin comes from NEURON_SERVING_MODEL_MANIFEST_SHA256.
    monkeypatch.setenv("NEURON_SERVING_MODEL_MANIFEST_SHA256", pin)
    url = f"s3://{bucket}/demo/v1"
    assert cli.main(["checkpoint", "fetch", url, str(out), "--rank", "1"]) == 1
    assert not out.exists() or not any(out.iterdir())
    # A fetch of what was deployed passes the same pin.
    good = S3Location(bucket, "good/v1")
    _store().publish(ckpt, good)
    assert cli.main(["checkpoint", "fetch", f"s3://{bucket}/good/v1", str(tmp_path / "g")]) == 0
    assert cli.main(["checkpoint", "verify", str(tmp_path / "g")]) == 0  # pinned too
    assert cli.main(["checkpoint", "verify", str(tmp_path / "unpinned")]) == 1
