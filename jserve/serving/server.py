"""OpenAI-compatible HTTP server around one engine (`jserve serve`).

Routes: `/v1/completions` and `/v1/chat/completions` (server-sent events with
`stream: true`), `/v1/models`, `/health`, `/metrics` (Prometheus). Handlers only tokenize,
validate and hand requests to the `AsyncEngine`, whose single loop steps the engine;
every error a client can cause comes back as OpenAI's error JSON with a 4xx status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from jserve.errors import InvalidRequestError
from jserve.serving.async_engine import AsyncEngine, EngineStopped, RequestStream
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
    model_list,
    model_not_found,
    preemption_info,
    usage,
)
from models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# How long Ctrl-C waits for open streams before cutting them (a second Ctrl-C cuts at once).
GRACEFUL_SHUTDOWN_S = 5
STARTUP_TIMEOUT_S = 60


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
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()  # a no-op once it is done
    if task.cancelled():
        raise ClientGone
    return task.result()


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class OpenAIServer:
    """The routes' logic: one served model, one engine loop."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.model = llm.config.name
        self.policy = llm.policy.name
        self.max_model_len = llm.engine.state.limits.max_model_len
        self.engine = AsyncEngine(llm.engine, predictor=llm.predictor)
        self.created = int(time.time())

    # ------------------------------------------------------------------ endpoints
    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        self._check_model(body.model)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            return await self._generate(request, body, COMPLETION,
                                        self._tokenizer("prompt").encode(prompt),
                                        prompt, DEFAULT_COMPLETION_MAX_TOKENS)
        return await self._generate(request, body, COMPLETION, prompt, None,
                                    DEFAULT_COMPLETION_MAX_TOKENS)

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        self._check_model(body.model)
        tokenizer = self._tokenizer("messages")
        try:
            text = render_chat(tokenizer, [m.as_template_input() for m in body.messages])
        except InvalidRequestError as e:
            raise OpenAIError.invalid(e) from None
        ids = tokenizer.encode(text)
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
            return EventStreamResponse(stream, self._events(body, fmt, header, stream, len(prompt_ids)))
        try:
            collected = self._collect(body, fmt, header, stream, len(prompt_ids))
            return JSONResponse(await _unless_disconnected(request, collected))
        except ClientGone:  # nobody reads the answer; close() below aborts the request
            log.info("client of %s disconnected; request aborted", header.id)
            return Response(status_code=499)  # nginx's "client closed request", for the log
        finally:
            stream.close()

    async def _collect(self, body: GenerationRequest, fmt: ResponseFormat, header: ResponseHeader,
                       stream: RequestStream, num_prompt: int) -> dict[str, Any]:
        token_ids: list[int] = []
        text: list[str] = []
        finish = None
        cached = 0
        async for delta in stream:
            token_ids += delta.token_ids
            text.append(delta.text)
            finish = delta.finish_reason
            cached = delta.metrics.num_cached_tokens if delta.metrics is not None else cached
        choice = fmt.choice("".join(text), finish, token_ids if body.return_token_ids else None,
                            stream=False)
        return header.body(fmt.object, [choice], usage=usage(num_prompt, len(token_ids), cached))

    async def _events(self, body: GenerationRequest, fmt: ResponseFormat, header: ResponseHeader,
                      stream: RequestStream, num_prompt: int) -> AsyncIterator[str]:
        """One event per batch of tokens, the usage chunk if asked for, then `[DONE]`."""
        num_out = 0
        cached = 0
        try:
            async for delta in stream:
                cached = delta.metrics.num_cached_tokens if delta.metrics is not None else cached
                choice = fmt.choice(delta.text, delta.finish_reason,
                                    delta.token_ids if body.return_token_ids else None,
                                    stream=True, first=num_out == 0)
                num_out += len(delta.token_ids)
                extra = {} if delta.metrics is None else {"jserve": preemption_info(delta.metrics)}
                yield _sse(header.body(fmt.chunk_object, [choice], **extra))
        except Exception as e:  # the status line is sent: report the failure in the stream
            log.exception("stream %s failed", header.id)
            yield _sse(OpenAIError(500, str(e), type="server_error").to_json())
        else:
            if body.include_usage:
                yield _sse(header.body(fmt.chunk_object, [], usage=usage(num_prompt, num_out, cached)))
        yield _sse("[DONE]")

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise model_not_found(model, self.model)

    def _tokenizer(self, param: str) -> Tokenizer:
        if self.llm.tokenizer is None:
            raise OpenAIError(400, f"{self.model} has dummy weights and no tokenizer: send the "
                                   "prompt as a list of token ids to /v1/completions", param=param)
        return self.llm.tokenizer


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's first complaint as a 400, naming the field (OpenAI answers 400 here too)."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return OpenAIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}")
    param = ".".join(str(x) for x in err["loc"] if x != "body") or None
    return OpenAIError(400, f"{param or 'request body'}: {err['msg']}", param=param)


def build_app(llm: LLM) -> FastAPI:
    """The ASGI app serving `llm`; its lifespan starts and stops the engine loop."""
    server = OpenAIServer(llm)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        await server.engine.stop()

    app = FastAPI(title="jserve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status)

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


def serve(llm: LLM, host: str, port: int) -> None:
    """Serve until Ctrl-C (blocking)."""
    log.info("serving %s with policy %s (%d KV blocks) at http://%s:%d/v1", llm.config.name,
             llm.policy.name, llm.engine.state.blocks.num_blocks, host, port)
    uvicorn.run(build_app(llm), host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


@contextmanager
def serve_in_background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run uvicorn in a daemon thread (tests, the load benchmark); yields the base URL.
    Port 0 takes a free port."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="jserve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=STARTUP_TIMEOUT_S)
