"""Frames of control messages over a TCP socket: bounded, timed, sealed after the handshake.

Blocking sockets on dedicated threads rather than asyncio: the leader's
executor lives inside vLLM's EngineCore, which has no event loop of ours, and
the follower's main thread blocks in Gloo collectives.

Wire format (big-endian)::

    plain   len u32 | 0 u8 | body                        Challenge, Hello, Reject
    sealed  len u32 | 1 u8 | seq u64 | mac[32] | body    everything after Hello

``body`` is one msgpack-encoded message of ``len`` bytes; ``mac`` is HMAC-SHA256
over ``seq`` and ``body`` with the link key of the sender's direction
(``auth.link_key``).

Invariants:
- ``len`` is checked against the receiver's limit before a byte of the body is
  read, and the body buffer grows only with bytes that arrived: a claimed
  length allocates nothing.
- Once its first byte has arrived a frame must be complete within
  ``frame_timeout``: a peer trickling bytes cannot hold a thread.
- Once sealed (``seal``) a side sends only sealed frames and accepts only
  sealed frames whose MAC verifies and whose ``seq`` is exactly one more than
  the last one's, checked before the body is decoded (and so before any
  ``Reply.payload`` can be unpickled): a forged, altered, replayed, reordered,
  dropped or reflected frame fails the link. The one plain frame a sealed side
  accepts is a ``Reject`` in answer to ``Hello`` (``plain_reject_ok``): a leader
  cannot seal for a follower whose token is wrong.
- A send that fails or times out may have put part of a frame on the wire, and
  its sequence number is spent: the stream cannot continue, so the channel
  shuts the socket down and closes it (``LinkBroken``). Every later send and
  recv on either side then sees a lost connection (EOF or reset), never a
  frame that is out of sequence or fails its MAC, which would read as tampering.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgspec

from neuron_serving.logsafe import printable
from neuron_serving.unit import auth, messages
from neuron_serving.unit.messages import ControlMessage, Reject

_HEAD = struct.Struct("!IB")
_SEAL = struct.Struct("!Q32s")
_SEQ = struct.Struct("!Q")
PLAIN, SEALED = 0, 1
# Replies of gathered calls (vLLM's KV cache specs, load stats) are the largest
# frames, from an authenticated follower only.
MAX_FRAME_BYTES = 64 << 20
# Leader -> follower frames after Welcome (Start, heartbeats, failures) are small.
MAX_LEADER_FRAME_BYTES = 1 << 20
# Before the peer's first sealed frame has verified: Hello, Welcome or Reject.
MAX_UNAUTHENTICATED_FRAME_BYTES = 8192
# Once a frame's first byte arrived, the rest is expected promptly.
FRAME_TIMEOUT_S = 30.0

_reject_decoder = msgspec.msgpack.Decoder(Reject)


class ChannelClosed(ConnectionError):
    """The peer closed the connection (or it broke, or broke the protocol)."""


class LinkBroken(ChannelClosed):
    """This side closed the link because a send failed or timed out (the peer
    stopped reading: stopped, hung or cut off): a lost connection, not tampering."""


class FrameRejected(ChannelClosed):
    """A frame failed authentication or sequencing, or was malformed: the link is
    no longer trustworthy and is closed; nothing of the frame was decoded."""


class Channel:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self._send_lock = threading.Lock()
        self.max_frame = MAX_UNAUTHENTICATED_FRAME_BYTES
        self._send_key: bytes | None = None
        self._recv_key: bytes | None = None
        self._send_seq = 0
        self._recv_seq = 0
        # Why the link broke on a send (the error the next send raises again);
        # None while it is usable.
        self._broken: ChannelClosed | None = None

    @property
    def sealed(self) -> bool:
        return self._send_key is not None

    def seal(self, send_key: bytes, recv_key: bytes) -> None:
        """From now on every frame either way carries a MAC and a sequence number."""
        with self._send_lock:
            self._send_key, self._recv_key = send_key, recv_key

    def send(self, msg: ControlMessage, timeout: float = 10.0) -> None:
        body = messages.encode(msg)
        with self._send_lock:  # seq order must be wire order
            if self._broken is not None:
                raise type(self._broken)(*self._broken.args)
            if self.sock.fileno() == -1:  # closed here on purpose (shutdown, a rejected frame)
                raise ChannelClosed(f"connection to {self.peer} is closed")
            if self._send_key is None:
                frame = _HEAD.pack(len(body), PLAIN) + body
            else:
                self._send_seq += 1
                tag = auth.mac(self._send_key, _SEQ.pack(self._send_seq), body)
                frame = _HEAD.pack(len(body), SEALED) + _SEAL.pack(self._send_seq, tag) + body
            try:
                self.sock.settimeout(timeout)
                self.sock.sendall(frame)
            except OSError as e:  # also EBADF: closed by another thread
                # Part of the frame may be on the wire: end the stream here, so
                # the peer reads EOF instead of a half frame and then the next one.
                if isinstance(e, (BrokenPipeError, ConnectionResetError)):
                    # The peer closed its end (it exited or was killed): the same
                    # event a reader sees as EOF, whichever thread meets it first.
                    self._broken = ChannelClosed(f"{self.peer} closed the connection ({e})")
                else:
                    self._broken = LinkBroken(
                        f"link to {self.peer} closed after a failed send "
                        f"({str(e) or type(e).__name__}; timeout {timeout:g} s)"
                    )
                self.close()
                raise type(self._broken)(*self._broken.args) from e

    def recv(
        self,
        timeout: float | None,
        frame_timeout: float = FRAME_TIMEOUT_S,
        plain_reject_ok: bool = False,
    ) -> ControlMessage:
        """Next message; ``TimeoutError`` if none starts within ``timeout`` seconds."""
        try:
            self.sock.settimeout(timeout)
        except OSError as e:
            raise self._lost(f"connection to {self.peer} is closed: {e}") from e
        head = self._recv_first(_HEAD.size)
        deadline = time.monotonic() + frame_timeout
        head += self._recv_exact(_HEAD.size - len(head), deadline)
        length, kind = _HEAD.unpack(head)
        if length > self.max_frame:
            raise FrameRejected(f"{self.peer} sent a {length}-byte frame (limit {self.max_frame})")
        if kind == SEALED and self._recv_key is not None:
            rest = self._recv_exact(_SEAL.size + length, deadline)
            seq, tag = _SEAL.unpack_from(rest)
            body = memoryview(rest)[_SEAL.size :]  # no copy of a large Reply
            if not auth.verify(self._recv_key, tag, _SEQ.pack(seq), body):
                raise FrameRejected(f"frame {seq} from {self.peer} failed authentication")
            if seq != self._recv_seq + 1:
                raise FrameRejected(
                    f"frame from {self.peer} out of sequence: got {seq}, want {self._recv_seq + 1} "
                    "(replayed, reordered or dropped)"
                )
            self._recv_seq = seq
            return self._decode(body, messages.decode)
        if kind == PLAIN and self._recv_key is None:
            return self._decode(self._recv_exact(length, deadline), messages.decode)
        if kind == PLAIN and plain_reject_ok:
            return self._decode(self._recv_exact(length, deadline), _reject_decoder.decode)
        raise FrameRejected(
            f"{self.peer} sent a frame of kind {kind} on a "
            f"{'sealed' if self._recv_key else 'new'} link"
        )

    def _decode(self, body: bytes | bytearray | memoryview, decode) -> ControlMessage:
        try:
            return decode(body)
        except msgspec.DecodeError as e:
            # msgspec quotes some bad values (an unknown tag) verbatim: escape and cut.
            raise FrameRejected(
                f"{self.peer} sent a malformed message: {printable(str(e), 200)}"
            ) from None

    def _recv_first(self, n: int) -> bytes:
        """1..``n`` bytes: the start of the next frame. ``TimeoutError`` if none
        arrive within the socket's timeout (an idle link, not an error)."""
        try:
            chunk = self.sock.recv(n)
        except TimeoutError:
            raise
        except OSError as e:
            raise self._lost(f"connection to {self.peer} broke: {e}") from e
        if not chunk:
            raise self._lost(f"{self.peer} closed the connection")
        return chunk

    def _recv_exact(self, n: int, deadline: float) -> bytearray:
        """``n`` bytes, all of them by ``deadline`` (monotonic)."""
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelClosed(f"{self.peer} stalled mid-frame")
            try:
                self.sock.settimeout(left)
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except TimeoutError:
                continue  # the loop checks the deadline
            except OSError as e:
                raise self._lost(f"connection to {self.peer} broke: {e}") from e
            if not chunk:
                raise self._lost(f"{self.peer} closed the connection")
            buf += chunk
        return buf

    def _lost(self, what: str) -> ChannelClosed:
        # EOF or EBADF after this side broke the link is its own doing: say why.
        if self._broken is not None:
            return type(self._broken)(*self._broken.args)
        return ChannelClosed(what)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
