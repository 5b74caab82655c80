"""`resolve_published`: a version in S3 checked in place (manifest, shape, canaries,
every object's size and sha256 metadata) without downloading it; moto's S3."""

from __future__ import annotations

import pytest

from neuron_serving.checkpoint.compat import UnitShape
from neuron_serving.checkpoint.layout import vllm_shard_name
from neuron_serving.checkpoint.store import S3Store
from neuron_serving.deploy.source import DeployError, resolve_published
from tests.neuron_serving.deploy.conftest import BUCKET, publish

CPU2 = UnitShape(2)


def test_published_version_resolves_to_its_prefix(s3, tmp_path):
    uri, manifest = publish(tmp_path, "v2")
    release = resolve_published("v2", "s3://ckpt/llama/", CPU2)
    assert (release.version, release.location, release.manifest) == ("v2", uri, manifest)


def test_refusals_name_the_problem(s3, tmp_path):
    publish(tmp_path, "v2")
    client = S3Store.from_env().client
    with pytest.raises(DeployError, match="must be s3://BUCKET/PREFIX"):
        resolve_published("v2", str(tmp_path), CPU2)
    with pytest.raises(DeployError, match="no manifest.json"):
        resolve_published("v3", "s3://ckpt/llama", CPU2)
    with pytest.raises(DeployError, match="sharded for tp=2"):
        resolve_published("v2", "s3://ckpt/llama", UnitShape(4))
    with pytest.raises(DeployError, match="a Neuron unit loads NxDI artifacts"):
        resolve_published("v2", "s3://ckpt/llama", UnitShape(2, "neuron"))

    shard = f"llama/v2/{vllm_shard_name(1, 0)}"
    client.put_object(Bucket=BUCKET, Key=shard, Body=b"short", Metadata={"sha256": "0" * 64})
    with pytest.raises(DeployError, match=rf"{vllm_shard_name(1, 0)}: 5 bytes, expected"):
        resolve_published("v2", "s3://ckpt/llama", CPU2)
    client.delete_object(Bucket=BUCKET, Key=shard)
    with pytest.raises(DeployError, match=rf"not intact: {vllm_shard_name(1, 0)}: missing"):
        resolve_published("v2", "s3://ckpt/llama", CPU2)
