"""Log-probabilities a request asks for (`SamplingParams.logprobs` / `prompt_logprobs`) equal
a dense reference's log-softmax, chunked, batched and preempted alike."""

from __future__ import annotations

import numpy as np
import pytest

from jserve import LLM, SamplingParams
from jserve.models.dense_reference import dense_logits
from jserve.models.llama import llama_weights_of
from jserve.models.loading import LoadedModel

TOL = 2e-4  # fp32: paged vs dense attention, summation order


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _check(entry: dict[int, float], actual: int, row: np.ndarray, n: int) -> None:
    top = np.argsort(-row)[:n]
    assert set(entry) == set(top.tolist()) | {actual}
    for token, lp in entry.items():
        assert lp == pytest.approx(row[token], abs=TOL)


@pytest.mark.parametrize("chunked", [False, True])
def test_logprobs_equal_the_dense_reference(tiny_loaded: LoadedModel, chunked: bool) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tiny_loaded.config.vocab_size, size=n).tolist() for n in (9, 30, 1)]
    policy = dict(policy="sarathi", max_num_batched_tokens=16, max_num_seqs=4) if chunked else {}
    llm = LLM(tiny_loaded, num_blocks=64, max_model_len=128, warmup=False, **policy)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts + [prompts[0]],
                        sampling_params=[params] * len(prompts) + [plain], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.token_ids
        ref = _log_softmax(dense_logits(tiny_loaded.config, llama_weights_of(tiny_loaded.model), np.asarray(ids)))
        assert len(out.top_logprobs) == len(out.token_ids) == 6
        for k, (token, entry) in enumerate(zip(out.token_ids, out.top_logprobs)):
            row = ref[len(prompt) - 1 + k]
            _check(entry, token, row, 5)
            assert out.logprobs[k] == pytest.approx(row[token], abs=TOL)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            _check(out.prompt_logprobs[p], prompt[p], ref[p - 1], 3)
    assert outs[-1].top_logprobs is None and outs[-1].prompt_logprobs is None
    assert outs[-1].token_ids == outs[0].token_ids
