"""Recording a step's results: progress, new tokens, first-token times, and the requests
they end.

Everything that is the same for every request is one column operation over the step's
rows, and the tokens, log-probabilities and times go onto the requests' lists through
C-level `map`s, so a step of requests that end by length alone (the simulator's) runs no
Python per token. Only requests that `stopping.watches_tokens` are read token by token.
Requests end in batch order, which decides the order their blocks return to the free
list, and so which blocks later requests get.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

import numpy as np

from jserve.engine.batch import Batch, RepeatedSteps, StepOutput
from jserve.engine.fork import Forks
from jserve.engine.live_requests import LiveRequests
from jserve.engine.logprobs import record_logprobs
from jserve.engine.prefix_reuse import PrefixReuse
from jserve.engine.release import Finisher
from jserve.engine.request import FinishReason, Request
from jserve.engine.stopping import stops_at

_consume = collections.deque(maxlen=0).extend  # runs an iterator to its end, in C
_OUTPUT_IDS = attrgetter("output_token_ids")
_LOGPROBS = attrgetter("output_logprobs")
_TOKEN_TIMES = attrgetter("metrics.token_times")


def _append_tokens(reqs: list[Request], tokens: list[int], logprobs: list[float], now: float) -> None:
    """Each request's new token, its log-probability and its time, through C-level maps."""
    _consume(map(list.append, map(_OUTPUT_IDS, reqs), tokens))
    _consume(map(list.append, map(_LOGPROBS, reqs), logprobs))
    _consume(map(list.append, map(_TOKEN_TIMES, reqs), repeat(now, len(reqs))))


@dataclass(frozen=True)
class Booked:
    """A dispatched step's progress, booked before its tokens are read (`TokenCommit.book`):
    the batch's requests in batch order (None: ended before the step was booked), the batch
    indices that sampled a token, which of those are read token by token (`watched`) and
    which reached their length (`ended`: released at once, ended when their token is read)."""

    batch: Batch
    reqs: list[Request | None]
    sampled: np.ndarray
    watched: np.ndarray
    ended: np.ndarray


