from __future__ import annotations

import pytest

PART = 64 << 10  # small parts so the synthetic checkpoint's shards go multipart

# s3_server and s3_env (moto on loopback) are in tests/conftest.py.


@pytest.fixture
def bucket(s3_env, request):
    """A fresh bucket per test, through the same client code the commands use."""
    from neuron_serving.checkpoint.store import S3Store

    name = "ckpt-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    S3Store.from_env().client.create_bucket(Bucket=name)
    return name
