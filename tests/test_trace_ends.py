"""A replayed trace ends each request at its recorded length without telling the engine:
no policy's view, reservation or `max_len` depends on the true output length (the
oracle leak of passing it as `max_tokens`), and the tokens generated are unchanged."""

from __future__ import annotations


import numpy as np
import pytest

from jserve import builder
from jserve.benchmarking.replay import TraceEnds, open_params, replay
from jserve.benchmarking.workload import Trace, TraceRequest
from jserve.cache_features.swap_tier.section import preempt_modes
from jserve.config import EngineConfig
from jserve.engine.plan import Plan
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.view import SchedulerView
from jserve.serving.llm import LLM

MAX_MODEL_LEN = 512


class Spy:
    """Wraps a policy; keeps, per step, what the view said of each request and the plan."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.chunked_prefill = inner, inner.name, inner.chunked_prefill
        self.capabilities = inner.capabilities
        self.max_lens: list[np.ndarray] = []
        self.steps: list[tuple] = []

    def schedule(self, view: SchedulerView) -> Plan:
        plan = self.inner.schedule(view)
        r = view.requests
        self.max_lens.append(r.max_len.copy())
        self.steps.append((r.seq_id.tolist(), r.num_tokens.tolist(), r.reserved_blocks.tolist(),
                           list(plan.run.items()), sorted(plan.reserve.items()),
                           sorted((s, m.value) for s, m in preempt_modes(plan).items())))
        return plan


def trace(outputs: list[int]) -> Trace:
    rng = np.random.default_rng(5)
    prompts = rng.integers(16, 160, len(outputs))
    times = np.cumsum(rng.exponential(1 / 30.0, len(outputs)))
    return Trace("test", tuple(TraceRequest(str(i), float(t), int(p), int(o))
                               for i, (t, p, o) in enumerate(zip(times, prompts, outputs))),
                 seed=5, rate=30.0, cv=1.0)


def run(policy: str, outputs: list[int]) -> tuple[Spy, list]:
    config = EngineConfig(runner="sim", policy=policy, model="opt-13b", hardware="a100-80g",
                          num_blocks=96, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, swap_space=0.3)
    built = builder.build_engine(config)
    spy = Spy(built.engine.policy)
    built.engine.policy = spy
    t = trace(outputs)
    # Predictions fixed beforehand, the same in both runs (the predictor's share is its own).
    predictions = {r.request_id: (100, -1) for r in t.requests}
    records = replay(built.engine, t, built.clock, lambda r: [0] * r.prompt_len,
                     predictions=predictions)
    return spy, records


@pytest.mark.parametrize("policy", ["cacheopt", "rlp", "s3", "vllm"])
def test_policies_never_see_the_true_output_length(policy: str) -> None:
    """Two traces alike but for their true output lengths: every request ends at its own
    trace's length, every view's `max_len` is the context's bound alone, and the two runs
    decide exactly alike (views, reservations, plans) until the first request ends."""
    short = [int(x) for x in np.random.default_rng(1).integers(40, 200, 40)]
    long = [o + 60 for o in short]
    spy_a, rec_a = run(policy, short)
    spy_b, rec_b = run(policy, long)
    for records, outputs in ((rec_a, short), (rec_b, long)):
        assert sorted((int(r.request_id), r.output_len) for r in records) == list(enumerate(outputs))
    for spy in (spy_a, spy_b):
        assert all((m == MAX_MODEL_LEN).all() for m in spy.max_lens)
    # Up to the step in which run A's first request ends, nothing in B can differ.
    first_end = next(k for k, s in enumerate(spy_a.steps[1:])
                     if len(s[0]) < len(spy_a.steps[k][0]) or
                     not set(spy_a.steps[k][0]) <= set(s[0]))
    assert first_end > 10
    assert spy_a.steps[: first_end + 1] == spy_b.steps[: first_end + 1]


def test_trace_ends_keep_greedy_ids(tiny_loaded) -> None:
    """On the real model, ending requests by `TraceEnds` generates the same tokens as a
    `max_tokens` of the trace's length, on a cache tight enough to preempt."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, tiny_loaded.config.vocab_size, n).tolist() for n in (7, 12, 30, 9, 21)]
    lengths = [9, 25, 14, 31, 5]
    llm = LLM(tiny_loaded, num_blocks=12, block_size=4, max_model_len=64, warmup=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    want = [out.token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                  use_tqdm=False)]
    engine = LLM(tiny_loaded, num_blocks=12, block_size=4, max_model_len=64, warmup=False).engine
    ends = TraceEnds(engine.runner)
    engine.runner = ends
    for k, (p, n) in enumerate(zip(prompts, lengths)):
        req = engine.add_request(str(k), p, open_params(64))
        assert req.max_len == 48  # the whole cache bounds it, the trace does not
        ends.end_at(req.seq_id, len(p) + n)
    got = {}
    while engine.has_unfinished:
        got.update({q.request_id: list(q.output_token_ids) for q in engine.step() if q.finished})
    assert engine.stats.num_preemptions > 0
    assert [got[str(k)] for k in range(len(prompts))] == want
