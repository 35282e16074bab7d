"""OpenAI-compatible HTTP server around one engine (`jserve serve`).

Routes: `/v1/completions` and `/v1/chat/completions` (server-sent events with
`stream: true`), `/v1/models` and `/v1/models/{id}`, `/health`, `/ping`, `/version`,
`/metrics` (Prometheus), and vLLM's tokenizer routes `/tokenize`, `/detokenize`,
`/tokenizer_info` (for clients that count tokens without a local tokenizer, e.g. lm-eval's
remote tokenizer). `jserve serve` listens before the model loads and compiles (in a
thread, `ModelLoading`), so a probe gets its 503 at once rather than a refused connection
or a request that hangs until ready; every route but `/version` answers 503 until then.
Handlers only tokenize (in a worker thread, so a large prompt never stalls the other
routes), validate and hand requests to the `AsyncEngine`, whose single loop steps the
engine; every error a client can cause comes back as OpenAI's error JSON with a 4xx status.
`RequestGuard` checks the API key and the body size before FastAPI reads anything;
`JServeServer` drains the engine on SIGINT/SIGTERM before uvicorn closes the connections.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from importlib.metadata import version
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from jserve.config import ServerConfig
from jserve.engine.request import pick_best
from jserve.engine.sampling_params import SamplingParams
from jserve.errors import InvalidRequestError
from jserve.models.tokenizer import Tokenizer
from jserve.serving.async_engine import AsyncEngine, Delta, EngineStopped, QueueFull, RequestStream
from jserve.serving.choices import Choice, PromptInput
from jserve.serving.llm import LLM, render_chat
from jserve.serving.openai_protocol import (
    CHAT,
    COMPLETION,
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    OpenAIError,
    ResponseFormat,
    ResponseHeader,
    TokenizeRequest,
    model_card,
    model_list,
    model_not_found,
    preemption_info,
    tokenize_response,
    usage,
)
from jserve.serving.server_metrics import ServerMetrics

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60
# uvicorn's own backstop, counted from the end of the engine's drain: the drain has ended
# every request by then, so connections close well within it (a second Ctrl-C cuts at once).
CONNECTION_CLOSE_S = 5
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait


class EventStreamResponse(StreamingResponse):
    """Server-sent events that close their request streams however the response ends
    (finished, client gone: the send task is cancelled, server stopping), so an abandoned
    request is aborted and its KV blocks freed."""

    def __init__(self, streams: list[RequestStream], events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()


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


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of several streams (a batch's), each with its stream's index, as they
    come; an error of any stream ends the whole."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                delta = task.result()
                yield i, delta
                if not delta.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for task in pending:
            task.cancel()


async def _whole(stream: RequestStream) -> Delta:
    """A stream's deltas joined into one."""
    whole = Delta([], "")
    async for delta in stream:
        whole = whole.then(delta)
    return whole


