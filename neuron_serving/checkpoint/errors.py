"""Why a unit refuses a checkpoint (shared by the compatibility and trust checks)."""

from __future__ import annotations


class CheckpointMismatch(ValueError):
    """This unit cannot load this checkpoint: wrong tp degree, device, version skew
    between ranks, or missing files. The message says what was found and what to do."""


class CheckpointUntrusted(CheckpointMismatch):
    """The checkpoint is not what the deploy checked: the manifest's sha256 differs
    from the pin, or a file differs from the manifest's sha256. The message names the
    file. A subclass so that every caller refusing a mismatch refuses this too."""
