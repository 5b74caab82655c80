"""Units on one host compile one after another, the later ones from the first one's kernels.

On CPU vLLM compiles the model (torch.compile, inductor's C++ kernels) in every
rank's profile run (``determine_available_memory``). Two units started together
on a 2-core host (`neuron-serving up`: 2 units x TP=2) compiled four ranks at once,
each building the same kernels from nothing, every rank slowed by the three others.
Every unit keys vLLM's compile cache alike (``take_unit_config``, and the followers'
``engine_env``), so the inductor kernels a unit built are found by the next one:
the leader takes this host-wide lock around the profile run, and a unit that
finds it held waits, then compiles from the warm cache, alone on the cores.

The lock is an ``flock`` on a file in vLLM's cache root: released by the kernel
when its holder dies, so a crashed unit never blocks the others. The wait is
bounded (``NEURON_SERVING_COMPILE_LOCK_WAIT_S``; the unit compiles anyway after
it); the followers meanwhile wait in the control broadcast, which the leader's
keepalives hold open. One unit per host (production) never waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = "neuron-serving-compile.lock"
_POLL_S = 0.2


def lock_path() -> Path:
    """In vLLM's cache root, beside the compile cache it serializes."""
    from vllm import envs as vllm_envs

    return Path(vllm_envs.VLLM_CACHE_ROOT) / LOCK_NAME


@contextlib.contextmanager
def compile_lock(path: Path, wait_s: float, who: str) -> Iterator[bool]:
    """Hold ``path``'s flock for the block; yields whether it was taken (False: no
    lock wanted, ``wait_s`` <= 0, the file cannot be opened, or not taken within
    ``wait_s``: the block runs anyway)."""
    if wait_s <= 0:
        yield False
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:  # a read-only cache root: serializing is an optimisation only
        log.warning("%s: no compile lock (%s); compiling without it", who, e)
        yield False
        return
    try:
        start = time.monotonic()
        taken = _acquire(fd, start + wait_s)
        waited = time.monotonic() - start
        if not taken:
            log.warning("%s: compile lock %s still held after %.0f s; compiling anyway",
                        who, path, waited)  # fmt: skip
        elif waited > 1.0:
            log.info("%s: waited %.1f s for the compile lock (another unit compiling)", who, waited)
        yield taken
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
