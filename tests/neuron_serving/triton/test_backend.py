"""LLMBackend's request handling against a fake Triton and a fake AsyncLLM.

The real thing runs in tests/e2e/test_triton_leader.py; here the invariant "every
request ends with exactly one FINAL response" is checked path by path (finished,
invalid, cancelled, engine error, unit failure) in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import vllm.sampling_params  # noqa: F401 - import once here, not inside a timed canary
from prometheus_client import CollectorRegistry

from neuron_serving.triton.backend import LLMBackend
from neuron_serving.triton.backend_config import BackendConfig
from neuron_serving.triton.metrics import BackendMetrics

FINAL = 1


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, CANCELLED = range(7)

    def __init__(self, message: str, code: int = 0) -> None:
        self.message, self.code = message, code


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] = (), error: TritonError | None = None):
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


class Sender:
    def __init__(self, cancel_after: int | None = None, send_s: float = 0.0) -> None:
        self.sent: list[tuple[InferenceResponse, int]] = []
        self.times: list[float] = []
        self.cancel_after = cancel_after
        self.send_s = send_s  # a slow send (IPC, client) blocks the response thread

    def send(self, response: InferenceResponse, flags: int = 0) -> None:
        time.sleep(self.send_s)
        self.sent.append((response, flags))
        self.times.append(time.monotonic())

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after

    def finals(self) -> list[InferenceResponse]:
        return [r for r, f in self.sent if f & FINAL]


class Request:
    def __init__(self, sender: Sender, **inputs: Any) -> None:
        self.sender = sender
        self.inputs = {}
        for name, value in inputs.items():
            dtype = bool if isinstance(value, bool) else np.object_
            self.inputs[name] = Tensor(name, np.array([value], dtype=dtype))

    def get_response_sender(self) -> Sender:
        return self.sender

    def parameters(self) -> str:
        return "{}"

    def request_id(self) -> str:
        return ""


class Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


class Engine:
    """Generates 'tN ' tokens; records aborts the way AsyncLLM.generate does."""

    def __init__(self) -> None:
        self.errored = False
        self.fail_after: int | None = None
        self.aborted: list[str] = []
        self.dead = False
        self.step_s = 0.002
        # True: tokens are produced whether or not the consumer keeps up, and DELTA
        # outputs not yet taken are merged, as vLLM's RequestOutputCollector does.
        self.collect = False
        self.produced_at: dict[str, list[float]] = {}
        # True: every request's next token comes from one shared step, as in vLLM, where
        # one engine step's outputs wake every running request in one loop iteration.
        self.lockstep = False
        self._step: asyncio.Future | None = None

    async def _sleep_step(self) -> None:
        if not self.lockstep:
            await asyncio.sleep(self.step_s)
            return
        if self._step is None or self._step.done():
            loop = asyncio.get_running_loop()
            self._step = step = loop.create_future()
            loop.call_later(self.step_s, lambda: step.done() or step.set_result(None))
        await asyncio.shield(self._step)

    def get_tokenizer(self) -> Tokenizer:
        return Tokenizer()

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("EngineCore died")

    async def generate(self, prompt: dict, params: Any, request_id: str):
        from vllm.sampling_params import RequestOutputKind

        if self.collect and params.output_kind == RequestOutputKind.DELTA:
            async for out in self._collected(params.max_tokens, request_id):
                yield out
            return
        n = params.max_tokens
        try:
            for i in range(n):
                await self._sleep_step()
                if self.fail_after is not None and i == self.fail_after:
                    raise RuntimeError("boom")
                last = i == n - 1
                if params.output_kind == RequestOutputKind.FINAL_ONLY and not last:
                    continue
                if params.output_kind == RequestOutputKind.DELTA:
                    ids, text = [i], f"t{i} "
                else:
                    ids, text = list(range(n)), "".join(f"t{j} " for j in range(n))
                seq = SimpleNamespace(
                    text=text,
                    token_ids=ids,
                    finish_reason="length" if last else None,
                    logprobs=None,
                )
                yield SimpleNamespace(finished=last, outputs=[seq])
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise

    async def _collected(self, n: int, request_id: str):
        pending: list[int] = []
        ready = asyncio.Event()
        times = self.produced_at.setdefault(request_id, [])

        async def produce() -> None:
            for i in range(n):
                await asyncio.sleep(self.step_s)
                pending.append(i)
                times.append(time.monotonic())
                ready.set()

        producer = asyncio.ensure_future(produce())
        try:
            done = 0
            while done < n:
                await ready.wait()
                ready.clear()
                ids, pending[:] = list(pending), []
                done += len(ids)
                last = done == n
                seq = SimpleNamespace(
                    text="".join(f"t{i} " for i in ids),
                    token_ids=ids,
                    finish_reason="length" if last else None,
                    logprobs=None,
                )
                yield SimpleNamespace(finished=last, outputs=[seq])
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise
        finally:
            producer.cancel()


class LoopThread:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float):
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


@pytest.fixture
def backend():
    unloaded: list[str] = []
    pb = SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
        Tensor=Tensor,
        InferenceResponse=InferenceResponse,
        TritonError=TritonError,
        get_input_tensor_by_name=lambda req, name: req.inputs.get(name),
        unload_model=unloaded.append,
    )
    b = LLMBackend(pb)
    b.model_name = "llm"
    b.unloaded = unloaded
    engine = Engine()
    config = BackendConfig(
        model="/m", max_model_len=64, health_interval_s=0.02, canary_interval_s=0.05
    )
    b.start(config, LoopThread(engine), BackendMetrics("u", CollectorRegistry()))
    yield b
    b.finalize()


def wait_final(sender: Sender, timeout: float = 10.0) -> InferenceResponse:
    deadline = time.monotonic() + timeout
    while not sender.finals():
        assert time.monotonic() < deadline, f"no FINAL response; sent {sender.sent}"
        time.sleep(0.005)
    time.sleep(0.05)  # a second FINAL would arrive now
    assert len(sender.finals()) == 1, sender.sent
    return sender.finals()[0]


def text(r: InferenceResponse) -> str:
    return r.outputs["text_output"][0].decode()


def test_non_streaming_prepends_prompt_by_default(backend) -> None:
    s = Sender()
    params = json.dumps({"max_tokens": 3})
    backend.execute([Request(s, text_input=b"two words", sampling_parameters=params)])
    r = wait_final(s)
    assert r.error is None and len(s.sent) == 1
    assert text(r) == "two wordst0 t1 t2 "
    assert r.outputs["prompt_tokens"][0] == 2 and r.outputs["completion_tokens"][0] == 3
    assert r.outputs["finish_reason"][0] == b"length"


def test_streaming_sends_deltas_and_cumulative_counts(backend) -> None:
    s = Sender()
    backend.execute(
        [Request(s, text_input=b"hi", stream=True, sampling_parameters='{"max_tokens": 4}')]
    )
    wait_final(s)
    assert [text(r) for r, _ in s.sent] == ["t0 ", "t1 ", "t2 ", "t3 "]
    assert [f for _, f in s.sent] == [0, 0, 0, FINAL]
    # Counts and the finish reason ride on the first and the last response only (the
    # middle ones carry text alone: fewer tensors per token).
    assert [sorted(r.outputs) for r, _ in s.sent][1:3] == [["text_output"]] * 2
    first, last = s.sent[0][0].outputs, s.sent[-1][0].outputs
    assert first["completion_tokens"][0] == 1 and first["finish_reason"][0] == b""
    assert last["completion_tokens"][0] == 4 and last["finish_reason"][0] == b"length"
    assert first["prompt_tokens"][0] == last["prompt_tokens"][0] == 1


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ({"text_input": b""}, "text_input is empty"),
        ({"text_input": b"\xff"}, "not valid UTF-8"),
        ({"text_input": b"x", "sampling_parameters": "{"}, "not valid JSON"),
        ({"text_input": b"x " * 64}, "max_model_len is 64"),  # found after tokenizing
    ],
)
def test_invalid_input_is_one_invalid_arg_final(backend, inputs, fragment) -> None:
    s = Sender()
    backend.execute([Request(s, **inputs)])
    r = wait_final(s)
    assert r.error.code == TritonError.INVALID_ARG and fragment in r.error.message


def test_cancelled_stream_is_aborted_in_the_engine(backend) -> None:
    backend.engine.step_s = 0.01
    s = Sender(cancel_after=2)
    backend.execute(
        [Request(s, text_input=b"hi", stream=True, sampling_parameters='{"max_tokens": 60}')]
    )
    r = wait_final(s)
    assert r.error.code == TritonError.CANCELLED
    assert len(backend.engine.aborted) == 1
    assert len(s.sent) < 60


def test_engine_error_mid_stream_is_one_internal_final(backend) -> None:
    backend.engine.fail_after = 2
    s = Sender()
    backend.execute(
        [Request(s, text_input=b"hi", stream=True, sampling_parameters='{"max_tokens": 8}')]
    )
    r = wait_final(s)
    assert r.error.code == TritonError.INTERNAL and "boom" in r.error.message
    assert len(s.sent) == 3  # two partials, then the error


def test_unit_failure_unloads_model_and_answers_unavailable(backend) -> None:
    backend.engine.dead = True
    deadline = time.monotonic() + 10
    while not backend.unloaded:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert backend.unloaded == ["llm"] and not backend.health.healthy
    s = Sender()
    backend.execute([Request(s, text_input=b"hi")])
    r = wait_final(s)
    assert r.error.code == TritonError.UNAVAILABLE and "EngineCore died" in r.error.message


def test_idle_canary_runs(backend) -> None:
    deadline = time.monotonic() + 10
    while backend.health.canaries_ok < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_request_cancelled_before_any_output_is_aborted(backend) -> None:
    backend.engine.step_s = 0.01
    s = Sender(cancel_after=0)  # the client is gone before the first token
    backend.execute([Request(s, text_input=b"hi", sampling_parameters='{"max_tokens": 60}')])
    r = wait_final(s)
    assert r.error.code == TritonError.CANCELLED
    deadline = time.monotonic() + 5
    while not backend.engine.aborted:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def stream_request(sender: Sender, max_tokens: int) -> Request:
    params = json.dumps({"max_tokens": max_tokens})
    return Request(sender, text_input=b"hi", stream=True, sampling_parameters=params)


def test_slow_sends_coalesce_deltas_exactly(backend) -> None:
    """Sending slower than the engine produces: fewer responses, same text and counts."""
    backend.engine.collect = True
    backend.engine.step_s = 0.001
    s = Sender(send_s=0.01)
    backend.execute([stream_request(s, 40)])
    wait_final(s)
    texts = [text(r) for r, _ in s.sent]
    assert "".join(texts) == "".join(f"t{i} " for i in range(40))
    assert len(s.sent) < 20, "deltas were not merged"
    # Exact cumulative counts on the first and last responses (the middle carry text).
    assert int(s.sent[0][0].outputs["completion_tokens"][0]) == 1
    assert int(s.sent[-1][0].outputs["completion_tokens"][0]) == 40
    assert texts[0] == "t0 ", "the first token goes out alone, never held back"
    assert [f for _, f in s.sent] == [0] * (len(s.sent) - 1) + [FINAL]
    assert s.sent[-1][0].outputs["finish_reason"][0] == b"length"
    assert s.sent[0][0].outputs["finish_reason"][0] == b""


def test_fast_sends_get_every_token(backend) -> None:
    backend.engine.collect = True
    backend.engine.step_s = 0.005
    s = Sender()
    backend.execute([stream_request(s, 10)])
    wait_final(s)
    assert [text(r) for r, _ in s.sent] == [f"t{i} " for i in range(10)]


def test_first_token_is_not_delayed_by_other_streams(backend) -> None:
    """A new request's first response goes out with the next batch, even while other
    streams are backed up behind slow sends."""
    backend.engine.collect = True
    backend.engine.step_s = 0.002
    slow = [Sender(send_s=0.005) for _ in range(4)]
    backend.execute([stream_request(x, 60) for x in slow])
    time.sleep(0.1)
    s = Sender()
    backend.execute([stream_request(s, 5)])
    wait_final(s)
    first_token_at = list(backend.engine.produced_at.values())[-1][0]  # the newest request
    # behind at most one unsent response per slow stream (4 x 5 ms), plus slack
    assert s.times[0] - first_token_at < 0.5  # unbounded per-token queue: ~1 s here
    assert text(s.sent[0][0]) == "t0 "
    for x in slow:
        wait_final(x)
        assert "".join(text(r) for r, _ in x.sent) == "".join(f"t{i} " for i in range(60))


def test_one_steps_responses_reach_the_response_thread_together(backend) -> None:
    """Streams stepping together hand their responses over as one batch per step (one
    queue operation and wake-up instead of one per token), each stream still in order."""
    backend.engine.lockstep = True
    backend.engine.step_s = 0.01
    senders = [Sender() for _ in range(8)]
    backend.execute([stream_request(x, 12) for x in senders])
    for x in senders:
        wait_final(x)
        assert [text(r) for r, _ in x.sent] == [f"t{i} " for i in range(12)]
    responses = sum(len(x.sent) for x in senders)
    assert responses == 8 * 12
    assert backend.responses.entries_total <= responses / 4, backend.responses.entries_total


def test_cancel_while_waiting_for_a_slow_send(backend) -> None:
    backend.engine.collect = True
    backend.engine.step_s = 0.002
    s = Sender(cancel_after=2, send_s=0.02)
    backend.execute([stream_request(s, 60)])
    r = wait_final(s)
    assert r.error.code == TritonError.CANCELLED
    assert len(backend.engine.aborted) == 1
