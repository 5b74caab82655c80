"""Log lines about what others do: their strings escaped, their rate bounded.

A unit's peers, the proxy's clients and a full disk can each make the same line
happen at will. Neither the text of a line (forged lines, terminal escapes) nor
how many of them there are (disk, the log pipeline's bill, the operator's
attention) may be theirs to choose. Imported by ``proxy`` and by
``neuron_serving``'s packages alike, so it depends on the standard library only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


def printable(value: object, limit: int = 200) -> str:
    """``value`` (its ``repr`` unless a str) made safe for one log line or error message.

    Cut to ``limit`` characters, then every character outside printable ASCII
    escaped (``unicode_escape``): no forged lines (CR, LF, U+2028), no terminal
    escapes, no lone surrogates for a log shipper to choke on, no look-alike
    letters. A backslash is doubled, so an escape in the output is always one the
    escaping made, never one the peer typed.
    """
    text = value if isinstance(value, str) else repr(value)
    safe = text[:limit].encode("unicode_escape").decode("ascii")
    return safe if len(text) <= limit else safe + "...[truncated]"


class RateLimitedLog:
    """At most ``burst`` lines per ``interval_s``; the rest are counted.

    A window opens with the first line after the previous window closed. The last
    line a window allows says that similar ones will be suppressed; the next line
    written (or the recovery) says how many were, so counts survive when lines do
    not. ``recovered`` reports the end of a spell of failures once, and lets the
    next failure through at once.

    ``sink`` is a logger (each line at the level given; a level the logger does not
    log neither counts nor uses up the window, so hidden debug lines cannot crowd
    out errors) or a callable taking the finished line (``print``, a UI callback).
    A sink that raises (a log file on the very disk that is full) is ignored:
    reporting never raises. Thread-safe.
    """

    def __init__(
        self,
        sink: logging.Logger | Callable[[str], None],
        burst: int = 5,
        interval_s: float = 10.0,
    ) -> None:
        if burst < 1 or interval_s <= 0:
            raise ValueError(f"burst must be >= 1 and interval_s > 0, got {burst}, {interval_s}")
        self.sink = sink
        self.burst = burst
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._window_start = float("-inf")
        self._in_window = 0
        self._level = logging.WARNING  # of the latest line: the recovery's level
        self.suppressed = 0  # since the last line written
        self.failing = False  # a line was logged or suppressed since the last recovery

    def log(self, level: int, fmt: str, *args: object) -> None:
        """``fmt % args`` (``fmt`` as is without args), if the window allows it."""
        if isinstance(self.sink, logging.Logger) and not self.sink.isEnabledFor(level):
            return
        now = time.monotonic()
        with self._lock:
            self.failing, self._level = True, level
            if now - self._window_start >= self.interval_s:
                self._window_start, self._in_window = now, 0
            if self._in_window >= self.burst:
                self.suppressed += 1
                return
            self._in_window += 1
            last = self._in_window == self.burst
            dropped, self.suppressed = self.suppressed, 0
        self._emit(level, fmt, args, dropped, last)

    def debug(self, fmt: str, *args: object) -> None:
        self.log(logging.DEBUG, fmt, *args)

    def info(self, fmt: str, *args: object) -> None:
        self.log(logging.INFO, fmt, *args)

    def warning(self, fmt: str, *args: object) -> None:
        self.log(logging.WARNING, fmt, *args)

    def error(self, fmt: str, *args: object) -> None:
        self.log(logging.ERROR, fmt, *args)

    def recovered(self, fmt: str, *args: object) -> None:
        """Report the end of the trouble, once, at the level of the lines it ends:
        nothing if no line was logged or suppressed since the last recovery."""
        with self._lock:
            if not self.failing:
                return
            level, dropped = self._level, self.suppressed
            self.failing, self.suppressed = False, 0
            self._window_start, self._in_window = float("-inf"), 0
        self._emit(level, fmt, args, dropped, False)

    def _emit(
        self, level: int, fmt: str, args: tuple[object, ...], dropped: int, last: bool
    ) -> None:
        notes = []
        if dropped:
            notes.append(f"{dropped} similar messages suppressed")
        if last:
            notes.append(f"rate limit: similar messages suppressed for up to {self.interval_s:g} s")
        # No "%" in a note, so it extends the format whether or not there are args.
        suffix = f" ({'; '.join(notes)})" if notes else ""
        try:
            if isinstance(self.sink, logging.Logger):
                # Formatted by logging (lazily, its errors handled by logging).
                self.sink.log(level, fmt + suffix, *args)
            else:
                self.sink((fmt % args if args else fmt) + suffix)
        except Exception:  # noqa: BLE001 (see the class doc: reporting never raises)
            pass
