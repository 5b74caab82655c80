"""Progress of a long transfer (`checkpoint publish`, `checkpoint fetch`).

The store reports bytes (store.py, "Progress"); what shows them is chosen by the
command: a rich bar on stderr when stderr is a terminal, nothing otherwise or with
``--quiet``, so logs and pipes never fill with bar redraws.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, Protocol


class TransferProgress(Protocol):
    def start(self, total_bytes: int) -> None:
        """Once, before the first byte: everything the transfer will account for."""

    def advance(self, nbytes: int) -> None:
        """Bytes moved, or found already in place (negative: counted again later)."""


class ProgressBar:
    """A rich progress bar on stderr: bytes, rate, time left. A context manager: the
    bar is closed (its last state left on screen) however the transfer ends."""

    def __init__(self, description: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.description = description
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=30),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task: Any = None

    def start(self, total_bytes: int) -> None:
        self._task = self._progress.add_task(self.description, total=total_bytes)
        self._progress.start()

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, nbytes)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._progress.stop()


def progress_bar(description: str, quiet: bool) -> ProgressBar | None:
    """A bar when stderr is a terminal and not ``quiet``; None (no progress) otherwise."""
    if quiet or not sys.stderr.isatty():
        return None
    return ProgressBar(description)
