"""The control broadcast: leader -> all followers over a torch.distributed Gloo group.

Wire format of one message (one Gloo broadcast in the common case)::

    header (56 B) | payload[: inline - 56]          first broadcast, fixed size `inline`
    payload[inline - 56 :]                           second broadcast, only if needed

    header = magic "NSCB" | version u16 | kind u16 | seq u64 | payload_len u64 | mac[32]

Why fixed-size first frames: every rank must post a Gloo broadcast of the same
size, and a separate size broadcast (what SGLang does) costs a second round of
latency on every step. With ``inline`` = 4 KiB (the default), a decode step of
64 running requests (a vLLM ``SchedulerOutput`` diff, about 1.3 KiB measured on
the demo model) fits in one broadcast; prefill steps that carry new requests'
prompts take a second one.

Invariants:
- Only rank 0 sends; ``seq`` increases by exactly one per message, and a
  follower rejects anything else (no replay, no reordering).
- The MAC (HMAC-SHA256, key from the unit token and the session nonce) covers
  header fields and payload and is checked before a byte is unpickled.
- ``payload_len`` is bounded (``max_payload``, NEURON_SERVING_BROADCAST_MAX_BYTES)
  before anything is allocated from it: the MAC covers the whole payload, so a
  forged header could otherwise make a follower allocate up to 2**64 bytes
  before the check fails. The sender refuses larger payloads, so a legitimate
  unit never trips the bound.
- A Gloo broadcast cannot be cancelled, so liveness is not this module's job:
  the control connection's heartbeats (``control_server``/``follower``) detect
  dead or hung peers, and the group's timeout is only a backstop.
"""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from neuron_serving import envs
from neuron_serving.unit import auth
from neuron_serving.unit.broadcast_stats import BroadcastStats
from neuron_serving.unit.store import tcp_store

MAGIC = b"NSCB"
WIRE_VERSION = 1
HEADER = struct.Struct("!4sHHQQ32s")

KIND_CALL = 1  # payload: a pickled call (method, args, kwargs, gather): calls.py
KIND_KEEPALIVE = 2  # no payload: keeps idle followers inside the group timeout
KIND_SHUTDOWN = 3  # no payload: clean exit

# The group's timeout, the same on every rank. Only a backstop (heartbeats on
# the control connections detect a dead or hung rank within seconds); the
# leader's keepalive keeps an idle unit well inside it.
GROUP_TIMEOUT_S = 300.0
# Idle followers wait in a Gloo broadcast; the leader (executor.py) sends a
# keepalive after this long without a call, so an idle unit never times itself out.
KEEPALIVE_INTERVAL_S = 30.0


class BroadcastError(RuntimeError):
    """A control broadcast was malformed, unauthenticated or out of order."""


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where a rank finds the unit's control group."""

    world_size: int
    store_host: str  # the leader's TCPStore (it listens on this address only)
    store_port: int
    local_host: str  # this rank's address for Gloo's pair sockets


def make_group(
    rank: int, where: GroupAddress, timeout_s: float
) -> tuple[dist.ProcessGroupGloo, dist.TCPStore]:
    """A Gloo group of the whole unit on its own TCPStore (independent of vLLM's groups).

    Returns the store too: the group must not outlive it (the leader's store is
    the server other ranks reconnect to). Rank 0 hosts the store, listening on
    ``store_host`` only (``store.tcp_store``), not on every interface."""
    store = tcp_store(
        where.store_host,
        where.store_port,
        where.world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
    )
    prefixed = dist.PrefixStore("neuron-serving/control", store)
    # torch's stubs lack the pybind class _Options (Options is Backend.Options there).
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timedelta(seconds=timeout_s)
    # Bind Gloo to the address this rank reaches the leader from, so a unit on
    # loopback stays on loopback and a multi-host unit uses the routed interface.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=where.local_host)]
    group = dist.ProcessGroupGloo(prefixed, rank, where.world_size, opts)
    return group, store


def open_control_broadcast(
    rank: int, where: GroupAddress, key: bytes, inline_bytes: int
) -> ControlBroadcast:
    """This rank's end of the unit's control broadcast (rank 0 sends, the others
    receive); ``key`` is ``auth.broadcast_key`` of the session the leader's
    ``Welcome`` announced."""
    return ControlBroadcast(make_group(rank, where, GROUP_TIMEOUT_S), rank, key, inline_bytes)


