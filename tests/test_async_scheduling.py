"""The pipelined loop (`async_scheduling`: a step planned while the one before runs, its
tokens read a step late) returns what the synchronous loop returns: the same tokens, text,
finish and stop reasons and log-probabilities, whatever ends the requests (length, a stop
id or string, EOS, an abort) and however tight the cache."""

from __future__ import annotations

import numpy as np
import pytest

from jserve import LLM, SamplingParams
from jserve.models.loading import LoadedModel


def _outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
             approx: bool = False) -> list[tuple]:
    """Each output's tokens, text and reasons, and its log-probabilities, as `pytest.approx`
    if `approx`: a batch of another composition (the pipelined loop runs a stopped request
    one step more) may move a log-probability's last bits."""
    def near(entries: list | None) -> list | None:
        if entries is None or not approx:
            return entries
        return [None if e is None else pytest.approx(e, rel=1e-5, abs=1e-5) for e in entries]

    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason, near(o.top_logprobs),
             near(o.prompt_logprobs)) for o in outs]


def _pair(model: LoadedModel, **options) -> tuple[LLM, LLM]:
    return (LLM(model, warmup=False, async_scheduling=False, **options),
            LLM(model, warmup=False, **options))


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in rng.integers(1, 40, size=n)]


def test_pipelined_engine_is_pipelined(tiny_smollm2_vocab: LoadedModel) -> None:
    sync, piped = _pair(tiny_smollm2_vocab, num_blocks=64)
    assert piped.engine.pipelined and not sync.engine.pipelined


# Roomy, and 16 blocks of 4 tokens: a few sequences at a time, growth forces preemptions.
@pytest.mark.parametrize("cache", [dict(num_blocks=256), dict(num_blocks=16, block_size=4, max_model_len=64)])
def test_pipelined_outputs_equal_synchronous(tiny_smollm2_vocab: LoadedModel, cache: dict) -> None:
    model = tiny_smollm2_vocab
    prompts = _prompts(model.config.vocab_size, 10)
    sync, piped = _pair(model, max_num_seqs=6, **cache)
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in prompts]
    plain = sync.generate(prompt_token_ids=prompts, sampling_params=free, use_tqdm=False)
    # Stops the requests really meet: a token id and a piece of text from their free runs.
    params = []
    for i, out in enumerate(plain):
        kind = i % 6
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[out.token_ids[5]]))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop=[out.text[10:14]]))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=1))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20, logprobs=3))
        elif kind == 4:
            params.append(SamplingParams(temperature=0.0, max_tokens=7, prompt_logprobs=2,
                                         stop_token_ids=[out.token_ids[6]]))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=17))
    want = _outputs(sync, prompts, params, approx=True)
    assert _outputs(piped, prompts, params) == want
    assert {w[2] for w in want} == {"stop", "length"}
    if cache["num_blocks"] == 16:
        assert piped.num_preemptions > 0


class CountingPolicy:
    """A policy's plans, counted."""

    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def schedule(self, view: object) -> object:
        self.calls += 1
        return self.inner.schedule(view)


def test_repeating_plans_skip_the_policy_and_change_no_token(tiny_smollm2_vocab: LoadedModel) -> None:
    """A decode plan that repeats (`Plan.repeat`) is applied again by the pipelined engine
    without asking the policy (`EngineState.apply_repeat`) until a request ends: most steps
    skip the policy, and the tokens are those of the policy asked every step."""
    model = tiny_smollm2_vocab
    prompts = _prompts(model.config.vocab_size, 6)
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 4 * i, ignore_eos=True) for i in range(6)]
    asked, reused = (LLM(model, warmup=False, num_blocks=256) for _ in range(2))
    asked.engine.state.apply_repeat = lambda now: None
    counted = reused.engine.policy = CountingPolicy(reused.engine.policy)
    assert _outputs(reused, prompts, params) == _outputs(asked, prompts, params)
    assert reused.engine.pipelined and counted.calls * 2 < reused.engine.stats.num_steps, (
        counted.calls, reused.engine.stats.num_steps)


def test_abort_while_a_step_is_in_flight(tiny_smollm2_vocab: LoadedModel) -> None:
    """An abort between steps drops the request whose token is still on the device; the
    others go on as before and the state's bookkeeping holds after every step."""
    model = tiny_smollm2_vocab
    prompts = _prompts(model.config.vocab_size, 4, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    finished = {}
    for llm in _pair(model, num_blocks=64):
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        steps = 0
        while engine.has_unfinished:
            for req in engine.step():
                assert req.request_id != "1" or steps < 4
                if req.finished:
                    finished[(llm.engine.pipelined, req.request_id)] = list(req.output_token_ids)
            engine.state.check_invariants()
            steps += 1
            if steps == 4:
                assert engine.abort("1") is not None
    for i in ("0", "2", "3"):
        assert finished[(True, i)] == finished[(False, i)]
        assert len(finished[(True, i)]) == 12
    assert (True, "1") not in finished
