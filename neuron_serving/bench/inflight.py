"""Streamed requests kept in flight through a failure, and how each one ended.

``InFlight`` sends each request from a thread of its own (``http.client``; one
``data: <json>`` SSE event per line, as Triton's ``generate_stream`` and OpenAI's
``/v1/completions`` frame them) and records, per request, when each event came
and how the stream ended: ``completed`` (``[DONE]``, or a clean end after an
event with a finish reason), ``error`` (an error event, a non-200 answer, a reset or cut
connection, a stream closed early), or, while it is still open, nothing yet.
``outcomes(now, ..., since)`` times each end from ``since`` and turns an open stream into ``hung`` when no byte came for
``hung_after_s``. Every socket has a timeout, and ``close`` shuts every socket
down, which ends every thread's blocking read.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class StreamRecord:
    started: float
    events: int = 0
    last_event: float | None = None
    ended: float | None = None
    how: str = ""  # "completed" or "error: ..." once ended

    def outcome(self, now: float, hung_after_s: float, since: float) -> str:
        """How it ended (or ``hung``/``streaming``), timed from ``since`` (the failure)."""
        if self.ended is not None:
            return f"{self.how}, {self.ended - since:+.1f} s"
        quiet = now - (self.last_event or self.started)
        if quiet >= hung_after_s:
            return f"hung: open, no event for {quiet:.1f} s"
        return f"streaming: last event {quiet:.1f} s ago"


class InFlight:
    """``bodies`` POSTed to ``http://host:port{path}``, one streamed request each."""

    def __init__(
        self, host: str, port: int, path: str, bodies: list[dict[str, Any]], *,
        read_timeout_s: float,
    ) -> None:  # fmt: skip
        self.records = [StreamRecord(started=0.0) for _ in bodies]
        self._conns: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(host, port, path, b, rec, read_timeout_s),
                daemon=True,
                name=f"inflight-{i}",
            )  # fmt: skip
            for i, (b, rec) in enumerate(zip(bodies, self.records, strict=True))
        ]

    def start(self) -> InFlight:
        for t in self._threads:
            t.start()
        return self

    def all_streaming(self) -> bool:
        return all(r.events > 0 or r.ended is not None for r in self.records)

    def all_ended(self) -> bool:
        return all(r.ended is not None for r in self.records)

    def outcomes(self, now: float, hung_after_s: float, since: float) -> list[str]:
        return [r.outcome(now, hung_after_s, since) for r in self.records]

    def close(self, join_timeout_s: float = 5.0) -> None:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        deadline = time.monotonic() + join_timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(
        self, host: str, port: int, path: str, body: dict[str, Any], rec: StreamRecord,
        read_timeout_s: float,
    ) -> None:  # fmt: skip
        conn = http.client.HTTPConnection(host, port, timeout=read_timeout_s)
        with self._lock:
            self._conns.append(conn)
        rec.started = time.monotonic()
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self._end(rec, f"error: HTTP {resp.status} {resp.read(200)!r}")
                return
            finished = False
            while True:
                line = resp.readline()
                if not line:
                    self._end(
                        rec, "completed" if finished else f"error: closed after {rec.events} events"
                    )
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    self._end(rec, "completed")
                    return
                event = json.loads(data)
                if "error" in event:
                    self._end(rec, f"error event: {str(event['error'])[:120]}")
                    return
                rec.events += 1
                rec.last_event = time.monotonic()
                finished = bool(_finish_reason(event))
        except Exception as e:  # noqa: BLE001 - how the request ended is the measurement
            self._end(rec, f"error: {type(e).__name__}: {str(e)[:120]}")
        finally:
            conn.close()

    @staticmethod
    def _end(rec: StreamRecord, how: str) -> None:
        if rec.ended is None:
            rec.how, rec.ended = how, time.monotonic()


def _finish_reason(event: dict[str, Any]) -> Any:
    """Triton's ``finish_reason`` output, or OpenAI's ``choices[0].finish_reason``."""
    if "finish_reason" in event:
        return event["finish_reason"]
    choices = event.get("choices") or [{}]
    return choices[0].get("finish_reason")
