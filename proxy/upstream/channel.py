"""The OpenAI route's upstream over the leaders' OpenAI channel
(``neuron_serving/openai_channel.py``), under the contract of ``base.py``.

One authenticated TCP connection per leader carries every OpenAI call the proxy
sends that unit: a call is one small ``Open`` frame on a connection already open,
and the leader answers every stream's events of one engine step in one frame. So
the proxy pays one read and one decode per engine step instead of one per token
per stream, and no per-request HTTP or gRPC set-up (bench/README.md, "cpu"). What the dispatcher sees does not change: ``openai`` is an async
iterator of ``GenerationDelta`` ending with the final one, raising only
``UpstreamError``, bounded by one ``ReadWatchdog`` per call (first response,
between responses, the deadline; the leader's ``Progress`` reports extend it, so only
a silent leader fails a call). Events of one call that arrived together are
merged into one delta (bodies and token ids concatenated), so a proxy that falls
behind writes each client once per wake-up, not once per event.

Failures: a lost connection fails every call on it as a unit fault (the
dispatcher retries or migrates each, as for a broken Triton stream); a call the
caller abandons is cancelled on the leader with ``Cancel`` (vLLM aborts it). A
leader whose channel is not connected (yet), cannot be reached or does not prove
the token is served through Triton's transport instead (``fallback``): the channel
is an optimisation, never a new way to fail, and no request waits for it to
connect (``ChannelUpstream``).

Where a unit's channel is: its leader's host and the port its model config
announces (``CONFIG_PARAMETER``), which the health checker reads with the
checkpoint version and hands to ``announce``.

Load reports: the leader pushes its engine's load (``Load``: vLLM's running and
waiting requests, KV cache usage, ``max_num_seqs``) right after the handshake and
whenever it changes (at most every ~100 ms), and unchanged every ~2 s (so its
``at``, the receipt time, stays within a few seconds while the leader's engine loop
runs). Each one is set as ``engine_load`` on the registry's ``UnitState`` of every
unit announced at that channel; when the channel fails or closes, or a unit's
channel is not connected, its ``engine_load`` is None.

KV cache events: a leader that relays its vLLM's KV events sends ``KvInfo`` right
after the handshake, then ``KvEvents(seq, payload)`` (vLLM's msgpack ``KVEventBatch``
bytes, unchanged) and, after a replay it could not fully serve, ``KvReplayMiss``.
Each goes to the ``KvEventSink`` (``kv_stream.py``) for every unit announced at
that channel, as for loads: ``on_kv_info(unit_id, info)`` when the unit's stream
starts (the channel connected, or the unit was announced at a connected one),
``on_kv_events(unit_id, seq, payload)``, and ``on_kv_reset(unit_id, next_seq)`` when
what the proxy knows of the unit's cache can no longer be trusted (a ``KvReplayMiss``:
``next_seq`` its ``oldest_seq``, or None when unknown; the channel failed or closed,
the unit was forgotten or withdrew its channel: None).
``kv_replay(unit_id, from_seq)`` asks the unit's leader to resend from ``from_seq``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeGuard

import msgspec

from neuron_serving.openai_channel import (
    HELLO_BYTES,
    MAC_BYTES,
    MAX_TO_PROXY,
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
    ToProxy,
    check_leader,
    frame,
    prove,
)
from proxy.config import TimeoutConfig, UnitSpec
from proxy.registry import EngineLoad, Registry
from proxy.upstream.base import (
    AttemptTiming,
    DeadlineExceeded,
    GenerationDelta,
    ReadWatchdog,
    Upstream,
    UpstreamError,
)
from proxy.upstream.kv_stream import InOrderKvSink, KvEventSink

log = logging.getLogger(__name__)

# After a failed connect or handshake: Triton's transport meanwhile, retried after
# RETRY_MIN_S, doubling up to RETRY_MAX_S.
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
_DECODER = msgspec.msgpack.Decoder(ToProxy)
_ENCODER = msgspec.msgpack.Encoder()
# KV messages that arrive with the handshake, before the channel is in use (its
# KvInfo, the first batches), wait for it; more than this is dropped (a gap the
# proxy can replay).
KV_EARLY_MAX = 1024

Address = tuple[str, int]


class _Call:
    __slots__ = ("events", "waiter", "error", "watchdog")

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.waiter: asyncio.Future | None = None
        self.error: UpstreamError | None = None
        self.watchdog: ReadWatchdog | None = None  # extended by the leader's ``Progress``

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


KvMessage = KvInfo | KvEvents | KvReplayMiss


class LeaderChannel(asyncio.Protocol):
    """One connection to one leader's channel: the handshake, then frames.
    ``on_load(channel)`` runs when ``load`` changes: a ``Load`` arrived, or the
    channel failed (then None). ``on_kv(channel, message)`` runs for each KV message
    once the channel is adopted (``adopt_kv``; the ones before wait), and with None
    when a channel that had sent ``KvInfo`` fails."""

    def __init__(
        self,
        token: bytes,
        name: str,
        addr: Address | None = None,
        on_load: Callable[[LeaderChannel], None] | None = None,
        on_kv: Callable[[LeaderChannel, KvMessage | None], None] | None = None,
    ) -> None:
        self.token = token
        self.name = name
        self.addr = addr
        self.on_load = on_load
        self.on_kv = on_kv
        self.kv_info: KvInfo | None = None  # the leader relays KV events
        self._kv_early: list[KvMessage] | None = []  # None once adopted
        self.kv_early_dropped = 0
        self.load: EngineLoad | None = None
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = self.loop.create_future()
        self.closed = False
        self.calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._handshake = bytearray()
        self._leader_nonce = self._proxy_nonce = b""
        self._reader = FrameReader(MAX_TO_PROXY)
        self._outbox: list[Open | Generate | Cancel | KvReplay] = []

    # ---- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            if not self.ready.done():
                data = self._shake(data)
                if not data:
                    return
            for payload in self._reader.feed(data):
                for message in _DECODER.decode(payload):
                    if type(message) is Event:
                        self._deliver(message)
                    elif type(message) is Progress:
                        call = self.calls.get(message.id)
                        if call is not None and call.watchdog is not None:
                            call.watchdog.heard()
                    elif type(message) is Load:
                        self._loaded(message)
                    else:
                        self._kv(message)
        except (ChannelError, msgspec.DecodeError) as e:
            self._fail(f"{type(e).__name__}: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(f"connection lost ({exc or 'closed by the leader'})")

    # ---- handshake ----------------------------------------------------------------------

    def _shake(self, data: bytes) -> bytes:
        """Feed handshake bytes; returns what follows the handshake."""
        self._handshake += data
        if not self._leader_nonce:
            if len(self._handshake) < HELLO_BYTES:
                return b""
            proof, self._leader_nonce, self._proxy_nonce = prove(
                self.token, bytes(self._handshake[:HELLO_BYTES])
            )
            del self._handshake[:HELLO_BYTES]
            assert self.transport is not None  # connection_made precedes data_received
            self.transport.write(proof)
        if len(self._handshake) < MAC_BYTES:
            return b""
        tag = bytes(self._handshake[:MAC_BYTES])
        rest = bytes(self._handshake[MAC_BYTES:])
        self._handshake = bytearray()
        check_leader(self.token, self._leader_nonce, self._proxy_nonce, tag)
        self.ready.set_result(None)
        return rest

    # ---- calls --------------------------------------------------------------------------

    def open(self, request: Callable[[int], Open | Generate]) -> tuple[int, _Call]:
        """Start a call: ``request(id)`` is its first message."""
        call_id = next(self._ids)
        call = _Call()
        self.calls[call_id] = call
        self._send(request(call_id))
        return call_id, call

    def cancel(self, call_id: int) -> None:
        if self.calls.pop(call_id, None) is not None and not self.closed:
            self._send(Cancel(call_id))

    def replay(self, from_seq: int) -> None:
        """Ask the leader for its KV event batches from ``from_seq`` on."""
        if not self.closed:
            self._send(KvReplay(from_seq))

    def _send(self, message: Open | Generate | Cancel | KvReplay) -> None:
        # One write per loop iteration for every call opened or cancelled in it.
        self._outbox.append(message)
        if len(self._outbox) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        messages, self._outbox = self._outbox, []
        if not self.closed and self.transport is not None:
            self.transport.write(frame(_ENCODER.encode(messages)))

    def _deliver(self, event: Event) -> None:
        call = self.calls.get(event.id)
        if call is None:
            return  # cancelled by us; the leader's last words for it
        call.events.append(event)
        if event.final:
            del self.calls[event.id]
        call.wake()

    def _loaded(self, m: Load) -> None:
        self.load = EngineLoad(m.running, m.waiting, m.kv_usage, m.max_num_seqs,
                               time.monotonic(), m.num_blocks, m.degraded_ranks)  # fmt: skip
        if self.on_load is not None:
            self.on_load(self)

    def _kv(self, m: KvMessage) -> None:
        if m.__class__ is KvInfo:
            self.kv_info = m
        early = self._kv_early
        if early is not None:
            if len(early) < KV_EARLY_MAX:
                early.append(m)
            else:
                self.kv_early_dropped += 1
        elif self.on_kv is not None:
            self.on_kv(self, m)

    def adopt_kv(self) -> None:
        """The channel is in use: deliver the KV messages that came before."""
        early, self._kv_early = self._kv_early, None
        if self.on_kv is not None:
            for m in early or ():
                self.on_kv(self, m)

    def _fail(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        if self.load is not None:
            self.load = None
            if self.on_load is not None:
                self.on_load(self)
        if self.kv_info is not None and self._kv_early is None and self.on_kv is not None:
            self.on_kv(self, None)  # its stream ends here
        if not self.ready.done():
            self.ready.set_exception(ChannelError(reason))
            self.ready.exception()  # retrieved: connect() may have stopped waiting
        calls, self.calls = self.calls, {}
        if calls:
            log.warning("OpenAI channel %s failed with %d calls: %s", self.name, len(calls), reason)
        for call in calls.values():
            call.error = UpstreamError(
                f"upstream channel {self.name}: {reason}", unit_fault=True, retriable=True
            )
            call.wake()
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self._fail("closed by the proxy")


def _delta(events: list[Event], text: bool) -> GenerationDelta:
    """One or more events of one call (in order, none an error) -> one delta. ``text``:
    a text request's (the bodies are its text), else an OpenAI call's."""
    if len(events) == 1:
        e = events[0]
        if text:
            return GenerationDelta(
                e.body.decode("utf-8", errors="replace"), e.finish_reason, e.prompt_tokens,
                e.completion_tokens, e.model_version, token_ids=e.token_ids,
                cached_tokens=e.cached_tokens,
            )  # fmt: skip
        return GenerationDelta(
            "", e.finish_reason, e.prompt_tokens, e.completion_tokens, e.model_version,
            e.status, e.body, e.token_ids, e.prompt_token_ids, e.cached_tokens,
        )  # fmt: skip
    token_ids: list[int] | None = None
    status = prompt_ids = version = prompt_tokens = completion_tokens = cached = None
    for e in events:
        if e.token_ids is not None:
            token_ids = e.token_ids if token_ids is None else token_ids + e.token_ids
        status = e.status if status is None else status
        prompt_ids = e.prompt_token_ids if prompt_ids is None else prompt_ids
        version = e.model_version if version is None else version
        if e.prompt_tokens is not None:
            prompt_tokens, completion_tokens = e.prompt_tokens, e.completion_tokens
        cached = e.cached_tokens if cached is None else cached
    body = b"".join(e.body for e in events)
    if text:
        return GenerationDelta(
            body.decode("utf-8", errors="replace"), events[-1].finish_reason, prompt_tokens,
            completion_tokens, version, token_ids=token_ids, cached_tokens=cached,
        )  # fmt: skip
    return GenerationDelta(
        "", events[-1].finish_reason, prompt_tokens, completion_tokens, version, status,
        body, token_ids, prompt_ids, cached,
    )  # fmt: skip


def classify_event_error(event: Event) -> UpstreamError:
    """A call's error event: the Triton error the other transports would carry."""
    message = f"upstream {event.error_code}: {event.error}"
    if event.error_code == "INVALID_ARG":  # the proxy's envelope was refused
        return UpstreamError(message, unit_fault=False, retriable=False, status=400)
    status = 503 if event.error_code == "UNAVAILABLE" else 502
    return UpstreamError(message, unit_fault=True, retriable=True, status=status)


