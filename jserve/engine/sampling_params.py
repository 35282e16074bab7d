"""Per-request decoding options, validated where the user passes them."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from jserve.errors import InvalidRequestError
from jserve.structured.spec import GrammarSpec

MAX_LOGPROBS = 20  # most alternatives a request may ask for per position (OpenAI's cap)
INT32_MAX = 2**31 - 1


class Encoder(Protocol):
    """What resolving `bad_words` needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-compatible sampling options. `temperature=0` means greedy.

    `top_k=0` disables top-k; `top_p=1` disables nucleus sampling. `seed` makes a sampled
    request reproducible regardless of which other requests share its batches.
    `logprobs=N` (vLLM's meaning) returns, for every output token, the N most likely tokens'
    log-probabilities beside the sampled one's; `prompt_logprobs=N` the same for every prompt
    token after the first. None (the default) computes neither, and the step stays the
    plain one. Log-probabilities are of the model's distribution, before temperature,
    top-p and top-k.
    `n`: sequences returned for the prompt; `best_of` (vLLM's, at least `n`): sequences
    generated, of which the `n` with the highest cumulative log-probability are returned.
    The prompt is prefilled once and its KV blocks shared (`jserve.engine.fork`).
    `grammar`: the output follows it (a JSON schema, a tool call; see
    `jserve.structured`): tokens outside it are masked before sampling.
    `presence_penalty` / `frequency_penalty` (in [-2, 2]) subtract from the logit of each
    token already output, once / per time it was; `repetition_penalty` (> 0) divides the
    positive logits and multiplies the negative ones of tokens in the prompt or the output
    (vLLM's and the OpenAI API's definitions; 0, 0 and 1 turn them off).
    `min_tokens`: EOS and the stop token ids cannot be sampled, and stop strings do not
    end the output, before it has this many tokens. `logit_bias` ({token id: bias}, a
    mapping or pairs, kept as sorted pairs) is added to those tokens' logits. `bad_words`
    are never sampled: each word, and the word after a space, must be one token of the
    model's vocabulary (a longer one is refused: `resolved`). The engine resolves them
    against its tokenizer at admission (`resolved`), filling `bad_word_ids` and
    `min_tokens_stop_ids`; they change the logits tokens are chosen from, as penalties do.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    grammar: GrammarSpec | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[str, ...] = ()
    # Filled by `resolved` (the engine's admission), not by a user.
    bad_word_ids: tuple[int, ...] = ()
    min_tokens_stop_ids: tuple[int, ...] = ()

    @property
    def num_sequences(self) -> int:
        """Sequences generated for the prompt: `best_of`, or `n`."""
        return self.n if self.best_of is None else self.best_of

    # Lists are accepted for convenience and frozen into tuples.
    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        self._validate()

    @property
    def has_token_rules(self) -> bool:
        """Whether the sampler must change this request's logits beyond penalties: a bias,
        a banned word or a minimum length."""
        return bool(self.logit_bias or self.bad_word_ids or self.min_tokens)

    def resolved(self, encoder: Encoder | None, vocab_size: int, eos_token_id: int | None) -> SamplingParams:
        """These options against a model: `logit_bias` ids checked against its vocabulary,
        `bad_words` tokenized as vLLM does (the word with its leading spaces stripped, then
        after one space, the second kept where it is another token of the same length), and
        the ids `min_tokens` holds back (the stop ids, and EOS unless ignored).

        A bad word of more than one token is refused: vLLM bans its last token only after
        the output ends with the others, which needs each sequence's latest tokens on the
        device (the host reads them a step late while steps are pipelined); one token is a
        ban with no history.

        Values past what the device's 32-bit columns hold but meaning the same are brought
        in: a `top_k` of the whole vocabulary or more is no cutoff (as in vLLM v1), and a
        `min_tokens` past 2**31 - 1 holds the stop ids back for any output a context allows.
        Stop token ids outside the vocabulary are refused, as `logit_bias` ids are."""
        _check_in_vocab("stop_token_ids", self.stop_token_ids, vocab_size)
        top_k = 0 if self.top_k >= vocab_size else self.top_k
        min_tokens = min(self.min_tokens, INT32_MAX)
        base = (self if (top_k, min_tokens) == (self.top_k, self.min_tokens)
                else dataclasses.replace(self, top_k=top_k, min_tokens=min_tokens))
        if not (self.bad_words or self.logit_bias or self.min_tokens):
            return base
        bad: list[int] = []
        if self.bad_words:
            if encoder is None:
                raise InvalidRequestError("bad_words needs the model's tokenizer; this model has none",
                                          "bad_words")
            for word in self.bad_words:
                plain, spaced = encoder.encode(word.lstrip()), encoder.encode(" " + word.lstrip())
                if len(plain) != 1:
                    raise InvalidRequestError(
                        f"bad_words: {word!r} is {len(plain)} tokens; only words of one token are "
                        "supported", "bad_words")
                bad += plain + (spaced if len(spaced) == 1 and spaced != plain else [])
        _check_in_vocab("logit_bias", [t for t, _ in self.logit_bias], vocab_size)
        _check_in_vocab("bad_words", bad, vocab_size)
        stops = self.stop_token_ids + ((eos_token_id,) if eos_token_id is not None and not self.ignore_eos else ())
        return dataclasses.replace(base, bad_word_ids=tuple(dict.fromkeys(bad)),
                                   min_tokens_stop_ids=tuple(dict.fromkeys(stops)) if self.min_tokens else ())

    def _validate(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
            return value

        def integer(name: str, low: int, what: str = "") -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise InvalidRequestError(f"{name} must be an integer >= {low}{what}, got {value!r}", name)

        if not number("temperature") >= 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < number("top_p") <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        integer("top_k", 0, " (0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not number("repetition_penalty") > 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                                      "repetition_penalty")
        integer("max_tokens", 1)
        integer("min_tokens", 0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got "
                                      f"{self.min_tokens}", "min_tokens")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias values must be finite numbers", "logit_bias")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise InvalidRequestError("bad_words must be non-empty strings", "bad_words")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, 0)
                if getattr(self, name) > MAX_LOGPROBS:
                    raise InvalidRequestError(f"{name} must be at most {MAX_LOGPROBS}, got "
                                              f"{getattr(self, name)}", name)
        integer("n", 1)
        if self.best_of is not None:
            integer("best_of", self.n, " (n)")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidRequestError(f"grammar must be a GrammarSpec, got {type(self.grammar)}", "grammar")
        if self.grammar is not None and self.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be used with a grammar, whose output ends "
                                      "with EOS", "ignore_eos")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")


def _check_in_vocab(name: str, ids: Sequence[int], vocab_size: int) -> None:
    """A 400 naming `name` unless every id of `ids` is a token of the vocabulary."""
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise InvalidRequestError(f"{name}: token ids must lie in [0, {vocab_size})", name)


def _bias_pairs(bias: Mapping[int, float] | tuple | list | None) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, bias) pairs, or a 400 naming it."""
    items = (bias.items() if isinstance(bias, Mapping) else bias) or ()
    try:
        pairs = {_token_id(t): float(b) for t, b in items}
    except (TypeError, ValueError):
        raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias") from None
    return tuple(sorted(pairs.items()))


def _token_id(t: object) -> int:
    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        raise TypeError(t)
    return int(t)
