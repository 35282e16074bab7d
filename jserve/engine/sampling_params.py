"""Per-request decoding options, validated where the user passes them."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from jserve.errors import InvalidRequestError
from jserve.structured.spec import GrammarSpec

MAX_LOGPROBS = 20  # most alternatives a request may ask for per position (OpenAI's cap)


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
        self._validate()

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
