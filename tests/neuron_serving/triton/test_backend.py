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
            if isinstance(value, np.ndarray):  # a tensor as it is (e.g. of two elements)
                self.inputs[name] = Tensor(name, value)
                continue
            if isinstance(value, bool):
                dtype = bool
            elif isinstance(value, int):
                dtype = np.int32  # as the model config declares it (priority)
            else:
                dtype = np.object_
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
        self.priorities: list[int] = []  # the priority of each generate() call
        self.calls: list[tuple[str, int]] = []  # (request id, priority) of each call
        # True: tokens are produced whether or not the consumer keeps up, and DELTA
        # outputs not yet taken are merged, as vLLM's RequestOutputCollector does.
        self.collect = False
        self.produced_at: dict[str, list[float]] = {}
        # True: every request's next token comes from one shared step, as in vLLM, where
        # one engine step's outputs wake every running request in one loop iteration.
        self.lockstep = False
        self._step: asyncio.Future | None = None
        # Each output's RequestOutput.num_cached_tokens (vLLM: the prompt's prefix hit).
        self.cached_tokens = 0

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

    async def generate(self, prompt: dict, params: Any, request_id: str, **kwargs: Any):
        """AsyncLLM.generate's signature; of its keywords the backend sends only
        ``priority`` (the traffic class, through the tee)."""
        from vllm.sampling_params import RequestOutputKind

        self.priorities.append(kwargs.get("priority", 0))
        self.calls.append((request_id, kwargs.get("priority", 0)))

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
                    index=0,
                    text=text,
                    token_ids=ids,
                    finish_reason="length" if last else None,
                    logprobs=None,
                )
                yield SimpleNamespace(
                    finished=last, outputs=[seq], num_cached_tokens=self.cached_tokens
                )
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
                    index=0,
                    text="".join(f"t{i} " for i in ids),
                    token_ids=ids,
                    finish_reason="length" if last else None,
                    logprobs=None,
                )
                yield SimpleNamespace(
                    finished=last, outputs=[seq], num_cached_tokens=self.cached_tokens
                )
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
        """As EngineThread stops: cancel what still runs on the loop (the health
        monitor, requests) and wait for it, then stop. A task left pending is logged
        as "Task was destroyed but it is pending!" whenever the garbage collector
        finds it, which can be in the middle of a later test that watches the log."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def make_backend(openai_serving=None):
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
    metrics = BackendMetrics("u", CollectorRegistry())
    b.start(config, LoopThread(engine), metrics, openai_serving=openai_serving)
    return b


@pytest.fixture
def backend():
    b = make_backend()
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


def test_the_prefix_cache_hit_rides_on_the_last_response(backend) -> None:
    """``cached_tokens``: vLLM's ``num_cached_tokens`` of the request, on its last
    response only (streamed or not); the proxy reads it with the final response."""
    backend.engine.cached_tokens = 1
    s = Sender()
    backend.execute(
        [Request(s, text_input=b"hi", stream=True, sampling_parameters='{"max_tokens": 3}')]
    )
    wait_final(s)
    assert ["cached_tokens" in r.outputs for r, _ in s.sent] == [False, False, True]
    assert s.sent[-1][0].outputs["cached_tokens"].tolist() == [1]
    assert s.sent[-1][0].outputs["cached_tokens"].dtype == np.int32  # as config.pbtxt says
    s = Sender()
    backend.execute([Request(s, text_input=b"hi", sampling_parameters='{"max_tokens": 2}')])
    assert wait_final(s).outputs["cached_tokens"].tolist() == [1]


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ({"text_input": b""}, "text_input is empty"),
        ({"text_input": b"\xff"}, "not valid UTF-8"),
        ({"text_input": b"x", "sampling_parameters": "{"}, "not valid JSON"),
        ({"text_input": b"x " * 64}, "max_model_len is 64"),  # found after tokenizing
        ({"openai_request": b"{"}, "not a valid envelope"),
        ({"openai_request": b'{"endpoint": "embeddings"}'}, "not a valid envelope"),
        ({"openai_request": b'{"endpoint": "completions", "x": 1}'}, "not a valid envelope"),
        (
            {
                "openai_request": b'{"endpoint": "tokenize", "resume": '
                b'{"prompt_token_ids": [1], "output_token_ids": []}}'
            },
            "resume applies",
        ),
        ({"openai_request": b'{"endpoint": "version"}', "text_input": b"hi"}, "not both"),
    ],
)
def test_invalid_input_is_one_invalid_arg_final(openai_backend, inputs, fragment) -> None:
    s = Sender()
    openai_backend.execute([Request(s, **inputs)])
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


def test_the_priority_input_reaches_the_engine(backend) -> None:
    """The ``priority`` input (the proxy's traffic class) is AsyncLLM.generate's
    ``priority``; without it, 0. A value outside [0, 16), or not one element, is one
    INVALID_ARG final and never reaches the engine."""

    def requests() -> list[int]:  # the priority of each text request (not the canaries)
        return [p for rid, p in backend.engine.calls if not rid.startswith("canary-")]

    for priority in (2, None, 1):
        s = Sender()
        inputs = {"text_input": b"hi", "sampling_parameters": '{"max_tokens": 2}'}
        if priority is not None:
            inputs["priority"] = priority
        backend.execute([Request(s, **inputs)])
        assert wait_final(s).error is None
    assert requests() == [2, 0, 1]
    for bad, fragment in (
        (16, r"priority must be an integer in [0, 16)"),
        (-1, r"priority must be an integer in [0, 16)"),
        (np.array([1, 2], dtype=np.int32), "priority must hold exactly one integer"),
    ):
        s = Sender()
        backend.execute([Request(s, text_input=b"hi", priority=bad)])
        r = wait_final(s)
        assert r.error.code == TritonError.INVALID_ARG and fragment in r.error.message
    assert requests() == [2, 0, 1]  # the bad ones never reached the engine


class ChannelCall:
    """What the OpenAI channel hands the backend per call (channel_server.ChannelCall)."""

    reports_progress = True

    def __init__(self, call_id: int) -> None:
        self.id = call_id
        self.events: list = []
        self.errors: list[tuple[str, str]] = []
        self.cancelled = False
        self.task = None
        self.done = threading.Event()
        self.sends = self.seen = self.progress_reports = 0

    def progress(self) -> None:
        self.progress_reports += 1

    def send(self, event, final: bool) -> None:
        self.sends += 1
        self.events.append(event)
        if final:
            self.done.set()

    def error(self, message: str, code: str) -> None:
        self.errors.append((message, code))
        self.done.set()


def test_the_channels_generate_priority_reaches_the_engine(backend) -> None:
    """The channel's ``Generate.priority``, checked as the ``priority`` input: a bad
    one ends that call with INVALID_ARG (the connection and its other calls go on)."""
    from neuron_serving.openai_channel import Generate

    async def open_call(call, message) -> None:
        backend._open_channel_call(call, message)

    params = '{"max_tokens": 2}'
    for message in (Generate(1, "hi", params, 2), Generate(2, "hi", params)):
        call = ChannelCall(message.id)
        backend.engine_thread.call(open_call(call, message), 5.0)
        assert call.done.wait(5.0) and not call.errors
        assert call.events[-1].finish_reason == "length"
    calls = backend.engine.calls
    assert [p for rid, p in calls if rid.startswith("channel-")] == [2, 0]
    call = ChannelCall(3)
    backend.engine_thread.call(open_call(call, Generate(3, "hi", params, 16)), 5.0)
    assert call.done.wait(5.0) and call.errors[0][1] == "INVALID_ARG"
    assert "priority must be an integer in [0, 16)" in call.errors[0][0]
    assert [p for rid, p in calls if rid.startswith("channel-")] == [2, 0]


def test_channel_calls_end_with_the_prefix_cache_hit(openai_backend) -> None:
    """Over the channel ``Event.cached_tokens`` is on each call's last event, for a
    text request and an OpenAI call alike."""
    from neuron_serving.openai_channel import Generate, Open

    async def open_call(call, message) -> None:
        openai_backend._open_channel_call(call, message)

    openai_backend.engine.cached_tokens = 2
    envelope = json.dumps({"endpoint": "completions", "body": {"max_tokens": 3, "stream": True}})
    for message in (Generate(1, "hi", '{"max_tokens": 3}'), Open(2, envelope.encode())):
        call = ChannelCall(message.id)
        openai_backend.engine_thread.call(open_call(call, message), 5.0)
        assert call.done.wait(5.0) and not call.errors
        assert [e.cached_tokens for e in call.events] == [None] * (len(call.events) - 1) + [2]


def test_the_load_report_turns_idle_when_the_last_request_ends(backend) -> None:
    """An aborted request leaves no scheduler stats behind it (engine_load.py): the
    backend's last request ending re-checks the engine's unfinished requests."""
    unfinished = [1]
    backend.engine.get_num_unfinished_requests = lambda: unfinished[0]
    backend.load.max_num_seqs = 4
    backend.load.bind(backend.engine)
    backend.load.record(1, 0, 0.2)  # the stats of a step that still ran it
    unfinished[0] = 0  # then it was aborted: no step, no stats
    assert backend.load.snapshot() == (1, 0, 0.2, 4, 0, ())  # no vLLM config: 0 blocks
    backend.engine.step_s = 0.01
    s = Sender(cancel_after=2)
    backend.execute(
        [Request(s, text_input=b"hi", stream=True, sampling_parameters='{"max_tokens": 60}')]
    )
    assert wait_final(s).error.code == TritonError.CANCELLED
    assert backend.load.snapshot() == (0, 0, 0.0, 4, 0, ())


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


@pytest.mark.parametrize(
    ("make", "cancel_after"),
    [
        # the client is gone before the first token
        (lambda s: Request(s, text_input=b"hi", sampling_parameters='{"max_tokens": 60}'), 0),
        (lambda s: openai_request(s, {"max_tokens": 60, "stream": True}), 0),
        (lambda s: openai_request(s, {"max_tokens": 60, "stream": True}), 2),
    ],
)
def test_cancelled_request_is_aborted(openai_backend, make, cancel_after) -> None:
    openai_backend.engine.step_s = 0.01
    s = Sender(cancel_after=cancel_after)
    openai_backend.execute([make(s)])
    r = wait_final(s)
    assert r.error.code == TritonError.CANCELLED
    deadline = time.monotonic() + 5
    while not openai_backend.engine.aborted:
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


# ---- openai_request: vLLM's serving layer, faked here around the same fake engine --------


class FakeOpenAI:
    """Stands in for OpenAIServing: the real TeeEngineClient and EngineTap around the
    fake engine, and a stream generator that behaves as vLLM's does (one event per
    output, an in-stream error event on an engine exception, then [DONE])."""

    def __init__(self, engine: Engine) -> None:
        from neuron_serving.triton.openai_serving import TeeEngineClient

        self.engine = TeeEngineClient(engine)

    async def handle(self, env):
        from vllm.sampling_params import RequestOutputKind

        from neuron_serving.triton import openai_serving as s

        tap = s.EngineTap(env.resume, env.priority)
        s._TAP.set(tap)
        if "max_tokens" not in env.body:
            return s.OpenAIResult(400, tap, b'{"error":{"message":"max_tokens","code":400}}')
        stream = env.body.get("stream", False)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        params = SimpleNamespace(max_tokens=env.body["max_tokens"], output_kind=kind, min_tokens=0)
        # As vLLM's serving layer: the body's priority as a keyword (the tee replaces it).
        priority = env.body.get("priority", 0)
        outputs = self.engine.generate(
            {"prompt_token_ids": [7, 8, 9]}, params, "r", priority=priority
        )
        if not stream:
            async for out in outputs:
                text = out.outputs[0].text
            tap.carry()
            return s.OpenAIResult(200, tap, json.dumps({"text": text}).encode())
        held = env.body.get("hold", [])  # token indices whose output makes no event
        return s.OpenAIResult(200, tap, stream=self._events(outputs, held))

    async def _events(self, outputs, held):
        try:
            async for out in outputs:
                if out.outputs[0].token_ids[0] in held:
                    continue  # as vLLM holds back a partial UTF-8 character
                yield f"data: {json.dumps({'text': out.outputs[0].text})}\n\n"
        except Exception as e:  # noqa: BLE001 - as vLLM's chat_completion_stream_generator
            yield f"data: {json.dumps({'error': {'message': str(e), 'code': 500}})}\n\n"
        yield "data: [DONE]\n\n"


@pytest.fixture
def openai_backend():
    b = make_backend(openai_serving=FakeOpenAI)
    yield b
    b.finalize()


def openai_request(sender: Sender, body: dict, **envelope: Any) -> Request:
    env = {"endpoint": "chat/completions", "body": body, **envelope}
    return Request(sender, openai_request=json.dumps(env).encode())


def body_of(r: InferenceResponse) -> str:
    return r.outputs["openai_body"][0].decode()


def test_openai_priority_is_the_envelopes_not_the_bodys(openai_backend) -> None:
    """The traffic class: the engine gets the envelope's priority for every call, and
    a client's own ``priority`` field changes nothing."""
    for envelope_priority in (2, 0):
        s = Sender()
        body = {"max_tokens": 2, "priority": -50}
        openai_backend.execute([openai_request(s, body, priority=envelope_priority)])
        assert wait_final(s).error is None
    # Not the idle canaries' (which may run between the two): the requests'.
    calls = openai_backend.engine.calls
    assert [p for rid, p in calls if not rid.startswith("canary-")] == [2, 0]


