"""An on-path attacker for control connections: a TCP relay on loopback that
parses the control protocol's frames (``channel.py``) and lets a test alter,
drop, duplicate, reorder or inject them in either direction.

A relay sees what a host between leader and follower would see: every frame
in clear (the protocol has integrity, not confidentiality), but no key.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from neuron_serving.unit import messages
from neuron_serving.unit.channel import _HEAD, _SEAL, SEALED

TO_LEADER, TO_FOLLOWER = "to_leader", "to_follower"


@dataclass
class Frame:
    kind: int
    seal: bytes  # seq and mac of a sealed frame, b"" for a plain one
    body: bytes
    claimed_len: int | None = None  # a length header that lies about the body

    @property
    def seq(self) -> int:
        return struct.unpack("!Q", self.seal[:8])[0] if self.seal else 0

    def message(self):
        return messages.decode(self.body)

    def wire(self) -> bytes:
        n = len(self.body) if self.claimed_len is None else self.claimed_len
        return _HEAD.pack(n, self.kind) + self.seal + self.body


# (direction, frame) -> the frames to forward instead (empty: drop it).
Mutator = Callable[[str, Frame], list[Frame]]


class Relay:
    def __init__(self, leader_port: int, mutate: Mutator) -> None:
        self.leader_port = leader_port
        self.mutate = mutate
        self.seen: list[tuple[str, str]] = []  # (direction, message type) as forwarded
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="relay").start()

    def _accept(self) -> None:
        while True:
            try:
                follower, _ = self._listener.accept()
            except OSError:
                return
            leader = socket.create_connection(("127.0.0.1", self.leader_port), timeout=5)
            self._socks += [follower, leader]
            for src, dst, direction in (
                (follower, leader, TO_LEADER),
                (leader, follower, TO_FOLLOWER),
            ):
                threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        src.settimeout(None)
        try:
            while True:
                length, kind = _HEAD.unpack(_read(src, _HEAD.size))
                seal = _read(src, _SEAL.size) if kind == SEALED else b""
                frame = Frame(kind, seal, _read(src, length))
                for out in self.mutate(direction, frame):
                    self.seen.append((direction, type(_try_decode(out.body)).__name__))
                    dst.sendall(out.wire())
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            s.close()


def _try_decode(body: bytes):
    try:
        return messages.decode(body)
    except Exception:
        return None


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise OSError("closed")
        buf += chunk
    return bytes(buf)
