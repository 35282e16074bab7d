"""Presence, frequency and repetition penalties as vLLM defines them: the sampler against a
numpy transcription of vLLM's `apply_penalties`, and the engine's greedy tokens against a
dense model whose logits are penalised in numpy step by step, with and without preemptions,
pipelined or not."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sampler_checks import assert_greedy_draw

from jserve import LLM, SamplingParams
from jserve.engine.batch import BatchDelta, PenaltySettings, SequenceSettings
from jserve.errors import InvalidRequestError
from jserve.models.dense_reference import dense_logits
from jserve.models.llama import llama_weights_of
from jserve.models.loading import LoadedModel
from jserve.runners.input_batch import NO_ROW, PersistentBatch
from jserve.runners.penalties import Penalties, TokenCounts, apply_penalties
from jserve.runners.sampling import sample_tokens


def reference_penalties(logits: np.ndarray, counts: np.ndarray, prompt: np.ndarray, presence: np.ndarray,
                        frequency: np.ndarray, repetition: np.ndarray) -> np.ndarray:
    """vLLM's `apply_penalties` (model_executor/layers/utils.py) in numpy: repetition over
    tokens of the prompt or the output, then frequency and presence over the output's."""
    output = counts > 0
    r = np.where(output | prompt, repetition[:, None], 1.0)
    logits = np.where(logits > 0, logits / r, logits * r)
    return logits - frequency[:, None] * counts - presence[:, None] * output


def _random_penalties(rng: np.random.Generator, rows: int, vocab: int, slots: int):
    counts = rng.integers(0, 4, size=(slots, vocab)) * (rng.random((slots, vocab)) < 0.2)
    prompt = rng.random((slots, vocab)) < 0.1
    slot = rng.permutation(slots)[:rows]
    presence = rng.uniform(-2, 2, rows).astype(np.float32)
    frequency = rng.uniform(-2, 2, rows).astype(np.float32)
    repetition = rng.uniform(0.5, 2, rows).astype(np.float32)
    presence[0], frequency[0], repetition[0] = 0, 0, 1  # a row without penalties beside them
    p = Penalties(TokenCounts(counts.astype(np.int32), prompt), slot.astype(np.int32), presence, frequency,
                  repetition)
    return p, (counts[slot], prompt[slot], presence, frequency, repetition)


def test_penalties_match_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    rows, vocab = 6, 300
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    p, ref_args = _random_penalties(rng, rows, vocab, slots=9)
    expected = reference_penalties(logits, *ref_args)
    np.testing.assert_allclose(np.asarray(jax.jit(apply_penalties)(logits, p)), expected, rtol=1e-6, atol=1e-5)

    assert_greedy_draw(logits, expected, penalties=p)


def test_sampler_without_penalties_is_plain() -> None:
    rng = np.random.default_rng(1)
    rows, vocab = 4, 100
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    p, _ = _random_penalties(rng, rows, vocab, slots=4)
    off = Penalties(p.state, p.slot, np.zeros(rows, np.float32), np.zeros(rows, np.float32), np.ones(rows, np.float32))
    z = np.zeros(rows)
    tokens, _ = sample_tokens(logits, z.astype(np.float32), np.ones(rows, np.float32), z.astype(np.int32),
                              z.astype(np.uint32), z.astype(np.int32), penalties=off)
    assert np.asarray(tokens).tolist() == logits.argmax(-1).tolist()


