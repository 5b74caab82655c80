"""A follower rank: joins a leader by address and runs every broadcast call on its shard.

Threads:
- main: join, then ``recv broadcast -> run on local worker -> (reply)``, the
  nano-vllm loop; "shutdown" is just another message.
- control reader: leader heartbeats, ``Start``, ``Failure``, ``Shutdown``.
- heartbeat sender: tells the leader this process is alive even while the main
  thread is blocked in a collective.
- leader monitor: if the leader's connection closes or its heartbeats stop, the
  unit is broken and this process exits non-zero at once (``os._exit``: the
  main thread may be stuck in Gloo or the shared-memory all-reduce, which
  cannot be interrupted).

Exit codes (``neuron_serving.exitcodes``): OK on a clean shutdown by the
leader; FAILED when this rank failed or was rejected; LEADER_LOST when the
leader died, hung, or reported the unit failed.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuron_serving.exitcodes import ExitCode
from neuron_serving.logsafe import printable
from neuron_serving.unit import auth
from neuron_serving.unit.channel import (
    MAX_LEADER_FRAME_BYTES,
    Channel,
    ChannelClosed,
    FrameRejected,
)
from neuron_serving.unit.late_beats import SATURATED_FACTOR, BeatEcho, LateBeats, saturated
from neuron_serving.unit.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Failure,
    Heartbeat,
    Hello,
    Joined,
    Reject,
    Reply,
    Shutdown,
    Start,
    Welcome,
    clip,
)
from neuron_serving.unit.node_status import NodeState, NodeStatus
from neuron_serving.unit.step_timing import TIMING, StepTiming
from neuron_serving.versions import runtime_versions

if TYPE_CHECKING:  # an annotation only: worker_loop makes the broadcast
    from neuron_serving.unit.broadcast import ControlBroadcast

logger = logging.getLogger("neuron_serving.follower")

# Each handshake frame from the leader, whole (the leader's own bound is the same).
HANDSHAKE_TIMEOUT_S = 10.0


class FollowerRejected(RuntimeError):
    """The leader refused this follower; the message names the field."""


class CheckpointRejected(FollowerRejected):
    """This host cannot serve the checkpoint the leader loads (another version,
    or this rank's files missing); the leader is told why and fails its join."""


@dataclass(slots=True)
class FollowerConfig:
    leader_host: str
    leader_port: int
    rank: int
    token_file: str | None = None
    join_timeout_s: float = 600.0
    health_port: int = 0
    health_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(
                f"a follower's rank must be >= 1 (rank 0 is the leader), got {self.rank}"
            )
        if not 0 < self.leader_port < 65536:
            raise ValueError(f"leader port out of range: {self.leader_port}")
        if self.join_timeout_s <= 0:
            raise ValueError("join_timeout_s must be > 0")


def _exit(code: int, message: str) -> None:
    sys.stderr.write(f"neuron-serving follower: {message}\n")
    sys.stderr.flush()
    os._exit(code)


class Follower:
    def __init__(
        self,
        cfg: FollowerConfig,
        status: NodeStatus | None = None,
        exit_fn: Callable[[int, str], None] = _exit,
        timing: StepTiming = TIMING,
    ) -> None:
        self.timing = timing  # this rank's step totals, sent in every heartbeat
        # exit_fn: how background threads end the process when the unit breaks
        # (os._exit in production; tests running followers in-process record it).
        self._exit_fn = exit_fn
        # Run before any exit, also the abrupt ones from background threads.
        self.on_exit: list[Callable[[], None]] = []
        self.cfg = cfg
        self.token = auth.resolve_token(cfg.token_file)
        self.status = status or NodeStatus("?", cfg.rank, 0)
        self.channel: Channel | None = None
        # Set by worker_loop once the Gloo group exists.
        self.broadcast: ControlBroadcast | None = None
        self.welcome: Welcome | None = None
        self._starts: queue.Queue[Start] = queue.Queue()
        self._last_seen = time.monotonic()
        # Start time of the latest step every rank took part in (ranks_alive).
        self._ranks_seen = 0.0
        self.late_beats: LateBeats | None = None  # from the heartbeat thread's start
        self.leader_beats: LateBeats | None = None  # gaps in the leader's, from Welcome on
        self.leader_echo = BeatEcho()  # round trips of beats to the leader and back
        self._shutdown = threading.Event()

    def _exit(self, code: int, message: str) -> None:
        self.run_exit_hooks()
        self._exit_fn(code, message)

    def run_exit_hooks(self) -> None:
        hooks, self.on_exit = self.on_exit, []
        for hook in hooks:
            try:
                hook()
            except Exception as e:  # exiting anyway
                logger.warning("exit hook failed: %s", e)

    # -- join ---------------------------------------------------------------
    def join(self) -> Welcome:
        """Connect (retrying while the leader is not up yet) and authenticate."""
        deadline = time.monotonic() + self.cfg.join_timeout_s
        backoff = 0.1
        addr = f"{self.cfg.leader_host}:{self.cfg.leader_port}"
        last_error = "no attempt"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"rank {self.cfg.rank} could not join leader {addr} within "
                    f"{self.cfg.join_timeout_s:g} s (last error: {last_error})"
                )
            try:
                sock = socket.create_connection(
                    (self.cfg.leader_host, self.cfg.leader_port), timeout=min(left, 5.0)
                )
            except OSError as e:
                last_error = str(e)
                time.sleep(min(backoff, max(left, 0)))
                backoff = min(backoff * 2, 1.0)
                continue
            ch = Channel(sock, addr)
            try:
                welcome = self._handshake(ch)
            except (ChannelClosed, TimeoutError) as e:
                # The leader restarted or dropped us mid-handshake: try again.
                ch.close()
                last_error = str(e)
                time.sleep(backoff)
                continue
            self.channel, self.welcome = ch, welcome
            self.leader_beats = LateBeats(welcome.heartbeat_interval_s, "leader", None)
            self.status.unit_id, self.status.world_size = welcome.unit_id, welcome.world_size
            if welcome.checkpoint is not None:
                self.status.set_checkpoint(welcome.checkpoint.model, welcome.checkpoint.version)
            return welcome

    def _handshake(self, ch: Channel) -> Welcome:
        challenge = ch.recv(timeout=HANDSHAKE_TIMEOUT_S, frame_timeout=HANDSHAKE_TIMEOUT_S)
        if not isinstance(challenge, Challenge):
            raise ChannelClosed(f"expected a challenge, got {type(challenge).__name__}")
        if challenge.protocol != PROTOCOL_VERSION:
            raise FollowerRejected(
                f"protocol: leader speaks control protocol {challenge.protocol}, "
                f"this follower {PROTOCOL_VERSION}"
            )
        nonce = auth.new_nonce()
        rank = self.cfg.rank
        ch.send(
            Hello(
                protocol=PROTOCOL_VERSION,
                rank=rank,
                host=socket.gethostname()[:255],
                pid=os.getpid(),
                versions=runtime_versions(),
                nonce=nonce,
                mac=auth.mac(self.token, b"hello", challenge.nonce, nonce, str(rank).encode()),
            )
        )
        ch.seal(
            send_key=auth.link_key(
                self.token, challenge.nonce, nonce, rank, auth.FOLLOWER_TO_LEADER
            ),
            recv_key=auth.link_key(
                self.token, challenge.nonce, nonce, rank, auth.LEADER_TO_FOLLOWER
            ),
        )
        # The frame limit stays at the unauthenticated one until the Welcome's MAC
        # has verified; a Reject is the one plain frame accepted here.
        try:
            answer = ch.recv(
                timeout=HANDSHAKE_TIMEOUT_S,
                frame_timeout=HANDSHAKE_TIMEOUT_S,
                plain_reject_ok=True,
            )
        except FrameRejected as e:
            raise auth.AuthError(
                f"token: the leader's answer failed verification ({e}); it could not prove "
                "it holds the unit token, refusing to trust it"
            ) from None
        if isinstance(answer, Reject):
            # Unauthenticated text from whoever answered: escaped and cut.
            raise FollowerRejected(
                f"leader rejected rank {rank}: {printable(answer.field, 64)}: "
                f"{printable(answer.reason, 2000)}"
            )
        if not isinstance(answer, Welcome):
            raise ChannelClosed(f"expected welcome, got {type(answer).__name__}")
        ch.max_frame = MAX_LEADER_FRAME_BYTES
        problem = self._checkpoint_problem(answer)
        if problem:
            ch.send(Failure(clip(problem)), timeout=HANDSHAKE_TIMEOUT_S)
            raise CheckpointRejected(problem)
        ch.send(Joined(), timeout=HANDSHAKE_TIMEOUT_S)
        return answer

    def _checkpoint_problem(self, welcome: Welcome) -> str:
        """Hook 2 of checkpoint loading: before any weight is read (before torch is
        even imported), this host must hold the leader's checkpoint version and
        this rank's files. Followers learn the model path only from the leader."""
        ref = welcome.checkpoint
        if ref is None:
            return ""
        from pathlib import Path

        from neuron_serving.checkpoint.compat import CheckpointMismatch, check_follower

        try:
            manifest = check_follower(
                Path(ref.model),
                ref.version,
                ref.manifest_sha256,
                self.cfg.rank,
                socket.gethostname(),
            )
        except (CheckpointMismatch, OSError) as e:
            return f"rank {self.cfg.rank}: {e}"
        if manifest is not None:
            logger.info(
                "rank %d: checkpoint %s %s present (%d bytes of rank files)",
                self.cfg.rank,
                manifest.model_name,
                manifest.version,
                manifest.rank_bytes(self.cfg.rank),
            )
        return ""

    # -- background threads ---------------------------------------------------
    def start_background(self) -> None:
        for target, name in (
            (self._read_loop, "control-reader"),
            (self._heartbeat_loop, "heartbeat"),
            (self._monitor_loop, "leader-monitor"),
        ):
            threading.Thread(target=target, name=name, daemon=True).start()

    def _read_loop(self) -> None:
        assert self.channel is not None
        while True:
            try:
                msg = self.channel.recv(timeout=1.0)
            except TimeoutError:
                continue
            except (ChannelClosed, OSError) as e:  # FrameRejected: tampered or forged
                if self._shutdown.is_set():
                    return
                self._exit(
                    ExitCode.LEADER_LOST, f"rank {self.cfg.rank}: lost the leader ({e}); exiting"
                )
                return
            self._last_seen = time.monotonic()
            if isinstance(msg, Heartbeat):
                self._leader_state = msg.state
                self.leader_echo.received(msg, self._last_seen)
                if self.leader_beats is not None:
                    self.leader_beats.beat(self._last_seen)
            elif isinstance(msg, Start):
                self._starts.put(msg)
            elif isinstance(msg, Failure):
                self._exit(
                    ExitCode.LEADER_LOST,
                    f"rank {self.cfg.rank}: leader reports {printable(msg.reason, 4000)}; exiting",
                )
                return
            elif isinstance(msg, Shutdown):
                self._shutdown.set()

    def heartbeat_rtts(self) -> dict[str, float]:
        """The round trip of heartbeats to the leader (rank "0") and back, once one
        was echoed."""
        rtt = self.leader_echo.rtt_s
        return {"0": rtt} if rtt is not None else {}

    def _heartbeat_loop(self) -> None:
        assert self.channel is not None and self.welcome is not None
        self.late_beats = LateBeats(
            self.welcome.heartbeat_interval_s, f"rank {self.cfg.rank}", logger
        )
        while not self._shutdown.is_set():
            self.late_beats.beat()
            try:
                # A send that times out ends the link (channel.py), so allow as
                # long as the leader would wait for a beat: the socket may still
                # be full of a large Reply the leader is reading.
                steps, step_s, wait_s = self.timing.totals()
                beat = self.leader_echo.beat(
                    str(self.status.state), steps, time.monotonic(), step_s, wait_s
                )
                self.channel.send(beat, timeout=self.welcome.heartbeat_timeout_s)
            except ChannelClosed:
                # Closed for good (a failed send closes the link rather than
                # send behind a half frame); the reader reports a lost leader.
                return
            time.sleep(self.welcome.heartbeat_interval_s)

    def _monitor_loop(self) -> None:
        assert self.welcome is not None
        tick = self.welcome.heartbeat_interval_s / 2
        woke = time.monotonic()
        while True:
            strict = self._leader_state == "ready" and self.status.state == NodeState.READY
            timeout = leader_silence_timeout(
                strict,
                self.welcome.heartbeat_timeout_s,
                self.welcome.startup_heartbeat_timeout_s,
                saturated(time.monotonic(), self.late_beats, self.leader_beats),
            )
            time.sleep(tick)
            # After a stall of our own (this process starved), beats may be waiting
            # unread: judge the leader on the next tick, as the leader judges us.
            now = time.monotonic()
            stalled, woke = now - woke > 2 * tick + self.welcome.heartbeat_interval_s, now
            if stalled:
                continue
            if self._shutdown.is_set():
                # The leader asked us to stop; give the main loop a moment to do it
                # cleanly, then make sure we do not linger.
                time.sleep(5.0)
                self._exit(ExitCode.OK, f"rank {self.cfg.rank}: shut down by the leader")
                return
            # A step the leader took part in proves it alive as well as a beat
            # does: under load its heartbeat thread can be starved while steps go on.
            age = time.monotonic() - max(self._last_seen, self._ranks_seen)
            # Only leader-side heartbeats count; before Start the leader may be
            # waiting for other ranks, but it heartbeats from Start on.
            if self._started and age > timeout:
                self._exit(
                    ExitCode.LEADER_LOST,
                    f"rank {self.cfg.rank}: no heartbeat from the leader for "
                    f"{time.monotonic() - self._last_seen:.1f} s and no step shared with it "
                    f"for {age:.1f} s (limit {timeout:g} s; leader hung or unreachable); exiting",
                )
                return

    _started = False
    _leader_state = "joining"

    def ranks_alive(self, since: float) -> None:
        """This rank finished a step, begun at ``since``, that every rank took part
        in (calls.runs_collective), the leader among them. Called by the thread
        running steps; a float store is atomic under the GIL."""
        self._ranks_seen = max(self._ranks_seen, since)

    def wait_start(self) -> Start:
        try:
            start = self._starts.get(timeout=self.cfg.join_timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"rank {self.cfg.rank}: joined, but the unit did not start within "
                f"{self.cfg.join_timeout_s:g} s (other ranks missing?)"
            ) from None
        self._last_seen = time.monotonic()
        self._started = True
        return start

    # -- failure reporting ----------------------------------------------------
    def report_failure(self, reason: str) -> None:
        if self.channel is None:
            return
        try:
            self.channel.send(Failure(clip(reason)), timeout=2.0)
        except ChannelClosed:
            pass

    def reply(self, seq: int, ok: bool, result=None, error: str = "") -> None:
        assert self.channel is not None
        payload = pickle.dumps(result, protocol=5) if ok else b""
        self.channel.send(Reply(seq=seq, ok=ok, payload=payload, error=clip(error)), timeout=60.0)

    def format_exc(self) -> str:
        return traceback.format_exc(limit=6)


# The leader is judged more leniently than the leader judges a follower: on a saturated
# host a starved leader misses beats far more often than a leader hangs (seen on 2
# cores under `bench classes`: 2.1 s without a beat from a healthy leader, and the
# unit was recreated for 150 s), while a dead leader is seen at once (its connection
# resets) and a hung one is taken out of rotation by the proxy's probes within
# seconds; only the unit's recreation waits the extra time.
LEADER_SILENCE_FACTOR = 3.0


def leader_silence_timeout(
    strict: bool, heartbeat_timeout_s: float, startup_s: float, late: bool = False
) -> float:
    """How long a follower waits without a beat from the leader before giving it up:
    while serving (``strict``), LEADER_SILENCE_FACTOR x the heartbeat timeout, and
    SATURATED_FACTOR x more after ``late`` beats on either side (late_beats.py: on a
    saturated host an idle leader's beats can stop for longer than the strict limit);
    while either side starts, the start-up timeout."""
    if not strict:
        return startup_s
    factor = LEADER_SILENCE_FACTOR * (SATURATED_FACTOR if late else 1.0)
    return min(max(startup_s, heartbeat_timeout_s), factor * heartbeat_timeout_s)