def test_openai_non_streaming_is_one_final_with_status_body_and_ids(openai_backend) -> None:
    s = Sender()
    openai_backend.execute([openai_request(s, {"max_tokens": 3}, token_ids=True)])
    r = wait_final(s)
    assert len(s.sent) == 1 and r.error is None
    out = r.outputs
    assert out["openai_status"].tolist() == [200]
    assert json.loads(body_of(r)) == {"text": "t0 t1 t2 "}
    assert out["prompt_token_ids"].tolist() == [7, 8, 9]
    assert out["token_ids"].tolist() == [0, 1, 2]
    assert out["finish_reason"][0] == b"length"
    assert out["prompt_tokens"][0] == 3 and out["completion_tokens"][0] == 3


def test_openai_stream_status_first_ids_per_response_done_last(openai_backend) -> None:
    s = Sender()
    body = {"max_tokens": 4, "stream": True}
    openai_backend.execute([openai_request(s, body, token_ids=True)])
    wait_final(s)
    outs = [r.outputs for r, _ in s.sent]
    assert [f for _, f in s.sent] == [0] * (len(s.sent) - 1) + [FINAL]
    assert outs[0]["openai_status"].tolist() == [200]
    assert outs[0]["prompt_token_ids"].tolist() == [7, 8, 9]
    assert all("openai_status" not in o and "prompt_token_ids" not in o for o in outs[1:])
    assert all("finish_reason" not in o for o in outs[:-1])
    assert outs[-1]["finish_reason"][0] == b"length"
    assert outs[-1]["completion_tokens"][0] == 4
    assert [i for o in outs for i in o["token_ids"].tolist()] == [0, 1, 2, 3]
    text = "".join(body_of(r) for r, _ in s.sent)
    events = [f"data: {json.dumps({'text': f't{i} '})}\n\n" for i in range(4)]
    assert text == "".join(events) + "data: [DONE]\n\n"
    # The last event and [DONE] were ready together: one response, the FINAL one.
    assert body_of(s.sent[-1][0]).endswith("data: [DONE]\n\n")
    assert body_of(s.sent[-1][0]).startswith("data: {")


