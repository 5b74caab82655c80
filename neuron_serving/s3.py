"""The one recipe for an S3 client (checkpoints, the proxy's batch files).

``NEURON_SERVING_S3_ENDPOINT_URL`` (or an explicit ``endpoint_url``) points it at an
S3-compatible server (moto in tests, MinIO); credentials and region come from
boto3's usual chain. Every call is bounded: connect and read timeouts, and
botocore's standard retry mode (5 attempts, with backoff).
"""

from __future__ import annotations

from typing import Any

from neuron_serving import envs


def s3_client(endpoint_url: str | None = None, read_timeout_s: float = 60.0) -> Any:
    import boto3
    from botocore.config import Config

    endpoint_url = endpoint_url or envs.NEURON_SERVING_S3_ENDPOINT_URL
    config = Config(
        retries={"mode": "standard", "max_attempts": 5},
        connect_timeout=10,
        read_timeout=read_timeout_s,
        # Custom endpoints (moto, minio) serve buckets by path, not by host name.
        s3={"addressing_style": "path"} if endpoint_url else {},
    )
    return boto3.client("s3", endpoint_url=endpoint_url, config=config)
