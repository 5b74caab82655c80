"""The Batch API's durable state: SQLite, in the proxy's data directory.

Three tables: ``files`` (metadata; the bytes are in a ``blobs`` store), ``batches``
(OpenAI's batch object, one column per field) and ``lines`` (one row per input
line: its request, its state, its lease and, once done, its output line).

Exactly once, across restarts and replicas:

- a line is run only under a lease: ``claim`` moves pending lines (or lines whose
  lease has run out) to ``leased`` with this replica's id and an expiry, in one
  statement, so two replicas never hold one line;
- its result is committed with ``complete``, which only succeeds while the lease
  is still this replica's (``state = 'leased' AND lease_owner = ?``), in the same
  transaction that counts it in the batch's ``request_counts``: a result whose
  lease was lost is dropped, so no line has two;
- a line counts as done only once its result is committed. A replica killed
  mid-line leaves it leased; another replica takes it when the lease runs out,
  and the same replica at once on its next start (``release_own``).

SQLite runs in WAL mode with a busy timeout, so replicas on one host can share
the file; every statement is short. Calls are blocking: the async wrapper
(``BatchDB``) runs them on one worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    blob TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT,
    errors TEXT,
    metadata TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    lease_owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    ok INTEGER,
    result TEXT,
    PRIMARY KEY (batch_id, idx)
);
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state, lease_until);
"""

# The batch statuses in which lines still run.
RUNNING = ("in_progress", "cancelling")
# Batch statuses that are final.
FINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True, slots=True)
class Line:
    batch_id: str
    idx: int
    custom_id: str
    body: str  # the request body, JSON
    attempts: int


class _Lost(Exception):
    """A conditional transition found the batch moved on: roll back."""


