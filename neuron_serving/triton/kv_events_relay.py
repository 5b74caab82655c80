"""Relays vLLM's KV cache events from the leader's private ZMQ sockets to every proxy
connected to the OpenAI channel (``openai_channel.py``, "KV cache events").

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) runs in EngineCore: a
thread that sends each engine step's ``KVEventBatch`` on a PUB socket as the frames
``(topic, seq as 8 bytes big-endian, msgpack payload)`` and keeps the newest
``buffer_steps`` of them for replay on a ROUTER socket. Both are ``ipc://`` sockets in
the leader's private directory (``kv_events.py``). This relay, on the engine loop next
to the channel server (``channel_server.py``), holds:

- one SUB socket on the live stream: each batch becomes ``KvEvents(seq, payload)``
  (vLLM's bytes, unchanged) for every connection (``KvPeer``);
- replays: a connection's ``KvReplay(from_seq)`` becomes a request on the ROUTER
  (a DEALER socket per request, so a late answer to an abandoned request cannot
  mix into the next: vLLM's protocol is the request ``(b"", from_seq as 8 bytes)``
  answered by one ``(b"", topic, seq, payload)`` per buffered batch with
  ``seq >= from_seq``, then ``(b"", b"", -1 as 8 signed bytes, b"")``). One replay at
  a time for the whole leader: vLLM answers from its publisher thread, inside
  EngineCore, and sends the whole buffer at once.

Per connection (``KvPeer``), ordering: a connection gets ``KvInfo`` first (the newest
seq relayed, and the engine's hashing), then batches in increasing seq. While a
replay for it runs, its live batches wait in its backlog; the replay's batches go
out (after a ``KvReplayMiss`` when the buffer no longer reaches back to ``from_seq``),
then the backlog without the batches the replay already carried. So a proxy that
applies only the next seq it expects and asks for a replay on a gap applies every
batch once, in order.

Memory (a proxy that does not read must not grow the leader): while a connection's
transport is over its high-water mark, its live batches wait in a backlog of at most
``BACKLOG_BATCHES`` batches and ``BACKLOG_BYTES`` bytes; beyond that they are dropped
(the proxy sees the gap and asks for a replay). A replay is read whole, at most
``REPLAY_MAX_BYTES``, before any of it is handed to the connection, and a connection
over its high-water mark is not served one until it drains. A batch over
``MAX_KV_PAYLOAD`` is never relayed; the connections get ``KvReplayMiss`` for it.

Timeouts: a replay (request, every answer, the end marker) is bounded by
``REPLAY_TIMEOUT_S``; every socket closes with linger 0. The live SUB socket waits
for the next batch without a bound, as an idle engine publishes none; that wait is
an awaited future on the loop, never a blocking call.

Hostile input: a proxy's ``KvReplay`` is typed and bounded (``0 <= from_seq < 2**63``)
by the channel's decoder, anything else ends that connection only; requests merge per
connection (one queued at most, from the lowest seq asked). What comes from the
sockets is the engine's own, still checked (frame count, sizes) before use.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Protocol

import zmq
import zmq.asyncio

from neuron_serving.openai_channel import MAX_KV_PAYLOAD, KvEvents, KvInfo, KvReplayMiss
from neuron_serving.triton.kv_events import KvSource

log = logging.getLogger(__name__)

# A connection over its transport's high-water mark keeps at most this much of the
# live stream; newer batches are dropped for it (a gap it can replay).
BACKLOG_BATCHES = 4096
BACKLOG_BYTES = 8 << 20
# One replay, from the request to vLLM's end marker (vLLM answers between its
# publisher thread's queue polls, which wait up to 0.1 s each).
REPLAY_TIMEOUT_S = 5.0
# The most of one replay held before it is handed to the connection; the rest is left
# for the proxy's next request (it sees a gap where this one stopped).
REPLAY_MAX_BYTES = 32 << 20
# The most ZMQ itself allocates for one frame (beyond it drops the connection: the
# SUB socket reconnects and the proxies see a gap): a hard memory bound behind the
# MAX_KV_PAYLOAD check on the frames received (a batch between the two is reported
# lost with KvReplayMiss).
ZMQ_MAX_FRAME = 4 * MAX_KV_PAYLOAD
# vLLM's end-of-replay marker (ZmqEventPublisher.END_SEQ).
END_SEQ = -1
# Batches queued in the SUB socket before the PUB side drops them (kv_events.PUB_HWM
# bounds EngineCore's side).
SUB_HWM = 4096

KvMessage = KvEvents | KvReplayMiss


class KvOut(Protocol):
    """A channel connection as the relay sees it (``channel_server._Connection``)."""

    paused: bool  # over the transport's high-water mark

    @property
    def closing(self) -> bool: ...

    def queue(self, message: KvInfo | KvEvents | KvReplayMiss) -> None:
        """Append to the connection's next frame."""


