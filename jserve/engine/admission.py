"""Admitting a request: everything a user can get wrong is refused here with
`InvalidRequestError` and the reason, before the request touches any engine state, so a
rejected request leaves nothing behind and the engine keeps serving."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

from jserve.engine.live_requests import LiveRequests
from jserve.engine.load_meter import LoadMeter
from jserve.engine.prefix_reuse import PrefixReuse
from jserve.engine.request import WAITING, Request, RequestMetrics
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.stopping import watches_tokens
from jserve.engine.view import SchedulerLimits
from jserve.errors import InvalidRequestError
from jserve.models.tokenizer import IncrementalDetokenizer, Tokenizer
from jserve.structured import GrammarMatcher, compiler_for


class RequestOptions(TypedDict, total=False):
    """What a request may carry beyond its prompt and sampling settings."""

    prompt: str | None  # the text, when the prompt came as text
    # The client's targets in seconds; policies read them from the view's columns (nan
    # where none was given).
    ttft_slo: float | None
    tbt_slo: float | None
    # An output-length prediction the caller already has and its expected error direction
    # (+1 over, -1 under, 0 unknown), for policies that allocate by prediction; without
    # one, the engine's `PredictionSource` is asked. Admission puts what the request itself
    # tells before either (`known_prediction`).
    predicted_len: int
    predicted_dir: int
    conversation_id: str | None  # the chat it is a turn of, for the prefix cache


def output_length_known(params: SamplingParams, prompt_len: int, max_len: int) -> bool:
    """Whether a request's output length is known when it arrives: it ignores EOS, has no
    stop token or string, and its `max_tokens` fits the context and the cache (`max_len`,
    the request's cap on prompt + output), so it generates exactly `max_tokens` tokens
    unless aborted. (A `max_tokens` past the cap is what a client that sets no bound
    sends: the cap then ends nothing it would not have ended.)"""
    return (params.ignore_eos and not params.stop and not params.stop_token_ids
            and prompt_len + params.max_tokens <= max_len)


def known_prediction(params: SamplingParams, prompt_len: int, max_len: int, predicted_len: int,
                     predicted_dir: int) -> tuple[int, int, bool]:
    """The output-length prediction every prediction-based policy (LayerKV, CacheOpt, RLP,
    S3) reads, as (length, error direction, known): what the request tells comes before a
    guess. A known length (`output_length_known`) replaces the prediction, with no error
    to expect; otherwise a prediction is capped by the most the request may generate
    (`max_len - prompt_len`: `max_tokens` within the context and cache), and 0 stays "no
    prediction"."""
    if output_length_known(params, prompt_len, max_len):
        return params.max_tokens, 0, True
    if predicted_len <= 0:
        return 0, 0, False
    return min(predicted_len, max_len - prompt_len), predicted_dir, False


class PredictionSource(Protocol):
    """Where the engine's output-length predictions come from: a trained predictor reading
    prompts (the real engine's, `jserve.builder`), or a benchmark's drawn per request id
    (`jserve.benchmarking.replay`). The engine asks it for every request it admits whose
    length is neither known nor predicted by the caller, all of a step's arrivals at once."""

    def predict(self, requests: Sequence[Request]) -> list[tuple[int, int]]:
        """(predicted output length, expected error direction) per request, in order; a
        length of 0 is no prediction."""
        ...


@dataclass
class Admission:
    live: LiveRequests
    limits: SchedulerLimits
    vocab_size: int
    capacity_tokens: int  # the whole device KV cache
    tokenizer: Tokenizer | None
    eos_token_id: int | None
    load: LoadMeter
    reuse: PrefixReuse | None
    predictions: PredictionSource | None = None
    # Admitted requests the source has not been asked about yet (`predict_arrivals`).
    _unpredicted: list[Request] = field(default_factory=list, init=False, repr=False)

    def admit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float,
        prompt: str | None = None,
        ttft_slo: float | None = None,
        tbt_slo: float | None = None,
        predicted_len: int = 0,
        predicted_dir: int = 0,
        conversation_id: str | None = None,
    ) -> Request:
        """The request, waiting (its options: `RequestOptions`)."""
        ids = [int(t) for t in prompt_token_ids]
        self._validate(request_id, ids, params)
        params = params.resolved(self.tokenizer, self.vocab_size, self.eos_token_id)
        matcher = self._matcher(params)
        for name, slo in (("ttft_slo", ttft_slo), ("tbt_slo", tbt_slo)):
            if slo is not None and not (math.isfinite(slo) and slo > 0):
                raise InvalidRequestError(f"{name} must be a positive number of seconds, got {slo}", name)
        cap = min(len(ids) + params.max_tokens, self.limits.max_model_len, self.capacity_tokens)
        predicted_len, predicted_dir, known = known_prediction(params, len(ids), cap, predicted_len, predicted_dir)
        req = Request(
            request_id=request_id, seq_id=self.live.new_seq_id(), prompt=prompt,
            prompt_token_ids=ids, params=params, max_len=cap, metrics=RequestMetrics(arrival_time),
            detokenizer=self.detokenizer(params), conversation_id=conversation_id, matcher=matcher,
        )
        self.live.add(
            req, watches_tokens(req, self.eos_token_id), status=WAITING, arrival_time=arrival_time,
            prompt_len=len(ids), num_tokens=len(ids), max_len=cap, first_token_time=math.nan,
            ttft_slo=math.nan if ttft_slo is None else ttft_slo,
            tbt_slo=math.nan if tbt_slo is None else tbt_slo,
            predicted_len=predicted_len, predicted_dir=predicted_dir, length_known=known,
            last_token_time=math.nan,
        )
        if self.reuse is not None:
            self.reuse.record_arrival(req)
        self.load.record_arrival(arrival_time)
        if self.predictions is not None and not known and predicted_len <= 0:
            self._unpredicted.append(req)
        return req

    def detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        """A new request's text maker (None: no tokenizer, no text)."""
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)

    def predict_arrivals(self) -> None:
        """Ask the prediction source about the requests admitted since the last call, in
        one batch, and put its answers under what the requests tell (`known_prediction`).
        The state calls it before every snapshot, so no policy sees a request before its
        prediction; batching the step's arrivals makes one predictor call of them (and,
        on the server, keeps that call off the event loop, in the step's thread)."""
        if not self._unpredicted:
            return
        live = [r for r in self._unpredicted if self.live.requests.get(r.seq_id) is r]
        self._unpredicted.clear()
        if not live or self.predictions is None:
            return
        cols = self.live.cols
        for req, (length, direction) in zip(live, self.predictions.predict(live), strict=True):
            row = self.live.row(req.seq_id)
            cols.predicted_len[row], cols.predicted_dir[row], _ = known_prediction(
                req.params, len(req.prompt_token_ids), req.max_len, length, direction)

    def _matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """The request's place in its grammar, at its start (None: no grammar)."""
        if params.grammar is None:
            return None
        if self.tokenizer is None:
            raise InvalidRequestError("a grammar needs the model's tokenizer; this model has none",
                                      "grammar")
        try:
            return compiler_for(self.tokenizer, self.vocab_size).matcher(params.grammar)
        except ValueError as e:
            raise InvalidRequestError(str(e), "grammar") from None

    def check_sequences(self, params: SamplingParams) -> None:
        """Refuse more sequences (`n`, `best_of`) than can run at once; asked before anything
        is made per sequence (a fuzzed `best_of` of 134 million once spelled out as many
        child ids first)."""
        if params.num_sequences > self.limits.max_num_seqs:
            name = "n" if params.best_of is None else "best_of"
            raise InvalidRequestError(f"{name}={params.num_sequences} sequences cannot run at once: "
                                      f"max_num_seqs is {self.limits.max_num_seqs}", name)

    def _validate(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params)}")
        if self.live.by_request_id(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must lie in [0, {self.vocab_size})", "prompt")
        limit = self.limits.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context limit is {limit} "
                f"(prompt + at least one output token)", "prompt"
            )
        if len(ids) >= self.capacity_tokens:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but the whole KV cache holds {self.capacity_tokens}",
                "prompt",
            )
