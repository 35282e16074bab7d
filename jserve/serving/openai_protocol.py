"""The OpenAI wire format: request bodies (pydantic), response and chunk JSON, error JSON.

Kept apart from the routes so the HTTP layer only wires requests to the engine, and so the
benchmark client and the tests read the same field names the server writes.

Extensions beyond OpenAI's API (vLLM's names where vLLM has one): `top_k`, `ignore_eos`,
`response_format` (json_object, json_schema) and `tools` with `tool_choice` "required" or a
named function, decoded under a grammar (`jserve.structured`), `return_token_ids` (each choice carries the generated token ids: a model without a
tokenizer has no text to stream), `ttft_slo` / `tbt_slo` (seconds, handed to SLO-aware
policies), on the finishing chunk of a stream a `jserve` object with the request's
preemptions, which a client cannot observe otherwise, and vLLM's tokenizer routes'
bodies (`/tokenize`, `/detokenize`).

Bodies are strict (`StrictModel`): a value of the wrong JSON type is refused, not coerced, a
field the server does not know is refused by name, a field it knows of but does not implement
(`UNSUPPORTED_FIELDS`) is refused as "not supported" unless it holds its neutral value, and
text UTF-8 cannot carry (a lone surrogate such as `"\\ud800"`) is refused where it stands. Each
is a 400 naming the field, never a silent 200 that ignores what the client asked for.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from jserve.engine.request import RequestMetrics
from jserve.engine.sampling_params import SamplingParams
from jserve.errors import InvalidRequestError
from jserve.structured import GrammarSpec, ToolCall, ToolDef, check_grammar

# OpenAI's default for /v1/completions; chat completions default to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


# --------------------------------------------------------------------------- errors


class OpenAIError(Exception):
    """An error the client caused or must see, rendered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # e.g. Retry-After on a 503

    @classmethod
    def invalid(cls, err: InvalidRequestError, prompt_param: str = "prompt") -> OpenAIError:
        """The engine's refusal as a 400 naming its field; `prompt_param` is what the
        endpoint calls the prompt (chat: `messages`)."""
        param = prompt_param if err.param == "prompt" else err.param
        return cls(400, str(err), param=param)

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def model_not_found(model: str, served: tuple[str, ...]) -> OpenAIError:
    names = ", ".join(f"`{name}`" for name in served)
    return OpenAIError(404, f"The model `{model}` does not exist; this server serves {names}",
                       param="model", code="model_not_found")


# --------------------------------------------------------------------------- requests


class StrictModel(BaseModel):
    """A request body (or a part of one) whose values keep their JSON types, as OpenAI's
    schema has them: no `"yes"` or `1` taken for true, no `"0.5"` for a number (an int is
    still a number); and whose fields are all known: any other is refused by name."""

    model_config = ConfigDict(strict=True, extra="forbid")


@dataclass(frozen=True)
class Unsupported:
    """A field OpenAI's or vLLM's API defines that this server does not implement (yet).
    Sent with one of its `neutral` values (the value that changes nothing, as some clients
    send every default) it is accepted; any other value is a 400 naming the field."""

    what: str  # what the field asks for, in the refusal
    neutral: tuple[Any, ...] = (None,)


