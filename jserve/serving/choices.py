"""One choice of a completion response, rendered chunk by chunk: its text (the echoed
prompt first, if asked), its token ids, and its log-probabilities with each token's text
and character offset; a chat answer decoded under a tool grammar as its tool calls.

A stream renders a choice over many chunks, so what a later chunk needs is kept here: how
far into the choice's text the rendered tokens reach, and the state that splits the text
into tokens (a character may span tokens of two chunks). A batch of prompts has one
`Choice` per prompt, told apart by `index`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jserve.models.tokenizer import Tokenizer, TokenTexts
from jserve.serving.async_engine import Delta
from jserve.serving.openai_protocol import GenerationRequest, ResponseFormat, TokenLogprobs


@dataclass(frozen=True)
class PromptInput:
    """One prompt as the engine takes it, with its text as the client sent it (None: sent
    as token ids; chat: the rendered conversation)."""

    ids: list[int]
    text: str | None


class Choice:
    def __init__(self, index: int, prompt: PromptInput, body: GenerationRequest, fmt: ResponseFormat,
                 tokenizer: Tokenizer | None) -> None:
        self.index = index
        self.prompt = prompt
        self._body = body
        self._fmt = fmt
        self._tokenizer = tokenizer
        self._echo = bool(getattr(body, "echo", False))
        self._score_only = body.score_only  # the prompt's log-probabilities, no output
        self._num_top = body.requested_logprobs()[0] or 0
        grammar = body.grammar()
        self._tools = grammar if grammar is not None and grammar.calls_tools else None
        self._first = True
        self._offset = 0  # characters of the choice's text the rendered tokens cover
        self._output_texts = None if tokenizer is None else TokenTexts(tokenizer)
        self.num_output_tokens = 0  # returned to the client, for usage
        self.num_cached_tokens = 0

    def render(self, delta: Delta, *, stream: bool) -> dict[str, Any]:
        """The choice's JSON for `delta` (a stream's chunk, or the whole of a non-streamed
        answer), the first one carrying the echoed prompt."""
        first, self._first = self._first, False
        if delta.metrics is not None:
            self.num_cached_tokens = delta.metrics.num_cached_tokens
        text, ids = delta.text, delta.token_ids
        lps, tops = delta.logprobs, delta.top_logprobs
        if self._score_only:  # the step's one token was only the way to the prompt's scores
            text, ids = "", []
            lps = [] if lps is not None else None
            tops = [] if tops is not None else None
        self.num_output_tokens += len(ids)
        logprobs = None
        if lps is not None and tops is not None:
            rendered = self._prompt_logprobs(delta) if first and self._echo else None
            output = self._logprobs(ids, lps, tops, self._output_texts, in_text=self._in_output_text,
                                    last=delta.finished)
            logprobs = self._merge(rendered, output)
            logprobs = logprobs.chat() if self._fmt.chat else logprobs.completion()
        if first and self._echo:
            text = self._echo_text() + text
        calls = None if self._tools is None or not delta.finished else self._tools.tool_calls(text)
        return self._fmt.choice(self.index, text, delta.finish_reason,
                                ids if self._body.return_token_ids else None,
                                stream=stream, first=first, logprobs=logprobs, tool_calls=calls)

    # ------------------------------------------------------------------ helpers
    def _echo_text(self) -> str:
        if self.prompt.text is not None:
            return self.prompt.text
        tok = self._tokenizer
        return "" if tok is None else tok.decode(self.prompt.ids, skip_special_tokens=False)

    def _in_output_text(self, token_id: int) -> bool:
        """Whether a generated token's text is part of the choice's text: the engine's
        detokenizer leaves special tokens out (their entries still name them)."""
        return self._tokenizer is not None and not self._tokenizer.is_special(token_id)

    def _prompt_logprobs(self, delta: Delta) -> TokenLogprobs:
        """The echoed prompt's entries: None where nothing was computed (the first token,
        and positions a prefix cache served)."""
        ids = self.prompt.ids
        known = list(delta.prompt_logprobs or [])
        tops = known + [None] * (len(ids) - len(known))
        lps = [None if e is None else e[t] for e, t in zip(tops, ids)]
        texts = None if self._tokenizer is None else TokenTexts(self._tokenizer)
        return self._logprobs(ids, lps, tops, texts, in_text=lambda _: True, last=True)

    def _logprobs(self, ids: list[int], lps: list[float | None], tops: list[dict[int, float] | None],
                  texts: TokenTexts | None, *, in_text: Callable[[int], bool], last: bool) -> TokenLogprobs:
        """Entries for `ids`, their texts from `texts` (None: no tokenizer, vLLM's
        `token_id:N` labels, which are no part of any text), offsets counting on from the
        choice's. `last`: no token follows, so what `texts` holds back belongs to the last."""
        tokens: list[str] = []
        offsets: list[int] = []
        top_texts: list[dict[str, float] | None] = []
        for t, top in zip(ids, tops):
            label = (lambda k: f"token_id:{k}") if texts is None else texts.peek
            # most likely first; where two alternatives share a text, the likelier stays
            alternatives: dict[str, float] | None = None
            if top is not None:
                alternatives = {}
                for k, v in sorted(top.items(), key=lambda kv: -kv[1]):
                    alternatives.setdefault(label(k), v)
            top_texts.append(alternatives)
            tokens.append(label(t) if texts is None else texts.push(t))
            offsets.append(self._offset)
            if texts is not None and in_text(t):
                self._offset += len(tokens[-1])
        if last and texts is not None and tokens:
            rest = texts.flush()
            tokens[-1] += rest
            self._offset += len(rest)
        return TokenLogprobs(tokens, list(lps), top_texts, self._num_top, offsets)

    @staticmethod
    def _merge(prompt: TokenLogprobs | None, output: TokenLogprobs) -> TokenLogprobs:
        if prompt is None:
            return output
        return TokenLogprobs(prompt.tokens + output.tokens, prompt.logprobs + output.logprobs,
                             prompt.top + output.top, output.num_top, prompt.offsets + output.offsets)
