"""The leader's end of the OpenAI channel (``neuron_serving/openai_channel.py``).

A TCP server on the engine loop, next to AsyncLLM: the proxy's ``Open`` becomes a
request task on that loop at once (no Triton, no thread hand-off), and what the
tasks answer in one loop iteration (an engine step's outputs for every stream)
leaves as one frame: ``ChannelCall.send`` appends an event, and a flush callback
queued behind the tasks that are ready now writes them all, as the backend's
``_enqueue`` does for Triton responses.

Backpressure is the Triton path's: a streaming request's task awaits the future
``send`` returns before it pulls more output from AsyncLLM, and vLLM's per-request
output collector merges what arrives meanwhile. Here the future resolves when the
frame is handed to the transport, or, while the transport is over its high-water
mark (a proxy that does not read), when the transport asks for more
(``resume_writing``). A connection's tasks are cancelled when it closes (vLLM
aborts their requests); a ``Cancel`` cancels one. A call that has nothing to send
gets a ``Progress`` report every ``PROGRESS_INTERVAL_S`` (``progress.py``), so that
the proxy never takes a long answer for a dead leader.

Load reports (``openai_channel.Load``, from ``engine_load.EngineLoadTracker``):
each connection gets the unit's load right after the handshake, then whenever it
changed, at most every ``LOAD_INTERVAL_S``. A change schedules one push for the
whole server (``call_soon`` when the last push is that long ago, else a timer),
which appends a ``Load`` to every connection's pending events: it rides in the
frame of the engine step whose stats changed it when that step's events are still
pending. An unchanged load is resent only after ``LOAD_REFRESH_S``: a proxy wakes
for every frame, so no more often, but its flow control distrusts a report older
than its ``admission.load_max_age_s`` (5 s by default), and reports that stop
coming tell it this loop is stuck. A connection over its high-water mark (a proxy
that does not read) is sent no loads: it is owed one and gets the then-current
load when the transport asks for more, so nothing piles up for it.

KV cache events (``kv_events_relay.py``): with a relay, each connection gets
``KvInfo`` right after the handshake (before its first ``Load``), then vLLM's KV event
batches as ``KvEvents``; a ``KvReplay`` goes to the relay. The relay decides what a
connection over its high-water mark is sent (a bounded backlog, then drops).

Hostile input: before the handshake only fixed-size bytes are read and nothing is
parsed; a peer that does not prove the token within ``HANDSHAKE_TIMEOUT_S`` is cut
off. After it, frames are bounded (``MAX_TO_LEADER``) before they are buffered and
decoded into typed messages; anything else ends the connection (and its calls).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from neuron_serving.openai_channel import (
    HANDSHAKE_TIMEOUT_S,
    MAX_TO_LEADER,
    PROOF_BYTES,
    Cancel,
    ChannelError,
    Event,
    FrameReader,
    Generate,
    KvEvents,
    KvInfo,
    KvReplay,
    KvReplayMiss,
    Load,
    Open,
    Progress,
    ToLeader,
    check_proof,
    frame,
    hello,
)

if TYPE_CHECKING:
    from neuron_serving.triton.engine_load import EngineLoadTracker, Snapshot
    from neuron_serving.triton.kv_events_relay import KvEventsRelay, KvPeer

log = logging.getLogger(__name__)

# The most often a load report goes out (per server, so per connection too).
LOAD_INTERVAL_S = 0.1
# An unchanged load is resent to a connection that has had none for this long
# (checked every half of it).
LOAD_REFRESH_S = 2.0

_DECODER = msgspec.msgpack.Decoder(ToLeader)
_ENCODER = msgspec.msgpack.Encoder()
_conn_ids = itertools.count(1)


class ChannelCall:
    """One OpenAI call on a connection: what the backend's request task answers into
    (the channel's counterpart of a Triton response sender)."""

    __slots__ = ("conn", "id", "task", "cancelled", "sends", "seen")

    # Every channel call gets progress reports (progress.py): the proxy is the
    # channel's only client, and its silence budget relies on them.
    reports_progress = True

    def __init__(self, conn: _Connection, call_id: int) -> None:
        self.conn = conn
        self.id = call_id
        self.task: asyncio.Task | None = None
        self.cancelled = False
        self.sends = 0  # events sent (progress.ProgressTracker)
        self.seen = 0

    def send(self, event: Event, final: bool) -> asyncio.Future | None:
        """Queue ``event`` (its ``id`` is set here). Not final: returns the future to
        await before pulling more output (see the module's backpressure note)."""
        event.id = self.id
        self.sends += 1
        if final:
            self.conn.calls.pop(self.id, None)
        return self.conn.send(event, waiter=not final)

    def error(self, message: str, code: str) -> None:
        self.send(Event(self.id, error=message, error_code=code), final=True)

    def progress(self) -> None:
        """Tell the proxy this call is alive (``Progress``). Not to a peer that does not
        read (over its high-water mark): it is not timing anything out meanwhile, and
        its backlog must not grow."""
        if not self.conn.paused:
            self.conn.queue(Progress(self.id))

    def cancel(self) -> None:
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()


OpenCall = Callable[[ChannelCall, Open | Generate], None]


class _Connection(asyncio.Protocol):
    def __init__(self, token: bytes, open_call: OpenCall, server: ChannelServer) -> None:
        self.token = token
        self.open_call = open_call
        self.server = server
        self.name = f"channel-{next(_conn_ids)}"
        self.calls: dict[int, ChannelCall] = {}
        self.transport: asyncio.Transport | None = None
        self.nonce = b""
        self.authenticated = False
        self.handshake = bytearray()
        self.reader = FrameReader(MAX_TO_LEADER)
        self.pending: list[Event | Load | KvInfo | KvEvents | KvReplayMiss | Progress] = []
        self.waiters: list[asyncio.Future] = []
        self.paused = False
        self.load_sent: Snapshot | None = None  # the last load queued for this peer
        self.load_sent_at = -math.inf  # loop.time() of it
        self.load_owed = False  # a load change skipped while paused
        self.timer: asyncio.TimerHandle | None = None
        self.kv: KvPeer | None = None  # this connection's share of the KV event stream
        self.loop = asyncio.get_running_loop()

    # ---- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server.connections.add(self)
        greeting, self.nonce = hello()
        transport.write(greeting)
        self.timer = self.loop.call_later(HANDSHAKE_TIMEOUT_S, self._handshake_expired)

    def data_received(self, data: bytes) -> None:
        try:
            if not self.authenticated:
                self.handshake += data
                if len(self.handshake) < PROOF_BYTES:
                    return
                proof = bytes(self.handshake[:PROOF_BYTES])
                rest = bytes(self.handshake[PROOF_BYTES:])
                self.handshake = bytearray()
                assert self.transport is not None  # connection_made precedes data_received
                self.transport.write(check_proof(self.token, self.nonce, proof))
                self.authenticated = True
                self._cancel_timer()
                self.server.welcome(self)
                if not rest:
                    return
                data = rest
            for payload in self.reader.feed(data):
                for message in _DECODER.decode(payload):
                    self._dispatch(message)
        except (ChannelError, msgspec.DecodeError) as e:  # ValidationError included
            self._drop(f"{type(e).__name__}: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.server.connections.discard(self)
        if self.kv is not None:
            self.kv.close()
            self.kv = None
        calls, self.calls = self.calls, {}
        if calls:
            log.info("%s closed with %d calls in flight; aborting them", self.name, len(calls))
        for call in calls.values():
            call.cancel()
        self._resolve()  # the tasks are cancelled; nothing waits on a dead peer

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.load_owed:
            self.load_owed = False
            self.server.greet(self)
        if self.kv is not None:
            self.kv.resume()
        self._resolve()

    # ---- calls ------------------------------------------------------------------------

    def _dispatch(self, message: Open | Generate | Cancel | KvReplay) -> None:
        if isinstance(message, Cancel):
            call = self.calls.pop(message.id, None)
            if call is not None:
                call.cancel()
        elif isinstance(message, KvReplay):
            if self.kv is not None:
                self.kv.request_replay(message.from_seq)
            else:  # no KV events here (no KvInfo was sent): nothing can be replayed
                self.queue(KvReplayMiss(message.from_seq, -1))
        else:
            if message.id in self.calls:
                raise ChannelError(f"call id {message.id} is already open")
            call = ChannelCall(self, message.id)
            self.calls[message.id] = call
            self.open_call(call, message)

    # ---- what the KV event relay sees (kv_events_relay.KvOut) ------------------------

    @property
    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def queue(self, message: Load | KvInfo | KvEvents | KvReplayMiss | Progress) -> None:
        """Append ``message`` to the next frame (flushed behind the tasks ready now)."""
        if self.closing:
            return
        self.pending.append(message)
        if len(self.pending) == 1:
            self.loop.call_soon(self._flush)

    def send_load(self, snapshot: Snapshot, refresh: bool = False) -> None:
        """Queue a load report unless this peer has it already (``refresh``: even
        then); a paused peer is owed the load instead (``resume_writing`` sends the
        then-current one)."""
        if self.transport is None or self.transport.is_closing():
            return
        if snapshot == self.load_sent and not refresh:
            return
        if self.paused:
            self.load_owed = True
            return
        self.load_sent, self.load_sent_at = snapshot, self.loop.time()
        self.queue(Load(*snapshot))

    def send(self, event: Event, waiter: bool) -> asyncio.Future | None:
        if self.transport is None or self.transport.is_closing():
            return None  # the peer is gone; connection_lost cancels the task
        self.pending.append(event)
        if len(self.pending) == 1:
            self.loop.call_soon(self._flush)
        if not waiter:
            return None
        future = self.loop.create_future()
        self.waiters.append(future)
        return future

    def _flush(self) -> None:
        events, self.pending = self.pending, []
        if self.transport is None or self.transport.is_closing():
            self._resolve()
            return
        self.transport.write(frame(_ENCODER.encode(events)))
        if not self.paused:
            self._resolve()

    def _resolve(self) -> None:
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            if not w.done():  # cancelled with its request task
                w.set_result(None)

    # ---- failures ---------------------------------------------------------------------

    def _handshake_expired(self) -> None:
        self.timer = None
        if not self.authenticated:
            self._drop(f"no handshake within {HANDSHAKE_TIMEOUT_S}s")

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _drop(self, reason: str) -> None:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        if not self.authenticated:
            self.server.rejected_total += 1
        log.warning("%s from %s dropped: %s", self.name, peer, reason)
        if self.transport is not None:
            self.transport.abort()


class ChannelServer:
    """Serves the channel on the running loop. ``open_call(call, message)`` runs on
    that loop for each ``Open`` or ``Generate``; it must answer the call
    (``send``/``error``) or start a task that will, and set ``call.task`` for
    cancellation. ``load``: the engine's load tracker (on the same loop), pushed to
    every connection as ``Load``; None = no load reports. ``kv``: the relay of the
    engine's KV cache events, started and closed with the server; None = none."""

    def __init__(
        self,
        token: bytes,
        open_call: OpenCall,
        load: EngineLoadTracker | None = None,
        kv: KvEventsRelay | None = None,
    ) -> None:
        self._token = token
        self._open_call = open_call
        self._server: asyncio.base_events.Server | None = None
        self.connections: set[_Connection] = set()
        self.rejected_total = 0  # connections dropped before they proved the token
        self.port = 0
        self._load = load
        self._load_pushed_at = -math.inf  # loop.time() of the last push
        self._load_push: asyncio.Handle | None = None  # a push is scheduled
        self._load_refresh: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.kv = kv

    # ---- load reports -----------------------------------------------------------------

    def welcome(self, conn: _Connection) -> None:
        """A connection that has just proved the token: its ``KvInfo`` (the KV stream
        starts there), then its first load."""
        if self.kv is not None:
            conn.kv = self.kv.attach(conn)
        self.greet(conn)

    def greet(self, conn: _Connection) -> None:
        """A connection that has just proved the token (or drained its backlog): the
        current load, if it does not have it."""
        snapshot = None if self._load is None else self._load.snapshot()
        if snapshot is not None:
            conn.send_load(snapshot)

    def _load_changed(self) -> None:
        if self._load_push is not None:
            return  # the scheduled push will send the latest
        loop = self._loop
        assert loop is not None  # subscribed by start(), which set the loop
        delay = self._load_pushed_at + LOAD_INTERVAL_S - loop.time()
        if delay <= 0:
            self._load_push = loop.call_soon(self._push_load)
        else:
            self._load_push = loop.call_later(delay, self._push_load)

    def _push_load(self) -> None:
        self._load_push = None
        # Scheduled only by _load_changed, subscribed by start() with a tracker.
        assert self._loop is not None and self._load is not None
        snapshot = self._load.snapshot()
        if snapshot is None:
            return
        self._load_pushed_at = self._loop.time()
        for conn in self.connections:
            if conn.authenticated:
                conn.send_load(snapshot)

    def _refresh_load(self) -> None:
        """Every ``LOAD_REFRESH_S / 2``: the load again to connections without a
        recent one."""
        loop = self._loop
        # Scheduled only by start(), with a tracker, and by itself.
        assert loop is not None and self._load is not None
        self._load_refresh = loop.call_later(LOAD_REFRESH_S / 2, self._refresh_load)
        snapshot = self._load.snapshot()
        if snapshot is None:
            return
        stale = loop.time() - 0.75 * LOAD_REFRESH_S
        for conn in self.connections:
            if conn.authenticated and conn.load_sent_at <= stale:
                conn.send_load(snapshot, refresh=True)

    async def start(self, host: str, port: int) -> int:
        self._loop = loop = asyncio.get_running_loop()
        if self.kv is not None:  # before the first connection can be welcomed
            try:
                self.kv.start()
            except Exception as e:  # noqa: BLE001 - zmq.ZMQError: the channel serves on
                log.error("KV cache events are not relayed: %s", e)
                self.kv = None
        try:
            self._server = await loop.create_server(
                lambda: _Connection(self._token, self._open_call, self), host, port
            )
        except BaseException:  # OSError (the port is taken): no relay left behind
            if self.kv is not None:
                self.kv.close()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        if self._load is not None:
            self._load.subscribe(self._load_changed)
            self._load_refresh = loop.call_later(LOAD_REFRESH_S / 2, self._refresh_load)
        return self.port

    def close(self) -> None:
        if self._load is not None:
            self._load.unsubscribe(self._load_changed)
        for handle in (self._load_push, self._load_refresh):
            if handle is not None:
                handle.cancel()
        self._load_push = self._load_refresh = None
        if self._server is not None:
            self._server.close()
        if self.kv is not None:
            self.kv.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
