"""The response thread: sends Triton responses and notices cancelled requests.

``response_sender.send()`` crosses from the stub process to tritonserver through
shared memory and can block on a slow client; doing it on the engine's event loop
would stall every other request's tokens. So the loop only enqueues, and this
thread sends, in enqueue order (per-request order is what Triton requires: the
FINAL flag must come last).

Backpressure (delta coalescing): a streaming request has at most one partial
response waiting here. Its task on the engine loop hands over a future with the
response and awaits it before it pulls the next output from AsyncLLM; the thread
resolves the futures of everything it sent in one drained batch with one
``wake()`` (a single ``call_soon_threadsafe``). While a request waits, vLLM's own
per-request output collector (``RequestOutputCollector``, the same one
``vllm serve`` relies on) merges the DELTA outputs that arrive meanwhile into one:
text concatenated, token ids and logprobs appended. So when sending is the slow
stage, each response carries the tokens that piled up instead of the queue
growing by one response per token; when it keeps up, every token goes out alone,
and a request's first response is never held back.

Cancellation: Triton sets a request cancelled when a gRPC client cancels its
stream or disconnects (and on server shutdown). The thread asks
``is_cancelled()`` after each partial send and, while idle, polls every
registered stream, then cancels the request's task on the engine loop; vLLM's
``AsyncLLM.generate`` turns that CancelledError into ``abort(request_id)``, which
frees the request's KV blocks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_POLL_S = 0.1
# is_cancelled() is an IPC round trip to tritonserver; asking after every token of
# every stream doubled the IPC per token. Once per stream per interval is plenty.
_CANCEL_CHECK_INTERVAL_S = 0.05


@dataclass(slots=True)
class Stream:
    """One in-flight request as the response thread sees it."""

    sender: Any  # pb_utils.InferenceResponseSender
    future: concurrent.futures.Future | None = None  # the request task on the engine loop
    cancelled: bool = False
    last_check: float = 0.0  # monotonic time of the last is_cancelled()


Item = tuple[str, Any, int, Any]  # request id, response, flags, waiter (or None)


class ResponseThread:
    def __init__(self, final_flag: int, wake: Callable[[list[Any]], None] | None = None) -> None:
        """``wake(waiters)`` runs on this thread after each drained batch with the
        waiters (opaque to this class) of every item taken from the queue in it,
        sent or dropped; the backend resolves them on the engine loop."""
        self._final_flag = final_flag
        self._wake = wake
        # Items, or lists of items put together (one engine step's responses: one
        # queue operation and at most one wake-up of this thread for all of them).
        self._queue: queue.Queue[Item | list[Item] | None] = queue.Queue()
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="triton-responses", daemon=True)
        self.cancelled_total = 0
        self.sent_total = 0
        self.entries_total = 0  # queue entries taken (an item, or a batch of them)

    def start(self) -> None:
        self._thread.start()

    def register(self, request_id: str, stream: Stream) -> None:
        with self._lock:
            self._streams[request_id] = stream

    def put(self, request_id: str, response: Any, flags: int = 0, waiter: Any = None) -> None:
        """Thread-safe; a FINAL response unregisters the stream once sent. ``waiter``
        is handed to ``wake()`` once the response was sent (or dropped)."""
        self._queue.put((request_id, response, flags, waiter))

    def put_batch(self, items: list[Item]) -> None:
        """``put`` for several items at once, in order; thread-safe."""
        if items:
            self._queue.put(items)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                self._poll_cancelled()
                continue
            # Drain what is queued now: one wake-up of the engine loop per batch.
            batch = [item]
            while item is not None:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
            self.entries_total += len(batch)
            waiters: list[Any] = []
            for entry in batch:
                if entry is None:
                    self._resolve(waiters)
                    return
                for item in entry if isinstance(entry, list) else (entry,):
                    self._send(*item[:3])
                    if item[3] is not None:
                        waiters.append(item[3])
            self._resolve(waiters)

    def _send(self, request_id: str, response: Any, flags: int) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # already finished (e.g. a late partial after cancellation)
        try:
            stream.sender.send(response, flags=flags)
        except Exception:  # noqa: BLE001 - one broken client must not stop the thread
            log.exception("sending a response for %s failed", request_id)
        self.sent_total += 1
        if flags & self._final_flag:
            with self._lock:
                self._streams.pop(request_id, None)
        else:
            self._check(request_id, stream)

    def _resolve(self, waiters: list[Any]) -> None:
        if waiters and self._wake is not None:
            try:
                self._wake(waiters)
            except Exception:  # noqa: BLE001 - e.g. the engine loop already closed
                log.debug("waking %d waiters failed", len(waiters), exc_info=True)

    def _poll_cancelled(self) -> None:
        with self._lock:
            streams = list(self._streams.items())
        for request_id, stream in streams:
            self._check(request_id, stream)

    def _check(self, request_id: str, stream: Stream) -> None:
        now = time.monotonic()
        if stream.cancelled or now - stream.last_check < _CANCEL_CHECK_INTERVAL_S:
            return
        stream.last_check = now
        try:
            cancelled = stream.sender.is_cancelled()
        except Exception:  # noqa: BLE001
            cancelled = False
        if cancelled:
            stream.cancelled = True
            self.cancelled_total += 1
            log.info("request %s cancelled by the client; aborting it in vLLM", request_id)
            if stream.future is not None:
                stream.future.cancel()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