class Store:
    """Blocking access to the database (one connection; see ``BatchDB``)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), timeout=10.0, isolation_level=None,
                                  check_same_thread=False)  # fmt: skip
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at each checkpoint
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return out

    # ---- files -----------------------------------------------------------------------

    def add_file(self, row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        self._tx(
            lambda db: db.execute(
                f"INSERT INTO files ({cols}) VALUES ({marks})", tuple(row.values())
            )
        )

    def get_file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        r = self.db.execute(
            "SELECT * FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)
        ).fetchone()
        return dict(r) if r else None

    def list_files(self, tenant: str, purpose: str | None, limit: int) -> list[dict[str, Any]]:
        q = "SELECT * FROM files WHERE tenant = ?"
        args: list[Any] = [tenant]
        if purpose:
            q += " AND purpose = ?"
            args.append(purpose)
        q += " ORDER BY created_at DESC, id LIMIT ?"
        args.append(limit)
        return [dict(r) for r in self.db.execute(q, args)]

    def delete_file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        def tx(db: sqlite3.Connection) -> dict[str, Any] | None:
            r = db.execute(
                "SELECT * FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)
            ).fetchone()
            if r is not None:
                db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            return dict(r) if r else None

        return self._tx(tx)

    def files_of_tenant(self, tenant: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM files WHERE tenant = ?", (tenant,)).fetchone()[
            0
        ]

    # ---- batches -----------------------------------------------------------------------

    def create_batch(self, row: dict[str, Any], lines: Iterable[tuple[int, str, str]]) -> None:
        """The batch and all its lines, in one transaction: a batch is never half there."""

        def tx(db: sqlite3.Connection) -> None:
            cols = ", ".join(row)
            marks = ", ".join("?" for _ in row)
            db.execute(f"INSERT INTO batches ({cols}) VALUES ({marks})", tuple(row.values()))
            db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, body) VALUES (?, ?, ?, ?)",
                ((row["id"], i, cid, body) for i, cid, body in lines),
            )

        self._tx(tx)

    def get_batch(self, batch_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        if tenant is None:
            r = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        else:
            r = self.db.execute(
                "SELECT * FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant)
            ).fetchone()
        return dict(r) if r else None

    def list_batches(
        self, tenant: str | None, after: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, ``limit`` after the batch ``after`` (OpenAI's cursor); and
        whether there are more."""
        q = "SELECT * FROM batches WHERE 1=1"
        args: list[Any] = []
        if tenant is not None:
            q += " AND tenant = ?"
            args.append(tenant)
        if after:
            r = self.db.execute("SELECT seq FROM batches WHERE id = ?", (after,)).fetchone()
            if r is not None:
                q += " AND seq < ?"
                args.append(r[0])
        q += " ORDER BY seq DESC LIMIT ?"
        args.append(limit + 1)
        rows = [dict(r) for r in self.db.execute(q, args)]
        return rows[:limit], len(rows) > limit

    def set_status(
        self, batch_id: str, status: str, when: str, expect: tuple[str, ...], **extra: Any
    ) -> bool:
        """Move a batch to ``status`` (stamping ``when``) if it is in one of ``expect``;
        False when another replica (or a cancel) moved it first."""
        sets = ["status = ?", f"{when} = ?"] + [f"{k} = ?" for k in extra]
        args = [status, int(time.time()), *extra.values(), batch_id, *expect]
        marks = ", ".join("?" for _ in expect)
        cur = self.db.execute(
            f"UPDATE batches SET {', '.join(sets)} WHERE id = ? AND status IN ({marks})", args
        )
        return cur.rowcount == 1

    def finish(
        self,
        batch_id: str,
        status: str,
        when: str,
        expect: tuple[str, ...],
        files: list[dict[str, Any]],
        **extra: Any,
    ) -> bool:
        """The final transition: the output/error file rows, the batch's status and its
        lines dropped, in one transaction that expects ``expect``; False (nothing
        written) when another replica or a cancel moved the batch first."""

        def tx(db: sqlite3.Connection) -> bool:
            sets = ["status = ?", f"{when} = ?"] + [f"{k} = ?" for k in extra]
            marks = ", ".join("?" for _ in expect)
            cur = db.execute(
                f"UPDATE batches SET {', '.join(sets)} WHERE id = ? AND status IN ({marks})",
                [status, int(time.time()), *extra.values(), batch_id, *expect],
            )
            if cur.rowcount != 1:
                raise _Lost
            for row in files:
                cols = ", ".join(row)
                db.execute(
                    f"INSERT INTO files ({cols}) VALUES ({', '.join('?' for _ in row)})",
                    tuple(row.values()),
                )
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            return True

        try:
            return self._tx(tx)
        except _Lost:
            return False

    def batches_in(self, statuses: tuple[str, ...]) -> list[dict[str, Any]]:
        marks = ", ".join("?" for _ in statuses)
        return [
            dict(r)
            for r in self.db.execute(
                f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", statuses
            )
        ]

    # ---- lines -------------------------------------------------------------------------

    def claim(self, batch_id: str, owner: str, n: int, lease_s: float) -> list[Line]:
        """Lease up to ``n`` runnable lines of the batch (pending, or leased by anyone
        whose lease has run out), in input order."""
        now = time.time()
        rows = self.db.execute(
            """UPDATE lines SET state = 'leased', lease_owner = ?, lease_until = ?
               WHERE rowid IN (
                   SELECT rowid FROM lines WHERE batch_id = ? AND lease_until <= ?
                   AND state IN ('pending', 'leased') ORDER BY idx LIMIT ?)
               RETURNING batch_id, idx, custom_id, body, attempts""",
            (owner, now + lease_s, batch_id, now, n),
        ).fetchall()
        return sorted((Line(*r) for r in rows), key=lambda line: line.idx)

    def renew(self, owner: str, keys: list[tuple[str, int]], lease_s: float) -> None:
        until = time.time() + lease_s
        self._tx(
            lambda db: db.executemany(
                "UPDATE lines SET lease_until = ? WHERE batch_id = ? AND idx = ? "
                "AND state = 'leased' AND lease_owner = ?",
                ((until, b, i, owner) for b, i in keys),
            )
        )

    def release(self, line: Line, owner: str, retry_at: float, attempted: bool) -> None:
        """Back to pending, runnable from ``retry_at`` (time.time())."""
        self.db.execute(
            "UPDATE lines SET state = 'pending', lease_owner = NULL, lease_until = ?, "
            "attempts = attempts + ? WHERE batch_id = ? AND idx = ? AND state = 'leased' "
            "AND lease_owner = ?",
            (retry_at, int(attempted), line.batch_id, line.idx, owner),
        )

    def release_own(self, owner: str) -> int:
        """On start: lines this replica held when it stopped are runnable again now."""
        cur = self.db.execute(
            "UPDATE lines SET state = 'pending', lease_owner = NULL, lease_until = 0 "
            "WHERE state = 'leased' AND lease_owner = ?",
            (owner,),
        )
        return cur.rowcount

    def complete(self, line: Line, owner: str, ok: bool, result: dict[str, Any]) -> bool:
        """Commit the line's output line and count it; False (nothing written) when
        the lease is no longer this replica's."""

        def tx(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE lines SET state = 'done', ok = ?, result = ?, lease_owner = NULL "
                "WHERE batch_id = ? AND idx = ? AND state = 'leased' AND lease_owner = ?",
                (int(ok), json.dumps(result, separators=(",", ":")), line.batch_id, line.idx,
                 owner),
            )  # fmt: skip
            if cur.rowcount != 1:
                return False
            col = "completed" if ok else "failed"
            db.execute(f"UPDATE batches SET {col} = {col} + 1 WHERE id = ?", (line.batch_id,))
            return True

        return self._tx(tx)

    def open_lines(self, batch_id: str) -> int:
        """Lines not done (pending or leased)."""
        return self.db.execute(
            "SELECT COUNT(*) FROM lines WHERE batch_id = ? AND state != 'done'", (batch_id,)
        ).fetchone()[0]

    def leased_lines(self, batch_id: str) -> int:
        return self.db.execute(
            "SELECT COUNT(*) FROM lines WHERE batch_id = ? AND state = 'leased' "
            "AND lease_until > ?",
            (batch_id, time.time()),
        ).fetchone()[0]

    def results(self, batch_id: str) -> Iterable[tuple[int, str | None, str, int | None]]:
        """(ok, result, custom_id, idx) of every line in input order; result None for a
        line that never ran."""
        for r in self.db.execute(
            "SELECT ok, result, custom_id, idx FROM lines WHERE batch_id = ? ORDER BY idx",
            (batch_id,),
        ):
            yield r[0], r[1], r[2], r[3]


class BatchDB:
    """``Store`` off the event loop: every call on one worker thread, in order."""

    def __init__(self, path: Path) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-db")
        self.store = self._pool.submit(Store, path).result(timeout=30)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        self._pool.submit(self.store.close).result(timeout=30)
        self._pool.shutdown(wait=True)