@dataclass(frozen=True)
class TokenCommit:
    live: LiveRequests
    finisher: Finisher
    eos_token_id: int | None
    reuse: PrefixReuse | None
    forks: Forks  # forks requests of several sequences at their first token, before any release

    def commit(self, batch: Batch, rows: np.ndarray, out: StepOutput, now: float) -> list[Request]:
        """`rows`: the batch's table rows. Returns the requests that gained a token, in
        batch order (finished ones too)."""
        cols = self.live.cols
        cols.num_computed[rows] += batch.query_lens
        sampled = np.flatnonzero(batch.sample)
        rows, seq_ids = rows[sampled], batch.seq_ids[sampled].tolist()
        tokens = out.next_tokens[sampled].tolist()
        reqs = list(map(self.live.requests.__getitem__, seq_ids))
        _append_tokens(reqs, tokens, out.logprobs[sampled].tolist(), now)
        if out.top_logprobs is not None:
            record_logprobs(batch, out, list(map(self.live.requests.__getitem__, batch.seq_ids.tolist())))
        self._first_tokens(reqs, rows, now)
        cols.num_tokens[rows] += 1
        cols.last_token_time[rows] = now
        stopped = self._stops(reqs, seq_ids, tokens)
        if out.ended is not None:
            stopped |= out.ended[sampled]
        done = np.flatnonzero(stopped | (cols.num_tokens[rows] >= cols.max_len[rows])).tolist()
        self.forks.fork(reqs)
        for i in done:
            self.finisher.finish(reqs[i], FinishReason.STOP if stopped[i] else FinishReason.LENGTH, now)
        return reqs

    def book(self, batch: Batch, now: float) -> Booked:
        """A dispatched step's progress, before its tokens are read (the pipelined loop):
        computed tokens and a pending token per sampled sequence; requests that reach their
        length give their blocks back now, so that no plan runs them again. Requests the
        previous step's tokens ended since the batch was built are left out (their work is
        wasted, as in vLLM's asynchronous scheduling). `read` records the tokens."""
        cols = self.live.cols
        seq_ids = batch.seq_ids.tolist()
        rows = self.live.rows(seq_ids)
        live = rows >= 0
        cols.num_computed[rows[live]] += batch.query_lens[live]
        all_reqs = list(map(self.live.requests.get, seq_ids))
        sampled = np.flatnonzero(batch.sample & live)
        rows = rows[sampled]
        reqs = [all_reqs[i] for i in sampled.tolist()]
        for req in reqs:
            req.pending_tokens = 1
        cols.num_tokens[rows] += 1
        watched = self.live.token_checked_mask(batch.seq_ids[sampled].tolist())
        ended = cols.num_tokens[rows] >= cols.max_len[rows]
        self.forks.fork(reqs)
        for i in np.flatnonzero(ended).tolist():
            self.finisher.release(reqs[i], now)
        return Booked(batch, all_reqs, sampled, watched, ended)

    def read(self, booked: Booked, out: StepOutput, now: float) -> list[Request]:
        """Record a booked step's tokens, one step after it was dispatched: what `commit`
        records, with the stops the tokens make (EOS, stop ids and strings) ending their
        requests a step late, and the requests that reached their length ended (by stop
        if their last token is one, as `commit` would). Returns the requests that gained
        a token, aborted ones left out."""
        sampled = booked.sampled
        reqs = [booked.reqs[i] for i in sampled.tolist()]
        tokens = out.next_tokens[sampled].tolist()
        for req in reqs:
            req.pending_tokens = 0
        _append_tokens(reqs, tokens, out.logprobs[sampled].tolist(), now)
        if out.top_logprobs is not None or out.position_logprobs is not None:
            record_logprobs(booked.batch, out, booked.reqs)
        rows = self.live.rows([r.seq_id for r in reqs])
        live = rows >= 0
        self._first_tokens([r for r, k in zip(reqs, live.tolist()) if k], rows[live], now)
        self.live.cols.last_token_time[rows[live]] = now
        for i in np.flatnonzero(booked.watched | booked.ended).tolist():
            req = reqs[i]
            if req.finish_reason is FinishReason.ABORT:
                continue
            if req.metrics.first_token_time is None:  # its first token ended it by length
                req.metrics.first_token_time = now
            stopped = bool(booked.watched[i]) and stops_at(req, tokens[i], self.eos_token_id)
            if booked.ended[i]:
                self.finisher.end(req, FinishReason.STOP if stopped else FinishReason.LENGTH, now)
            elif stopped:
                self.finisher.finish(req, FinishReason.STOP, now)
        return [r for r in reqs if r.finish_reason is not FinishReason.ABORT]

    def commit_repeated(self, rows: np.ndarray, seq_ids: list[int], steps: RepeatedSteps) -> list[Request]:
        """Record repeated decode steps of requests that all hold their first token and
        whose tokens need no reading (`EngineState.repeat_room` saw to both): what as many
        `commit`s would record, with the requests that reach their length, or that the
        runner ends, ended at the last step."""
        cols, k = self.live.cols, steps.num_steps
        reqs = list(map(self.live.requests.__getitem__, seq_ids))
        _consume(map(list.extend, map(_OUTPUT_IDS, reqs), steps.next_tokens.T.tolist()))
        _consume(map(list.extend, map(_LOGPROBS, reqs), steps.logprobs.T.tolist()))
        _consume(map(list.extend, map(_TOKEN_TIMES, reqs), repeat(steps.end_times, len(reqs))))
        cols.num_computed[rows] += k
        cols.num_tokens[rows] += k
        now = steps.end_times[-1]
        cols.last_token_time[rows] = now
        stopped = np.zeros(len(reqs), bool) if steps.ended is None else steps.ended
        for i in np.flatnonzero(stopped | (cols.num_tokens[rows] >= cols.max_len[rows])).tolist():
            self.finisher.finish(reqs[i], FinishReason.STOP if stopped[i] else FinishReason.LENGTH, now)
        return reqs

    def _first_tokens(self, reqs: list[Request], rows: np.ndarray, now: float) -> None:
        cols = self.live.cols
        first = np.isnan(cols.first_token_time[rows])
        cols.first_token_time[rows[first]] = now
        for i in np.flatnonzero(first).tolist():
            reqs[i].metrics.first_token_time = now
            if self.reuse is not None:
                self.reuse.record_first_token(reqs[i], now)

    def _stops(self, reqs: list[Request], seq_ids: list[int], tokens: list[int]) -> np.ndarray:
        """Which requests the new token ends, of those whose tokens are read one by one."""
        stopped = np.zeros(len(reqs), bool)
        for i in np.flatnonzero(self.live.token_checked_mask(seq_ids)).tolist():
            stopped[i] = stops_at(reqs[i], tokens[i], self.eos_token_id)
        return stopped