def test_count_rows_skip_prompt_and_recomputed_positions() -> None:
    held = PersistentBatch(max_blocks=4, scratch_block=99, slots=2)
    n = 2
    settings = SequenceSettings(np.array([7, 8], np.int64), np.zeros(n, np.float32), np.ones(n, np.float32),
                                np.zeros(n, np.int32), np.zeros(n, np.uint32),
                                PenaltySettings(np.array([0.5, 0], np.float32), np.zeros(n, np.float32),
                                                np.ones(n, np.float32), np.array([3, 2], np.int32),
                                                (np.zeros(0, np.int32),) * n))
    held.apply(BatchDelta(settings, {}))
    slots = held.slots([7, 8])
    # Prefill of 3 prompt tokens and 2 outputs (a recompute): the outputs count; seq 8 has none.
    rows = held.count_rows(slots, np.array([0, 0]), np.array([5, 3]))
    assert rows.tolist() == [NO_ROW] * 3 + [slots[0]] * 2 + [NO_ROW] * 3
    # The same positions again (a recompute after preemption) count nothing; the next one does.
    assert (held.count_rows(slots[:1], np.array([0]), np.array([6])) == [NO_ROW] * 5 + [slots[0]]).all()


@pytest.mark.parametrize("name,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.1),
                                        ("repetition_penalty", 0.0), ("repetition_penalty", float("nan"))])
def test_out_of_range_penalty_names_its_field(name: str, value: float) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{name: value})
    assert e.value.param == name


PARAMS = [dict(), dict(presence_penalty=1.5), dict(frequency_penalty=0.8), dict(repetition_penalty=1.8),
          dict(presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=0.7)]


def _reference(loaded: LoadedModel, prompt: list[int], p: dict, max_tokens: int) -> list[int]:
    """Greedy decoding of the dense model, its last logits penalised in numpy each step."""
    cfg, weights = loaded.config, llama_weights_of(loaded.model)
    vocab = cfg.vocab_size
    prompt_mask = np.zeros((1, vocab), bool)
    prompt_mask[0, prompt] = True
    out: list[int] = []
    for _ in range(max_tokens):
        logits = dense_logits(cfg, weights, np.asarray(prompt + out))[-1:]
        counts = np.bincount(np.asarray(out, np.int64), minlength=vocab)[None, :vocab]
        penalised = reference_penalties(logits, counts, prompt_mask, np.float32([p.get("presence_penalty", 0)]),
                                        np.float32([p.get("frequency_penalty", 0)]),
                                        np.float32([p.get("repetition_penalty", 1)]))
        out.append(int(penalised[0].argmax()))
    return out


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **PARAMS[i % len(PARAMS)])
              for i in range(len(prompts))]
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def test_engine_penalties_match_reference_through_preemption(tiny_loaded: LoadedModel) -> None:
    rng = np.random.default_rng(2)
    # Short prompts over few token ids, so prompts and outputs repeat tokens.
    prompts = [rng.integers(3, 40, size=int(k)).tolist() for k in (5, 12, 3, 20, 9, 7)]
    max_tokens = 16
    llm = LLM(tiny_loaded, num_blocks=256, warmup=False, async_scheduling=False)
    roomy = _generate(llm, prompts, max_tokens)
    assert _generate(llm, prompts, max_tokens) == roomy  # reused slots start afresh
    # More sequences held than slots (as when preempted ones pile up): the counts grow.
    slots = llm.runner.held.capacity
    idle = np.arange(10**9, 10**9 + slots, dtype=np.int64)
    z = np.zeros(slots, np.float32)
    llm.runner._hold(BatchDelta(SequenceSettings(idle, z, z + 1, z.astype(np.int32), z.astype(np.uint32)), {}))
    assert llm.runner._counts.num_slots == llm.runner.held.capacity > slots
    assert _generate(llm, prompts, max_tokens) == roomy
    assert roomy == [_reference(tiny_loaded, p, PARAMS[i % len(PARAMS)], max_tokens) for i, p in enumerate(prompts)]
    plain = [_reference(tiny_loaded, p, {}, max_tokens) for p in prompts]
    assert sum(a != b for a, b in zip(roomy, plain)) >= 3  # the penalties do change the tokens
    # 12 blocks of 4 tokens: growth forces recompute preemptions; pipelined and synchronous.
    for pipelined in (False, True):
        tight = LLM(tiny_loaded, num_blocks=12, block_size=4, max_model_len=64, warmup=False,
                    async_scheduling=pipelined)
        assert _generate(tight, prompts, max_tokens) == roomy
        assert tight.num_preemptions > 0
