"""Raw HTTP/1.1 for the proxy tests that must send bytes no HTTP client would (half
heads, invalid header bytes, stalled bodies): reading a response off a plain socket
and parsing it. Parsing is the standard library's own client parser
(``http.client.HTTPResponse``), so chunked bodies are decoded the way a real client
decodes them, and one decoder serves every test (test_hostile.py, test_fuzz.py).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import socket


class _Recorded:
    """What ``HTTPResponse`` needs of a socket: ``makefile`` over bytes already read."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(io.BytesIO(self._raw))


def recv_all(s: socket.socket, limit: int = 1 << 22) -> bytes:
    """Everything the peer sends until it closes (or resets, or the socket's timeout
    passes), at most ``limit`` bytes."""
    chunks, n = [], 0
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while n < limit:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
    return b"".join(chunks)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body with any chunked coding removed)
    of one complete response, as read off a ``Connection: close`` socket. A response
    cut short raises (``http.client.IncompleteRead``), as it would in a client."""
    assert raw.startswith(b"HTTP/1."), raw[:200]
    resp = http.client.HTTPResponse(_Recorded(raw))  # type: ignore[arg-type]
    resp.begin()
    headers = {k.lower(): v for k, v in resp.getheaders()}
    return resp.status, headers, resp.read()
