"""The OpenAI Files and Batches endpoints (what the official client's ``files`` and
``batches`` resources call):

    POST   /v1/files                  multipart: purpose=batch, file=<JSONL>
    GET    /v1/files                  ?purpose=
    GET    /v1/files/{id}
    GET    /v1/files/{id}/content
    DELETE /v1/files/{id}
    POST   /v1/batches                {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches                ?after=&limit= (newest first, OpenAI's cursor page)
    GET    /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

Every object belongs to the tenant whose key created it: another tenant's id is a
404, as an unknown one. An upload is streamed to a temporary file, bounded by
``batch.max_file_bytes`` as it arrives (Content-Length over it: 413 before a byte is
read) and by ``upload_timeout_s``, at most ``max_uploads`` at once; only then is it
stored (``blobs.py``) and given an id. A batch's input file is checked line by line
when the batch is created (``formats.parse_input``, on a thread); its lines go into
the store with the batch in one transaction, and the runner takes it from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web

from proxy.api.front_end import read_json
from proxy.api.http_guard import TENANT
from proxy.batch.blobs import Blobs
from proxy.batch.formats import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    batch_object,
    check_metadata,
    file_object,
    new_id,
    parse_input,
)
from proxy.batch.runner import BatchRunner
from proxy.batch.store import FINAL, BatchDB
from proxy.config import BatchConfig
from proxy.errors import APIError, invalid

log = logging.getLogger(__name__)

_FILE_PURPOSES = ("batch",)
MAX_FILENAME_CHARS = 255


def _not_found(kind: str, ident: str) -> APIError:
    return APIError(404, f"No such {kind}: {ident[:100]!r}", param="id", code="not_found")


class BatchAPI:
    def __init__(
        self,
        cfg: BatchConfig,
        db: BatchDB,
        blobs: Blobs,
        runner: BatchRunner,
        model_names: Any,
    ) -> None:
        self.cfg = cfg
        self.db = db
        self.store = db.store
        self.blobs = blobs
        self.runner = runner
        self.model_names = model_names
        self.tmp = Path(cfg.data_dir) / "tmp"
        self._uploads = asyncio.Semaphore(cfg.max_uploads)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/files", self.upload),
            web.get("/v1/files", self.list_files),
            web.get("/v1/files/{id}", self.get_file),
            web.get("/v1/files/{id}/content", self.file_content),
            web.delete("/v1/files/{id}", self.delete_file),
            web.post("/v1/batches", self.create_batch),
            web.get("/v1/batches", self.list_batches),
            web.get("/v1/batches/{id}", self.get_batch),
            web.post("/v1/batches/{id}/cancel", self.cancel_batch),
        ]

    # ---- files ------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        tenant = request.get(TENANT, "")
        limit = self.cfg.max_file_bytes
        if request.content_length is not None and request.content_length > limit + (64 << 10):
            raise APIError(413, f"file exceeds {limit} bytes", code="file_too_large", close=True)
        if not request.content_type.startswith("multipart/form-data"):
            raise invalid("expected multipart/form-data with fields 'purpose' and 'file'")
        if self._uploads.locked():
            raise APIError(
                503, "too many uploads at once; retry later", "server_error", None,
                "overloaded", {"Retry-After": "5"}, close=True,
            )  # fmt: skip
        async with self._uploads:
            try:
                async with asyncio.timeout(self.cfg.upload_timeout_s):
                    purpose, filename, path, size = await self._receive(request, limit)
            except TimeoutError:
                raise APIError(
                    408, f"upload not received within {self.cfg.upload_timeout_s:g}s",
                    code="request_timeout", close=True,
                ) from None  # fmt: skip
        try:
            if purpose is None:
                raise invalid("missing required field 'purpose'", "purpose")
            if purpose not in _FILE_PURPOSES:
                raise invalid(f"purpose must be one of {list(_FILE_PURPOSES)}", "purpose")
            if path is None:
                raise invalid("missing required field 'file'", "file")
            if await self.db.call(self.store.files_of_tenant, tenant) >= (
                self.cfg.max_files_per_tenant
            ):
                raise APIError(
                    400, f"at most {self.cfg.max_files_per_tenant} files; delete some first",
                    code="too_many_files",
                )  # fmt: skip
            fid = new_id("file-")
            await asyncio.to_thread(self.blobs.put, fid, path)
            row = {"id": fid, "tenant": tenant, "purpose": purpose, "filename": filename,
                   "bytes": size, "created_at": int(time.time()), "blob": fid}  # fmt: skip
            await self.db.call(self.store.add_file, row)
        finally:
            if path is not None:
                path.unlink(missing_ok=True)
        return web.json_response(file_object(row))

    async def _receive(
        self, request: web.Request, limit: int
    ) -> tuple[str | None, str, Path | None, int]:
        """The form's purpose and file (streamed to a temporary file, bounded)."""
        reader = await request.multipart()
        purpose: str | None = None
        filename, path, size = "file.jsonl", None, 0
        parts = 0
        try:
            while (part := await reader.next()) is not None:
                parts += 1
                if parts > 8 or not isinstance(part, BodyPartReader):
                    raise invalid("unexpected form parts; send 'purpose' and 'file'")
                if part.name == "purpose":
                    raw = await part.read_chunk(256)
                    purpose = raw.decode("utf-8", "replace").strip()
                elif part.name == "file" and path is None:
                    filename = (part.filename or filename)[:MAX_FILENAME_CHARS]
                    f = tempfile.NamedTemporaryFile("wb", dir=self.tmp, delete=False)
                    path = Path(f.name)
                    with f:
                        while chunk := await part.read_chunk(1 << 16):
                            size += len(chunk)
                            if size > limit:
                                raise APIError(
                                    413, f"file exceeds {limit} bytes", code="file_too_large",
                                    close=True,
                                )  # fmt: skip
                            f.write(chunk)
                else:
                    raise invalid(f"unexpected form field {str(part.name)[:40]!r}")
        except BaseException:
            if path is not None:
                path.unlink(missing_ok=True)
            raise
        return purpose, filename, path, size

    async def _file(self, request: web.Request) -> dict[str, Any]:
        fid = request.match_info["id"]
        row = await self.db.call(self.store.get_file, request.get(TENANT, ""), fid)
        if row is None:
            raise _not_found("file", fid)
        return row

    async def list_files(self, request: web.Request) -> web.Response:
        purpose = request.query.get("purpose")
        limit = _limit(request, 10_000, 10_000)
        rows = await self.db.call(self.store.list_files, request.get(TENANT, ""), purpose, limit)
        return web.json_response(
            {"object": "list", "data": [file_object(r) for r in rows], "has_more": False}
        )

    async def get_file(self, request: web.Request) -> web.Response:
        return web.json_response(file_object(await self._file(request)))

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        row = await self._file(request)
        resp = web.StreamResponse(
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Length": str(row["bytes"]),
            }  # fmt: skip
        )
        chunks = self.blobs.chunks(row["blob"])
        first = await asyncio.to_thread(next, chunks, b"")  # a missing blob fails before headers
        await resp.prepare(request)
        try:
            chunk = first
            while chunk:
                await resp.write(chunk)
                chunk = await asyncio.to_thread(next, chunks, b"")
        finally:
            with contextlib.suppress(Exception):
                chunks.close()
        await resp.write_eof()
        return resp

    async def delete_file(self, request: web.Request) -> web.Response:
        fid = request.match_info["id"]
        row = await self.db.call(self.store.delete_file, request.get(TENANT, ""), fid)
        if row is None:
            raise _not_found("file", fid)
        await asyncio.to_thread(self.blobs.delete, row["blob"])
        return web.json_response({"id": fid, "object": "file", "deleted": True})

    # ---- batches ----------------------------------------------------------------------------

    async def create_batch(self, request: web.Request) -> web.Response:
        tenant = request.get(TENANT, "")
        body = await read_json(request)
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        url = body.get("endpoint")
        if url not in ENDPOINTS:
            raise invalid(
                f"endpoint must be one of {sorted(ENDPOINTS)} (got {str(url)[:80]!r})",
                "endpoint", "invalid_endpoint",
            )  # fmt: skip
        window = body.get("completion_window")
        if window not in COMPLETION_WINDOWS:
            raise invalid(
                f"completion_window must be one of {sorted(COMPLETION_WINDOWS)}",
                "completion_window",
            )
        metadata = check_metadata(body.get("metadata"))
        fid = body.get("input_file_id")
        if not isinstance(fid, str):
            raise invalid("input_file_id must be a string", "input_file_id")
        src = await self.db.call(self.store.get_file, tenant, fid)
        if src is None:
            raise _not_found("file", fid)
        if src["purpose"] != "batch":
            raise invalid(f"file {fid} has purpose {src['purpose']!r}, not 'batch'",
                          "input_file_id")  # fmt: skip
        lines, errors = await self._read_input(src, url)
        now = int(time.time())
        row: dict[str, Any] = {
            "id": new_id("batch_"), "tenant": tenant, "endpoint": url, "input_file_id": fid,
            "completion_window": window, "created_at": now,
            "expires_at": now + COMPLETION_WINDOWS[window],
            "metadata": json.dumps(metadata) if metadata is not None else None,
            "total": 0 if errors else len(lines),
        }  # fmt: skip
        if errors:
            row |= {"status": "failed", "failed_at": now,
                    "errors": json.dumps({"object": "list", "data": errors})}  # fmt: skip
            lines = []
        else:
            row |= {"status": "in_progress", "in_progress_at": now}
        await self.db.call(self.store.create_batch, row, lines)
        self.runner.wake.set()
        return web.json_response(batch_object(await self._batch_row(row["id"], tenant)))

    async def _read_input(self, src: dict[str, Any], url: str):
        def read() -> tuple[list[tuple[int, str, str]], list[dict[str, Any]]]:
            with tempfile.NamedTemporaryFile(dir=self.tmp) as f:
                self.blobs.fetch(src["blob"], Path(f.name))
                return parse_input(Path(f.name), url, self.model_names(), self.cfg.max_lines)

        return await asyncio.to_thread(read)

    async def _batch_row(self, bid: str, tenant: str) -> dict[str, Any]:
        row = await self.db.call(self.store.get_batch, bid, tenant)
        if row is None:
            raise _not_found("batch", bid)
        return row

    async def get_batch(self, request: web.Request) -> web.Response:
        row = await self._batch_row(request.match_info["id"], request.get(TENANT, ""))
        return web.json_response(batch_object(row))

    async def list_batches(self, request: web.Request) -> web.Response:
        limit = _limit(request, 20, 100)
        after = request.query.get("after")
        rows, more = await self.db.call(
            self.store.list_batches, request.get(TENANT, ""), after, limit
        )
        data = [batch_object(r) for r in rows]
        return web.json_response({
            "object": "list", "data": data, "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        })  # fmt: skip

    async def cancel_batch(self, request: web.Request) -> web.Response:
        bid, tenant = request.match_info["id"], request.get(TENANT, "")
        row = await self._batch_row(bid, tenant)
        if row["status"] in FINAL:
            raise APIError(
                409, f"batch {bid} is {row['status']}: it cannot be cancelled",
                code="batch_not_cancellable",
            )  # fmt: skip
        await self.db.call(
            self.store.set_status, bid, "cancelling", "cancelling_at",
            ("validating", "in_progress", "finalizing"),
        )  # fmt: skip
        self.runner.wake.set()
        return web.json_response(batch_object(await self._batch_row(bid, tenant)))


def _limit(request: web.Request, default: int, most: int) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise invalid(f"limit must be an integer in [1, {most}]", "limit")
    return int(raw)