class ChannelUpstream:
    """``openai``/``generate`` over the channel for units whose leader's channel is
    connected; everything else goes to ``fallback``, Triton's gRPC transport.

    A request never waits for a connection: ``address`` answers from what is
    connected now and, for a unit whose channel is announced but not connected, starts
    a connection in the background (also started as soon as a probe announces the
    port), so the first requests after a leader (re)starts go over Triton and the rest
    over the channel. A failed connect or handshake is retried with backoff
    (``RETRY_MIN_S`` doubling to ``RETRY_MAX_S``); meanwhile Triton serves the unit.

    ``registry``: where the leaders' load reports go (``UnitState.engine_load`` of
    the units announced at each channel); None = they are dropped. ``kv_sink``: where
    the leaders' KV cache events go (per unit announced at each channel), each batch
    once and in order (``kv_order``: ``kv_stream.InOrderKvSink`` around it, asking this
    channel for the replays; ``kv_history``: from the oldest batch each leader still
    has); None = they are dropped."""

    def __init__(
        self,
        token: bytes,
        timeouts: TimeoutConfig,
        fallback: Upstream,
        on_fallback: Callable[[], None] | None = None,
        connect_timeout_s: float = 5.0,
        registry: Registry | None = None,
        kv_sink: KvEventSink | None = None,
        kv_history: bool = True,
    ) -> None:
        self._token = token
        self._registry = registry
        self.kv_order: InOrderKvSink | None = None
        if kv_sink is not None:
            self.kv_order = InOrderKvSink(kv_sink, self.kv_replay, history=kv_history)
        self.kv_sink: KvEventSink | None = self.kv_order
        self._units_at: dict[Address, set[str]] = {}  # channel -> unit ids announced there
        self._timeouts = timeouts
        self._fallback = fallback
        self._on_fallback = on_fallback
        self._connect_timeout_s = connect_timeout_s
        self._ports: dict[str, Address] = {}  # unit id -> its leader's channel
        self._channels: dict[Address, LeaderChannel] = {}
        self._connecting: dict[Address, asyncio.Task[None]] = {}
        self._retry: dict[Address, tuple[float, float]] = {}  # addr -> (not before, backoff)
        self.fallbacks_total = 0

    def announce(self, unit: UnitSpec, port: int | None) -> None:
        """The health checker read the unit's model config: its channel's port, or
        None (a leader without one). Connects at once, so requests find it ready."""
        if port is None:
            self.forget(unit.unit_id)
            self._set_load(unit.unit_id, None)
            return
        host = unit.leader_grpc.rsplit(":", 1)[0].strip("[]")  # HOST:PORT or [V6]:PORT
        addr = (host, port)
        channel = self._channels.get(addr)
        if self._ports.get(unit.unit_id) != addr:
            self.forget(unit.unit_id)
            self._ports[unit.unit_id] = addr
            self._units_at.setdefault(addr, set()).add(unit.unit_id)
            if self._kv_live(channel):  # joins a stream under way
                self._to_sink("on_kv_info", unit.unit_id, channel.kv_info)
        self._set_load(unit.unit_id, None if channel is None else channel.load)
        self._ensure(addr)

    def forget(self, unit_id: str) -> None:
        addr = self._ports.pop(unit_id, None)
        if addr is None:
            return
        units = self._units_at.get(addr)
        if units is not None:
            units.discard(unit_id)
            if not units:
                del self._units_at[addr]
        if self._kv_live(self._channels.get(addr)):
            self._to_sink("on_kv_reset", unit_id, None)  # its stream ends for this unit
        if self.kv_order is not None:
            self.kv_order.forget(unit_id)  # announced again, it starts from its KvInfo

    # ---- KV cache events --------------------------------------------------------------

    def _kv_live(self, channel: LeaderChannel | None) -> TypeGuard[LeaderChannel]:
        """``channel`` is delivering a KV stream to the sink."""
        return (
            self.kv_sink is not None
            and channel is not None
            and not channel.closed
            and channel.kv_info is not None
        )

    def _channel_kv(self, channel: LeaderChannel, m: KvMessage | None) -> None:
        """A KV message of an adopted channel (None: its stream ended), for every unit
        announced there, if it is the channel in use at its address."""
        addr = channel.addr
        if self.kv_sink is None or addr is None or self._channels.get(addr) is not channel:
            return
        units = tuple(self._units_at.get(addr, ()))
        if m.__class__ is KvEvents:
            for unit_id in units:
                self._to_sink("on_kv_events", unit_id, m.seq, m.payload)
        elif m.__class__ is KvInfo:
            for unit_id in units:
                self._to_sink("on_kv_info", unit_id, m)
        else:  # KvReplayMiss, or the channel's end (None)
            next_seq = m.oldest_seq if m.__class__ is KvReplayMiss and m.oldest_seq >= 0 else None
            for unit_id in units:
                self._to_sink("on_kv_reset", unit_id, next_seq)

    def _to_sink(self, method: str, *args: Any) -> None:
        """A sink that raises loses that message, never the channel (an exception in
        ``data_received`` would close it, failing every call on it)."""
        try:
            getattr(self.kv_sink, method)(*args)
        except Exception:  # noqa: BLE001
            log.exception("the KV event sink's %s failed", method)

    def kv_replay(self, unit_id: str, from_seq: int) -> bool:
        """Ask ``unit_id``'s leader to resend its KV event batches from ``from_seq`` on
        (``KvReplay``); False when the unit's channel is not connected (its stream
        restarts with a ``KvInfo`` when it is). ValueError for a seq the wire cannot
        carry (the leader would drop the connection)."""
        if not 0 <= from_seq < 1 << 63:
            raise ValueError(f"from_seq must be in [0, 2**63), got {from_seq}")
        addr = self._ports.get(unit_id)
        channel = None if addr is None else self._channels.get(addr)
        if channel is None or channel.closed:
            return False
        channel.replay(from_seq)
        return True

    # ---- load reports -----------------------------------------------------------------

    def _set_load(self, unit_id: str, load: EngineLoad | None) -> None:
        unit = None if self._registry is None else self._registry.get(unit_id)
        if unit is not None:
            unit.set_engine_load(load)

    def _channel_load(self, channel: LeaderChannel) -> None:
        """A channel's load changed: its units' too, if it is the channel in use at
        its address (not one still connecting, nor one a reconnection replaced)."""
        addr = channel.addr
        if addr is None or self._channels.get(addr) is not channel:
            return
        for unit_id in self._units_at.get(addr, ()):
            self._set_load(unit_id, channel.load)

    def address(self, unit: UnitSpec) -> Address | None:
        """The unit's channel if it is connected now (else None: use Triton)."""
        addr = self._ports.get(unit.unit_id)
        if addr is None:
            return None
        channel = self._channels.get(addr)
        if channel is not None and not channel.closed:
            return addr
        self._ensure(addr)
        return None

    def _ensure(self, addr: Address) -> None:
        """Start connecting to ``addr`` unless connected, connecting or backing off."""
        channel = self._channels.get(addr)
        if (channel is not None and not channel.closed) or addr in self._connecting:
            return
        if self._retry.get(addr, (0.0, 0.0))[0] > time.monotonic():
            return
        task = asyncio.get_running_loop().create_task(self._connect(addr))
        self._connecting[addr] = task
        task.add_done_callback(lambda _: self._connecting.pop(addr, None))

    def openai(
        self,
        addr: Address,
        unit: UnitSpec,
        envelope: bytes,
        deadline: float,
        timing: AttemptTiming | None = None,
    ) -> AsyncGenerator[GenerationDelta, None]:
        """``Upstream.openai`` over the channel at ``addr`` (``address(unit)``)."""
        return self._stream(
            addr, unit, lambda i: Open(i, envelope), False, deadline, timing,
            lambda t: t.openai(unit, envelope, deadline, timing),
        )  # fmt: skip

    def generate(
        self,
        addr: Address,
        unit: UnitSpec,
        prompt: str,
        sampling: dict[str, Any],
        deadline: float,
        timing: AttemptTiming | None = None,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[GenerationDelta, None]:
        """``Upstream.generate`` (a text request) over the channel at ``addr``;
        ``priority`` is ``Generate.priority``."""
        params = json.dumps(sampling)
        return self._stream(
            addr, unit, lambda i: Generate(i, prompt, params, priority), True, deadline, timing,
            lambda t: t.generate(unit, prompt, sampling, deadline, timing, priority=priority),
        )  # fmt: skip

    async def _connect(self, addr: Address) -> None:
        loop = asyncio.get_running_loop()
        name = f"{addr[0]}:{addr[1]}"
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, channel = await loop.create_connection(
                    lambda: LeaderChannel(
                        self._token, name, addr, self._channel_load, self._channel_kv
                    ),
                    addr[0],
                    addr[1],
                )
                try:
                    await channel.ready
                except BaseException:
                    channel.close()
                    raise
        except (OSError, ChannelError, TimeoutError) as e:
            backoff = min(max(2 * self._retry.get(addr, (0.0, 0.0))[1], RETRY_MIN_S), RETRY_MAX_S)
            self._retry[addr] = (time.monotonic() + backoff, backoff)
            log.warning(
                "OpenAI channel %s unusable (%s: %s); Triton carries its calls, retry in %.0f s",
                name, type(e).__name__, e, backoff,
            )  # fmt: skip
            return
        self._retry.pop(addr, None)
        old = self._channels.get(addr)
        self._channels[addr] = channel
        if old is not None:
            old.close()
        self._channel_load(channel)  # a load that came with the handshake
        channel.adopt_kv()  # and its KvInfo, with what followed
        log.info("OpenAI channel %s connected", name)

    async def _stream(
        self,
        addr: Address,
        unit: UnitSpec,
        request: Callable[[int], Open | Generate],
        text: bool,
        deadline: float,
        timing: AttemptTiming | None,
        over_triton: Callable[[Any], AsyncIterator[GenerationDelta]],
    ) -> AsyncGenerator[GenerationDelta, None]:
        loop = asyncio.get_running_loop()
        if deadline - loop.time() <= 0:
            raise DeadlineExceeded()
        channel = self._channels.get(addr)
        if channel is None or channel.closed:
            # Lost since ``address`` saw it; nothing was sent: ask over Triton.
            self.fallbacks_total += 1
            if self._on_fallback is not None:
                self._on_fallback()
            async for delta in over_triton(self._fallback):
                yield delta
            return
        call_id, call = channel.open(request)
        if timing is not None:
            timing.mark_sent(loop)
        call.watchdog = watchdog = ReadWatchdog(loop, deadline, asyncio.current_task())
        budget = self._timeouts.silence_s
        finished = False
        try:
            while True:
                events = call.events
                if not events:
                    if call.error is not None:
                        raise call.error
                    call.waiter = loop.create_future()
                    try:
                        await watchdog.bounded(call.waiter, budget)
                    finally:
                        call.waiter = None
                    continue
                if events[-1].error is not None:
                    if len(events) == 1:
                        finished = True  # the leader ended the call itself
                        raise classify_event_error(events[0])
                    call.events, events = events[-1:], events[:-1]
                else:
                    call.events = []
                if timing is not None and not timing.first:
                    timing.first = loop.time()
                delta = _delta(events, text)
                finished = delta.final
                yield delta
                if finished:
                    return
        finally:
            watchdog.close()
            if not finished:
                channel.cancel(call_id)

    async def close(self) -> None:
        for task in list(self._connecting.values()):
            task.cancel()
        for channel in list(self._channels.values()):
            channel.close()
        self._channels.clear()