class KvPeer:
    """One connection's share of the stream: its backlog, its replay state."""

    __slots__ = (
        "relay", "out", "backlog", "backlog_bytes", "sent", "replaying", "replay_from",
        "queued", "closed", "dropped", "overflowing",
    )  # fmt: skip

    def __init__(self, relay: KvEventsRelay, out: KvOut, seq: int) -> None:
        self.relay = relay
        self.out = out
        self.backlog: collections.deque[KvMessage] = collections.deque()
        self.backlog_bytes = 0
        self.sent = seq  # the newest seq handed to the connection (or told lost)
        self.replaying = False
        self.replay_from: int | None = None  # a replay asked for, not started yet
        self.queued = False  # in the relay's replay queue
        self.closed = False
        self.dropped = 0  # live batches dropped for this connection
        self.overflowing = False  # logged once per overflow episode

    # ---- live stream ------------------------------------------------------------------

    def live(self, message: KvMessage) -> None:
        if self.closed or self.out.closing:
            return
        if self.replaying or self.out.paused or self.backlog:
            self._hold(message)
        else:
            self._emit(message)

    def _hold(self, message: KvMessage) -> None:
        size = len(message.payload) if isinstance(message, KvEvents) else 0
        if len(self.backlog) >= BACKLOG_BATCHES or self.backlog_bytes + size > BACKLOG_BYTES:
            self.dropped += 1
            self.relay.dropped_total += 1
            if not self.overflowing:
                self.overflowing = True
                log.warning(
                    "a proxy is not reading its KV events (%d batches held): dropping its "
                    "newer ones; it will see the gap and ask for a replay",
                    len(self.backlog),
                )
            return
        self.backlog.append(message)
        self.backlog_bytes += size

    def _emit(self, message: KvMessage) -> None:
        self.out.queue(message)
        if isinstance(message, KvEvents):
            self.sent = message.seq
        elif message.oldest_seq > 0:
            self.sent = max(self.sent, message.oldest_seq - 1)

    def drain(self) -> None:
        """The connection can take more (it drained, or its replay is over): the
        backlog, without what a replay has carried since it was held."""
        backlog = self.backlog
        while backlog and not self.replaying and not self.out.paused:
            message = backlog.popleft()
            if isinstance(message, KvEvents):
                self.backlog_bytes -= len(message.payload)
                if message.seq <= self.sent:
                    continue
            elif message.from_seq <= self.sent:
                continue
            self._emit(message)
        if not backlog:
            self.backlog_bytes = 0
            self.overflowing = False

    def resume(self) -> None:
        """The connection's transport went under its low-water mark."""
        self.drain()
        if self.replay_from is not None:
            self.relay._schedule(self)

    # ---- replays ----------------------------------------------------------------------

    def request_replay(self, from_seq: int) -> None:
        """The proxy's ``KvReplay``: merged with one still waiting (the lower seq)."""
        if self.replay_from is None or from_seq < self.replay_from:
            self.replay_from = from_seq
        self.relay._schedule(self)

    def miss(self, from_seq: int, oldest_seq: int) -> None:
        self.relay.misses_total += 1
        self._emit(KvReplayMiss(from_seq, oldest_seq))

    def close(self) -> None:
        self.closed = True
        self.backlog.clear()
        self.backlog_bytes = 0
        self.relay._peers.discard(self)