# ------------------------------------------------------------------------------------------
# THE UNSUPPORTED-FIELD TABLE of /v1/completions and /v1/chat/completions. To implement one:
# delete its line here and declare the field on `GenerationRequest` (or on one endpoint's
# request) with the engine option it sets.
# ------------------------------------------------------------------------------------------
UNSUPPORTED_FIELDS: dict[str, Unsupported] = {
    # beam search
    "use_beam_search": Unsupported("beam search", (None, False)),
    "length_penalty": Unsupported("beam search's length penalty", (None, 1, 1.0)),
    # penalties and token constraints in the sampler
    "min_p": Unsupported("min-p sampling", (None, 0, 0.0)),
    "allowed_token_ids": Unsupported("a restricted vocabulary"),
    "stop_token_ids": Unsupported("stop token ids over HTTP", (None, [])),
    "include_stop_str_in_output": Unsupported("stop strings kept in the output", (None, False)),
    "skip_special_tokens": Unsupported("special tokens written into the text", (None, True)),
    "spaces_between_special_tokens": Unsupported("the spacing of special tokens", (None, True)),
    "truncate_prompt_tokens": Unsupported("prompt truncation"),
    "prompt_logprobs": Unsupported("prompt log-probabilities without `echo`"),
    # structured outputs and tools
    "structured_outputs": Unsupported("structured outputs"),
    "guided_json": Unsupported("guided decoding"),
    "guided_regex": Unsupported("guided decoding"),
    "guided_choice": Unsupported("guided decoding"),
    "guided_grammar": Unsupported("guided decoding"),
    "guided_decoding_backend": Unsupported("guided decoding"),
    "parallel_tool_calls": Unsupported("tool calls"),
    "functions": Unsupported("function calls (the legacy form of tools)", (None, [])),
    "function_call": Unsupported("function calls (the legacy form of tools)", (None, "none")),
    # prompts and templates
    "suffix": Unsupported("text after the completion (insertion)", (None, "")),
    "add_generation_prompt": Unsupported("a chat prompt without the assistant's turn", (None, True)),
    "continue_final_message": Unsupported("continuing the last message", (None, False)),
    "chat_template": Unsupported("a chat template per request"),
    "chat_template_kwargs": Unsupported("chat template arguments", (None, {})),
    "add_special_tokens": Unsupported("special tokens added to the prompt (the template writes its own)",
                                      (None, False)),
    # OpenAI features outside a text model's sampling
    "user": Unsupported("end-user ids"),
    "metadata": Unsupported("stored metadata"),
    "store": Unsupported("stored completions", (None, False)),
    "service_tier": Unsupported("service tiers"),
    "reasoning_effort": Unsupported("reasoning effort"),
    "modalities": Unsupported("output modalities", (None, ["text"])),
    "audio": Unsupported("audio output"),
    "prediction": Unsupported("predicted outputs"),
    "priority": Unsupported("request priorities", (None, 0)),
}


def _refuse_unsupported(data: Any, table: dict[str, Unsupported]) -> Any:
    """`data` without the table's fields that hold a neutral value; a `ValidationError`
    located at the first that holds any other."""
    if not isinstance(data, dict):
        return data
    for name, value in data.items():
        field = table.get(name)
        if field is not None and not any(type(value) is type(v) and value == v for v in field.neutral):
            raise _located_error("unsupported", "not supported by this server: {what}", (name,), value,
                                 what=field.what)
    return {k: v for k, v in data.items() if k not in table}


def _escaped(text: str) -> str:
    """`text` with what UTF-8 cannot encode written as Python escapes (`\\ud800`)."""
    return text.encode(errors="backslashreplace").decode()