def test_openai_prefix_cache_hit_on_the_last_response_but_not_for_a_resume(
    openai_backend,
) -> None:
    """vLLM's ``num_cached_tokens`` goes with an OpenAI call's last response whether or
    not the client asked for usage; a resumed call's engine prompt (prompt plus the
    tokens already streamed) is not the request's, so it sends none."""
    openai_backend.engine.cached_tokens = 2
    for body in ({"max_tokens": 3, "stream": True}, {"max_tokens": 3}):
        s = Sender()
        openai_backend.execute([openai_request(s, body)])
        wait_final(s)
        assert not any("cached_tokens" in r.outputs for r, _ in s.sent[:-1])
        assert s.sent[-1][0].outputs["cached_tokens"].tolist() == [2]
    s = Sender()
    resume = {"prompt_token_ids": [7, 8, 9], "output_token_ids": [0]}
    body = {"max_tokens": 3, "stream": True}
    openai_backend.execute([openai_request(s, body, token_ids=True, resume=resume)])
    wait_final(s)
    assert s.sent[-1][0].outputs["finish_reason"][0] == b"length"
    assert not any("cached_tokens" in r.outputs for r, _ in s.sent)


def test_openai_without_token_ids_sends_no_ids(openai_backend) -> None:
    s = Sender()
    openai_backend.execute([openai_request(s, {"max_tokens": 2, "stream": True})])
    wait_final(s)
    assert all(
        "token_ids" not in r.outputs and "prompt_token_ids" not in r.outputs for r, _ in s.sent
    )


