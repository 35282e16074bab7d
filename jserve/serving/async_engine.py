"""The engine loop of a server: one asyncio task steps the `Engine` while request handlers
add and abort requests and await their token streams.

A jit step takes milliseconds to seconds, so it runs in a worker thread (`to_thread`) and
the event loop keeps serving HTTP meanwhile. `EngineState` is not thread-safe, so handlers
never touch the engine: they queue adds and aborts, and the loop task applies them on the
loop thread between steps, when no step is running. After each step the loop publishes
every advanced request's new tokens and text to that request's queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jserve.engine.fork import child_request_ids
from jserve.engine.loop import Engine
from jserve.engine.request import FinishReason, Request, RequestMetrics
from jserve.engine.sampling_params import SamplingParams
from jserve.serving.server_metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    """What a request gained since its consumer last read: new tokens and their text."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # set on the last delta
    metrics: RequestMetrics | None = None  # the finished request's timings, on the last delta
    # Asked-for log-probabilities (`SamplingParams.logprobs`): the new tokens' own and their
    # top alternatives; the prompt's (`prompt_logprobs`) on the first delta only.
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cumulative_logprob: float | None = None  # the sequence's, on the last delta (`best_of`)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: Delta) -> Delta:
        def join(a: list | None, b: list | None) -> list | None:
            return None if a is None and b is None else (a or []) + (b or [])

        return Delta(self.token_ids + later.token_ids, self.text + later.text,
                     later.finish_reason, later.metrics, join(self.logprobs, later.logprobs),
                     join(self.top_logprobs, later.top_logprobs),
                     self.prompt_logprobs or later.prompt_logprobs, later.cumulative_logprob)


