"""What loading the weights cost each rank: wall time and bytes read.

``measured_load_model`` is what the unit executor broadcasts instead of a bare
``load_model``: every rank runs it on its local worker and answers with a
``LoadStats`` (a gathered call). Before ``load_model``, every rank checks what
it is about to read (``checkpoint.trust.verify_before_load``): the manifest is the
one the deploy pinned and each of the rank's files has the manifest's sha256; a
mismatch raises naming the file, so the rank fails before a weight is loaded.
All ranks hash at once, each its own files. Counters come from ``/proc/self/io``
of the rank's process, sampled right before and after ``load_model``:

- ``rchar``: bytes returned by read()-family syscalls, page-cache hits
  included; socket reads count too (the follower's heartbeats: tens of bytes).
- ``read_bytes``: bytes the process caused to be fetched from storage, page
  faults on memory-mapped files included; zero for pages already cached.

vLLM's safetensors loaders (``sharded_state`` and the default HF one)
memory-map the files, so the weights themselves show up in ``read_bytes`` on a
cold page cache and in neither counter on a warm one; ``rchar`` then holds
only headers, config and Python imports. ``bench load`` evicts the
checkpoint's pages before each trial (see bench/README.md). Free of torch
imports.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROC_IO = "/proc/self/io"


def read_proc_io(path: str = PROC_IO) -> dict[str, int]:
    """The counters of ``/proc/self/io`` (empty where the kernel does not expose it)."""
    try:
        with open(path) as f:
            return {k: int(v) for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError):
        return {}


@dataclass(frozen=True, slots=True)
class LoadStats:
    rank: int
    host: str
    seconds: float
    rchar: int
    read_bytes: int
    # The sha256 check before load_model (0: not a sharded checkpoint, nothing pinned).
    verify_seconds: float = 0.0
    verified_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        verified = (
            f"; sha256 of {self.verified_bytes / 1e6:.1f} MB checked in "
            f"{self.verify_seconds:.2f} s before it"
            if self.verified_bytes
            else ""
        )
        return (
            f"rank {self.rank} ({self.host}): load_model {self.seconds:.2f} s, "
            f"rchar {self.rchar / 1e6:.1f} MB, read_bytes {self.read_bytes / 1e6:.1f} MB"
            f"{verified}"
        )


def measured_load_model(worker: Any) -> LoadStats:
    """Check, then run ``worker.load_model()`` (vLLM's ``WorkerWrapperBase``) and
    measure it."""
    from neuron_serving.checkpoint.trust import verify_before_load

    rank = getattr(worker, "rpc_rank", -1)
    checked = verify_before_load(Path(worker.vllm_config.model_config.model), rank)
    before, t0 = read_proc_io(), time.perf_counter()
    worker.load_model()
    seconds, after = time.perf_counter() - t0, read_proc_io()
    return LoadStats(
        rank=rank,
        host=socket.gethostname(),
        seconds=seconds,
        rchar=after.get("rchar", 0) - before.get("rchar", 0),
        read_bytes=after.get("read_bytes", 0) - before.get("read_bytes", 0),
        verify_seconds=checked.seconds if checked else 0.0,
        verified_bytes=checked.bytes if checked else 0,
    )