def test_openai_error_status_is_one_final_relayed_as_is(openai_backend) -> None:
    s = Sender()
    openai_backend.execute([openai_request(s, {"stream": True}, token_ids=True)])
    r = wait_final(s)
    assert len(s.sent) == 1 and r.error is None
    assert r.outputs["openai_status"].tolist() == [400]
    assert json.loads(body_of(r))["error"]["code"] == 400
    assert r.outputs["finish_reason"][0] == b"done"


def test_openai_engine_death_mid_stream_is_unavailable_not_an_event(openai_backend) -> None:
    engine = openai_backend.engine
    engine.fail_after = 2
    engine.errored = True  # AsyncLLM's flag once EngineCore is gone
    s = Sender()
    openai_backend.execute([openai_request(s, {"max_tokens": 8, "stream": True})])
    r = wait_final(s)
    assert r.error.code == TritonError.UNAVAILABLE and "unavailable" in r.error.message
    assert not any('"error"' in body_of(x) for x, _ in s.sent if x.error is None)


def test_openai_request_error_mid_stream_is_relayed_as_vllms_event(openai_backend) -> None:
    openai_backend.engine.fail_after = 2  # the unit is healthy: a per-request failure
    s = Sender()
    openai_backend.execute([openai_request(s, {"max_tokens": 8, "stream": True})])
    r = wait_final(s)
    assert r.error is None and body_of(r).endswith("data: [DONE]\n\n")
    assert '"error"' in "".join(body_of(x) for x, _ in s.sent)


