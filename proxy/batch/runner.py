"""Runs the Batch API's lines: leased from the store, sent as class ``batch`` through
the proxy's one generation path (``Pipeline.complete``: flow control, routing,
retries), each result committed before the line counts as done.

    every poll_s, or when woken (a batch created or cancelled, a line done):
      in_progress batches: expired? -> finish "expired" (unrun lines: batch_expired)
                           lease lines (up to lines_in_flight in all, shared evenly
                           between batches) -> one task per line
                           no line open -> "finalizing" -> output + error files ->
                           "completed" (and the lines dropped)
      cancelling batches:  this replica's line tasks cancelled (vLLM aborts them),
                           their leases released; once no live lease is left (another
                           replica's runs out) -> files of what finished -> "cancelled"
      finalizing batches left by a replica that died there: finished again
    every lease_s / 3: this replica's leases renewed

A line's outcome: vLLM's answer (any status) is its result (200: output file; else
error file). Flow control's refusals (429/503: shed, queue deadline, no unit) are
not the line's fault: it goes back to pending and is retried later, unboundedly
within the completion window, so batch work waits for capacity instead of failing.
A unit fault after the dispatcher's own retries counts an attempt; after
``max_attempts`` the line fails with the error.

The final transition writes the file rows and the status in one transaction that
expects the batch's current status, so of two replicas finishing one batch only
one succeeds; the other's blobs are deleted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from proxy.api.pipeline import Pipeline
from proxy.batch.blobs import Blobs
from proxy.batch.formats import ENDPOINTS, error_line, new_id, output_line
from proxy.batch.store import BatchDB, Line
from proxy.config import BatchConfig
from proxy.errors import APIError
from proxy.protocol import parse_openai
from proxy.serving.dispatch import NoRoutableUnit, OpenAIJob
from proxy.serving.flow_control import Overloaded
from proxy.serving.metrics import ProxyMetrics
from proxy.traffic_class import TrafficClass
from proxy.upstream.base import UpstreamError

log = logging.getLogger(__name__)

# A line refused by flow control (no capacity now) is retried after this, jittered.
RETRY_IDLE_S = (0.5, 2.0)
FINALIZE_STALE_S = 120.0  # a "finalizing" batch untouched this long: its finisher died


class BatchRunner:
    def __init__(
        self, db: BatchDB, blobs: Blobs, pipeline: Pipeline, cfg: BatchConfig,
        metrics: ProxyMetrics | None = None,
    ) -> None:  # fmt: skip
        self.metrics = metrics
        self.db = db
        self.store = db.store
        self.blobs = blobs
        self.pipeline = pipeline
        self.cfg = cfg
        # The replica's name on the leases it takes (``start``): known only once the
        # proxy's port is bound when no ``replica_id`` is configured.
        self.owner = ""
        self.tmp = Path(cfg.data_dir) / "tmp"
        self.wake = asyncio.Event()
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._finishing: set[str] = set()
        self._main: asyncio.Task[None] | None = None
        self._last_renew = 0.0
        self.lines_done = 0
        self.lines_retried = 0

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self, owner: str) -> None:
        self.owner = owner
        self.tmp.mkdir(parents=True, exist_ok=True)
        released = await self.db.call(self.store.release_own, self.owner)
        if released:
            log.info("batch: %d lines this replica held when it stopped run again", released)
        self._main = asyncio.get_running_loop().create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        """Stop running lines; their leases are released so the next start (or another
        replica) runs them at once."""
        if self._main is not None:
            self._main.cancel()
            await asyncio.gather(self._main, return_exceptions=True)
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.db.call(self.store.release_own, self.owner)

    async def status(self) -> dict[str, Any]:
        """For /status: the batches not final yet (every tenant's: /status with detail
        is for operators), and this replica's line counters."""
        rows = await self.db.call(
            self.store.batches_in, ("validating", "in_progress", "finalizing", "cancelling")
        )
        return {
            "replica_id": self.owner,
            "lines_in_flight": len(self._tasks),
            "lines_done": self.lines_done,
            "lines_retried": self.lines_retried,
            "active": [
                {
                    "id": r["id"],
                    "tenant": r["tenant"],
                    "status": r["status"],
                    "endpoint": r["endpoint"],
                    "created_at": r["created_at"],
                    "expires_at": r["expires_at"],
                    "request_counts": {
                        "total": r["total"],
                        "completed": r["completed"],
                        "failed": r["failed"],
                    },
                    "in_flight_here": self.in_flight(r["id"]),
                }  # fmt: skip
                for r in rows
            ],
        }

    def in_flight(self, batch_id: str) -> int:
        return sum(1 for b, _ in self._tasks if b == batch_id)

    # ---- the loop -----------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            self.wake.clear()
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception:  # the store or a blob failed: log, try again next round
                log.exception("batch runner round failed")
            try:
                async with asyncio.timeout(self.cfg.poll_s):
                    await self.wake.wait()
            except TimeoutError:
                pass

    async def _round(self) -> None:
        now = time.time()
        if self._tasks and now - self._last_renew >= self.cfg.lease_s / 3:
            await self.db.call(self.store.renew, self.owner, list(self._tasks), self.cfg.lease_s)
            self._last_renew = now
        batches = await self.db.call(
            self.store.batches_in, ("in_progress", "cancelling", "finalizing")
        )
        running = [b for b in batches if b["status"] == "in_progress"]
        free = self.cfg.lines_in_flight - len(self._tasks)
        share = -(-free // len(running)) if running and free > 0 else 0
        for b in batches:
            status = b["status"]
            if status == "in_progress":
                if now >= b["expires_at"]:
                    self._cancel_lines(b["id"])
                    await self._finish(b, "expired", "expired_at", ("in_progress",))
                    continue
                take = min(share, free)
                if take > 0:
                    lines = await self.db.call(
                        self.store.claim, b["id"], self.owner, take, self.cfg.lease_s
                    )
                    free -= len(lines)
                    for line in lines:
                        self._spawn(b, line)
                if not self.in_flight(b["id"]) and not await self.db.call(
                    self.store.open_lines, b["id"]
                ):
                    if await self.db.call(
                        self.store.set_status, b["id"], "finalizing", "finalizing_at",
                        ("in_progress",),
                    ):  # fmt: skip
                        await self._finish(b, "completed", "completed_at", ("finalizing",))
            elif status == "cancelling":
                self._cancel_lines(b["id"])
                if not self.in_flight(b["id"]) and not await self.db.call(
                    self.store.leased_lines, b["id"]
                ):
                    await self._finish(b, "cancelled", "cancelled_at", ("cancelling",))
            elif status == "finalizing" and now - (b["finalizing_at"] or 0) > FINALIZE_STALE_S:
                await self._finish(b, "completed", "completed_at", ("finalizing",))

    def _cancel_lines(self, batch_id: str) -> None:
        for key, t in list(self._tasks.items()):
            if key[0] == batch_id:
                t.cancel()

    def _spawn(self, batch: dict[str, Any], line: Line) -> None:
        key = (line.batch_id, line.idx)
        task = asyncio.get_running_loop().create_task(self._run_line(batch, line))
        self._tasks[key] = task

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.pop(key, None)
            self.wake.set()

        task.add_done_callback(done)

    # ---- one line -------------------------------------------------------------------------

    async def _run_line(self, batch: dict[str, Any], line: Line) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.pipeline.deps.config
        try:
            body = json.loads(line.body)
            if body.get("stream"):
                body = dict(body, stream=False)  # a batch line is answered whole
            # Checked as the OpenAI front end checks a request, against today's config:
            # n above admission.max_n is this line's 400 (the except below).
            req = parse_openai(
                body,
                ENDPOINTS[batch["endpoint"]],
                self.pipeline.deps.model_names(),
                max_n=cfg.admission.max_n,
            )
            job = OpenAIJob(
                model=req.model,
                deadline=loop.time() + cfg.timeouts.max_request_s,
                traffic_class=TrafficClass.BATCH,
                tenant=batch["tenant"],
                prompt_tokens=await self.pipeline.prompt_tokens(
                    req.model, req.endpoint, body, len(req.routing_key)
                ),
                request=req,
                cost=req.sequences,
                raw_body=msgspec.json.encode(body),
                body=body,
            )
            status, payload = await self.pipeline.complete(job)
            try:
                answer: Any = json.loads(payload)
            except ValueError:
                answer = {"error": {"message": "the model server's answer was not JSON"}}
            result = output_line(line.custom_id, status, answer)
            ok = status == 200
        except APIError as e:  # the line's body: checked again against today's models
            result, ok = output_line(line.custom_id, e.status, e.body()), False
        except (Overloaded, NoRoutableUnit) as e:
            self.lines_retried += 1
            log.debug("batch %s line %d waits for capacity: %s", line.batch_id, line.idx, e)
            await self._release(line, attempted=False)
            return
        except UpstreamError as e:
            if line.attempts + 1 < self.cfg.max_attempts:
                self.lines_retried += 1
                await self._release(line, attempted=True)
                return
            result, ok = (
                error_line(line.custom_id, "server_error", str(e.client_message or e)),
                False,
            )
        except asyncio.CancelledError:  # cancelled batch, or the proxy stopping
            await asyncio.shield(self._release(line, attempted=False, now=True))
            raise
        if await self.db.call(self.store.complete, line, self.owner, ok, result):
            self.lines_done += 1
            if self.metrics is not None:
                self.metrics.batch_requests.labels("completed" if ok else "failed").inc()
        else:
            log.warning(
                "batch %s line %d: lease lost; its result was dropped", line.batch_id, line.idx
            )

    async def _release(self, line: Line, attempted: bool, now: bool = False) -> None:
        retry_at = time.time() + (0 if now else random.uniform(*RETRY_IDLE_S))
        await self.db.call(self.store.release, line, self.owner, retry_at, attempted)

    # ---- the end of a batch ------------------------------------------------------------------

    async def _finish(
        self, batch: dict[str, Any], status: str, when: str, expect: tuple[str, ...]
    ) -> None:
        bid = batch["id"]
        if bid in self._finishing:
            return
        self._finishing.add(bid)
        try:
            rows, keys = await asyncio.to_thread(self._write_outputs, batch, status)
            for row in rows:
                await asyncio.to_thread(self.blobs.put, row["blob"], Path(row.pop("_path")))
            extra = {f"{r['_kind']}_file_id": r["id"] for r in rows}
            for r in rows:
                r.pop("_kind")
            if status == "expired":
                extra["failed"] = batch["total"] - batch["completed"]
            done = await self.db.call(self.store.finish, bid, status, when, expect, rows, **extra)
            if not done:  # another replica finished it first
                for key in keys:
                    await asyncio.to_thread(self.blobs.delete, key)
            else:
                log.info("batch %s %s", bid, status)
        finally:
            self._finishing.discard(bid)

    def _write_outputs(
        self, batch: dict[str, Any], status: str
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """The output and error files (those with a line) as temporary files, and
        their file rows; blocking."""
        files = {
            kind: tempfile.NamedTemporaryFile("wb", dir=self.tmp, delete=False)
            for kind in ("output", "error")
        }
        counts = {"output": 0, "error": 0}
        try:
            for ok, result, custom_id, _idx in self.store.results(batch["id"]):
                if result is None:
                    if status != "expired":
                        continue  # cancelled before it ran: in neither file
                    kind = "error"
                    text = json.dumps(
                        error_line(custom_id, "batch_expired",
                                   "This request could not be executed before the "
                                   "completion window expired."),
                        separators=(",", ":"),
                    )  # fmt: skip
                else:
                    kind, text = ("output" if ok else "error"), result
                files[kind].write(text.encode() + b"\n")
                counts[kind] += 1
        finally:
            for f in files.values():
                f.close()
        rows, keys = [], []
        now = int(time.time())
        for kind, f in files.items():
            if not counts[kind]:
                Path(f.name).unlink(missing_ok=True)
                continue
            fid = new_id("file-")
            keys.append(fid)
            rows.append({
                "id": fid, "tenant": batch["tenant"], "purpose": "batch_output",
                "filename": f"{batch['id']}_{kind}.jsonl", "bytes": Path(f.name).stat().st_size,
                "created_at": now, "blob": fid, "_path": f.name, "_kind": kind,
            })  # fmt: skip
        return rows, keys