class KvEventsRelay:
    """The relay of one engine's KV event publisher (``source``) to the channel's
    connections. ``hashing``: ``KvInfo``'s hashing fields (``kv_events.hashing``).
    ``start``/``close``/``attach`` run on the loop that serves the channel."""

    def __init__(self, source: KvSource, hashing: dict[str, Any]) -> None:
        self.source = source
        self._hashing = hashing
        self._topic = source.topic.encode("utf-8")
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._peers: set[KvPeer] = set()
        self._replay_queue: asyncio.Queue[KvPeer] | None = None
        self.last_seq = -1  # the newest seq received live
        # Counters (logs, tests).
        self.received_total = 0  # live batches received
        self.live_gaps_total = 0  # jumps in the live seq (the PUB side dropped some)
        self.dropped_total = 0  # live batches dropped for connections that did not read
        self.oversize_total = 0
        self.replays_total = 0
        self.misses_total = 0

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Connect to the publisher (ZMQ reconnects on its own, so the publisher may
        bind later) and start receiving; on the running loop."""
        loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, SUB_HWM)
        sub.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_FRAME)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self.source.endpoint)
        self._replay_queue = asyncio.Queue()
        self._tasks = [
            loop.create_task(self._receive(sub), name="kv-events-live"),
            loop.create_task(self._replays(), name="kv-events-replays"),
        ]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        for peer in list(self._peers):
            peer.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # ---- the channel's side -----------------------------------------------------------

    def attach(self, out: KvOut) -> KvPeer:
        """A connection that has just proved the token: its ``KvInfo``, then the stream."""
        peer = KvPeer(self, out, self.last_seq)
        self._peers.add(peer)
        out.queue(KvInfo(self.last_seq, buffer_steps=self.source.buffer_steps, **self._hashing))
        return peer

    def _schedule(self, peer: KvPeer) -> None:
        """Queue ``peer``'s replay unless it is queued, closed, or over its high-water
        mark (``resume`` schedules it then)."""
        if peer.queued or peer.closed or peer.out.paused or self._replay_queue is None:
            return
        peer.queued = True
        self._replay_queue.put_nowait(peer)  # each peer at most once: bounded

    # ---- live stream ------------------------------------------------------------------

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sub.recv_multipart()
            except zmq.ZMQError as e:  # the context was destroyed: closing
                log.debug("KV event stream closed: %s", e)
                return
            try:
                message = self._live(frames)
                if message is not None:
                    for peer in list(self._peers):
                        peer.live(message)
            except Exception:  # noqa: BLE001 - one batch, never the stream
                log.exception("relaying a KV event batch failed")

    def _live(self, frames: list[bytes]) -> KvMessage | None:
        if len(frames) != 3 or frames[0] != self._topic or len(frames[1]) != 8:
            log.warning("a malformed KV event message (%d frames) ignored", len(frames))
            return None
        seq = int.from_bytes(frames[1], "big")
        self.received_total += 1
        if self.last_seq >= 0 and seq > self.last_seq + 1:
            self.live_gaps_total += 1
        self.last_seq = max(self.last_seq, seq)
        if len(frames[2]) > MAX_KV_PAYLOAD:
            self.oversize_total += 1
            log.warning(
                "KV event batch %d is %d bytes (bound %d): not relayed", seq, len(frames[2]),
                MAX_KV_PAYLOAD,
            )  # fmt: skip
            return KvReplayMiss(seq, seq + 1)
        return KvEvents(seq, frames[2])

    # ---- replays ----------------------------------------------------------------------

    async def _replays(self) -> None:
        queue = self._replay_queue
        assert queue is not None  # start() made it before this task
        while True:
            peer = await queue.get()
            peer.queued = False
            from_seq, peer.replay_from = peer.replay_from, None
            if peer.closed or from_seq is None:
                continue
            if peer.out.paused:  # stopped reading since: served when it drains
                peer.replay_from = from_seq
                continue
            peer.replaying = True
            try:
                await self._replay(peer, from_seq)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one replay, never the relay
                log.exception("replaying KV events from %d failed", from_seq)
            finally:
                peer.replaying = False
                if not peer.closed:
                    peer.drain()

    async def _replay(self, peer: KvPeer, from_seq: int) -> None:
        self.replays_total += 1
        if self.source.replay_endpoint is None:
            peer.miss(from_seq, -1)
            return
        items, answered, complete = await self._fetch(self.source.replay_endpoint, from_seq)
        if peer.closed:
            return
        if not answered:
            log.warning("the KV event replay endpoint did not answer within %.1f s",
                        REPLAY_TIMEOUT_S)  # fmt: skip
            peer.miss(from_seq, -1)
            return
        if not complete:
            log.info("KV event replay from %d cut after %d batches", from_seq, len(items))
        if not items:
            if from_seq <= self.last_seq:  # relayed live, yet no longer buffered
                peer.miss(from_seq, -1)
            return
        first = items[0].seq if isinstance(items[0], KvEvents) else items[0].from_seq
        if first > from_seq:
            peer.miss(from_seq, first)
        for message in items:
            peer._emit(message)

    async def _fetch(self, endpoint: str, from_seq: int) -> tuple[list[KvMessage], bool, bool]:
        """vLLM's buffered batches at ``endpoint`` from ``from_seq`` -> (batches in seq
        order, any answer at all, the end marker seen). Oversize batches become
        ``KvReplayMiss``."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # The whole buffer must fit, or the ROUTER drops what does not (silently).
        sock.setsockopt(zmq.RCVHWM, self.source.buffer_steps + 16)
        sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_FRAME)
        sock.connect(endpoint)
        items: list[KvMessage] = []
        answered = False
        held = 0
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                await sock.send_multipart([b"", from_seq.to_bytes(8, "big")])
                while True:
                    frames = await sock.recv_multipart()
                    answered = True
                    if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                        log.warning("a malformed KV replay answer (%d frames)", len(frames))
                        continue
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == END_SEQ:
                        return items, True, True
                    if frames[1] != self._topic or seq < from_seq:
                        continue
                    if len(frames[3]) > MAX_KV_PAYLOAD:
                        self.oversize_total += 1
                        items.append(KvReplayMiss(seq, seq + 1))
                        continue
                    held += len(frames[3])
                    if held > REPLAY_MAX_BYTES:
                        return items, True, False
                    items.append(KvEvents(seq, frames[3]))
        except TimeoutError:
            return items, answered, False
        finally:
            sock.close(linger=0)