class OpenAIServer:
    """The routes' logic: one served model, one engine loop."""

    def __init__(self, llm: LLM, config: ServerConfig) -> None:
        self.llm = llm
        self.config = config
        self.model = llm.config.name
        # the names clients may ask for (vLLM's --served-model-name); the first is the
        # one /health names and vLLM's metrics label
        self.names = config.served_model_names or (self.model,)
        self.policy = llm.policy.name
        self.max_model_len = llm.engine.state.limits.max_model_len
        self.engine = AsyncEngine(llm.engine, ServerMetrics(self.names[0]),
                                  max_waiting=config.max_waiting_requests)
        self.created = int(time.time())

    # ------------------------------------------------------------------ endpoints
    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        self._check_model(body.model)
        prompts = body.prompts()
        texts = [p for p in prompts if isinstance(p, str)]
        encoded: Iterator[list[int]] = iter([])
        if texts:
            tokenizer = self._tokenizer("prompt")
            encoded = iter(await asyncio.to_thread(lambda: [tokenizer.encode(t) for t in texts]))
        inputs = [PromptInput(next(encoded), p) if isinstance(p, str) else PromptInput(p, None)
                  for p in prompts]
        return await self._generate(request, body, COMPLETION, inputs, DEFAULT_COMPLETION_MAX_TOKENS)

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        self._check_model(body.model)
        tokenizer = self._tokenizer("messages")
        messages = [m.as_template_input() for m in body.messages]
        try:
            text, ids = await asyncio.to_thread(_render_and_encode, tokenizer, messages)
        except InvalidRequestError as e:
            raise OpenAIError.invalid(e) from None
        # OpenAI's default for chat: whatever the context leaves.
        return await self._generate(request, body, CHAT, [PromptInput(ids, text)],
                                    max(1, self.max_model_len - len(ids)))

    def health(self) -> JSONResponse:
        ok = self.engine.running
        return JSONResponse({"status": "ok" if ok else "engine stopped", "model": self.names[0],
                             "policy": self.policy}, status_code=200 if ok else 503)

    def model_card(self, model_id: str) -> dict[str, Any]:
        """vLLM's /v1/models/{id}: one served name's entry, 404 for any other."""
        self._check_model(model_id)
        return model_card(model_id, self.model, self.created, self.max_model_len)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the ids the completion or chat endpoint would run."""
        if body.model is not None:
            self._check_model(body.model)
        if body.messages is not None:
            tokenizer = self._tokenizer("messages")
            messages = [m.as_template_input() for m in body.messages]
            try:
                _, ids = await asyncio.to_thread(_render_and_encode, tokenizer, messages,
                                                 body.add_generation_prompt)
            except InvalidRequestError as e:
                raise OpenAIError.invalid(e) from None
        else:
            tokenizer = self._tokenizer("prompt")
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt)
        return tokenize_response(ids, self.max_model_len,
                                 tokenizer.token_strings(ids) if body.return_token_strs else None)

    def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's /detokenize: the text of token ids, special tokens written out."""
        if body.model is not None:
            self._check_model(body.model)
        tokenizer = self._tokenizer("tokens")
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise OpenAIError(400, f"token ids must lie in [0, {tokenizer.vocab_size}), got {bad[0]}",
                              param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: what the tokenizer's `tokenizer_config.json` says (the
        file `jserve export-tokenizer` writes), e.g. for lm-eval's remote tokenizer."""
        return self._tokenizer("model").hf_tokenizer_config(self.max_model_len)

    # ------------------------------------------------------------------ generation
    async def _generate(self, request: Request, body: GenerationRequest, fmt: ResponseFormat,
                        inputs: list[PromptInput], default_max_tokens: int) -> Response:
        """Run every prompt of `inputs` as its own engine request and answer with `n`
        choices per prompt, in order: prompt `i`'s `j`-th is choice `i * n + j` (OpenAI's
        and vLLM's numbering). The prompt is prefilled once for its `n` (or `best_of`)
        sequences, and counted once in the usage."""
        params = [body.sampling_params(default_max_tokens, len(p.ids), self.max_model_len)
                  for p in inputs]
        if params[0].grammar is not None:
            self._tokenizer(body.grammar_param)  # a grammar's token table is the tokenizer's
        header = ResponseHeader.new(fmt, body.model)
        ids = [header.id] if len(inputs) == 1 else [f"{header.id}-{i}" for i in range(len(inputs))]
        streams = await self._add_all(body, ids, inputs, params)
        flat = [s for per_prompt in streams for s in per_prompt]
        n = params[0].n
        if body.stream:  # the protocol refuses best_of > n here: each sequence is a choice
            choices = [Choice(i * n + j, p, body, fmt, self.llm.tokenizer)
                       for i, p in enumerate(inputs) for j in range(n)]
            return EventStreamResponse(flat, self._events(body, fmt, header, flat, choices, inputs))
        try:
            collected = self._collect(body, fmt, header, streams, inputs, n)
            return JSONResponse(await _unless_disconnected(request, collected))
        except ClientGone:  # nobody reads the answer; close() below aborts the request
            log.info("client of %s disconnected; request aborted", header.id)
            return Response(status_code=499)  # nginx's "client closed request", for the log
        finally:
            for stream in flat:
                stream.close()

    async def _add_all(self, body: GenerationRequest, ids: list[str], inputs: list[PromptInput],
                       params: list[SamplingParams]) -> list[list[RequestStream]]:
        """Hand every prompt to the engine at once (admitted in one pass of its loop): per
        prompt, a stream per sequence. If any is refused, the others are aborted and the
        refusal raised."""
        added = await asyncio.gather(*(
            self.engine.add_request(request_id, p.ids, sp, prompt=p.text, ttft_slo=body.ttft_slo,
                                    tbt_slo=body.tbt_slo, conversation_id=body.conversation_id)
            for request_id, p, sp in zip(ids, inputs, params)), return_exceptions=True)
        errors = [(i, e) for i, e in enumerate(added) if isinstance(e, BaseException)]
        if not errors:
            return list(added)
        for streams in added:
            if not isinstance(streams, BaseException):
                for stream in streams:
                    stream.close()
        i, error = errors[0]
        if isinstance(error, InvalidRequestError):
            if len(inputs) > 1 and error.param == "prompt":
                error = InvalidRequestError(f"{body.prompt_param}[{i}]: {error}", error.param)
            raise OpenAIError.invalid(error, body.prompt_param) from None
        raise error

    async def _collect(self, body: GenerationRequest, fmt: ResponseFormat, header: ResponseHeader,
                       streams: list[list[RequestStream]], inputs: list[PromptInput],
                       n: int) -> dict[str, Any]:
        """Every sequence whole, then per prompt the `n` it returns (`pick_best`)."""
        tasks = [[asyncio.ensure_future(_whole(s)) for s in per_prompt] for per_prompt in streams]
        try:
            wholes = [await asyncio.gather(*per_prompt) for per_prompt in tasks]
        finally:
            for task in (t for per_prompt in tasks for t in per_prompt):
                task.cancel()
        choices, rendered = [], []
        for i, (prompt, seqs) in enumerate(zip(inputs, wholes)):
            for j, whole in enumerate(pick_best(seqs, n, lambda d: d.cumulative_logprob or 0.0)):
                choices.append(Choice(i * n + j, prompt, body, fmt, self.llm.tokenizer))
                rendered.append(choices[-1].render(whole, stream=False))
        return header.body(fmt.object, rendered, usage=_usage(inputs, choices))

    async def _events(self, body: GenerationRequest, fmt: ResponseFormat, header: ResponseHeader,
                      streams: list[RequestStream], choices: list[Choice],
                      inputs: list[PromptInput]) -> AsyncIterator[str]:
        """One event per batch of one choice's tokens (with the usage so far if asked for:
        vLLM's `continuous_usage_stats`), the usage chunk if asked for, then `[DONE]`."""
        try:
            async for i, delta in _merged(streams):
                chunk = [choices[i].render(delta, stream=True)]
                extra = {} if delta.metrics is None else {"jserve": preemption_info(delta.metrics)}
                if body.continuous_usage:
                    extra["usage"] = _usage(inputs, choices)
                yield _sse(header.body(fmt.chunk_object, chunk, **extra))
        except EngineStopped as e:  # shutting down: the drain window is over
            yield _sse(OpenAIError(503, str(e), type="server_error").to_json())
        except Exception as e:  # the status line is sent: report the failure in the stream
            log.exception("stream %s failed", header.id)
            yield _sse(OpenAIError(500, str(e), type="server_error").to_json())
        else:
            if body.include_usage:
                yield _sse(header.body(fmt.chunk_object, [], usage=_usage(inputs, choices)))
        yield _sse("[DONE]")

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str) -> None:
        if model not in self.names:
            raise model_not_found(model, self.names)

    def _tokenizer(self, param: str) -> Tokenizer:
        if self.llm.tokenizer is None:
            raise OpenAIError(400, f"{self.model} has dummy weights and no tokenizer: send the "
                                   "prompt as a list of token ids to /v1/completions", param=param)
        return self.llm.tokenizer


