"""Where the Batch API's file bytes live: a local directory (the default) or S3.

Both are blocking and called on a thread. A file is written whole under a temporary
name and then made visible (``os.replace`` locally; S3's PUT and multipart upload
are atomic), so a reader never sees half a file and a crash leaves no partial
object behind a file id. Keys are the proxy's own (``file-<hex>``): nothing a
client sends becomes a path or an S3 key.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator
from pathlib import Path
from typing import Any, Protocol

CHUNK = 1 << 20


class Blobs(Protocol):
    name: str

    def put(self, key: str, src: Path) -> None:
        """Store the file at ``src`` under ``key`` (``src`` may be moved)."""
        ...

    def fetch(self, key: str, dest: Path) -> None:
        """Copy the object to the local file ``dest``."""
        ...

    def chunks(self, key: str) -> Generator[bytes, None, None]:
        """The object's bytes, in chunks (for a download)."""
        ...

    def delete(self, key: str) -> None: ...


class LocalBlobs:
    name = "local"

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / key

    def put(self, key: str, src: Path) -> None:
        tmp = self._path(key + ".tmp")
        shutil.move(str(src), tmp)
        os.replace(tmp, self._path(key))

    def fetch(self, key: str, dest: Path) -> None:
        shutil.copyfile(self._path(key), dest)

    def chunks(self, key: str) -> Generator[bytes, None, None]:
        with open(self._path(key), "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class S3Blobs:
    """Objects under ``s3://bucket/prefix/``; uploads and downloads are boto3's
    managed transfers (multipart above 8 MiB, parts retried)."""

    name = "s3"

    def __init__(self, url: str, client: Any) -> None:
        rest = url.removeprefix("s3://")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"batch files: expected s3://BUCKET[/PREFIX], got {url!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, src: Path) -> None:
        self.client.upload_file(str(src), self.bucket, self._key(key))
        src.unlink(missing_ok=True)

    def fetch(self, key: str, dest: Path) -> None:
        self.client.download_file(self.bucket, self._key(key), str(dest))

    def chunks(self, key: str) -> Generator[bytes, None, None]:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        try:
            yield from body.iter_chunks(CHUNK)
        finally:
            body.close()

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