class ControlBroadcast:
    def __init__(
        self,
        group: tuple[dist.ProcessGroupGloo, dist.TCPStore],
        rank: int,
        key: bytes,
        inline_bytes: int,
        max_payload: int | None = None,
    ):
        if inline_bytes <= HEADER.size:
            raise ValueError(f"inline_bytes must exceed the {HEADER.size}-byte header")
        self.max_payload = (
            envs.NEURON_SERVING_BROADCAST_MAX_BYTES if max_payload is None else max_payload
        )
        if self.max_payload < inline_bytes:
            raise ValueError(
                f"max_payload ({self.max_payload}) must be >= inline_bytes ({inline_bytes})"
            )
        self.group, self._store = group
        self.rank = rank
        self.key = key
        self.inline = inline_bytes
        self._seq = 0
        self._buf = torch.empty(inline_bytes, dtype=torch.uint8)
        self._send_lock = threading.Lock()
        self.stats = BroadcastStats()
        self.last_send_monotonic = time.monotonic()

    def _bcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        # torch's stubs omit Backend.broadcast, which the pybind class has.
        self.group.broadcast([tensor], opts).wait()  # type: ignore[attr-defined]

    def send(self, kind: int, payload: bytes = b"") -> int:
        """Rank 0 only. Returns the message's seq."""
        assert self.rank == 0, "only the leader broadcasts"
        if len(payload) > self.max_payload:
            # Refused before anything is sent: the followers stay in lockstep
            # and the caller's error names the limit instead of a rank failing.
            raise BroadcastError(
                f"control broadcast of {len(payload)} bytes exceeds the limit of "
                f"{self.max_payload} (NEURON_SERVING_BROADCAST_MAX_BYTES)"
            )
        with self._send_lock:
            t0 = time.perf_counter()
            self._seq += 1
            seq = self._seq
            tag = auth.mac(self.key, struct.pack("!HQQ", kind, seq, len(payload)), payload)
            header = HEADER.pack(MAGIC, WIRE_VERSION, kind, seq, len(payload), tag)
            first = self.inline - HEADER.size
            view = self._buf.numpy()
            view[: HEADER.size] = memoryview(header)
            head = payload[:first]
            view[HEADER.size : HEADER.size + len(head)] = memoryview(head)
            self._bcast(self._buf)
            wire = self.inline
            if len(payload) > first:
                rest = torch.frombuffer(bytearray(payload[first:]), dtype=torch.uint8)
                self._bcast(rest)
                wire += rest.numel()
            self.last_send_monotonic = time.monotonic()
            self.stats.record(len(payload), wire, time.perf_counter() - t0)
            return seq

    def recv(self) -> tuple[int, int, bytes]:
        """Followers: block for the next message; returns (kind, seq, payload)."""
        assert self.rank != 0
        self._bcast(self._buf)
        raw = self._buf.numpy().tobytes()
        magic, version, kind, seq, length, tag = HEADER.unpack_from(raw)
        if magic != MAGIC or version != WIRE_VERSION:
            raise BroadcastError(
                f"bad control broadcast header (magic={magic!r}, version={version})"
            )
        if length > self.max_payload:
            # Before allocating from an unauthenticated length.
            raise BroadcastError(
                f"control broadcast seq {seq} announces {length} bytes, over the limit of "
                f"{self.max_payload} (NEURON_SERVING_BROADCAST_MAX_BYTES)"
            )
        first = self.inline - HEADER.size
        payload = raw[HEADER.size : HEADER.size + min(length, first)]
        if length > first:
            rest = torch.empty(length - first, dtype=torch.uint8)
            self._bcast(rest)
            payload += rest.numpy().tobytes()
        if not auth.verify(self.key, tag, struct.pack("!HQQ", kind, seq, length), payload):
            raise BroadcastError(f"control broadcast seq {seq} failed authentication")
        if seq != self._seq + 1:
            raise BroadcastError(
                f"control broadcast out of order: got seq {seq}, want {self._seq + 1}"
            )
        self._seq = seq
        self.stats.record(length, self.inline + max(0, length - first), 0.0)
        return kind, seq, payload
