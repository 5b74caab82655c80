"""Fixtures: the ECS tests' moto AWS and real proxy (tests/neuron_serving/ecs/conftest.py,
whose notes on what moto does not emulate apply here too), and checkpoint versions
published to moto's S3 with the same client code `checkpoint publish` uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_serving.checkpoint.layout import MANIFEST_NAME
from neuron_serving.checkpoint.manifest import Manifest, sha256_bytes
from neuron_serving.deploy.source import Release
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint
from tests.neuron_serving.ecs.conftest import REGION, aws, proxy  # noqa: F401 (fixtures)

BUCKET = "ckpt"


def publish(
    tmp_path: Path, version: str, prefix: str = "llama", seed: int = 0
) -> tuple[str, Manifest]:
    """A synthetic tp=2 version published at s3://ckpt/<prefix>/<version> (inside moto)."""
    from neuron_serving.checkpoint.store import S3Location, S3Store

    manifest = make_checkpoint(tmp_path / version, tp=2, version=version, seed=seed)
    store = S3Store.from_env()
    if BUCKET not in {b["Name"] for b in store.client.list_buckets()["Buckets"]}:
        store.client.create_bucket(Bucket=BUCKET)
    loc = S3Location(BUCKET, f"{prefix}/{version}")
    store.publish(tmp_path / version, loc)
    return str(loc), manifest


def published(tmp_path: Path, version: str, prefix: str = "llama", seed: int = 0) -> Release:
    """``publish``, as the Release a deploy makes of it: pinned to the manifest's sha256."""
    uri, manifest = publish(tmp_path, version, prefix, seed)
    pin = sha256_bytes((tmp_path / version / MANIFEST_NAME).read_bytes())
    return Release(version, uri, manifest, pin)


@pytest.fixture
def s3(monkeypatch) -> Iterator[None]:
    """moto's S3 alone, in process (no ECS set-up)."""
    from moto import mock_aws

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    with mock_aws():
        yield


@pytest.fixture(autouse=True)
def _aws_s3_endpoint(monkeypatch) -> None:
    # Inside mock_aws every boto3 client is moto's; an endpoint from the environment
    # would send S3 calls elsewhere.
    monkeypatch.delenv("NEURON_SERVING_S3_ENDPOINT_URL", raising=False)