def test_openai_on_a_dead_unit_is_unavailable(openai_backend) -> None:
    openai_backend.engine.dead = True
    deadline = time.monotonic() + 10
    while openai_backend.health.healthy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s = Sender()
    openai_backend.execute([openai_request(s, {"max_tokens": 2})])
    assert wait_final(s).error.code == TritonError.UNAVAILABLE


def test_openai_request_without_the_serving_layer_is_invalid_arg(backend) -> None:
    s = Sender()
    backend.execute([openai_request(s, {"max_tokens": 2})])
    assert wait_final(s).error.code == TritonError.INVALID_ARG


def test_openai_slow_sends_coalesce_events_exactly(openai_backend) -> None:
    engine = openai_backend.engine
    engine.collect = True
    engine.step_s = 0.001
    s = Sender(send_s=0.01)
    openai_backend.execute([openai_request(s, {"max_tokens": 40, "stream": True}, token_ids=True)])
    wait_final(s)
    text = "".join(
        json.loads(line[6:])["text"]
        for r, _ in s.sent
        for line in body_of(r).split("\n\n")
        if line.startswith("data: {")
    )
    assert text == "".join(f"t{i} " for i in range(40))
    assert [i for r, _ in s.sent for i in r.outputs["token_ids"].tolist()] == list(range(40))
    assert len(s.sent) < 20, "outputs were not merged"


def test_openai_ids_of_an_output_without_event_go_with_the_next_event(openai_backend) -> None:
    """token_ids never run ahead of the text a response carries: a migration resumes
    after exactly the tokens whose text the client has."""
    openai_backend.engine.step_s = 0.01
    s = Sender()
    body = {"max_tokens": 4, "stream": True, "hold": [1]}
    openai_backend.execute([openai_request(s, body, token_ids=True)])
    wait_final(s)
    pairs = [(body_of(r), r.outputs["token_ids"].tolist()) for r, _ in s.sent]
    assert [ids for _, ids in pairs] == [[0], [1, 2], [3]]
    assert '"t2 "' in pairs[1][0] and '"t1 "' not in "".join(b for b, _ in pairs)


def test_a_slow_request_that_asked_gets_progress_reports(backend) -> None:
    """Slow is not dead (progress.py): a non-streamed request whose tokens take 0.3 s
    gets ``progress``-only responses every interval when it asked (the proxy's
    ``report_progress``), and a plain Triton client's gets none."""
    backend.progress.interval_s = 0.05
    backend.engine.step_s = 0.1
    asked, plain = Sender(), Sender()
    params = json.dumps({"max_tokens": 3})
    backend.execute([
        Request(asked, text_input=b"hi", sampling_parameters=params,
                report_progress=np.array([True])),
        Request(plain, text_input=b"hi", sampling_parameters=params),
    ])  # fmt: skip
    assert text(wait_final(asked)) == text(wait_final(plain)) == "hit0 t1 t2 "
    reports = [r for r, flags in asked.sent if list(r.outputs) == ["progress"]]
    assert reports and all(flags == 0 for r, flags in asked.sent[:-1])
    assert len(plain.sent) == 1  # the answer alone
    assert len(backend.progress) == 0  # untracked once answered


def test_every_channel_call_gets_progress_reports(backend) -> None:
    """The channel's only client is the proxy: its calls are reported on unasked."""
    backend.progress.interval_s = 0.05
    backend.engine.step_s = 0.1
    call = ChannelCall(7)
    from neuron_serving.openai_channel import Generate

    async def open_call() -> None:
        backend._open_channel_call(call, Generate(7, "hi", '{"max_tokens": 3}'))

    backend.engine_thread.call(open_call(), 5.0)
    assert call.done.wait(5.0) and call.progress_reports >= 1
