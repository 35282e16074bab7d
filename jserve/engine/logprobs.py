"""Recording the log-probabilities a request asked for (`SamplingParams.logprobs`,
`prompt_logprobs`) from a step's output. Runs only for steps whose batch asked, so the
plain step's commit stays column operations."""

from __future__ import annotations

from jserve.engine.batch import Batch, StepOutput, TopLogprobs
from jserve.engine.request import Request


def _entry(token: int, logprob: float, top: TopLogprobs, row: int, n: int) -> dict[int, float]:
    """vLLM's per-position dict: the top `n` alternatives and the actual token."""
    entry = dict(zip(top.token_ids[row, :n].tolist(), top.logprobs[row, :n].tolist()))
    entry[token] = logprob
    return entry


def record_logprobs(batch: Batch, out: StepOutput, reqs: list[Request]) -> None:
    """`reqs`: the batch's requests in batch order, their new tokens already appended
    (None: one that ended before its step was booked, whose outputs are dropped).
    Prompt positions are recorded once, in order, however the prompt was chunked or
    recomputed after a preemption."""
    starts, lens = batch.start.tolist(), batch.query_lens.tolist()
    offset = 0
    for i, req in enumerate(reqs):
        if req is None:
            offset += lens[i]
            continue
        params = req.params
        if batch.sample[i] and params.logprobs is not None and out.top_logprobs is not None:
            if req.top_logprobs is None:
                req.top_logprobs = []
            req.top_logprobs.append(_entry(req.output_token_ids[-1], req.output_logprobs[-1],
                                           out.top_logprobs, i, params.logprobs))
        if params.prompt_logprobs is not None and out.position_logprobs is not None:
            next_lp, top = out.position_logprobs
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]
            prompt = req.prompt_token_ids
            for p in range(starts[i], min(starts[i] + lens[i], len(prompt) - 1)):
                if len(req.prompt_logprobs) == p + 1:  # not yet recorded (recompute repeats)
                    flat = offset + p - starts[i]
                    req.prompt_logprobs.append(_entry(prompt[p + 1], float(next_lp[flat]), top,
                                                      flat, params.prompt_logprobs))
        offset += lens[i]
