from __future__ import annotations

import pytest

PART = 64 << 10  # small parts so the synthetic checkpoint's shards go multipart


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-compatible HTTP server on loopback (moto's server mode), one per module.

    S3 requires 5 MiB parts; moto enforces it at CompleteMultipartUpload unless told
    otherwise, so the minimum is lowered for this in-process server only.
    """
    import moto.s3.models as moto_s3
    from moto.server import ThreadedMotoServer

    mp = pytest.MonkeyPatch()
    mp.setattr(moto_s3, "S3_UPLOAD_PART_MIN_SIZE", 1024)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        mp.undo()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("NEURON_SERVING_S3_ENDPOINT_URL", s3_server)
    return s3_server


@pytest.fixture
def bucket(s3_env, request):
    """A fresh bucket per test, through the same client code the commands use."""
    from neuron_serving.checkpoint.store import S3Store

    name = "ckpt-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    S3Store.from_env().client.create_bucket(Bucket=name)
    return name
