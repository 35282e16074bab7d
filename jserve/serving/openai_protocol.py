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

Bodies are strict (`StrictModel`): a value of the wrong JSON type is refused, not coerced.
"""

from __future__ import annotations

import time
import uuid
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
from pydantic_core import PydanticCustomError

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
    """A request body whose values keep their JSON types, as OpenAI's schema has them: no
    `"yes"` or `1` taken for true, no `"0.5"` for a number (an int is still a number)."""

    model_config = ConfigDict(strict=True)


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


class GenerationRequest(StrictModel):
    """Fields both endpoints share. Nullable as in OpenAI's spec: null means the default.
    Fields this server does not implement (penalties, ...) are ignored."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; 0 or -1 (vLLM's old "off") disable it
    seed: int | None = None
    stop: Stop = None
    n: int | None = None
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

    def sampling_params(self, default_max_tokens: int, num_prompt_tokens: int,
                        max_model_len: int) -> SamplingParams:
        """The engine's options, or `OpenAIError` (400) naming what is wrong. An explicit
        `max_tokens` must fit the context beside the prompt (vLLM's check and message); the
        default is capped by the context instead. Scoring a prompt (`max_tokens: 0` with
        `echo`) runs one step, as vLLM does; its token is not returned."""
        if self.n not in (None, 1):
            raise OpenAIError(400, f"only n=1 is supported, got n={self.n}", param="n")
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
                grammar=self.grammar(),
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


def model_list(names: tuple[str, ...], root: str, created: int, max_model_len: int) -> dict[str, Any]:
    """/v1/models: every served name (vLLM's `--served-model-name`), each of the one model
    `root` (its registry name)."""
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "jserve", "root": root,
         "max_model_len": max_model_len}
        for name in names
    ]}


# --------------------------------------------------------------------------- tokenizer routes


class TokenizeRequest(StrictModel):
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


class DetokenizeRequest(StrictModel):
    """vLLM's /detokenize: token ids back to text (special tokens included)."""

    model: str | None = None
    tokens: list[int]


def tokenize_response(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}
