"""ResponseThread: order, FINAL unregisters, one wake-up per drained batch."""

from __future__ import annotations

import threading
import time

from neuron_serving.triton.responses import ResponseThread, Stream

FINAL = 1


class Sender:
    def __init__(self, gate: threading.Event | None = None) -> None:
        self.sent: list[tuple[str, int]] = []
        self.gate = gate

    def send(self, response: str, flags: int = 0) -> None:
        if self.gate is not None:
            self.gate.wait(5)
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return False


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def test_waiters_woken_once_per_batch_in_order() -> None:
    wakes: list[list[str]] = []
    gate = threading.Event()
    t = ResponseThread(FINAL, wake=wakes.append)
    a, b = Sender(gate), Sender()
    t.register("a", Stream(a))
    t.register("b", Stream(b))
    t.start()
    t.put("a", "a0", 0, "wa0")  # blocks the thread in send until the gate opens
    time.sleep(0.05)
    t.put("b", "b0", 0, "wb0")
    t.put("a", "a1", FINAL, None)
    t.put("b", "b1", 0, "wb1")
    gate.set()
    wait_for(lambda: len(b.sent) == 2)
    wait_for(lambda: sum(map(len, wakes)) == 3)
    t.stop()
    assert wakes == [["wa0"], ["wb0", "wb1"]]
    assert a.sent == [("a0", 0), ("a1", FINAL)] and t.in_flight() == 1


def test_dropped_response_still_wakes_its_waiter() -> None:
    wakes: list[list[str]] = []
    t = ResponseThread(FINAL, wake=wakes.append)
    t.start()
    t.put("gone", "late partial", 0, "w")  # stream never registered / already final
    wait_for(lambda: wakes == [["w"]])
    t.stop()


def test_failing_wake_does_not_stop_the_thread() -> None:
    def wake(_: list) -> None:
        raise RuntimeError("loop closed")

    t = ResponseThread(FINAL, wake=wake)
    s = Sender()
    t.register("a", Stream(s))
    t.start()
    t.put("a", "x", 0, "w")
    t.put("a", "y", FINAL, None)
    wait_for(lambda: len(s.sent) == 2)
    t.stop()
    assert t.in_flight() == 0


def test_put_batch_sends_in_order_and_wakes_once() -> None:
    wakes: list[list[str]] = []
    t = ResponseThread(FINAL, wake=wakes.append)
    a, b = Sender(), Sender()
    t.register("a", Stream(a))
    t.register("b", Stream(b))
    t.put_batch([("a", "a0", 0, "wa0"), ("b", "b0", 0, "wb0"), ("a", "a1", FINAL, None)])
    t.put_batch([])  # nothing queued, nothing woken
    t.start()
    wait_for(lambda: len(a.sent) == 2)
    assert t.entries_total == 1  # counted before sending; stop() adds its own entry
    t.stop()
    assert a.sent == [("a0", 0), ("a1", FINAL)] and b.sent == [("b0", 0)]
    assert wakes == [["wa0", "wb0"]]
