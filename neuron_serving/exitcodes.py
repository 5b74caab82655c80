"""The exit codes of every neuron-serving command and process, in one table.

A supervisor (``up``'s group supervisor, ECS, systemd) reads them to decide what
to do next; the top-level README has the same table for SREs. Codes are stable:
add new ones at the end, never renumber. Death by a signal is not in the table:
``subprocess`` reports it as ``-N`` and a shell as ``128 + N``.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    """Finished, or stopped on request (SIGTERM/SIGINT) after an orderly drain."""

    FAILED = 1
    """Generic failure: an exception, a refused join, a failed check or report.
    The log's last lines say which."""

    USAGE = 2
    """Bad arguments or configuration, found before anything started (argparse
    uses 2 too), or a request refused before anything changed (``deploy``: the
    version or fleet is not fit; ``ecs teardown`` without ``--yes``). Retrying the
    same command fails the same way."""

    UNIT_FAILED = 3
    """The inference unit failed as a whole: a rank died, timed out or reported an
    error, so the leader's executor (or the leader, once the model unloaded itself)
    ended the unit. Recreate the whole unit: leader and every follower."""

    START_FAILED = 4
    """Leader: the model was not ready in time, tritonserver exited before it was,
    tritonserver abandoned the load, or its settings were refused. ``up``: the
    cluster did not become ready (a unit failed to start or timed out)."""

    SERVER_DIED = 5
    """Leader: tritonserver died on its own while serving."""

    LEADER_LOST = 6
    """Follower: its leader went away (connection lost, heartbeat missing). Normal
    when the leader failed or was stopped first; recreate the unit."""

    PROCESSES_LEFT = 7
    """``up``: shut down, but some processes survived SIGKILL (listed on stderr);
    their ports and memory are still taken."""

    CHECKPOINT_REJECTED = 8
    """Follower: its host cannot serve the checkpoint its leader loads (another
    version or manifest, its rank's files missing or corrupt), found before any
    weight was read. Restarting the same way fails the same way: fix the host's
    copy or the rollout."""
