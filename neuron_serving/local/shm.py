"""The POSIX shared memory a process tree maps, to unlink after SIGKILLing it.

A unit's processes share memory through files in ``/dev/shm``: tritonserver and
its Python backend stub (``triton_python_backend_shm_region_<uuid>``), vLLM's
message queues (``psm_<id>``, multiprocessing's shared_memory) and named
semaphores (``sem.mp-<id>``). Each owner unlinks its files on an orderly exit; a
SIGKILLed process cannot, and ``/dev/shm`` is RAM that nothing else frees. The
supervisor kills a crashed unit at once (group_supervisor.py), so it reads which
of these files the unit's processes map first (``/proc/<pid>/maps``) and unlinks
them once every process is gone.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = "/dev/shm/"


def mapped_shm_files(pids: Iterable[int]) -> set[Path]:
    """The ``/dev/shm`` files the processes ``pids`` map; a process that is gone (or
    not ours to read) maps nothing."""
    files: set[Path] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    # address perms offset dev inode path; a path may contain spaces.
                    parts = line.rstrip("\n").split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(SHM_DIR):
                        path = parts[5]
                        # Already unlinked by its owner: nothing left to remove.
                        if not path.endswith(" (deleted)"):
                            files.add(Path(path))
        except OSError:
            continue
    return files


def unlink_shm_files(files: Iterable[Path]) -> list[Path]:
    """Unlink ``files`` (only directly under /dev/shm); returns those removed."""
    removed = []
    for path in files:
        if str(path.parent) + "/" != SHM_DIR:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue  # gone already (its owner got to it first)
    return removed
