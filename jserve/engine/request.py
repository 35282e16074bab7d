"""A request's tokens, text and timings: what the caller gets back.

The numbers the scheduler reads every step (lengths, progress, blocks held) live in
`RequestTable` columns instead, so a snapshot is a few numpy copies, not a Python loop.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from jserve.engine.sampling_params import SamplingParams
from jserve.models.tokenizer import IncrementalDetokenizer
from jserve.structured import GrammarMatcher


T = TypeVar("T")


class RequestStatus(enum.IntEnum):
    WAITING = 0  # arrived; holds no KV (never started, or preempted by recompute)
    RUNNING = 1  # holds KV blocks on the device
    FINISHED = 2
    SWAPPED = 3  # preempted by swapping: its KV waits in host memory, none on the device
    # Prefilled, with some of its layers' KV in host memory (`device_layers` < the model's
    # layers, LayerKV), whether or not it runs: a step that decodes it reads those layers
    # from the host for the step.
    OFFLOADED = 4


# The statuses as plain ints, for the status column in hot loops: comparing numpy values
# with an IntEnum member makes numpy probe the enum class for array hooks, each probe a
# failed `EnumType.__getattr__` (about a microsecond).
WAITING = int(RequestStatus.WAITING)
RUNNING = int(RequestStatus.RUNNING)
FINISHED = int(RequestStatus.FINISHED)
SWAPPED = int(RequestStatus.SWAPPED)
OFFLOADED = int(RequestStatus.OFFLOADED)


# An output token sampled on the device whose id the host has not read yet: an asynchronous
# step (`Engine`'s pipelined loop) books the token when it is dispatched and reads it one
# step later; the next step takes it from the device (`JaxRunner.dispatch`).
PLACEHOLDER = -1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the context/cache length cap
    ABORT = "abort"


@dataclass
class RequestMetrics:
    """Wall or virtual clock times (seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    preempted_time: float = 0.0  # seconds spent waiting to be readmitted after preemptions
    last_preempted_at: float | None = None  # set while preempted
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when admitted

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class Request:
    request_id: str
    seq_id: int  # engine-internal id used by views and plans
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_len: int  # cap on prompt + output tokens (max_tokens, context and cache size)
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer | None = None
    output_token_ids: list[int] = field(default_factory=list)  # those read from the device
    # Output tokens sampled on the device and not read yet (0 or 1: the pipelined loop books
    # a token when its step is dispatched and reads it a step later); they count in
    # `num_tokens` and are `PLACEHOLDER`s in `all_token_ids`.
    pending_tokens: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    # With `params.logprobs`: per output token, {token id: log-probability} of the sampled
    # token and the top `params.logprobs`; with `params.prompt_logprobs`, the same for each
    # prompt token (None for the first, which nothing predicts). Filled by
    # `engine.logprobs.record_logprobs`.
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # The chat this request is a turn of (None: its own): what the prefix cache tags its
    # blocks with, and the key it isolates caches by when asked to.
    conversation_id: str | None = None
    # With `params.grammar`: where the output is in it, advanced by every token read
    # (`stopping.stops_at`); the runner masks the logits by it.
    matcher: GrammarMatcher | None = None
    # With `params.n` / `best_of` > 1, the request's sequences (`jserve.engine.fork`): the
    # admitted one is index 0; the others are forked from it (`parent_seq_id`) once its
    # prompt is prefilled, and carry the admitted request's id as `parent_request_id`.
    index: int = 0
    parent_seq_id: int | None = None
    parent_request_id: str | None = None

    @property
    def group_request_id(self) -> str:
        """The id the caller gave: the request's own, or that of the request it was forked from."""
        return self.request_id if self.parent_request_id is None else self.parent_request_id

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its read output tokens' log-probabilities (what `best_of` ranks by)."""
        return float(sum(self.output_logprobs))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids + [PLACEHOLDER] * self.pending_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending_tokens

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass(frozen=True)
class CompletionOutput:
    """One sequence of a request (vLLM's name): `index` is its place among the request's
    `best_of` sequences."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None
    top_logprobs: list[dict[int, float]] | None = None

    @classmethod
    def of(cls, req: Request) -> CompletionOutput:
        return cls(req.index, req.text, list(req.output_token_ids), req.cumulative_logprob,
                   list(req.output_logprobs),
                   None if req.finish_reason is None else req.finish_reason.value, req.stop_reason,
                   None if req.top_logprobs is None else list(req.top_logprobs))


def pick_best(seqs: Sequence[T], n: int, score: Callable[[T], float]) -> list[T]:
    """The `n` sequences a request returns of those it generated (given in index order):
    all of them, in that order, when it generated `n`; else the `n` with the highest
    cumulative log-probability (`score`, vLLM's `best_of` rule), best first."""
    if len(seqs) <= n:
        return list(seqs)
    return sorted(seqs, key=score, reverse=True)[:n]


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: streamed while running, final once `finished`.

    The flat fields are of one sequence (`index`); `outputs` holds every sequence returned,
    as vLLM's `RequestOutput.outputs` does: with n = 1 the one sequence, whose fields are
    the flat ones. `LLM.generate` returns, per prompt, an output whose flat fields are its
    first returned sequence's (`of_group`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[float]
    metrics: RequestMetrics
    top_logprobs: list[dict[int, float]] | None = None  # with SamplingParams.logprobs
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with .prompt_logprobs
    index: int = 0
    outputs: tuple[CompletionOutput, ...] = ()

    @classmethod
    def of(cls, req: Request) -> RequestOutput:
        """One sequence's state, under the id the caller gave (`group_request_id`)."""
        return cls.of_group([req], 1)

    @classmethod
    def of_group(cls, seqs: list[Request], n: int) -> RequestOutput:
        """A request's `n` returned sequences (`pick_best`) of its finished `seqs`;
        the flat fields are the first's."""
        best = pick_best(sorted(seqs, key=lambda r: r.index), n, lambda r: r.cumulative_logprob)
        req, first = best[0], min(seqs, key=lambda r: r.index)  # the prompt's are the first's
        return cls(
            request_id=req.group_request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=req.text, finished=all(r.finished for r in seqs),
            finish_reason=None if req.finish_reason is None else req.finish_reason.value,
            stop_reason=req.stop_reason, logprobs=list(req.output_logprobs), metrics=first.metrics,
            top_logprobs=None if req.top_logprobs is None else list(req.top_logprobs),
            prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
            index=req.index, outputs=tuple(map(CompletionOutput.of, best)),
        )