def _usage(inputs: list[PromptInput], choices: list[Choice]) -> dict[str, Any]:
    """Each prompt counted once, whatever its `n` (as OpenAI counts); the choices'
    completions summed."""
    return usage(sum(len(p.ids) for p in inputs), sum(c.num_output_tokens for c in choices),
                 sum(c.num_cached_tokens for c in choices))


def _render_and_encode(tokenizer: Tokenizer, messages: list[dict[str, str]],
                       add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    text = render_chat(tokenizer, messages, add_generation_prompt)
    return text, tokenizer.encode(text)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's first complaint as a 400, naming the field (OpenAI answers 400 here too)."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return OpenAIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}")
    param = ".".join(str(x) for x in err["loc"] if x != "body") or None
    if err["type"] == "extra_forbidden":
        return OpenAIError(400, f"{param}: unknown field, refused rather than ignored", param=param)
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


class ErrorResponse(JSONResponse):
    """An error's JSON, written in ASCII: a message that quotes what the client sent stays
    encodable whatever it holds, so the answer is sent and the connection kept."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


class ModelLoading:
    """The served model's state while the HTTP server already listens: loading (and
    compiling), ready with its `OpenAIServer`, or failed. `jserve serve` loads in a daemon
    thread, so a Ctrl-C during the load ends the process without waiting for it."""

    def __init__(self, load: LLM | Callable[[], LLM], config: ServerConfig) -> None:
        self.config = config
        self.server = OpenAIServer(load, config) if isinstance(load, LLM) else None
        self._load = None if isinstance(load, LLM) else load
        self.error: BaseException | None = None  # why loading failed: `serve` raises it

    def ready(self) -> OpenAIServer:
        """The server, or a 503 while the model loads."""
        if self.server is None:
            raise OpenAIError(503, "the model is loading" if self.error is None else
                              f"the model failed to load: {self.error}", type="server_error",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
        return self.server

    async def run(self) -> None:
        """Load (if not loaded yet) and start the engine loop."""
        if self.server is None:
            try:
                self.server = OpenAIServer(await _in_daemon_thread(self._load), self.config)
            except Exception as e:  # the CLI prints it once uvicorn has stopped
                self.error = e
                return
            s = self.server
            log.info("serving %s with policy %s (%d KV blocks)", s.model, s.policy,
                     s.llm.engine.state.blocks.num_blocks)
        self.server.engine.start()


async def _in_daemon_thread(work: Callable[[], Any]) -> Any:
    """`work()`'s result, computed in a daemon thread (`asyncio.to_thread`'s pool threads
    are joined at exit, which would hold a Ctrl-C until a model load ends)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled (the server stopped first)
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        try:
            result = work()
        except BaseException as e:
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="jserve-load", daemon=True).start()
    return await done


