"""Length-prefixed frames of control messages over a TCP socket, with timeouts.

Blocking sockets on dedicated threads rather than asyncio: the leader's
executor lives inside vLLM's EngineCore, which has no event loop of ours, and
the follower's main thread blocks in Gloo collectives.
"""

from __future__ import annotations

import socket
import struct
import threading

from neuron_serving.unit import messages
from neuron_serving.unit.messages import ControlMessage

_LEN = struct.Struct("!I")
# Control messages are small; a large frame is a protocol error or an attack.
MAX_FRAME_BYTES = 64 << 20
# Before authentication a peer may send only a tiny Hello.
MAX_UNAUTHENTICATED_FRAME_BYTES = 4096


class ChannelClosed(ConnectionError):
    """The peer closed the connection (or it broke)."""


class Channel:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self._send_lock = threading.Lock()
        self.max_frame = MAX_UNAUTHENTICATED_FRAME_BYTES

    def send(self, msg: ControlMessage, timeout: float = 10.0) -> None:
        data = messages.encode(msg)
        with self._send_lock:
            self.sock.settimeout(timeout)
            try:
                self.sock.sendall(_LEN.pack(len(data)) + data)
            except OSError as e:
                raise ChannelClosed(f"send to {self.peer} failed: {e}") from e

    def recv(self, timeout: float | None) -> ControlMessage:
        """Next message; ``TimeoutError`` if none within ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        (length,) = _LEN.unpack(self._recv_exact(_LEN.size))
        if length > self.max_frame:
            raise ChannelClosed(f"{self.peer} sent a {length}-byte frame (limit {self.max_frame})")
        # The body of a frame whose header arrived is expected promptly.
        self.sock.settimeout(max(timeout or 0.0, 30.0))
        return messages.decode(self._recv_exact(length))

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except TimeoutError:
                if buf:
                    raise ChannelClosed(f"{self.peer} stalled mid-frame") from None
                raise
            except OSError as e:
                raise ChannelClosed(f"connection to {self.peer} broke: {e}") from e
            if not chunk:
                raise ChannelClosed(f"{self.peer} closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