class RequestStream:
    """One request's deltas as an async iterator. Deltas that piled up while the consumer
    was busy come out merged, one per read. `close()` aborts the request unless it has
    finished, so a consumer that stops early (client gone) frees its blocks."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self._done = False

    def put(self, item: Delta | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        delta = self._take(await self._queue.get())
        while not delta.finished and not self._queue.empty():
            delta = delta.then(self._take(self._queue.get_nowait()))
        self._done = delta.finished
        return delta

    def _take(self, item: Delta | BaseException) -> Delta:
        if isinstance(item, BaseException):
            self._done = True  # the engine already dropped the request
            raise item
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


@dataclass
class _Live:
    """Publishing state of a request the engine holds."""

    stream: RequestStream
    holdback: int  # trailing characters withheld while a stop string may still be forming
    num_tokens_sent: int = 0
    num_chars_sent: int = 0
    forked: tuple[str, ...] = ()  # the ids of the sequences the engine forks from it


class EngineStopped(RuntimeError):
    """The server shut down before the request finished."""


class QueueFull(RuntimeError):
    """Too many requests wait for the engine already; the client should retry later."""


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None,
                 max_waiting: int | None = None) -> None:
        """`max_waiting`: refuse new requests with `QueueFull` while this many wait (queued
        adds included); None: no limit. Output-length predictions are the engine's own."""
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.max_waiting = max_waiting
        self._num_adding = 0  # adds queued for the loop, not yet in the engine's waiting count
        self._draining = False
        self._live: dict[str, _Live] = {}
        self._ops: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the loop task on the running event loop."""
        self.metrics.update(self.engine)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="jserve-engine")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def drain(self, timeout: float) -> None:
        """Shut down gracefully: refuse new requests, let those in flight finish for up to
        `timeout` seconds, then stop, failing the rest with `EngineStopped` (their handlers
        answer 503, their streams end with an error event)."""
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._live and self.running and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self._live:
            log.warning("aborting %d request(s) still running after the %.0f s drain",
                        len(self._live), timeout)
        await self.stop()

    async def stop(self) -> None:
        """Let the running step finish, stop, and fail the requests still in flight."""
        if self._task is None:
            return
        self._stopping = True
        self._wake.set()
        await self._task
        self._task = None
        self._apply_ops()  # settle handlers still waiting for admission
        self._fail_all(EngineStopped("the server is shutting down"))

    # ------------------------------------------------------------------ requests
    async def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
        prompt: str | None = None, ttft_slo: float | None = None, tbt_slo: float | None = None,
        conversation_id: str | None = None,
    ) -> list[RequestStream]:
        """Queue a request and wait until the engine has admitted it; raises the engine's
        `InvalidRequestError` if it refuses. Returns a stream per sequence the request
        generates (`params.num_sequences`, in index order: the engine forks the others at
        the first one's first token). The caller must `close()` every stream; closing the
        first aborts them all."""
        if not self.running or self._stopping or self._draining:
            raise EngineStopped("the server is shutting down" if self._draining
                                else "the engine loop is not running")
        if self.max_waiting is not None and self.metrics.num_waiting + self._num_adding >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are already waiting; retry later")
        admitted: asyncio.Future[list[RequestStream]] = asyncio.get_running_loop().create_future()
        arrival = self.engine.clock()

        def add() -> None:
            self._num_adding -= 1
            if admitted.cancelled():  # the handler is gone already
                return
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, prompt=prompt,
                                        arrival_time=arrival, ttft_slo=ttft_slo, tbt_slo=tbt_slo,
                                        conversation_id=conversation_id)
            except Exception as e:  # InvalidRequestError, or a bug the handler reports as 500
                admitted.set_exception(e)
                return
            # Streams only for an admitted request: the engine has checked its sequence count
            # (a fuzzed best_of of 4 million once made as many streams before the refusal).
            forked = child_request_ids(request_id, params)
            streams = [RequestStream(self, rid) for rid in (request_id, *forked)]
            holdback = max((len(s) for s in params.stop), default=1) - 1
            self._live[request_id] = _Live(streams[0], holdback, forked=forked)
            self._live.update((rid, _Live(stream, holdback)) for rid, stream in zip(forked, streams[1:]))
            admitted.set_result(streams)

        self._num_adding += 1
        self._submit(add)
        try:
            return await admitted
        except asyncio.CancelledError:
            self.abort(request_id)  # admitted just as the handler was cancelled
            raise

    def abort(self, request_id: str) -> None:
        """Drop a request (its client left), with the sequences forked from it; frees their
        blocks before the next step. A forked sequence's stream still open ends aborted."""

        def abort() -> None:
            live = self._live.pop(request_id, None)
            for rid in () if live is None else live.forked:
                child = self._live.pop(rid, None)
                if child is not None:
                    child.stream.put(Delta([], "", FinishReason.ABORT.value))
            if self.engine.abort(request_id) is not None:
                self.metrics.finished.labels("abort").inc()

        self._submit(abort)

    def _submit(self, op: Callable[[], None]) -> None:
        self._ops.append(op)
        self._wake.set()

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        while not self._stopping:
            self._apply_ops()
            if not self.engine.has_unfinished:
                self._wake.clear()  # nothing was submitted since the ops ran: no await between
                await self._wake.wait()
                continue
            try:
                self._publish(await asyncio.to_thread(self.engine.step))
            except Exception as e:  # a policy or runner bug: fail what is in flight, keep serving
                log.exception("engine step failed; aborting the %d requests in flight", len(self._live))
                self._fail_all(e)
            self.metrics.update(self.engine)

    def _apply_ops(self) -> None:
        if self._ops:
            ops, self._ops = self._ops, []
            for op in ops:
                op()
            self.metrics.update(self.engine)

    def _publish(self, updated: list[Request]) -> None:
        for req in updated:
            live = self._live.get(req.request_id)
            if live is None:
                continue
            self.metrics.observe_tokens(req, live.num_tokens_sent)
            text = req.text
            end = len(text) if req.finished else max(live.num_chars_sent, len(text) - live.holdback)
            finish = None if req.finish_reason is None else req.finish_reason.value
            sent = live.num_tokens_sent
            asked = req.top_logprobs is not None
            live.stream.put(Delta(req.output_token_ids[sent:], text[live.num_chars_sent:end], finish,
                                  req.metrics if req.finished else None,
                                  req.output_logprobs[sent:] if asked else None,
                                  req.top_logprobs[sent:] if asked else None,
                                  req.prompt_logprobs if sent == 0 else None,
                                  req.cumulative_logprob if req.finished else None))
            live.num_tokens_sent = len(req.output_token_ids)
            live.num_chars_sent = end
            if req.finished:
                del self._live[req.request_id]
                self.metrics.finished.labels(finish).inc()

    def _fail_all(self, error: BaseException) -> None:
        for request_id, live in self._live.items():
            live.stream.put(error)
            self.engine.abort(request_id)
        self._live.clear()