def build_app(llm: LLM | Callable[[], LLM], config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving `llm`, or the model `llm()` loads once the app has started
    (answering 503 until then); its lifespan starts and stops the engine loop."""
    config = config or ServerConfig()
    loading = ModelLoading(llm, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(loading.run(), name="jserve-load")
        if loading.server is not None:
            await task  # loaded already: serve from the first request
        yield
        task.cancel()
        if loading.server is not None:
            await loading.server.engine.stop()

    app = FastAPI(title="jserve", lifespan=lifespan)
    app.state.loading = loading
    app.add_middleware(RequestGuard, api_key=config.api_key,
                       max_request_bytes=config.max_request_bytes)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return ErrorResponse(exc.to_json(), status_code=exc.status, headers=exc.headers)

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
        return await loading.ready().completions(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await loading.ready().chat(request, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        server = loading.ready()
        return model_list(server.names, server.model, server.created, server.max_model_len)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return loading.ready().model_card(model_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await loading.ready().tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        return loading.ready().detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return loading.ready().tokenizer_info()

    @app.get("/health")
    async def health() -> JSONResponse:
        return loading.ready().health()

    async def ping() -> JSONResponse:
        """vLLM's (SageMaker's) liveness route, GET or POST: /health's answer."""
        return loading.ready().health()

    for method in ("GET", "POST"):
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": version("jserve")}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(loading.ready().engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class JServeServer(uvicorn.Server):
    """uvicorn, with jserve's shutdown: on SIGINT/SIGTERM it stops accepting, drains the
    engine (running requests finish for the drain window, the rest end with an error) and
    only then lets uvicorn close the connections, so no handler is cancelled mid-way. A
    model that fails to load stops it too (`serve` then raises the error)."""

    def __init__(self, app: FastAPI, log_level: str = "info", port: int | None = None) -> None:
        """`port`: instead of the config's (0 takes a free one)."""
        self.loading: ModelLoading = app.state.loading
        cfg = self.loading.config
        super().__init__(uvicorn.Config(app, host=cfg.host, port=cfg.port if port is None else port,
                                        log_level=log_level,
                                        timeout_graceful_shutdown=CONNECTION_CLOSE_S))

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            log.info("listening at http://%s:%d/v1%s", host, port,
                     "" if self.loading.server is not None else " (503 until the model has loaded)")

    async def on_tick(self, counter: int) -> bool:
        return self.loading.error is not None or await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting, drain, then let uvicorn close the connections. uvicorn's own
        close window starts only after the drain: every stream has had its final event by
        then, so the connections close at once and the window is never exceeded (run side
        by side, its timer and the drain's ended together, and uvicorn logged an error)."""
        for server in self.servers:
            server.close()
        if self.loading.server is not None:
            await self.loading.server.engine.drain(self.loading.config.drain_s)
        await super().shutdown(sockets)


def bind(config: ServerConfig) -> socket.socket:
    """The listening socket, bound before the model loads so a busy port fails at once
    (`OSError`)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    return socket.create_server((config.host, config.port), family=family, backlog=2048)


def serve(llm: LLM | Callable[[], LLM], config: ServerConfig, sock: socket.socket | None = None,
          log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM (blocking), on `sock` if given (see `bind`); `llm` may be
    a function that loads the model, called once the server listens. After its graceful
    shutdown uvicorn raises the signal again, as its default handler would: SIGTERM then
    ends the process (status 143), SIGINT arrives here as KeyboardInterrupt. A model that
    failed to load raises its error here once the server has stopped."""
    server = JServeServer(build_app(llm, config), log_level=log_level)
    with suppress(KeyboardInterrupt):
        server.run(sockets=None if sock is None else [sock])
    if server.loading.error is not None:
        raise server.loading.error


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
