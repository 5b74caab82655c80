"""Leader side of a unit's control connections: join, authenticate, heartbeat, gather.

One TCP listener on the control port. Each follower connects (before or after
the leader starts: followers retry), proves it holds the unit token, reports
rank and versions, and is admitted or rejected with the offending field named.
When every rank has joined, the leader sends ``Start`` and the Gloo groups form.

After start, each connection carries heartbeats both ways (a thread per side,
independent of the threads running steps, which may be blocked in a
collective), replies of gathered calls, and failure reports. A closed
connection or a heartbeat older than the timeout is a failed rank: the leader
calls ``on_failure(rank, reason)`` exactly once for the unit.

Hostile peers (anyone who reaches the port) cost bounded resources:
- at most ``world_size - 1 + SPARE_HANDSHAKE_SLOTS`` handshakes run at once
  (one thread each), and at most ``HANDSHAKES_PER_PEER`` from one source
  address, so one host holding idle connections cannot keep the others out; a
  connection beyond either limit is closed at accept, unread (a follower
  retries);
- a handshake has ``UnitConfig.handshake_timeout_s`` in all, however slowly
  its peer sends;
- rejections are kept in a short ring (``REJECTIONS_KEPT``) plus counters,
  peer-supplied strings are escaped and cut before they reach a log line or a
  message, and those log lines are rate-limited;
- once the unit has started (every rank joined) the listener is closed: a unit
  never admits anyone later, so connections are refused by the kernel.
Every frame after a follower's Hello is sealed with its link's MAC and
sequence number (``channel.py``).
"""

from __future__ import annotations

import collections
import logging
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from neuron_serving.logsafe import RateLimitedLog, printable
from neuron_serving.unit import auth
from neuron_serving.unit.channel import (
    MAX_FRAME_BYTES,
    Channel,
    ChannelClosed,
    FrameRejected,
    LinkBroken,
)
from neuron_serving.unit.config import UnitConfig
from neuron_serving.unit.late_beats import BeatEcho, LateBeats, silence_limit
from neuron_serving.unit.messages import (
    PROTOCOL_VERSION,
    Challenge,
    CheckpointRef,
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
from neuron_serving.unit.step_timing import TIMING, StepTiming
from neuron_serving.unit.straggler import StragglerConfig, StragglerDetector

logger = logging.getLogger(__name__)

# Handshakes beyond one per follower that may run at once: room for a follower
# reconnecting while its old connection times out, not for a flood.
SPARE_HANDSHAKE_SLOTS = 8
# Handshakes one source address may hold at once. A follower needs one (two
# while its old connection times out); ranks sharing an address (a loopback
# unit) take turns, each handshake being short. Filling every slot then takes
# (world_size - 1 + SPARE_HANDSHAKE_SLOTS) / HANDSHAKES_PER_PEER addresses.
HANDSHAKES_PER_PEER = 2
REJECTIONS_KEPT = 8
_REJECTION_CHARS = 400
_LINGER_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with RST, no TIME_WAIT


class UnitJoinError(RuntimeError):
    """Not every follower joined within the join timeout."""


def _unread(sock: socket.socket) -> bool:
    """Bytes from the follower wait in our socket: it is alive and our reader thread is
    behind (starved of CPU), so its silence is ours, not the follower's. (End of stream
    also reads as readable; the reader reports that as a lost link.)"""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):  # closed: the reader reports the loss
        return False
    return bool(readable)


