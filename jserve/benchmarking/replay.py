"""Feed a timed trace into an engine, request by request as the clock reaches each
arrival, and collect per-request records. The same driver serves the real engine (wall
clock: it sleeps through idle gaps) and the simulator (virtual clock: it jumps them).

Each request ends where the trace's did, but the engine is not told where: the trace's
output length is held by `TraceEnds`, beside the runner, which marks the token that
reaches it as ending the request (as the recorded model's end-of-sequence did). The
request itself is sent with the context as its only bound (`open_params`), so its
`max_len`, the view, every reservation and the predictor see nothing of the true length.
Passing the length as `max_tokens` with EOS ignored instead, as serving benchmarks do (and
the HTTP client still must: `benchmark_params`), tells the engine the length: prediction-
based policies read it as known (`jserve.engine.admission.known_prediction`). Replay does
so only where the client fixes the length itself (`TraceRequest.fixed_output`, the
``fixed:IN:OUT`` workloads), so every policy is told what such a client tells.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jserve.benchmarking.metrics import RequestRecord
from jserve.benchmarking.workload import Trace, TraceRequest
from jserve.engine.batch import Batch, RepeatedSteps, StepOutput
from jserve.engine.clock import VirtualClock, WallClock
from jserve.engine.loop import Engine, RepeatingRunner, Runner
from jserve.engine.request import FinishReason, Request
from jserve.engine.sampling_params import SamplingParams


def benchmark_params(req: TraceRequest) -> SamplingParams:
    """Greedy, exactly the trace's output length (EOS ignored), as serving benchmarks run
    over HTTP, where the length can only travel as `max_tokens`."""
    return SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)


def trace_params(req: TraceRequest, max_model_len: int) -> SamplingParams:
    """What a trace request is sent with: its fixed length (`benchmark_params`) where the
    client fixes it, else the context alone (`open_params`)."""
    return benchmark_params(req) if req.fixed_output else open_params(max_model_len)


def open_params(max_model_len: int) -> SamplingParams:
    """Greedy, bounded by the context alone (what a client that sets no `max_tokens`
    gets), EOS ignored: `TraceEnds` ends the request at the trace's length."""
    return SamplingParams(temperature=0.0, max_tokens=max_model_len, ignore_eos=True)


class TraceEnds:
    """A runner wrapped so that each request ends at its recorded length: the sampled
    token that brings sequence `s` to `end_at(s, total)` tokens is marked `ended`. The
    lengths stay here, out of the engine state, so no policy can read them."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.needs_inputs = runner.needs_inputs
        self._end = np.zeros(256, np.int64)  # by seq id: prompt + output tokens at the end
        if isinstance(runner, RepeatingRunner):  # repeats only where the runner can
            self.repeat_decodes = self._repeat_decodes

    def end_at(self, seq_id: int, total_tokens: int) -> None:
        if seq_id >= len(self._end):
            self._end = np.concatenate([self._end, np.zeros(max(seq_id + 1, 2 * len(self._end)), np.int64)])
        self._end[seq_id] = total_tokens

    def execute(self, batch: Batch) -> StepOutput:
        out = self.runner.execute(batch)
        if batch.num_seqs == 0:
            return out
        # A sampled token brings a sequence to (tokens computed by this step) + 1.
        ended = batch.sample & (batch.context_lens + 1 >= self._end[batch.seq_ids])
        return dataclasses.replace(out, ended=ended)

    def _repeat_decodes(self, batch: Batch, steps: int, until: float) -> RepeatedSteps:
        """The inner runner's repeated decodes, cut at the first step that ends a
        sequence (step `j` after `batch` brings each to `context_lens + j + 1` tokens)."""
        left = self._end[batch.seq_ids] - batch.context_lens - 1
        done = self.runner.repeat_decodes(batch, min(steps, int(left.min())), until)
        ended = batch.context_lens + done.num_steps + 1 >= self._end[batch.seq_ids]
        return dataclasses.replace(done, ended=ended)


@dataclasses.dataclass(frozen=True)
class TracePredictions:
    """A benchmark's output-length predictions as the engine's prediction source: drawn
    beforehand per request id (from a predictor's noise model, or the true lengths), since
    the trace's synthetic prompts say nothing a predictor could read."""

    by_request_id: Mapping[str, tuple[int, int]]

    def predict(self, requests: Sequence[Request]) -> list[tuple[int, int]]:
        return [self.by_request_id.get(r.request_id, (0, 0)) for r in requests]


def record_of(req: Request, spec: TraceRequest) -> RequestRecord:
    m = req.metrics
    return RequestRecord(
        request_id=req.request_id, arrival_time=m.arrival_time,
        first_token_time=m.first_token_time, finished_time=m.finished_time,
        token_times=tuple(m.token_times), prompt_len=len(req.prompt_token_ids),
        output_len=len(req.output_token_ids), num_preemptions=m.num_preemptions,
        preempted_time=m.preempted_time, ttft_slo=spec.ttft_slo, tbt_slo=spec.tbt_slo,
        finished=req.finish_reason is not FinishReason.ABORT,
        num_cached_tokens=m.num_cached_tokens,
    )


def replay(
    engine: Engine,
    trace: Trace,
    clock: WallClock | VirtualClock,
    prompt_ids: Callable[[TraceRequest], list[int]],
    on_finish: Callable[[RequestRecord], None] | None = None,
    predictions: Mapping[str, tuple[int, int]] | None = None,
) -> list[RequestRecord]:
    """Run the whole trace to completion; arrival times are offsets from the call.

    `predictions`: request id -> (predicted output length, expected error direction), for
    policies that allocate by prediction: the engine's prediction source for the run
    (none: the engine sees no predictions, whatever predictor it has)."""
    start = clock.now()
    pending = sorted(trace.requests, key=lambda r: r.arrival_time)
    specs = {r.request_id: r for r in pending}
    records: list[RequestRecord] = []
    max_model_len = engine.state.limits.max_model_len
    ends = TraceEnds(engine.runner)
    engine.runner = ends
    own_predictions = engine.state.predictions
    engine.state.predictions = None if predictions is None else TracePredictions(predictions)
    try:
        i = 0
        while i < len(pending) or engine.has_unfinished:
            now = clock.now()
            while i < len(pending) and start + pending[i].arrival_time <= now:
                spec = pending[i]
                req = engine.add_request(spec.request_id, prompt_ids(spec), trace_params(spec, max_model_len),
                                         prompt=spec.prompt, arrival_time=start + spec.arrival_time,
                                         ttft_slo=spec.ttft_slo, tbt_slo=spec.tbt_slo)
                ends.end_at(req.seq_id, len(req.prompt_token_ids) + spec.output_len)
                i += 1
            if not engine.has_unfinished:
                clock.wait_until(start + pending[i].arrival_time)
                continue
            until = start + pending[i].arrival_time if i < len(pending) else math.inf
            for req in engine.step(until):
                if req.finished:
                    record = record_of(req, specs[req.request_id])
                    records.append(record)
                    if on_finish is not None:
                        on_finish(record)
    finally:
        engine.runner = ends.runner
        engine.state.predictions = own_predictions
    return records