def _unencodable(value: Any, loc: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Where a JSON value holds text UTF-8 cannot encode (lone surrogates, which JSON's
    `\\ud800` escapes can write), with the offending text escaped."""
    if isinstance(value, str):
        if not value.isascii() and _escaped(value) != value:
            yield loc, _escaped(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _unencodable(k, loc + (_escaped(k),))
            yield from _unencodable(v, loc + (_escaped(k),))
    elif isinstance(value, list) and not all(type(x) is int for x in value):  # token ids: no text
        for i, v in enumerate(value):
            yield from _unencodable(v, loc + (i,))


def _located_error(kind: str, template: str, loc: tuple[str | int, ...], value: Any,
                   **context: Any) -> ValidationError:
    """A validation error at `loc` (which the server's 400 names as the field), raised from
    a model's validator about one of its fields."""
    error = PydanticCustomError(kind, template, context)
    return ValidationError.from_exception_data("request", [InitErrorDetails(type=error, loc=loc, input=value)])


class RequestBody(StrictModel):
    """A whole request body: before its fields are read, text UTF-8 cannot encode is refused
    at its field (it would fail in the tokenizer or in the JSON answer that echoes it), and
    so is a field of `unsupported` that holds more than its neutral value."""

    unsupported: ClassVar[dict[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_and_encodable(cls, data: Any) -> Any:
        for loc, text in _unencodable(data):
            raise _located_error("unencodable_text", "holds text UTF-8 cannot encode (a lone "
                                 "surrogate): {text}", loc, None, text=text[:80])
        return _refuse_unsupported(data, cls.unsupported)


def one_of(description: str) -> WrapValidator:
    """A union field's validator whose refusal says what the field may be, in place of
    pydantic's complaint about the union's first member (`prompt.str: ...`)."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "must be {description}",
                                      {"description": description}) from None

    return WrapValidator(check)


Prompt = Annotated[str | list[int] | list[str] | list[list[int]],
                   one_of("a string, a list of token ids, or a list of either (a batch)")]
Stop = Annotated[str | list[str] | None, one_of("a string or a list of strings")]


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk (guidellm asks)


class JsonSchemaFormat(StrictModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormatParam(StrictModel):
    """`response_format`: plain text (the default), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec.json_object()
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise OpenAIError(400, 'response_format of type "json_schema" needs json_schema.schema',
                              param="response_format")
        return GrammarSpec.json_schema(self.json_schema.schema_)


class FunctionDef(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the parameters' schema is always enforced


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice,
                       one_of('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')]


def checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    """`spec`, or a 400 naming `param` where llguidance cannot compile it."""
    error = check_grammar(spec)
    if error:
        raise OpenAIError(400, f"{param}: the schema cannot be enforced: {error}", param=param)
    return spec


class GenerationRequest(RequestBody):
    """Fields both endpoints share. Nullable as in OpenAI's spec: null means the default.
    Fields this server does not implement are refused (`UNSUPPORTED_FIELDS`)."""

    unsupported: ClassVar[dict[str, Unsupported]] = UNSUPPORTED_FIELDS

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; 0 or -1 (vLLM's old "off") disable it
    seed: int | None = None
    stop: Stop = None
    n: int | None = None
    best_of: int | None = None  # vLLM's: generate this many, return the n likeliest
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    min_tokens: int | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias, clamped to [-100, 100]
    bad_words: list[str] | None = None  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    ttft_slo: float | None = None
    tbt_slo: float | None = None
    # extension: the chat this request is a turn of, for the prefix cache (its tag for
    # T-LRU, and its isolation key under --cache-isolation)
    conversation_id: str | None = None
    response_format: ResponseFormatParam | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    prompt_param: ClassVar[str] = "prompt"  # what the endpoint calls its prompt, in errors

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> tuple[int | None, int | None]:
        """(alternatives per output token, per prompt token); None: not asked."""
        return None, None

    @property
    def score_only(self) -> bool:
        """Only the prompt's log-probabilities are wanted, nothing generated."""
        return False

    def grammar(self) -> GrammarSpec | None:
        """The grammar the output follows (None: free text), or a 400 naming the field."""
        spec = None if self.response_format is None else self.response_format.grammar()
        return None if spec is None else checked(spec, "response_format")

    @property
    def grammar_param(self) -> str:
        """The field a grammar came from, for errors about it."""
        return "response_format"

    def token_biases(self) -> dict[int, float]:
        """`logit_bias` by token id, each bias clamped to [-100, 100] as vLLM's server does
        (OpenAI's range), or a 400 naming it for a key that is no token id."""
        try:
            return {int(t): min(100.0, max(-100.0, b)) for t, b in (self.logit_bias or {}).items()}
        except ValueError:
            raise OpenAIError(400, "logit_bias keys must be token ids", param="logit_bias") from None

    def sampling_params(self, default_max_tokens: int, num_prompt_tokens: int,
                        max_model_len: int) -> SamplingParams:
        """The engine's options, or `OpenAIError` (400) naming what is wrong. An explicit
        `max_tokens` must fit the context beside the prompt (vLLM's check and message); the
        default is capped by the context instead. Scoring a prompt (`max_tokens: 0` with
        `echo`) runs one step, as vLLM does; its token is not returned."""
        if self.stream and self.best_of is not None and self.best_of != (self.n or 1):
            raise OpenAIError(400, "best_of sequences other than the n returned cannot be streamed; "
                                   "set stream to false or best_of to n", param="best_of")
        if self.requested_logprobs()[1] is not None and (self.best_of or self.n or 1) > 1:
            # the prompt's log-probabilities are computed once, by the first sequence
            raise OpenAIError(400, "echo with logprobs is supported with one sequence only (n and "
                                   "best_of 1)", param="echo")
        max_tokens = 1 if self.score_only else self.requested_max_tokens()
        if (max_tokens is not None and num_prompt_tokens < max_model_len
                and num_prompt_tokens + max_tokens > max_model_len):
            raise OpenAIError(
                400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                     f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                     f"{self.prompt_param}, {max_tokens} in the completion). Please reduce the length "
                     f"of the {self.prompt_param} or completion.", param=self.max_tokens_param)
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k,
                max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                stop=self.stop or (), ignore_eos=self.ignore_eos, seed=self.seed,
                logprobs=self.requested_logprobs()[0], prompt_logprobs=self.requested_logprobs()[1],
                n=1 if self.n is None else self.n, best_of=self.best_of,
                grammar=self.grammar(),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                min_tokens=self.min_tokens or 0, logit_bias=self.token_biases(), bad_words=self.bad_words or (),
            )
        except InvalidRequestError as e:
            if e.param == "max_tokens":
                e.param = self.max_tokens_param
            raise OpenAIError.invalid(e, self.prompt_param) from None


class CompletionRequest(GenerationRequest):
    """/v1/completions: a prompt as text or token ids, or a batch of them (a list of
    either), answered with one choice per prompt in the batch's order (`index`)."""

    prompt: Prompt
    logprobs: int | None = None  # alternatives per token (OpenAI caps it at 5; we at 20)
    echo: bool = False  # the prompt comes back before the completion (with logprobs, its own)

    def requested_logprobs(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    @property
    def score_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The batch: a lone prompt (text, or token ids, empty included) is a batch of one."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: str
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(GenerationRequest):
    """/v1/chat/completions: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def requested_logprobs(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None, None
    prompt_param: ClassVar[str] = "messages"

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def grammar(self) -> GrammarSpec | None:
        """`response_format`'s grammar, or the tool calls `tool_choice` asks for: "required"
        (any of the tools, one call or more) or a named function; "none" generates text.
        "auto" (OpenAI's default with tools) lets the model choose between text and calls,
        which takes a parser of the model's own tool-call format: refused, as is streaming
        calls."""
        choice = self.tool_choice
        if choice is None or choice == "none":
            if choice is None and self.tools:
                raise OpenAIError(400, 'tools need tool_choice "required" or a named function: the '
                                       'default "auto" is not supported', param="tool_choice")
            return super().grammar()
        if choice == "auto":
            raise OpenAIError(400, 'tool_choice "auto" is not supported: send "required" or a named '
                                   "function", param="tool_choice")
        if not self.tools:
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            raise OpenAIError(400, "response_format and tool calls cannot be asked together",
                              param="response_format")
        if self.stream:
            raise OpenAIError(400, "streaming tool calls is not supported", param="stream")
        tools = [ToolDef.of(t.function.name, t.function.parameters) for t in self.tools]
        if choice == "required":
            return checked(GrammarSpec.any_tools(tools), "tools")
        named = [t for t in tools if t.name == choice.function.name]
        if not named:
            raise OpenAIError(400, f"tool_choice names {choice.function.name!r}, which is not among "
                                   "the tools", param="tool_choice")
        return checked(GrammarSpec.tool(named[0]), "tools")

    @property
    def grammar_param(self) -> str:
        return "tools" if self.tool_choice not in (None, "none") else "response_format"


# --------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class ResponseFormat:
    """How one endpoint shapes its JSON: the completion and chat formats differ only in
    object names and in how a choice holds its text."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, index: int, text: str, finish_reason: str | None, token_ids: list[int] | None,
               *, stream: bool, first: bool = False,
               logprobs: dict[str, Any] | None = None,
               tool_calls: list[ToolCall] | None = None) -> dict[str, Any]:
        """`tool_calls` (chat, not streamed): the message holds them instead of content."""
        c: dict[str, Any] = {"index": index}
        if not self.chat:
            c["text"] = text
        elif stream:
            c["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        elif tool_calls:
            c["message"] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}} for call in tool_calls]}
            finish_reason = "tool_calls"
        else:
            c["message"] = {"role": "assistant", "content": text}
        c["logprobs"] = logprobs
        c["finish_reason"] = finish_reason
        if token_ids is not None:
            c["token_ids"] = token_ids
        return c


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of some tokens, with their text: what both endpoints render.

    A token's text is its share of the choice's text (see `TokenTexts`: empty for a token
    that leaves a character unfinished), so the tokens join back into the text and
    `bytes` concatenate to its UTF-8."""

    tokens: list[str]
    logprobs: list[float | None]  # None: the prompt's first token, which nothing predicts
    top: list[dict[str, float] | None]  # alternatives by text, most likely first
    num_top: int  # alternatives asked for
    offsets: list[int]  # each token's character offset into the choice's text

    def completion(self) -> dict[str, Any]:
        """/v1/completions' shape."""
        return {"tokens": self.tokens, "token_logprobs": self.logprobs, "top_logprobs": self.top,
                "text_offset": self.offsets}

    def chat(self) -> dict[str, Any]:
        """/v1/chat/completions' shape: `content`, one entry per token, `top_logprobs` a list."""
        def item(token: str, logprob: float | None) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [item(t, lp) | {"top_logprobs": [item(a, b) for a, b in list((top or {}).items())[:self.num_top]]}
                            for t, lp, top in zip(self.tokens, self.logprobs, self.top)],
                "refusal": None}


COMPLETION = ResponseFormat("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = ResponseFormat("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


@dataclass(frozen=True)
class ResponseHeader:
    """The fields every response and chunk of one request repeat."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, fmt: ResponseFormat, model: str) -> ResponseHeader:
        return cls(fmt.id_prefix + uuid.uuid4().hex, int(time.time()), model)

    def body(self, object: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts the prompt
    tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def preemption_info(metrics: RequestMetrics) -> dict[str, float]:
    """The `jserve` extension object of a finishing chunk."""
    return {"num_preemptions": metrics.num_preemptions, "preempted_time": metrics.preempted_time}


def model_card(name: str, root: str, created: int, max_model_len: int) -> dict[str, Any]:
    """One served name's entry of /v1/models (and vLLM's /v1/models/{id})."""
    return {"id": name, "object": "model", "created": created, "owned_by": "jserve", "root": root,
            "max_model_len": max_model_len}


def model_list(names: tuple[str, ...], root: str, created: int, max_model_len: int) -> dict[str, Any]:
    """/v1/models: every served name (vLLM's `--served-model-name`), each of the one model
    `root` (its registry name)."""
    return {"object": "list", "data": [model_card(name, root, created, max_model_len) for name in names]}


# --------------------------------------------------------------------------- tokenizer routes


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template.
    `add_special_tokens` is accepted as vLLM's clients send it; this server's tokenizers
    add no BOS or EOS either way (the chat template writes its own markers)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("tokenize_input", "send exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(RequestBody):
    """vLLM's /detokenize: token ids back to text (special tokens included)."""

    model: str | None = None
    tokens: list[int]


def tokenize_response(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}