@dataclass
class FollowerLink:
    rank: int
    host: str
    pid: int
    channel: Channel
    last_seen: float = field(default_factory=time.monotonic)
    state: str = "joining"
    steps: int = 0
    replies: queue.Queue = field(default_factory=queue.Queue)
    heartbeat_interval_s: float = 0.5
    beats: LateBeats = field(init=False)  # the gaps between its beats as they arrive
    echo: BeatEcho = field(default_factory=BeatEcho)
    # Its step totals as its last beat had them (step_timing.StepTiming.totals).
    timing: tuple[int, float, float] = (0, 0.0, 0.0)

    def __post_init__(self) -> None:
        self.beats = LateBeats(self.heartbeat_interval_s, self.describe(), None)

    def describe(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


class ControlServer:
    def __init__(
        self,
        unit: UnitConfig,
        world_size: int,
        token: bytes,
        versions: dict[str, str],
        on_failure: Callable[[int, str], None],
        leader_state: Callable[[], str] = lambda: "ready",
        checkpoint: CheckpointRef | None = None,
        timing: StepTiming = TIMING,
    ) -> None:
        self.leader_state = leader_state
        self.timing = timing  # rank 0's own step totals (this process's)
        self.checkpoint = checkpoint
        # A follower that cannot serve this unit's checkpoint fails the join at once.
        self.join_error: str | None = None
        self.unit = unit
        self.world_size = world_size
        self.token = token
        self.versions = versions
        self.on_failure = on_failure
        self.session_nonce = auth.new_nonce()
        self.links: dict[int, FollowerLink] = {}
        # The latest rejections, for the join error; older ones only counted.
        self.rejections: collections.deque[str] = collections.deque(maxlen=REJECTIONS_KEPT)
        self.rejected_total = 0  # Hellos answered with Reject, and failed joins
        self.failed_handshakes = 0  # timeouts, malformed or oversized frames
        self.dropped_at_accept = 0  # no free handshake slot, or the unit had formed
        self.max_handshakes = world_size - 1 + SPARE_HANDSHAKE_SLOTS
        # Handshakes in flight by source address (under _lock); at most
        # max_handshakes in all, at most HANDSHAKES_PER_PEER each.
        self._handshakes: collections.Counter[str] = collections.Counter()
        # One limit per kind: a flood of one kind does not hide the others.
        self._log_refused, self._log_failed, self._log_rejected = (
            RateLimitedLog(logger),
            RateLimitedLog(logger),
            RateLimitedLog(logger),
        )
        self._lock = threading.Condition()
        self._started = False
        self._closing = False
        self._failed = False
        self._listener: socket.socket | None = None
        # Start time of the latest step every rank took part in (ranks_alive).
        self.ranks_seen = 0.0
        self.late_beats = LateBeats(unit.heartbeat_interval_s, "leader", logger)
        straggler = StragglerConfig.from_env()
        self.stragglers = StragglerDetector(straggler)
        self.straggler_action = straggler.action

    # -- join ---------------------------------------------------------------
    def listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.unit.control_host, self.unit.control_port))
        except OSError as e:
            sock.close()
            raise OSError(
                f"control port {self.unit.control_host}:{self.unit.control_port} unavailable: {e}"
            ) from e
        sock.listen(64)
        sock.settimeout(0.5)
        self._listener = sock
        threading.Thread(target=self._accept_loop, name="control-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        try:
            self._accept_until_stopped(listener)
        finally:
            listener.close()

    def _accept_until_stopped(self, listener: socket.socket) -> None:
        while not self._closing:
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # shut down: the unit formed or is closing
            ip, peer = addr[0], f"{addr[0]}:{addr[1]}"
            refused = self._take_slot(ip)
            if refused:
                # Refused unread: a flood costs an accept and a close, no thread
                # and no buffer.
                self.dropped_at_accept += 1
                self._log_refused.warning(
                    "control port: refused connection from %s (%s; %d refused so far)",
                    peer,
                    refused,
                    self.dropped_at_accept,
                )
                _close_hard(conn)
                continue
            threading.Thread(
                target=self._handshake_in_slot,
                args=(Channel(conn, peer), ip),
                name="control-join",
                daemon=True,
            ).start()

    def _take_slot(self, ip: str) -> str:
        """Claims a handshake slot for a connection from ``ip``; why not, if not."""
        with self._lock:
            if self._started:
                return "unit already formed"
            if self._handshakes[ip] >= HANDSHAKES_PER_PEER:
                return f"{HANDSHAKES_PER_PEER} handshakes from this address in flight"
            if self._handshakes.total() >= self.max_handshakes:
                return "too many handshakes in flight"
            self._handshakes[ip] += 1
            return ""

    def _handshake_in_slot(self, ch: Channel, ip: str) -> None:
        try:
            self._handshake(ch)
        finally:
            with self._lock:
                self._handshakes[ip] -= 1
                if not self._handshakes[ip]:
                    del self._handshakes[ip]  # the map holds only addresses in flight

    def join_stats(self) -> dict[str, int]:
        return {
            "rejected_total": self.rejected_total,
            "failed_handshakes": self.failed_handshakes,
            "dropped_at_accept": self.dropped_at_accept,
            "rejections_kept": len(self.rejections),
            "rejections_chars": sum(len(r) for r in self.rejections),
        }

    def _handshake(self, ch: Channel) -> None:
        timeout_s = self.unit.handshake_timeout_s
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(deadline - time.monotonic(), 0.01)

        nonce = auth.new_nonce()
        try:
            ch.send(Challenge(PROTOCOL_VERSION, self.unit.unit_id, nonce), timeout=left())
            hello = ch.recv(timeout=left(), frame_timeout=left())
            if not isinstance(hello, Hello):
                raise FrameRejected(f"expected hello, got {type(hello).__name__}")
            problem = self._check_hello(hello, nonce)
            if problem is not None:
                self._reject(ch, hello, *problem, timeout=left())
                return
            # Authenticated (the Hello's MAC verified): every frame from here on
            # is sealed with keys only the two ends of this connection hold.
            link = FollowerLink(
                hello.rank,
                printable(hello.host, 64),
                hello.pid,
                ch,
                heartbeat_interval_s=self.unit.heartbeat_interval_s,
            )
            ch.seal(
                send_key=auth.link_key(
                    self.token, nonce, hello.nonce, hello.rank, auth.LEADER_TO_FOLLOWER
                ),
                recv_key=auth.link_key(
                    self.token, nonce, hello.nonce, hello.rank, auth.FOLLOWER_TO_LEADER
                ),
            )
            ch.max_frame = MAX_FRAME_BYTES
            ch.send(
                Welcome(
                    world_size=self.world_size,
                    unit_id=self.unit.unit_id,
                    session_nonce=self.session_nonce,
                    heartbeat_interval_s=self.unit.heartbeat_interval_s,
                    heartbeat_timeout_s=self.unit.heartbeat_timeout_s,
                    startup_heartbeat_timeout_s=self.unit.startup_heartbeat_timeout_s,
                    broadcast_inline_bytes=self.unit.broadcast_inline_bytes,
                    device=self.unit.device,
                    checkpoint=self.checkpoint,
                ),
                timeout=left(),
            )
            # The follower checks its local checkpoint against Welcome.checkpoint.
            ack = ch.recv(timeout=timeout_s, frame_timeout=timeout_s)
            if isinstance(ack, Failure):
                self._join_failed(link, ack.reason)
                ch.close()
                return
            if not isinstance(ack, Joined):
                raise FrameRejected(f"expected joined, got {type(ack).__name__}")
        except (ChannelClosed, TimeoutError, OSError) as e:
            with self._lock:
                self.failed_handshakes += 1
            self._log_failed.warning("join handshake with %s failed: %s", ch.peer, e)
            ch.close()
            return
        with self._lock:
            if self._started or self._closing:
                ch.close()
                return
            self.links[link.rank] = link
            self._lock.notify_all()
        logger.info("%s joined unit %s", link.describe(), self.unit.unit_id)
        threading.Thread(
            target=self._read_loop, args=(link,), name=f"control-r{link.rank}", daemon=True
        ).start()

    def _reject(
        self, ch: Channel, hello: Hello, field_name: str, reason: str, timeout: float
    ) -> None:
        # The Hello may be unauthenticated: only escaped, cut copies of its
        # strings reach the log, the ring and the join error.
        who = f"rank {hello.rank} from {printable(hello.host, 64)} (pid {hello.pid}, {ch.peer})"
        entry = clip(f"{who}: {field_name}: {reason}", _REJECTION_CHARS)
        with self._lock:
            self.rejections.append(entry)
            self.rejected_total += 1
        self._log_rejected.warning("rejected %s", entry)
        try:
            ch.send(Reject(field_name, reason), timeout=timeout)
        except ChannelClosed:
            pass
        ch.close()

    def _check_hello(self, hello: Hello, nonce: bytes) -> tuple[str, str] | None:
        if hello.protocol != PROTOCOL_VERSION:
            return (
                "protocol",
                f"follower speaks control protocol {hello.protocol}, leader {PROTOCOL_VERSION}",
            )
        # Authenticate before looking at anything else the peer claims.
        if not auth.verify(
            self.token, hello.mac, b"hello", nonce, hello.nonce, str(hello.rank).encode()
        ):
            return (
                "token",
                "authentication failed: the follower's unit token does not match the leader's",
            )
        if not 1 <= hello.rank < self.world_size:
            return (
                "rank",
                f"rank {hello.rank} is outside 1..{self.world_size - 1} (unit of {self.world_size} ranks)",
            )
        for name, mine in self.versions.items():
            theirs = hello.versions.get(name, "absent")
            if theirs != mine:
                return (
                    f"versions.{name}",
                    f"follower has {name} {printable(theirs, 64)}, leader has {name} {mine}",
                )
        with self._lock:
            if self._started:
                return "unit", "the unit is already running; a replacement needs a new unit"
            existing = self.links.get(hello.rank)
            if existing is not None:
                return "rank", (
                    f"rank {hello.rank} already joined from {existing.host} (pid {existing.pid}); "
                    f"duplicate from {printable(hello.host, 64)} (pid {hello.pid})"
                )
        return None

    def _join_failed(self, link: FollowerLink, reason: str) -> None:
        msg = f"{link.describe()} cannot join unit {self.unit.unit_id}: {printable(reason, 2000)}"
        logger.error("%s", msg)
        with self._lock:
            self.rejections.append(clip(msg, _REJECTION_CHARS))
            self.rejected_total += 1
            self.join_error = self.join_error or msg
            self._lock.notify_all()

    def wait_for_followers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = set(range(1, self.world_size))
        with self._lock:
            while not want <= set(self.links):
                if self.join_error:
                    raise UnitJoinError(self.join_error)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(want - set(self.links))
                    msg = (
                        f"unit {self.unit.unit_id}: ranks {missing} did not join within {timeout_s:g} s "
                        f"(control port {self.unit.control_host}:{self.unit.control_port}; "
                        f"joined: {sorted(self.links)})"
                    )
                    if self.rejections:
                        latest = list(self.rejections)[-5:]
                        msg += (
                            f"; rejected joins ({self.rejected_total} in all, latest "
                            f"{len(latest)}): " + "; ".join(latest)
                        )
                    raise UnitJoinError(msg)
                self._lock.wait(min(left, 0.5))

    def start_unit(self, start: Start) -> None:
        with self._lock:
            self._started = True
            links = list(self.links.values())
        # Formed: nobody joins a running unit (a replacement needs a new unit), so
        # stop listening; connections are refused by the kernel from now on.
        self._stop_listening()
        now = time.monotonic()
        for link in links:
            link.last_seen = now
            link.channel.send(start)
        threading.Thread(target=self._heartbeat_loop, name="control-heartbeat", daemon=True).start()
        threading.Thread(target=self._monitor_loop, name="control-monitor", daemon=True).start()

    # -- running unit -------------------------------------------------------
    def _read_loop(self, link: FollowerLink) -> None:
        while True:
            try:
                msg = link.channel.recv(timeout=1.0)
            except TimeoutError:
                continue
            except FrameRejected as e:
                # Tampered, replayed or forged: nothing of it was decoded, and
                # nothing later on this connection can be trusted.
                link.channel.close()
                self._lost(link, f"sent a control frame that failed verification: {e}")
                return
            except LinkBroken as e:
                # Our own send to it failed or timed out (it stopped reading).
                self._lost(link, f"is unreachable: {e}; stopped, hung or cut off")
                return
            except (ChannelClosed, OSError) as e:
                self._lost(
                    link, f"closed its control connection ({e}); process exited or was killed"
                )
                return
            link.last_seen = time.monotonic()
            if isinstance(msg, Heartbeat):
                link.state, link.steps = msg.state, msg.steps
                link.timing = (msg.steps, msg.step_s, msg.wait_s)
                link.beats.beat(link.last_seen)
                link.echo.received(msg, link.last_seen)
            elif isinstance(msg, Reply):
                link.replies.put(msg)
            elif isinstance(msg, Failure):
                self._fail(link.rank, f"{link.describe()} failed: {printable(msg.reason, 4000)}")
                return

    def _lost(self, link: FollowerLink, reason: str) -> None:
        with self._lock:
            if self._closing:
                return
            if not self._started:
                # Before start a follower may come and go; it can rejoin.
                if self.links.get(link.rank) is link:
                    del self.links[link.rank]
                logger.warning("%s left before the unit started: %s", link.describe(), reason)
                return
        self._fail(link.rank, f"{link.describe()} {reason}")

    def _fail(self, rank: int, reason: str) -> None:
        with self._lock:
            if self._failed or self._closing:
                return
            self._failed = True
        self.on_failure(rank, reason)

    def ranks_alive(self, since: float) -> None:
        """Rank 0 finished a step, begun at ``since``, that every rank took part in
        (calls.runs_collective): each was running after ``since``. Called by the
        thread running steps; a float store is atomic under the GIL."""
        self.ranks_seen = max(self.ranks_seen, since)

    def _heartbeat_loop(self) -> None:
        while not self._closing:
            self.late_beats.beat()
            state = self.leader_state()
            for link in list(self.links.values()):
                beat = link.echo.beat(state, 0, time.monotonic())
                try:
                    # A stopped peer stops reading; a short send timeout keeps one
                    # stuck follower from delaying heartbeats to the others.
                    link.channel.send(beat, timeout=self.unit.heartbeat_interval_s)
                except ChannelClosed:
                    # The link is closed for good (a failed send closes it, so no
                    # beat follows a half frame); its reader reports it.
                    pass
            time.sleep(self.unit.heartbeat_interval_s)

    def _monitor_loop(self) -> None:
        tick = self.unit.heartbeat_interval_s / 2
        woke = time.monotonic()
        while not self._closing and not self._failed:
            now = time.monotonic()
            # Judge a follower only on time this process was running: after a stall of
            # our own (a 2-core host starving the leader), the reader threads are as far
            # behind as this one, and a beat that did arrive may not be read yet.
            stalled = now - woke > tick + self.unit.heartbeat_interval_s
            woke = now
            strict = self.leader_state() == "ready"
            for link in list(self.links.values()):
                # A step every rank took part in proves each of them alive as well
                # as a beat does: under load a rank's heartbeat thread can be
                # starved (CPU, GIL) while its steps go on.
                age = now - max(link.last_seen, self.ranks_seen)
                limit = (
                    silence_limit(self.unit.heartbeat_timeout_s, now, self.late_beats, link.beats)
                    if strict and link.state == "ready"
                    else self.unit.startup_heartbeat_timeout_s
                )
                if age > limit and not stalled and not _unread(link.channel.sock):
                    shared = (
                        f"the last step all ranks took part in began {now - self.ranks_seen:.1f} s ago"
                        if self.ranks_seen
                        else "no step yet"
                    )
                    self._fail(
                        link.rank,
                        f"{link.describe()} sent no heartbeat for {now - link.last_seen:.1f} s "
                        f"and {shared} (limit {limit:g} s; hung, stopped, or cut off from "
                        "the leader)",
                    )
                    return
            if strict and self._judge_ranks(now):
                return
            time.sleep(tick)

    def _judge_ranks(self, now: float) -> bool:
        """Feed the slow-rank detector every rank's step totals; log what changed, and
        with the "fail" action fail the unit for a degraded rank (True: failed)."""
        totals = {0: self.timing.totals()}
        totals.update({link.rank: link.timing for link in list(self.links.values())})
        for change in self.stragglers.observe(now, totals):
            logger.warning("unit %s: %s", self.unit.unit_id, change)
        if self.straggler_action != "fail":
            return False
        for rank, reason in sorted(self.stragglers.degraded().items()):
            self._fail(rank, f"{reason}; failing the unit (NEURON_SERVING_STRAGGLER_ACTION=fail)")
            return True
        return False

    def heartbeat_rtts(self) -> dict[str, float]:
        """Each follower's heartbeat round trip, by rank (those measured yet)."""
        return {str(link.rank): link.echo.rtt_s for link in list(self.links.values())
                if link.echo.rtt_s is not None}  # fmt: skip

    def gather(self, seq: int, timeout_s: float, failed: Callable[[], str | None]) -> list[Reply]:
        """Replies to broadcast ``seq`` from ranks 1..N-1, in rank order."""
        deadline = time.monotonic() + timeout_s
        out = []
        for rank in range(1, self.world_size):
            link = self.links[rank]
            while True:
                reason = failed()
                if reason:
                    raise RuntimeError(reason)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{link.describe()} did not answer call {seq} within {timeout_s:g} s"
                    )
                try:
                    reply = link.replies.get(timeout=min(left, 0.1))
                except queue.Empty:
                    continue
                if reply.seq == seq:
                    out.append(reply)
                    break
                # Defensive: a gather that fails (timeout, a rank's failure) fails the
                # whole unit, so no reply to an earlier call should still arrive. One
                # that does must not be taken as this call's answer.
        return out

    def broadcast_failure(self, reason: str) -> None:
        for link in list(self.links.values()):
            try:
                link.channel.send(Failure(clip(reason)), timeout=0.5)
            except ChannelClosed:
                pass

    def _stop_listening(self) -> None:
        with self._lock:
            sock, self._listener = self._listener, None
        if sock is not None:
            # Stops listening at once (new connections are refused) and wakes the
            # accept loop, which closes the socket: closing it here, under a
            # thread blocked on it, could race with the reuse of its descriptor.
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self, clean: bool) -> None:
        with self._lock:
            self._closing = True
        self._stop_listening()
        for link in list(self.links.values()):
            if clean:
                try:
                    link.channel.send(Shutdown(), timeout=1.0)
                except ChannelClosed:
                    pass
            link.channel.close()


def _close_hard(conn: socket.socket) -> None:
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    except OSError:
        pass
    conn.close()
