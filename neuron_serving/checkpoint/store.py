"""`checkpoint publish` / `fetch`: a checkpoint version in S3 (or any S3-compatible store).

A version lives under one prefix, one object per file, same relative names as
on disk. Invariants:

- **Atomic visibility**: ``manifest.json`` is uploaded last, after every other
  object is complete and checked; ``fetch`` refuses a prefix without it. A
  publish that dies half-way leaves parts and objects but no manifest: the
  version does not exist for readers.
- **Immutable versions**: publishing over a prefix whose manifest differs is
  refused (a rollout pins a version; its bytes must not change under it).
- **Checksums end to end**: every part/object is sent with ``Content-MD5`` (the
  server rejects a damaged body), each object carries its sha256 in metadata,
  the completed multipart ETag is compared with the one computed locally, and
  ``fetch`` recomputes each file's sha256 against the *manifest* (not the object
  metadata, which a tamperer could rewrite too) before the file gets its final
  name.
- **Resumable**: publish skips objects already complete with the right sha256
  and, inside an unfinished multipart upload, parts whose ETag equals the local
  part's MD5; fetch skips files already present and verified and continues a
  partial download with ranged GETs pinned to the object's ETag (``If-Match``).
- **Per rank**: ``fetch(..., rank=R)`` downloads only rank R's shards plus the
  config and tokenizer files and the manifest (all a follower host needs), then
  verifies just those.
- **Pinned**: ``fetch(..., pin=SHA)`` (a deploy's pin, ``--manifest-sha256`` or
  ``NEURON_SERVING_MODEL_MANIFEST_SHA256``) refuses a manifest whose sha256 is not
  the pin before anything else is downloaded: a manifest swapped in S3 after the
  deploy is never loaded by a later restart.
- **Bounded**: a manifest object is refused past ``MAX_MANIFEST_BYTES`` from its
  Content-Length, before its body is read.
- **Progress**: a ``TransferProgress`` (progress.py: a bar on a terminal) learns the
  version's bytes up front (``start``), then ``advance``s by each part sent or
  received and by each file or part found already in place, so a transfer run to
  the end adds up to its total exactly. Parts are the unit (``part_size``, 64 MiB by
  default), not boto3's managed transfers, which would hide the per-part MD5 and
  resume logic above.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.layout import MANIFEST_NAME
from neuron_serving.checkpoint.manifest import (
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    sha256_bytes,
    sha256_file,
)
from neuron_serving.checkpoint.pin import check_pin_format
from neuron_serving.checkpoint.progress import TransferProgress
from neuron_serving.checkpoint.verify import verify

S3_MIN_PART = 5 << 20  # S3's minimum for every part but the last
PARTIAL_DIR = ".partial"  # fetch's downloads in progress, inside the target directory

# Called after each part is transferred: (object key, part number). Tests raise in it
# to interrupt a transfer half-way.
PartCallback = Callable[[str, int], None]


class StoreError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    prefix: str  # without leading/trailing slashes; may be empty

    def __post_init__(self) -> None:
        if not self.bucket or "/" in self.bucket:
            raise ValueError(f"invalid bucket name {self.bucket!r}")
        if self.prefix != self.prefix.strip("/"):
            raise ValueError(f"prefix must not start or end with '/': {self.prefix!r}")

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_s3_url(url: str) -> S3Location:
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    return S3Location(bucket, prefix.strip("/"))


@dataclass(frozen=True, slots=True)
class TransferConfig:
    # Real S3 needs >= 5 MiB per part (except the last); smaller sizes are for test
    # servers configured to allow them (moto: S3_UPLOAD_PART_MIN_SIZE).
    part_size: int = 64 << 20

    def __post_init__(self) -> None:
        if self.part_size < 64 << 10:
            raise ValueError(f"part_size must be >= 64 KiB, got {self.part_size}")


@dataclass(slots=True)
class TransferResult:
    action: str
    location: str
    version: str = ""
    files_transferred: list[str] = field(default_factory=list)
    files_skipped: list[str] = field(default_factory=list)
    parts_transferred: int = 0
    parts_skipped: int = 0
    bytes_transferred: int = 0
    already_complete: bool = False

    def render(self) -> str:
        if self.already_complete:
            return f"{self.action} {self.location}: version {self.version} already complete"
        return (
            f"{self.action} {self.location}: version {self.version}: "
            f"{len(self.files_transferred)} files transferred, {len(self.files_skipped)} "
            f"already present; {self.parts_transferred} parts sent, {self.parts_skipped} "
            f"resumed; {self.bytes_transferred} bytes"
        )


def _md5(data: bytes) -> tuple[str, str]:
    d = hashlib.md5(data, usedforsecurity=False)
    return d.hexdigest(), base64.b64encode(d.digest()).decode()


def _is_missing(e: Exception) -> bool:
    code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound", "NoSuchUpload")


class S3Store:
    def __init__(
        self,
        client: Any,
        transfer: TransferConfig | None = None,
        on_part: PartCallback | None = None,
        progress: TransferProgress | None = None,
    ) -> None:
        self.client = client
        self.transfer = transfer or TransferConfig()
        self.on_part = on_part
        self.progress = progress

    @classmethod
    def from_env(
        cls,
        endpoint_url: str | None = None,
        transfer: TransferConfig | None = None,
        on_part: PartCallback | None = None,
        progress: TransferProgress | None = None,
    ) -> S3Store:
        from neuron_serving.s3 import s3_client

        client = s3_client(endpoint_url)
        return cls(client, transfer, on_part, progress)

    # -- publish ------------------------------------------------------------
    def publish(self, directory: Path, loc: S3Location) -> TransferResult:
        report = verify(directory)
        if not report.ok:
            raise StoreError(
                f"refusing to publish a checkpoint that fails verify:\n{report.render()}"
            )
        manifest = report.manifest
        assert manifest is not None
        local_manifest = (directory / MANIFEST_NAME).read_bytes()
        result = TransferResult("publish", str(loc), manifest.version)
        remote = self._get_manifest_bytes(loc)
        if remote is not None:
            if remote == local_manifest:
                result.already_complete = True
                return result
            raise StoreError(
                f"{loc}/{MANIFEST_NAME} already exists with other content: a published "
                "version is immutable; publish under a new prefix"
            )
        self._start(sum(entry.size for entry in manifest.files.values()))
        for name, entry in sorted(manifest.files.items()):
            self._upload_file(directory / name, loc.bucket, loc.key(name), entry, result)
        # Last: the version becomes visible only now.
        _, md5_b64 = _md5(local_manifest)
        self.client.put_object(
            Bucket=loc.bucket, Key=loc.key(MANIFEST_NAME), Body=local_manifest, ContentMD5=md5_b64
        )
        return result

    def _upload_file(
        self, path: Path, bucket: str, key: str, entry: FileEntry, result: TransferResult
    ) -> None:
        head = self._head(bucket, key)
        if (
            head is not None
            and head["ContentLength"] == entry.size
            and head.get("Metadata", {}).get("sha256") == entry.sha256
        ):
            result.files_skipped.append(key)
            self._advance(entry.size)
            return
        meta = {"sha256": entry.sha256}
        if entry.size <= self.transfer.part_size:
            data = path.read_bytes()
            _, md5_b64 = _md5(data)
            self.client.put_object(
                Bucket=bucket, Key=key, Body=data, ContentMD5=md5_b64, Metadata=meta
            )
            result.parts_transferred += 1
            result.bytes_transferred += len(data)
            self._advance(len(data))
            self._notify(key, 1)
        else:
            self._upload_multipart(path, bucket, key, entry, meta, result)
        head = self._head(bucket, key)
        if head is None or head["ContentLength"] != entry.size:
            raise StoreError(f"s3://{bucket}/{key}: size after upload differs from {entry.size}")
        result.files_transferred.append(key)

    def _upload_multipart(
        self,
        path: Path,
        bucket: str,
        key: str,
        entry: FileEntry,
        meta: dict[str, str],
        result: TransferResult,
    ) -> None:
        ps = self.transfer.part_size
        nparts = (entry.size + ps - 1) // ps
        upload_id, existing = self._resume_upload(bucket, key)
        if upload_id is None:
            upload_id = self.client.create_multipart_upload(Bucket=bucket, Key=key, Metadata=meta)[
                "UploadId"
            ]
        etags: list[dict[str, Any]] = []
        digests: list[bytes] = []
        with open(path, "rb") as f:
            for n in range(1, nparts + 1):
                data = f.read(ps)
                md5_hex, md5_b64 = _md5(data)
                digests.append(bytes.fromhex(md5_hex))
                have = existing.get(n)
                if have is not None and have == (md5_hex, len(data)):
                    result.parts_skipped += 1
                    self._advance(len(data))
                else:
                    resp = self.client.upload_part(
                        Bucket=bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=n,
                        Body=data,
                        ContentMD5=md5_b64,
                    )
                    if resp["ETag"].strip('"') != md5_hex:
                        raise StoreError(f"s3://{bucket}/{key}: part {n} ETag mismatch")
                    result.parts_transferred += 1
                    result.bytes_transferred += len(data)
                    self._advance(len(data))
                    self._notify(key, n)
                etags.append({"ETag": f'"{md5_hex}"', "PartNumber": n})
        resp = self.client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": etags}
        )
        want = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + f"-{nparts}"
        if resp["ETag"].strip('"') != want:
            raise StoreError(f"s3://{bucket}/{key}: multipart ETag {resp['ETag']} != {want}")
        head = self._head(bucket, key)
        if head is not None and head.get("Metadata", {}).get("sha256") != entry.sha256:
            # A resumed upload begun for other content (the file changed between
            # runs): its metadata is stale. Start over with a fresh upload.
            self.client.delete_object(Bucket=bucket, Key=key)
            self._advance(-entry.size)  # counted again by the fresh upload
            self._upload_multipart(path, bucket, key, entry, meta, result)

    def _resume_upload(
        self, bucket: str, key: str
    ) -> tuple[str | None, dict[int, tuple[str, int]]]:
        """The newest unfinished upload of ``key`` and its parts (number -> (md5, size));
        older ones are aborted so their parts stop costing storage."""
        uploads = [
            u
            for u in self.client.list_multipart_uploads(Bucket=bucket, Prefix=key).get(
                "Uploads", []
            )
            if u["Key"] == key
        ]
        if not uploads:
            return None, {}
        uploads.sort(key=lambda u: u["Initiated"])
        for old in uploads[:-1]:
            self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=old["UploadId"])
        upload_id = uploads[-1]["UploadId"]
        parts: dict[int, tuple[str, int]] = {}
        kwargs: dict[str, Any] = dict(Bucket=bucket, Key=key, UploadId=upload_id)
        while True:
            resp = self.client.list_parts(**kwargs)
            for p in resp.get("Parts", []):
                parts[p["PartNumber"]] = (p["ETag"].strip('"'), p["Size"])
            if not resp.get("IsTruncated"):
                break
            kwargs["PartNumberMarker"] = resp["NextPartNumberMarker"]
        return upload_id, parts

    # -- fetch --------------------------------------------------------------
    def read_manifest(self, loc: S3Location, pin: str | None = None) -> tuple[bytes, Manifest]:
        """The published version's manifest (its bytes and parsed); StoreError if none,
        if it is oversized, or if its sha256 is not ``pin`` (checked before parsing)."""
        raw = self._get_manifest_bytes(loc)
        if raw is None:
            raise StoreError(
                f"{loc}: no {MANIFEST_NAME}: the version is incomplete (publish interrupted) "
                "or was never published"
            )
        if pin is not None and sha256_bytes(raw) != check_pin_format(pin):
            raise StoreError(
                f"{loc}/{MANIFEST_NAME}: sha256 {sha256_bytes(raw)} is not the deployed "
                f"manifest's ({pin}): the version was changed after the deploy checked it; "
                "nothing fetched"
            )
        try:
            return raw, Manifest.from_json(raw)
        except ValueError as e:
            raise StoreError(f"{loc}/{MANIFEST_NAME}: {e}") from e

    def check_published(self, loc: S3Location, manifest: Manifest) -> list[str]:
        """Problems of the objects behind a published manifest, without reading them:
        each must exist with the manifest's size and carry its sha256 in metadata (as
        ``publish`` writes them). Bytes are only hashed by ``fetch``, against the manifest."""
        problems = []
        for name, entry in sorted(manifest.files.items()):
            head = self._head(loc.bucket, loc.key(name))
            if head is None:
                problems.append(f"{name}: missing")
            elif head["ContentLength"] != entry.size:
                problems.append(f"{name}: {head['ContentLength']} bytes, expected {entry.size}")
            elif head.get("Metadata", {}).get("sha256") != entry.sha256:
                problems.append(f"{name}: sha256 metadata differs from the manifest")
        return problems

    def fetch(
        self,
        loc: S3Location,
        directory: Path,
        rank: int | None = None,
        pin: str | None = None,
    ) -> TransferResult:
        raw, manifest = self.read_manifest(loc, pin)
        ranks = None
        if rank is not None:
            if rank not in manifest.rank_files:
                raise StoreError(
                    f"{loc}: version {manifest.version} is tp={manifest.tp_degree}; no rank {rank}"
                )
            ranks = [rank]
        wanted = set(manifest.files)
        if rank is not None:  # ranks == [rank]
            wanted = set(manifest.rank_files[rank]) | set(manifest.config_files)
            wanted |= set(manifest.tokenizer_files)
        result = TransferResult("fetch", str(loc), manifest.version)
        directory.mkdir(parents=True, exist_ok=True)
        local = directory / MANIFEST_NAME
        if local.is_file():
            if local.read_bytes() != raw:
                raise StoreError(f"{directory} already holds another version's manifest")
            report = verify(directory, ranks=ranks)
            if report.ok:
                result.already_complete = True
                return result
        partial = directory / PARTIAL_DIR
        self._start(sum(entry.size for name, entry in manifest.files.items() if name in wanted))
        for name, entry in sorted(manifest.files.items()):
            if name not in wanted:
                continue
            target = directory / name
            if target.is_file() and target.stat().st_size == entry.size:
                if sha256_file(target) == entry.sha256:
                    result.files_skipped.append(name)
                    self._advance(entry.size)
                    continue
            self._download(loc, name, entry, partial / name, target, result)
        # Last, as on the server: the directory is a version only once complete.
        tmp = directory / f".{MANIFEST_NAME}.tmp"
        tmp.write_bytes(raw)
        tmp.replace(local)
        shutil.rmtree(partial, ignore_errors=True)
        report = verify(directory, ranks=ranks)
        if not report.ok:
            raise StoreError(f"fetched version fails verify:\n{report.render()}")
        return result

    def _download(
        self,
        loc: S3Location,
        name: str,
        entry: FileEntry,
        part_path: Path,
        target: Path,
        result: TransferResult,
    ) -> None:
        key = loc.key(name)
        url = f"s3://{loc.bucket}/{key}"
        head = self._head(loc.bucket, key)
        if head is None:
            raise StoreError(f"{url}: listed in the manifest but missing")
        if head["ContentLength"] != entry.size:
            raise StoreError(
                f"{url}: {head['ContentLength']} bytes, manifest says {entry.size}: "
                "object tampered or replaced"
            )
        part_path.parent.mkdir(parents=True, exist_ok=True)
        have = part_path.stat().st_size if part_path.exists() else 0
        if have > entry.size:
            part_path.unlink()
            have = 0
        self._advance(have)  # resumed: already here
        ps = self.transfer.part_size
        with open(part_path, "ab") as f:
            while have < entry.size:
                end = min(have + ps, entry.size) - 1
                try:
                    resp = self.client.get_object(
                        Bucket=loc.bucket,
                        Key=key,
                        Range=f"bytes={have}-{end}",
                        IfMatch=head["ETag"],
                    )
                except Exception as e:
                    code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
                    if code in ("PreconditionFailed", "412"):
                        raise StoreError(f"{url}: object changed during download") from e
                    raise
                data = resp["Body"].read()
                if len(data) != end - have + 1:
                    raise StoreError(f"{url}: short read at byte {have}")
                f.write(data)
                have += len(data)
                result.parts_transferred += 1
                result.bytes_transferred += len(data)
                self._advance(len(data))
                self._notify(key, have // ps + (1 if have % ps else 0))
        digest = sha256_file(part_path)
        if digest != entry.sha256:
            part_path.unlink()
            raise StoreError(
                f"{url}: sha256 {digest} after download, manifest says {entry.sha256}: "
                "object tampered or corrupted"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        part_path.replace(target)
        result.files_transferred.append(name)

    # -- helpers ------------------------------------------------------------
    def _start(self, total_bytes: int) -> None:
        if self.progress is not None:
            self.progress.start(total_bytes)

    def _advance(self, nbytes: int) -> None:
        if self.progress is not None:
            self.progress.advance(nbytes)

    def _notify(self, key: str, part: int) -> None:
        if self.on_part is not None:
            self.on_part(key, part)

    def _head(self, bucket: str, key: str) -> dict[str, Any] | None:
        try:
            return self.client.head_object(Bucket=bucket, Key=key)
        except Exception as e:
            if _is_missing(e):
                return None
            raise

    def _get_manifest_bytes(self, loc: S3Location) -> bytes | None:
        """The manifest object's bytes; refused from its Content-Length, before the body
        is read, past MAX_MANIFEST_BYTES (and past it while reading, should the header lie)."""
        key = loc.key(MANIFEST_NAME)
        try:
            resp = self.client.get_object(Bucket=loc.bucket, Key=key)
        except Exception as e:
            if _is_missing(e):
                return None
            raise
        body = resp["Body"]
        try:
            if resp.get("ContentLength", 0) > MAX_MANIFEST_BYTES:
                raise StoreError(
                    f"s3://{loc.bucket}/{key}: {resp['ContentLength']} bytes; a manifest is "
                    f"at most {MAX_MANIFEST_BYTES}"
                )
            raw = body.read(MAX_MANIFEST_BYTES + 1)
        finally:
            body.close()
        if len(raw) > MAX_MANIFEST_BYTES:
            raise StoreError(f"s3://{loc.bucket}/{key}: longer than {MAX_MANIFEST_BYTES} bytes")
        return raw
