"""The Triton ``llm`` model: vLLM AsyncLLM behind Triton's decoupled Python backend.

``model_repository/llm/1/model.py`` is a thin shim that creates ``LLMBackend`` and
forwards ``initialize``/``execute``/``finalize``. Threads in the stub process:

- Triton's thread calls ``execute()``: it reads and validates the inputs, answers
  bad ones at once with INVALID_ARG, and schedules the rest on the engine loop. It
  never waits for generation.
- the engine thread (``EngineThread``) runs AsyncLLM, one task per request, and
  the ``UnitHealthMonitor``;
- the response thread (``ResponseThread``) sends responses and turns client
  cancellation into task cancellation (= ``abort`` in vLLM).

Invariant: every request accepted by ``execute()`` gets exactly one response
flagged FINAL, whatever happens (finished, invalid, cancelled, engine dead);
otherwise Triton keeps the request, and its client, waiting forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from neuron_serving import envs
from neuron_serving.openai_channel import Event
from neuron_serving.triton import rank_health
from neuron_serving.triton.backend_config import BackendConfig
from neuron_serving.triton.engine_load import EngineLoadTracker
from neuron_serving.triton.engine_thread import EngineThread
from neuron_serving.triton.metrics import BackendMetrics, serve_registry
from neuron_serving.triton.openai_envelope import (
    GENERATE_ENDPOINTS,
    OpenAIEnvelope,
    parse_envelope,
)
from neuron_serving.triton.progress import ProgressTracker
from neuron_serving.triton.request import (
    GenerateRequest,
    RequestError,
    check_prompt_length,
    parse_request,
)
from neuron_serving.triton.responses import ResponseThread, Stream
from neuron_serving.triton.unit_monitor import HealthSettings, UnitHealthMonitor
from neuron_serving.unit.worker_import import engine_env

log = logging.getLogger(__name__)

ENGINE_START_TIMEOUT_S = 1800.0  # model load + all followers joining


class LLMBackend:
    def __init__(self, pb_utils: Any) -> None:
        self.pb = pb_utils
        self.final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._in_flight = 0
        self._idle_since: float | None = time.monotonic()
        self._unload_started = False
        # Responses made on the engine loop in this loop iteration; flushed to the
        # response thread in one piece by a callback queued behind them (_enqueue).
        self._pending: list[tuple[str, Any, int, Any]] = []
        # The engine's load, from vLLM's scheduler stats, for the OpenAI channel.
        self.load = EngineLoadTracker()
        # A temporary directory of the KV event sockets, removed in finalize().
        self._kv_tmp: Path | None = None

    # ---- Triton entry points -------------------------------------------------------

    def initialize(self, args: dict[str, str]) -> None:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        self.model_name = args["model_name"]
        model_config = json.loads(args["model_config"])
        if not self.pb.using_decoupled_model_transaction_policy(model_config):
            raise ValueError("the llm model must use the decoupled transaction policy")
        path = Path(args["model_repository"]) / args["model_version"] / "model.json"
        self.config = BackendConfig.load(path)
        if not self.config.model:
            raise ValueError(f"{path}: 'model' is empty; the launcher renders it (--model DIR)")
        log.info("llm model settings: %s", self.config.to_dict())
        # Before vLLM is imported here and EngineCore inherits it: rank 0 compiles as
        # the followers do (unit/worker_import.py engine_env).
        os.environ.update(engine_env(envs.NEURON_SERVING_DEVICE))
        serve_registry(self.config.vllm_metrics_host, self.config.vllm_metrics_port)
        if self.config.kv_events:
            # vLLM's KV event sockets: a private directory (kv_events.py).
            from neuron_serving.triton.kv_events import resolve_dir

            kv_dir, temporary = resolve_dir(self.config.kv_events_dir)
            self.config.kv_events_dir = str(kv_dir)
            self._kv_tmp = kv_dir if temporary else None
        self.start(
            self.config,
            EngineThread(
                self.config.engine_kwargs(),
                ENGINE_START_TIMEOUT_S,
                stat_loggers=[self.load.stat_logger],
            ),
            BackendMetrics(self.config.resolved_unit_id()),
            openai_serving=self._openai_serving,
        )

    def start(
        self,
        config: BackendConfig,
        engine_thread: Any,
        metrics: BackendMetrics,
        openai_serving: Callable[[Any], Any] | None = None,
    ) -> None:
        """Everything after reading the settings; tests pass a fake engine thread.

        ``openai_serving(engine)`` builds what answers ``openai_request`` (on the
        engine loop: vLLM's serving objects belong to it); None = that input is
        refused."""
        self.config = config
        self.metrics = metrics
        # Requests that get progress reports (engine loop only).
        self.progress = ProgressTracker(on_report=metrics.progress_reports.inc)
        self.engine_thread = engine_thread
        self.engine_thread.start()
        self.engine = self.engine_thread.engine
        self.engine_thread.call(_call_on_loop(self.load.bind, self.engine), 30.0)
        self.tokenizer = self.engine.get_tokenizer()
        self.openai = None
        if openai_serving is not None:
            self.openai = self.engine_thread.call(
                _call_on_loop(openai_serving, self.engine), ENGINE_START_TIMEOUT_S
            )
        self.responses = ResponseThread(self.final, wake=self._wake_senders)
        self.responses.start()

        canary_ids = self.tokenizer.encode("Is this in stock?")[:8] or [0]
        self.health = UnitHealthMonitor(
            self.engine,
            HealthSettings(
                self.config.health_interval_s,
                self.config.canary_interval_s,
                self.config.canary_timeout_s,
            ),
            idle_since=lambda: self._idle_since,
            on_failure=self._on_unit_failure,
            canary_prompt_token_ids=canary_ids,
        )
        # Warm-up before Triton marks the model ready: one canary through every rank,
        # so "ready" means a generation has actually succeeded.
        latency = self.engine_thread.call(self.health.canary(), self.config.canary_timeout_s)
        self.metrics.canary_seconds.observe(latency)
        self.engine_thread.submit(self.health.run())
        if envs.NEURON_SERVING_LEADER_HEALTH_PORT:
            # The slow-rank verdicts of EngineCore's detector, into the load reports.
            self.engine_thread.submit(rank_health.watch(
                envs.NEURON_SERVING_LEADER_HEALTH_PORT + 1, self.load.set_degraded,
                self.config.health_interval_s, lambda: self.health.healthy,
            ))  # fmt: skip
        self.channel = self._start_channel()
        self.metrics.ready.set(1)
        log.info("llm model ready (warm-up canary %.3f s)", latency)
        if self.config.init_marker:
            Path(self.config.init_marker).write_text(f"{latency}\n")

    def execute(self, requests: list[Any]) -> None:
        """Never blocks on generation; every request ends with one FINAL response."""
        for request in requests:
            sender = request.get_response_sender()
            if not self.health.healthy:
                self.metrics.outcome("unavailable")
                sender.send(self._error(self._unavailable_message(), "UNAVAILABLE"), self.final)
                continue
            try:
                parsed = self._parse(request)
            except RequestError as e:
                self.metrics.outcome("invalid")
                sender.send(self._error(str(e), "INVALID_ARG"), self.final)
                continue
            request_id = f"{request.request_id() or 'triton'}-{uuid.uuid4().hex[:12]}"
            stream = Stream(sender)
            self.responses.register(request_id, stream)
            if isinstance(parsed, OpenAIEnvelope):
                out = _TritonOut(self, request_id, stream, self._openai_response, parsed.progress)
                coro = self._generate_openai(request_id, parsed, out)
            else:
                out = _TritonOut(
                    self, request_id, stream, self._text_response, parsed.report_progress
                )
                coro = self._generate(request_id, parsed, out)
            try:
                stream.future = self.engine_thread.submit(coro)
            except Exception as e:  # noqa: BLE001 - e.g. the engine loop already stopped
                self.metrics.outcome("unavailable")
                self.responses.put(request_id, self._error(f"{e!r}", "UNAVAILABLE"), self.final)
        return None

    def finalize(self) -> None:
        log.info("llm model finalize: stopping the engine")
        channel = getattr(self, "channel", None)
        if channel is not None:
            try:
                self.engine_thread.call(_call_on_loop(lambda _: channel.close(), None), 5.0)
            except Exception:  # noqa: BLE001 - the engine loop may be gone already
                log.debug("closing the OpenAI channel failed", exc_info=True)
        self.engine_thread.stop()
        self._flush()  # the loop has stopped: whatever its last iteration left
        self.responses.stop()
        if self._kv_tmp is not None:
            from neuron_serving.triton.kv_events import remove_dir

            remove_dir(self._kv_tmp)

    # ---- request handling ------------------------------------------------------------

    def _parse(self, request: Any) -> GenerateRequest | OpenAIEnvelope:
        def tensor(name: str) -> Any:
            t = self.pb.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy().reshape(-1)

        text = tensor("text_input")
        openai = tensor("openai_request")
        if openai is not None:
            if text is not None:
                raise RequestError("a request carries text_input or openai_request, not both")
            if openai.size != 1:
                raise RequestError("openai_request must hold exactly one string")
            if self.openai is None:
                raise RequestError("this model does not serve openai_request")
            return parse_envelope(openai[0])
        if text is None or text.size != 1:
            raise RequestError("text_input must hold exactly one string")
        stream = tensor("stream")
        exclude = tensor("exclude_input_in_output")
        want_ids = tensor("return_token_ids")
        report = tensor("report_progress")
        priority = tensor("priority")
        if priority is not None and priority.size != 1:
            raise RequestError(f"priority must hold exactly one integer, got {priority.size}")
        sampling = tensor("sampling_parameters")
        sampling_raw = sampling[0] if sampling is not None and sampling.size else None
        if sampling_raw is None:
            params = request.parameters()  # generate endpoint's "parameters", as JSON
            sampling_raw = params if params not in ("", "{}") else None
        return parse_request(
            text[0],
            stream=bool(stream[0]) if stream is not None and stream.size else False,
            exclude_input_in_output=bool(exclude[0])
            if exclude is not None and exclude.size
            else False,
            sampling_parameters=sampling_raw,
            max_model_len=self.config.max_model_len,
            return_token_ids=bool(want_ids[0]) if want_ids is not None and want_ids.size else False,
            # An INT32 tensor (Triton checks the type against the model config).
            priority=None if priority is None else int(priority[0]),
            report_progress=bool(report[0]) if report is not None and report.size else False,
        )

    async def _generate(self, request_id: str, req: GenerateRequest, out: Any) -> None:
        """One text request (Triton's generate path). ``out`` as for
        ``_generate_openai``: a Triton response sender or an OpenAI channel call."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._begin(out)
        produced = False
        try:
            prompt_ids = self.tokenizer.encode(req.prompt)
            check_prompt_length(len(prompt_ids), self.config.max_model_len)
            kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
            try:
                params = SamplingParams(**req.sampling, output_kind=kind)
            except (ValueError, TypeError) as e:
                raise RequestError(f"invalid sampling parameters: {e}") from None
            completion_tokens = 0
            cached: int | None = None  # the first output's (openai_serving.EngineTap)
            # The priority: the proxy's traffic class (the ``priority`` input, or the
            # channel's Generate.priority), never a sampling parameter a client sets.
            outputs = self.engine.generate(
                {"prompt_token_ids": prompt_ids}, params, request_id, priority=req.priority
            )
            try:
                async for output in outputs:
                    if out.cancelled:  # noticed before the task's future existed
                        raise asyncio.CancelledError
                    first, produced = not produced, True
                    if first:
                        cached = output.num_cached_tokens
                    seq = output.outputs[0]
                    n = len(seq.token_ids)
                    completion_tokens = completion_tokens + n if req.stream else n
                    text = seq.text
                    if not req.stream and not req.exclude_input_in_output:
                        text = req.prompt + text
                    finish = seq.finish_reason if output.finished else None
                    logprobs = _sampled_logprobs(seq) if "logprobs" in req.sampling else None
                    event = self._text_event(
                        text,
                        finish,
                        len(prompt_ids),
                        completion_tokens,
                        logprobs,
                        token_ids=list(seq.token_ids) if req.return_token_ids else None,
                        first=first,
                        cached_tokens=cached,
                    )
                    sent = out.send(event, output.finished)
                    if sent is not None:
                        # Backpressure: pull the next output only once this one is
                        # sent; meanwhile vLLM's output collector merges the DELTAs
                        # that arrive (see responses.py).
                        await sent
            finally:
                # Deterministic abort when we leave early: AsyncLLM.generate aborts the
                # request on GeneratorExit; waiting for garbage collection could leave
                # it running (and holding KV blocks) for a while.
                await outputs.aclose()
            self.metrics.outcome("ok")
        except asyncio.CancelledError:
            # Client cancelled (or engine shutdown): AsyncLLM.generate has already
            # aborted the request in vLLM on its way out.
            self.metrics.outcome("cancelled")
            out.error("request was cancelled", "CANCELLED")
        except RequestError as e:
            self.metrics.outcome("invalid")
            out.error(str(e), "INVALID_ARG")
        except ValueError as e:
            # vLLM's own input validation; only possible before the first output.
            outcome, code = ("invalid", "INVALID_ARG") if not produced else ("error", "INTERNAL")
            self.metrics.outcome(outcome)
            out.error(str(e), code)
        except Exception as e:  # noqa: BLE001 - the client must always get a FINAL response
            dead = self.engine.errored or not self.health.healthy
            log.exception("request %s failed", request_id)
            self.metrics.outcome("unavailable" if dead else "error")
            message = self._unavailable_message() if dead else f"generation failed: {e!r}"
            out.error(message, "UNAVAILABLE" if dead else "INTERNAL")
        finally:
            self._end(out)

    async def _generate_openai(self, request_id: str, env: OpenAIEnvelope, out: Any) -> None:
        """One OpenAI call through vLLM's serving layer; the bodies are relayed verbatim.

        ``out``: where the answer goes, a Triton response sender (``_TritonOut``) or
        an OpenAI channel call (``ChannelCall``): ``send(event, final)`` returns the
        future to await before pulling more (None once final), ``error(message,
        code)`` ends the call, ``cancelled`` is set by the client's cancellation.

        Same discipline as ``_generate``: one final response whatever happens, the
        next SSE events pulled only once the previous response was sent (SSEPuller),
        and a unit fault is an UNAVAILABLE error, never vLLM's in-stream error event.
        """
        from neuron_serving.triton.openai_serving import SSEPuller

        self._begin(out)
        puller = None
        try:
            # OpenAI calls are admitted only with it (_parse, _start_channel).
            assert self.openai is not None
            result = await self.openai.handle(env)
            tap = result.tap
            if result.stream is None:
                # vLLM's full generators answer a cancellation with an error body.
                if out.cancelled:
                    raise asyncio.CancelledError
                self._check_unit(tap, result.status)
                out.send(self._openai_event(env, tap, result.body, result.status, True), True)
                self.metrics.outcome(_outcome(result.status))
                return
            puller = SSEPuller(result.stream, tap)
            status: int | None = result.status
            while True:
                body = await puller.pull()
                if out.cancelled:  # noticed before the task's future existed
                    raise asyncio.CancelledError
                self._check_unit(tap)
                event = self._openai_event(env, tap, body.encode("utf-8"), status, puller.done)
                status = None
                sent = out.send(event, puller.done)
                if puller.done:
                    break
                if sent is not None:
                    await sent
            self.metrics.outcome("ok")
        except asyncio.CancelledError:
            self.metrics.outcome("cancelled")
            out.error("request was cancelled", "CANCELLED")
        except _UnitFault:
            self.metrics.outcome("unavailable")
            out.error(self._unavailable_message(), "UNAVAILABLE")
        except Exception as e:  # noqa: BLE001 - the client must always get a final response
            log.exception("request %s failed", request_id)
            dead = self._unit_down(e)
            self.metrics.outcome("unavailable" if dead else "error")
            message = self._unavailable_message() if dead else f"generation failed: {e!r}"
            out.error(message, "UNAVAILABLE" if dead else "INTERNAL")
        finally:
            if puller is not None:
                await puller.aclose()
            self._end(out)

    # ---- the OpenAI channel ------------------------------------------------------------

    def _start_channel(self) -> Any:
        """Serve the OpenAI channel on the engine loop (after the warm-up canary: like
        Triton, it takes requests only once the model is ready). A channel that cannot
        start leaves the leader serving through Triton alone, which the proxy falls
        back to; it is logged, not fatal."""
        c = self.config
        if c.openai_channel_port is None or self.openai is None:
            return None
        from neuron_serving.openai_channel import resolve_token
        from neuron_serving.triton.channel_server import ChannelServer

        try:
            server = ChannelServer(
                resolve_token(), self._open_channel_call, self.load, kv=self._kv_relay()
            )
            port = self.engine_thread.call(
                server.start(c.openai_channel_host, c.openai_channel_port), 30.0
            )
        except Exception as e:  # noqa: BLE001 - SecretError, OSError (port taken)
            log.error("the OpenAI channel is off (the proxy uses Triton): %s", e)
            return None
        log.info("OpenAI channel on %s:%d", c.openai_channel_host, port)
        return server

    def _kv_relay(self) -> Any:
        """The relay of the engine's KV cache events to the channel's proxies
        (kv_events_relay.py), or None: events off, or the engine publishes none (prefix
        caching off). A relay that cannot be built leaves the channel without KV events
        (logged): the proxies then route without an exact index."""
        if not self.config.kv_events:
            return None
        from neuron_serving.triton import kv_events

        try:
            source = kv_events.published(self.engine)
            if source is None:
                log.info("the engine publishes no KV cache events (prefix caching off?)")
                return None
            from neuron_serving.triton.kv_events_relay import KvEventsRelay

            relay = KvEventsRelay(source, kv_events.hashing(self.engine))
        except Exception as e:  # noqa: BLE001 - an engine without the fields, ImportError
            log.error("KV cache events are not relayed: %s", e)
            return None
        log.info("relaying KV cache events from %s", source.endpoint)
        return relay

    def _open_channel_call(self, call: Any, message: Any) -> None:
        """Engine loop: the channel's ``execute()`` for one ``Open`` (an OpenAI call)
        or ``Generate`` (a text request), with the same checks."""
        from neuron_serving.openai_channel import Open

        if not self.health.healthy:
            self.metrics.outcome("unavailable")
            call.error(self._unavailable_message(), "UNAVAILABLE")
            return
        request_id = f"channel-{call.id}-{uuid.uuid4().hex[:12]}"
        try:
            if isinstance(message, Open):
                coro = self._generate_openai(request_id, parse_envelope(message.envelope), call)
            else:
                req = parse_request(
                    message.text_input,
                    stream=True,
                    exclude_input_in_output=True,
                    sampling_parameters=message.sampling_parameters,
                    max_model_len=self.config.max_model_len,
                    priority=message.priority,
                )
                coro = self._generate(request_id, req, call)
        except RequestError as e:
            self.metrics.outcome("invalid")
            call.error(str(e), "INVALID_ARG")
            return
        call.task = asyncio.get_running_loop().create_task(coro)

    def _begin(self, out: Any) -> None:
        self._in_flight += 1
        self._idle_since = None
        if out.reports_progress:
            self.progress.track(out)

    def _end(self, out: Any) -> None:
        self.progress.untrack(out)
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle_since = time.monotonic()
            # An aborted request ends with no scheduler stats after it: the load
            # report turns idle here (engine_load.py, "Idle").
            self.load.refresh()

    def _unit_down(self, fault: BaseException | None) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(fault, EngineDeadError) or self.engine.errored or not self.health.healthy

    def _check_unit(self, tap: Any, status: int | None = None) -> None:
        """The engine failed under this request: a unit fault ends it as UNAVAILABLE
        (whatever vLLM made of it), anything else is relayed as vLLM answers it. A 5xx
        answer with the engine dead is one too even when the failure never passed
        through the tap (vLLM refused the request up front: "EngineCore encountered an
        issue"), so the proxy retries it on another unit instead of relaying a 500."""
        if tap.fault is not None and self._unit_down(tap.fault):
            raise _UnitFault from tap.fault
        if status is not None and status >= 500 and self._unit_down(None):
            raise _UnitFault

    def _openai_serving(self, engine: Any) -> Any:
        from neuron_serving.checkpoint.served_name import default_served_name
        from neuron_serving.triton.openai_serving import OpenAIServing

        c = self.config
        name = c.served_model_name or default_served_name(Path(c.model))
        return OpenAIServing(engine, name, c.model, c.tool_call_parser, c.model_version)

    # ---- responses -------------------------------------------------------------------

    def _enqueue(self, request_id: str, response: Any, flags: int = 0, waiter: Any = None) -> None:
        """Engine loop only: queue a response for the response thread.

        An engine step wakes every running request's task in the same loop iteration,
        and each makes one response. Handing them over one by one cost a queue
        operation and a futex wake-up of the response thread per token; batched, it is
        one per step. The flush callback is queued behind the tasks that are ready now,
        so it runs once they all have; order per request is kept (one list, in order).
        """
        self._pending.append((request_id, response, flags, waiter))
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        items, self._pending = self._pending, []
        self.responses.put_batch(items)

    def _wake_senders(self, waiters: list[asyncio.Future]) -> None:
        """Response thread -> engine loop, once per drained batch."""
        self.engine_thread.loop.call_soon_threadsafe(_resolve_all, waiters)

    def _text_event(
        self,
        text: str,
        finish_reason: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        logprobs: list[float] | None,
        *,
        token_ids: list[int] | None = None,
        first: bool = False,
        cached_tokens: int | None = None,
    ) -> Event:
        """One response of a text request, for either output (the text as ``body``).
        The counts and the finish reason go with the first and the last response
        only: each output tensor of each Triton response is a shared-memory
        allocation in the stub and an output tensor in tritonserver and its front
        end, and text alone on the middle ones cut the leader's CPU per streamed token
        by ~20 % (stub 185 -> 147 us, tritonserver 112 -> 95 us; Triton README).
        Readers take counts as a maximum over the responses they saw
        (proxy/upstream/triton_grpc.py). ``cached_tokens`` goes with the last response only:
        the proxy reads it with the request's final response."""
        event = Event(0, text.encode("utf-8"), finish_reason=finish_reason)
        if first or finish_reason is not None:
            event.prompt_tokens, event.completion_tokens = prompt_tokens, completion_tokens
        if finish_reason is not None:
            event.cached_tokens = cached_tokens
        event.logprobs = logprobs
        event.token_ids = token_ids
        if first and self.config.model_version:
            event.model_version = self.config.model_version
        return event

    def _text_response(self, e: Event) -> Any:
        """A text request's event as the Triton ``llm`` model's outputs."""
        T = self.pb.Tensor
        tensors = [T("text_output", np.array([e.body], dtype=np.object_))]
        if e.prompt_tokens is not None:
            tensors += [
                T("finish_reason", np.array([(e.finish_reason or "").encode()], dtype=np.object_)),
                T("prompt_tokens", np.array([e.prompt_tokens], dtype=np.int32)),
                T("completion_tokens", np.array([e.completion_tokens], dtype=np.int32)),
            ]
        if e.cached_tokens is not None:
            tensors.append(T("cached_tokens", np.array([e.cached_tokens], dtype=np.int32)))
        if e.logprobs is not None:
            tensors.append(
                T("logprobs", np.array([json.dumps(e.logprobs).encode()], dtype=np.object_))
            )
        if e.token_ids is not None:
            tensors.append(T("token_ids", np.array(e.token_ids, dtype=np.int64)))
        if e.model_version is not None:
            version = e.model_version.encode()
            tensors.append(T("model_version", np.array([version], dtype=np.object_)))
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _openai_event(
        self, env: OpenAIEnvelope, tap: Any, body: bytes, status: int | None, last: bool
    ) -> Event:
        """One response of an OpenAI call, for either output. ``status`` (and the
        prompt ids, model version) go with the first response only, counts with the
        first and the last, the finish reason and the cached tokens with the last:
        fewer tensors per streamed Triton response, as on the text path. The cached
        tokens are not the body's: vLLM's ``usage`` shows them only with
        ``enable_prompt_tokens_details`` (off, as in ``vllm serve``), and a stream has
        ``usage`` only when the client asked; the proxy needs them for every call."""
        event = Event(0, body)
        first = status is not None
        ids = env.token_ids and env.endpoint in GENERATE_ENDPOINTS
        if first:
            event.status = status
            if ids and tap.prompt_token_ids is not None:
                event.prompt_token_ids = list(tap.prompt_token_ids)
            if self.config.model_version:
                event.model_version = self.config.model_version
        if ids:
            event.token_ids = tap.take_token_ids()
        if (first or last) and tap.prompt_token_ids is not None:
            event.prompt_tokens = len(tap.prompt_token_ids)
            event.completion_tokens = tap.completion_tokens
        if last:
            event.finish_reason = tap.finish_reason or "done"
            event.cached_tokens = tap.cached_tokens
        return event

    def _openai_response(self, e: Event) -> Any:
        """An OpenAI call's event as the Triton ``llm`` model's outputs."""
        T = self.pb.Tensor
        tensors = [T("openai_body", np.array([e.body], dtype=np.object_))]
        if e.status is not None:
            tensors.append(T("openai_status", np.array([e.status], dtype=np.int32)))
        if e.prompt_token_ids is not None:
            tensors.append(T("prompt_token_ids", np.array(e.prompt_token_ids, dtype=np.int64)))
        if e.model_version is not None:
            version = e.model_version.encode()
            tensors.append(T("model_version", np.array([version], dtype=np.object_)))
        if e.token_ids is not None:
            tensors.append(T("token_ids", np.array(e.token_ids, dtype=np.int64)))
        if e.prompt_tokens is not None:
            tensors += [
                T("prompt_tokens", np.array([e.prompt_tokens], dtype=np.int32)),
                T("completion_tokens", np.array([e.completion_tokens], dtype=np.int32)),
            ]
        if e.finish_reason is not None:
            tensors.append(
                T("finish_reason", np.array([e.finish_reason.encode()], dtype=np.object_))
            )
        if e.cached_tokens is not None:
            tensors.append(T("cached_tokens", np.array([e.cached_tokens], dtype=np.int32)))
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _progress_response(self) -> Any:
        """A Triton response that only says the request is alive (progress.py)."""
        progress = self.pb.Tensor("progress", np.array([True], dtype=np.bool_))
        return self.pb.InferenceResponse(output_tensors=[progress])

    def _error(self, message: str, code: str) -> Any:
        error = self.pb.TritonError(message, getattr(self.pb.TritonError, code))
        return self.pb.InferenceResponse(output_tensors=[], error=error)

    def _unavailable_message(self) -> str:
        return f"model {self.model_name} is unavailable: {self.health.reason or 'unit failed'}"

    # ---- unit failure ----------------------------------------------------------------

    def _on_unit_failure(self, reason: str) -> None:
        """Runs on the engine loop: flip readiness, fail in-flight requests."""
        self.metrics.ready.set(0)
        # Unloading ourselves makes /v2/models/llm/ready false at once (the server
        # runs with --model-control-mode=explicit, which the model-loading API needs).
        # unload_model waits on Triton, so it must not run on the engine loop.
        if not self._unload_started:
            self._unload_started = True
            threading.Thread(target=self._unload, name="llm-unload", daemon=True).start()

    def _unload(self) -> None:
        try:
            self.pb.unload_model(self.model_name)
        except Exception:  # noqa: BLE001 - the leader still exits on its readiness watch
            log.exception("unloading %s after a unit failure failed", self.model_name)


class _TritonOut:
    """A Triton response sender as a request's output (the channel's is
    ``channel_server.ChannelCall``; ``_generate`` and ``_generate_openai`` take either)."""

    __slots__ = ("backend", "request_id", "stream", "render", "reports_progress", "sends", "seen")

    def __init__(
        self,
        backend: LLMBackend,
        request_id: str,
        stream: Stream,
        render: Callable[[Event], Any],
        reports_progress: bool = False,
    ) -> None:
        self.backend = backend
        self.request_id = request_id
        self.stream = stream
        self.render = render  # event -> InferenceResponse (text or OpenAI outputs)
        # The client asked for progress reports (the envelope's ``progress``, the
        # ``report_progress`` input): a plain Triton client never sees one.
        self.reports_progress = reports_progress
        self.sends = 0  # responses sent (progress.ProgressTracker)
        self.seen = 0

    @property
    def cancelled(self) -> bool:
        return self.stream.cancelled

    def send(self, event: Event, final: bool) -> asyncio.Future | None:
        b = self.backend
        self.sends += 1
        if final:
            b._enqueue(self.request_id, self.render(event), b.final)
            return None
        sent = asyncio.get_running_loop().create_future()
        b._enqueue(self.request_id, self.render(event), 0, sent)
        return sent

    def error(self, message: str, code: str) -> None:
        b = self.backend
        b._enqueue(self.request_id, b._error(message, code), b.final)

    def progress(self) -> None:
        b = self.backend
        b._enqueue(self.request_id, b._progress_response())


class _UnitFault(Exception):
    """The engine died (or the unit went unhealthy) under an OpenAI request."""


def _outcome(status: int) -> str:
    return "ok" if status < 400 else "invalid" if status < 500 else "error"


async def _call_on_loop(fn: Callable[[Any], Any], arg: Any) -> Any:
    return fn(arg)


def _resolve_all(waiters: list[asyncio.Future]) -> None:
    for waiter in waiters:
        if not waiter.done():  # cancelled with its request task
            waiter.set_result(None)


def _sampled_logprobs(seq: Any) -> list[float]:
    """Log-probability of each sampled token (vLLM returns the top-k per position)."""
    if not seq.logprobs:
        return []
    return [float(pos[tok].logprob) for tok, pos in zip(seq.token_ids, seq.logprobs, strict=False)]
