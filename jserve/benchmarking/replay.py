"""Feed a timed trace into an engine, request by request as the clock reaches each
arrival, and collect per-request records. The same driver serves the real engine (wall
clock: it sleeps through idle gaps) and the simulator (virtual clock: it jumps them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from jserve.benchmarking.metrics import RequestRecord
from jserve.benchmarking.workload import Trace, TraceRequest
from jserve.engine.clock import VirtualClock, WallClock
from jserve.engine.loop import Engine
from jserve.engine.request import FinishReason, Request
from jserve.engine.sampling_params import SamplingParams


def benchmark_params(req: TraceRequest) -> SamplingParams:
    """Greedy, exactly the trace's output length (EOS ignored), as serving benchmarks run."""
    return SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)


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
    policies that allocate by prediction (none: the engine sees no predictions)."""
    start = clock.now()
    pending = sorted(trace.requests, key=lambda r: r.arrival_time)
    specs = {r.request_id: r for r in pending}
    records: list[RequestRecord] = []
    i = 0
    while i < len(pending) or engine.has_unfinished:
        now = clock.now()
        while i < len(pending) and start + pending[i].arrival_time <= now:
            spec = pending[i]
            length, direction = (predictions or {}).get(spec.request_id, (0, 0))
            engine.add_request(spec.request_id, prompt_ids(spec), benchmark_params(spec),
                               prompt=spec.prompt, arrival_time=start + spec.arrival_time,
                               ttft_slo=spec.ttft_slo, tbt_slo=spec.tbt_slo,
                               predicted_len=length, predicted_dir=direction)
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
    return records
