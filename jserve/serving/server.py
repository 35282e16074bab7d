"""OpenAI-compatible HTTP server around one engine (`jserve serve`).

Routes: `/v1/completions` and `/v1/chat/completions` (server-sent events with
`stream: true`), `/v1/models`, `/health`, `/metrics` (Prometheus). Handlers only tokenize
(in a worker thread, so a large prompt never stalls the other routes), validate and hand
requests to the `AsyncEngine`, whose single loop steps the engine; every error a client can
cause comes back as OpenAI's error JSON with a 4xx status. `RequestGuard` checks the API key
and the body size before FastAPI reads anything; `JServeServer` drains the engine on
SIGINT/SIGTERM before uvicorn closes the connections.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from jserve.config import ServerConfig
from jserve.errors import InvalidRequestError
from jserve.serving.async_engine import AsyncEngine, Delta, EngineStopped, QueueFull, RequestStream
from jserve.serving.llm import LLM, render_chat
from jserve.serving.openai_protocol import (
    CHAT,
    COMPLETION,
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    OpenAIError,
    ResponseFormat,
    ResponseHeader,
    TokenLogprobs,
    model_list,
    model_not_found,
    preemption_info,
    usage,
)
from jserve.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60
# uvicorn's own backstop after the engine's drain: the drain has ended every request by
# then, so connections close well within it (a second Ctrl-C cuts at once).
CONNECTION_CLOSE_S = 5
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait


class EventStreamResponse(StreamingResponse):
    """Server-sent events that close their request stream however the response ends
    (finished, client gone: the send task is cancelled, server stopping), so an abandoned
    request is aborted and its KV blocks freed."""

    def __init__(self, stream: RequestStream, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


class ClientGone(Exception):
    """The client closed its connection before its non-streaming answer was ready."""


async def _until_disconnected(receive: Receive) -> None:
    """Return once the client has gone. The body is already read, so the server's next
    message is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """`work`'s result, or `ClientGone` as soon as the client disconnects (`work` is then
    cancelled), so nobody waits on a request whose answer has nowhere to go."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task  # let it unwind before the caller aborts the request
    raise ClientGone


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class OpenAIServer:
    """The routes' logic: one served model, one engine loop."""

    def __init__(self, llm: LLM, config: ServerConfig) -> None:
        self.llm = llm
        self.config = config
        self.model = llm.config.name
        self.policy = llm.policy.name
        self.max_model_len = llm.engine.state.limits.max_model_len
        self.engine = AsyncEngine(llm.engine, predictor=llm.predictor,
                                  max_waiting=config.max_waiting_requests)
        self.created = int(time.time())

    # ------------------------------------------------------------------ endpoints
    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        self._check_model(body.model)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(self._tokenizer("prompt").encode, prompt)
            return await self._generate(request, body, COMPLETION, ids, prompt,
                                        DEFAULT_COMPLETION_MAX_TOKENS)
        return await self._generate(request, body, COMPLETION, prompt, None,
                                    DEFAULT_COMPLETION_MAX_TOKENS)

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        self._check_model(body.model)
        tokenizer = self._tokenizer("messages")
        messages = [m.as_template_input() for m in body.messages]
        try:
            text, ids = await asyncio.to_thread(_render_and_encode, tokenizer, messages)
        except InvalidRequestError as e:
            raise OpenAIError.invalid(e) from None
        # OpenAI's default for chat: whatever the context leaves.
        return await self._generate(request, body, CHAT, ids, text,
                                    max(1, self.max_model_len - len(ids)))

    def health(self) -> JSONResponse:
        ok = self.engine.running
        return JSONResponse({"status": "ok" if ok else "engine stopped", "model": self.model,
                             "policy": self.policy}, status_code=200 if ok else 503)

    # ------------------------------------------------------------------ generation
    async def _generate(self, request: Request, body: GenerationRequest, fmt: ResponseFormat,
                        prompt_ids: list[int], prompt: str | None,
                        default_max_tokens: int) -> Response:
        params = body.sampling_params(default_max_tokens, len(prompt_ids), self.max_model_len)
        header = ResponseHeader.new(fmt, self.model)
        try:
            stream = await self.engine.add_request(header.id, prompt_ids, params, prompt=prompt,
                                                   ttft_slo=body.ttft_slo, tbt_slo=body.tbt_slo,
                                                   conversation_id=body.conversation_id)
        except InvalidRequestError as e:
            raise OpenAIError.invalid(e, body.prompt_param) from None
        if body.stream:
            return EventStreamResponse(stream, self._events(body, fmt, header, stream, prompt_ids, prompt))
        try:
            collected = self._collect(body, fmt, header, stream, prompt_ids, prompt)
            return JSONResponse(await _unless_disconnected(request, collected))
        except ClientGone:  # nobody reads the answer; close() below aborts the request
            log.info("client of %s disconnected; request aborted", header.id)
            return Response(status_code=499)  # nginx's "client closed request", for the log
        finally:
            stream.close()

    async def _collect(self, body: GenerationRequest, fmt: ResponseFormat, header: ResponseHeader,
                       stream: RequestStream, prompt_ids: list[int], prompt: str | None) -> dict[str, Any]:
        whole = Delta([], "")
        async for delta in stream:
            whole = whole.then(delta)
        cached = whole.metrics.num_cached_tokens if whole.metrics is not None else 0
        choice, _ = self._choice(body, fmt, whole, prompt_ids, prompt, stream=False, first=True, offset=0)
        return header.body(fmt.object, [choice], usage=usage(len(prompt_ids), len(whole.token_ids), cached))

    async def _events(self, body: GenerationRequest, fmt: ResponseFormat, header: ResponseHeader,
                      stream: RequestStream, prompt_ids: list[int], prompt: str | None) -> AsyncIterator[str]:
        """One event per batch of tokens, the usage chunk if asked for, then `[DONE]`."""
        num_out = 0
        cached = 0
        offset = 0
        try:
            async for delta in stream:
                cached = delta.metrics.num_cached_tokens if delta.metrics is not None else cached
                choice, offset = self._choice(body, fmt, delta, prompt_ids, prompt, stream=True,
                                              first=num_out == 0, offset=offset)
                num_out += len(delta.token_ids)
                extra = {} if delta.metrics is None else {"jserve": preemption_info(delta.metrics)}
                yield _sse(header.body(fmt.chunk_object, [choice], **extra))
        except EngineStopped as e:  # shutting down: the drain window is over
            yield _sse(OpenAIError(503, str(e), type="server_error").to_json())
        except Exception as e:  # the status line is sent: report the failure in the stream
            log.exception("stream %s failed", header.id)
            yield _sse(OpenAIError(500, str(e), type="server_error").to_json())
        else:
            if body.include_usage:
                yield _sse(header.body(fmt.chunk_object, [], usage=usage(len(prompt_ids), num_out, cached)))
        yield _sse("[DONE]")

    def _choice(self, body: GenerationRequest, fmt: ResponseFormat, delta: Delta,
                prompt_ids: list[int], prompt: str | None, *, stream: bool, first: bool,
                offset: int) -> tuple[dict[str, Any], int]:
        """A choice of `delta`'s tokens (the first also echoing the prompt, if asked) and the
        text offset after it."""
        text, ids = delta.text, delta.token_ids
        lps: list[float | None] | None = delta.logprobs
        tops: list[dict[int, float] | None] | None = delta.top_logprobs
        if first and getattr(body, "echo", False):
            text = (prompt if prompt is not None else self._decode(prompt_ids)) + text
            if lps is not None and tops is not None:
                # None where nothing was computed: the first token, and positions a prefix
                # cache served
                known = list(delta.prompt_logprobs or [])
                prompt_tops = known + [None] * (len(prompt_ids) - len(known))
                lps = [None if e is None else e[t] for e, t in zip(prompt_tops, prompt_ids)] + lps
                tops = list(prompt_tops) + tops
                ids = prompt_ids + ids
        logprobs = None
        if lps is not None and tops is not None:
            num_top = body.requested_logprobs()[0] or 0
            rendered = self._token_logprobs(ids, lps, tops, num_top)
            logprobs = (rendered.chat() if fmt.chat
                        else rendered.completion(offset, self.llm.tokenizer is not None))
        choice = fmt.choice(text, delta.finish_reason,
                            delta.token_ids if body.return_token_ids else None,
                            stream=stream, first=first, logprobs=logprobs)
        return choice, offset + len(text)

    def _token_logprobs(self, ids: list[int], lps: list[float | None],
                        tops: list[dict[int, float] | None], num_top: int) -> TokenLogprobs:
        text = self._token_text
        return TokenLogprobs(
            [text(t) for t in ids], lps,
            [None if e is None else {text(k): v for k, v in sorted(e.items(), key=lambda kv: -kv[1])}
             for e in tops], num_top)

    def _token_text(self, token_id: int) -> str:
        """A token's text; without a tokenizer, vLLM's `token_id:N`."""
        tok = self.llm.tokenizer
        return f"token_id:{token_id}" if tok is None else tok.decode([token_id], skip_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return "" if self.llm.tokenizer is None else self.llm.tokenizer.decode(ids)

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise model_not_found(model, self.model)

    def _tokenizer(self, param: str) -> Tokenizer:
        if self.llm.tokenizer is None:
            raise OpenAIError(400, f"{self.model} has dummy weights and no tokenizer: send the "
                                   "prompt as a list of token ids to /v1/completions", param=param)
        return self.llm.tokenizer


def _render_and_encode(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    text = render_chat(tokenizer, messages)
    return text, tokenizer.encode(text)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's first complaint as a 400, naming the field (OpenAI answers 400 here too)."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return OpenAIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}")
    param = ".".join(str(x) for x in err["loc"] if x != "body") or None
    return OpenAIError(400, f"{param or 'request body'}: {err['msg']}", param=param)


class RequestGuard:
    """ASGI middleware run before routing and body parsing: the API key on /v1 routes (401)
    and the body-size limit (413), both answered in OpenAI's error shape. A body without
    Content-Length is read up to the limit here and replayed to the app."""

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"].startswith("/v1"):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _reply(send, OpenAIError(
                    401, "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                    code="invalid_api_key"))
        too_large = OpenAIError(413, f"request body exceeds {self.max_bytes} bytes "
                                     "(the server's --max-request-bytes)")
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_bytes:
                return await _reply(send, too_large)
            return await self.app(scope, receive, send)
        messages = []
        size = 0
        while True:  # chunked: read it all here, counting
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await _reply(send, too_large)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _reply(send: Send, err: OpenAIError) -> None:
    body = json.dumps(err.to_json()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def build_app(llm: LLM, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving `llm`; its lifespan starts and stops the engine loop."""
    config = config or ServerConfig()
    server = OpenAIServer(llm, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        await server.engine.stop()

    app = FastAPI(title="jserve", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(RequestGuard, api_key=config.api_key,
                       max_request_bytes=config.max_request_bytes)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, exc: QueueFull) -> JSONResponse:
        return await openai_error(_, OpenAIError(503, str(exc), type="server_error",
                                                 headers={"Retry-After": str(RETRY_AFTER_S)}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return await openai_error(_, _validation_error(exc))

    @app.exception_handler(EngineStopped)
    async def engine_stopped(_: Request, exc: EngineStopped) -> JSONResponse:
        return await openai_error(_, OpenAIError(503, str(exc), type="server_error"))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return await openai_error(_, OpenAIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> JSONResponse:
        return await openai_error(_, OpenAIError(500, f"internal error: {exc}", type="server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await server.completions(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await server.chat(request, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return model_list(server.model, server.created, server.max_model_len)

    @app.get("/health")
    async def health() -> JSONResponse:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class JServeServer(uvicorn.Server):
    """uvicorn, with jserve's shutdown: on SIGINT/SIGTERM it stops accepting, drains the
    engine (running requests finish for the drain window, the rest end with an error) and
    only then lets uvicorn close the connections, so no handler is cancelled mid-way."""

    def __init__(self, app: FastAPI, log_level: str = "info", port: int | None = None) -> None:
        """`port`: instead of the config's (0 takes a free one)."""
        self.openai: OpenAIServer = app.state.server
        cfg = self.openai.config
        super().__init__(uvicorn.Config(app, host=cfg.host, port=cfg.port if port is None else port,
                                        log_level=log_level,
                                        timeout_graceful_shutdown=CONNECTION_CLOSE_S))

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            s = self.openai
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            log.info("serving %s with policy %s (%d KV blocks) at http://%s:%d/v1", s.model,
                     s.policy, s.llm.engine.state.blocks.num_blocks, host, port)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = asyncio.ensure_future(self.openai.engine.drain(self.openai.config.drain_s))
        await super().shutdown(sockets)  # stops accepting first, then waits for connections
        await drain


def bind(config: ServerConfig) -> socket.socket:
    """The listening socket, bound before the model loads so a busy port fails at once
    (`OSError`)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    return socket.create_server((config.host, config.port), family=family, backlog=2048)


def warm_every_bucket(llm: LLM) -> None:
    """Compile every (tokens, sequences) bucket a schedule can meet under the engine's limits
    (`Buckets.all_shapes`), beyond the few `LLM` warms for offline use, so no request of a
    burst waits on a compile. Left to first use: the log-probability variants of the step."""
    if llm.engine_config.warmup:
        llm.runner.warmup(progress=True, shapes=llm.runner.buckets.all_shapes())


def serve(llm: LLM, config: ServerConfig, sock: socket.socket | None = None) -> None:
    """Serve until SIGINT/SIGTERM (blocking), on `sock` if given (see `bind`). After its
    graceful shutdown uvicorn raises the signal again, as its default handler would: SIGTERM
    then ends the process (status 143), SIGINT arrives here as KeyboardInterrupt."""
    warm_every_bucket(llm)
    with suppress(KeyboardInterrupt):
        JServeServer(build_app(llm, config)).run(sockets=None if sock is None else [sock])


@contextmanager
def serve_in_background(app: FastAPI, port: int = 0) -> Iterator[str]:
    """Run the server in a daemon thread (tests, the load benchmark) on its config's host;
    port 0 takes a free one. Yields the base URL; leaving drains as SIGTERM does."""
    server = JServeServer(app, log_level="warning", port=port)
    thread = threading.Thread(target=server.run, name="jserve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start on {server.config.host}:{server.config.port}")
        time.sleep(0.01)
    host, bound = server.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=STARTUP_TIMEOUT_S)
