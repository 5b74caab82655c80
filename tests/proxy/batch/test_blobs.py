"""The Batch API's file stores (proxy/batch/blobs.py): ``S3Blobs`` against a real S3
HTTP server (moto's server mode on loopback, ``s3_env`` in tests/conftest.py) and
``LocalBlobs`` by the same round trip; then a proxy whose ``batch.files_url`` is an
S3 prefix running a batch through fake units, its files in the bucket."""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest

from neuron_serving.s3 import s3_client
from proxy.batch.blobs import CHUNK, LocalBlobs, S3Blobs
from tests.proxy.batch.test_batch_api import chat_line, jsonl, wait_final
from tests.proxy.conftest import url

SIZE = 9 * CHUNK + 12_345  # over boto3's 8 MiB multipart threshold, not a whole chunk


@pytest.fixture
def bucket(s3_env, request) -> str:
    name = "batch-" + request.node.name.lower().replace("_", "-")[:40].strip("-[]")
    s3_client().create_bucket(Bucket=name)
    return name


def _blobs(kind: str, bucket: str | None, tmp_path: Path):
    if kind == "s3":
        return S3Blobs(f"s3://{bucket}/some/prefix/", s3_client())
    return LocalBlobs(tmp_path / "files")


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_put_fetch_chunks_delete_round_trip(kind, request, tmp_path) -> None:
    bucket = request.getfixturevalue("bucket") if kind == "s3" else None
    blobs = _blobs(kind, bucket, tmp_path)
    data = os.urandom(SIZE)
    src = tmp_path / "upload"
    src.write_bytes(data)
    blobs.put("file-abc", src)
    assert not src.exists()  # taken over by the store

    dest = tmp_path / "fetched"
    blobs.fetch("file-abc", dest)
    assert dest.read_bytes() == data
    chunks = list(blobs.chunks("file-abc"))
    assert b"".join(chunks) == data
    assert len(chunks) >= SIZE // CHUNK and all(len(c) <= CHUNK for c in chunks)
    if kind == "s3":  # under the prefix, by the proxy's own key
        objects = s3_client().list_objects_v2(Bucket=bucket)["Contents"]
        assert [(o["Key"], o["Size"]) for o in objects] == [("some/prefix/file-abc", SIZE)]

    blobs.delete("file-abc")
    with pytest.raises(Exception):  # noqa: B017 (botocore's ClientError or FileNotFoundError)
        blobs.fetch("file-abc", tmp_path / "gone")
    with pytest.raises(Exception):  # noqa: B017
        next(blobs.chunks("file-abc"))
    blobs.delete("file-abc")  # deleting twice is not an error
    if kind == "s3":
        assert "Contents" not in s3_client().list_objects_v2(Bucket=bucket)


def test_s3_url_is_checked() -> None:
    with pytest.raises(ValueError, match="s3://BUCKET"):
        S3Blobs("s3:///prefix", client=None)
    b = S3Blobs("s3://bkt", client=None)
    assert (b.bucket, b.prefix) == ("bkt", "")


async def test_a_proxy_with_s3_files_runs_a_batch(fleet, bucket) -> None:
    units = [await fleet.unit("u0"), await fleet.unit("u1")]
    proxy = await fleet.proxy(units, batch={"files_url": f"s3://{bucket}/batches"})
    async with openai.AsyncOpenAI(
        base_url=url(proxy, "/v1"), api_key="none", max_retries=0, timeout=10
    ) as c:
        lines = [chat_line(i) for i in range(12)]
        f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")  # fmt: skip
        b = await wait_final(c, b.id)
        assert b.status == "completed" and b.request_counts.completed == 12, b
        out = (await c.files.content(b.output_file_id)).content
    rows = [json.loads(x) for x in out.decode().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(12))
    assert all(r["response"]["status_code"] == 200 for r in rows)
    # Both files are objects under the prefix, and what the API served is the object.
    s3 = s3_client()
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="batches/")["Contents"]}
    assert keys == {f"batches/{f.id}", f"batches/{b.output_file_id}"}
    body = s3.get_object(Bucket=bucket, Key=f"batches/{b.output_file_id}")["Body"].read()
    assert body == out
    assert not (Path(proxy.config.batch.data_dir) / "files").exists()  # nothing local
