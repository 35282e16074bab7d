"""logit_bias, bad_words and min_tokens as vLLM defines them: the sampler against a numpy
transcription of vLLM's processors, the engine's greedy tokens against a dense model whose
logits are changed in numpy step by step (pipelined or not, forked children included), and
the options' validation naming each field."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sampler_checks import assert_greedy_draw

from jserve import LLM, SamplingParams
from jserve.builder import build_engine
from jserve.config import EngineConfig
from jserve.engine.batch import TokenRuleSettings
from jserve.errors import InvalidRequestError
from jserve.models.dense_reference import dense_logits
from jserve.models.llama import llama_weights_of
from jserve.models.loading import LoadedModel
from jserve.runners.sampling import sample_tokens
from jserve.runners.token_rules import SlotRules, TokenRules, apply_rules, set_rows


def reference_rules(logits: np.ndarray, bias: dict[int, float], banned: list[int], stops: list[int],
                    num_output: int, min_tokens: int) -> np.ndarray:
    """vLLM's bad words (one-token words: always -inf), min_tokens (stop ids -inf while the
    output is shorter) and logit bias (added), in its order, over one row."""
    logits = logits.copy()
    logits[banned] = -np.inf
    if num_output < min_tokens:
        logits[stops] = -np.inf
    for t, b in bias.items():
        logits[t] += b
    return logits


def test_rules_match_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    rows, vocab, slots = 5, 300, 8
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    specs = [(dict(zip(rng.integers(0, vocab, 6).tolist(), rng.uniform(-100, 100, 6).tolist())),
              rng.integers(0, vocab, 3).tolist(), rng.integers(0, vocab, 2).tolist(), int(rng.integers(0, 4)))
             for _ in range(rows)]
    specs[0] = ({}, [], [], 0)  # a row without rules beside them
    settings = TokenRuleSettings(
        tuple(np.array(list(b) + ban, np.int32) for b, ban, _, _ in specs),
        tuple(np.array(list(b.values()) + [-np.inf] * len(ban), np.float32) for b, ban, _, _ in specs),
        np.array([m for *_, m in specs], np.int32), tuple(np.array(s, np.int32) for _, _, s, _ in specs))
    slot = rng.permutation(slots)[:rows].astype(np.int32)
    state = set_rows(SlotRules.zeros(slots, vocab), slot, settings, np.arange(rows))
    num_output = rng.integers(0, 4, rows)
    rules = TokenRules(state, slot, settings.biased, num_output < settings.min_tokens)
    expected = np.stack([reference_rules(logits[i], b, ban, s, int(num_output[i]), m)
                         for i, (b, ban, s, m) in enumerate(specs)])
    np.testing.assert_allclose(np.asarray(jax.jit(apply_rules)(logits, rules)), expected, rtol=1e-6, atol=1e-4)

    assert_greedy_draw(logits, expected, rules=rules)


def test_sampled_rows_never_draw_a_banned_token() -> None:
    rng = np.random.default_rng(1)
    rows, vocab = 16, 64
    logits = np.zeros((rows, vocab), np.float32)  # uniform: every token likely
    banned = np.arange(0, vocab, 2, dtype=np.int32)  # every even token
    settings = TokenRuleSettings((banned,) * rows, (np.full(len(banned), -np.inf, np.float32),) * rows,
                                 np.zeros(rows, np.int32), (np.zeros(0, np.int32),) * rows)
    slot = np.arange(rows, dtype=np.int32)
    rules = TokenRules(set_rows(SlotRules.zeros(rows, vocab), slot, settings, slot), slot, settings.biased,
                       np.zeros(rows, bool))
    o = np.ones(rows)
    tokens, _ = sample_tokens(logits, o.astype(np.float32), o.astype(np.float32), np.zeros(rows, np.int32),
                              rng.integers(0, 2**31, rows).astype(np.uint32), np.zeros(rows, np.int32), rules=rules)
    assert (np.asarray(tokens) % 2 == 1).all()


def test_a_grammar_wins_where_the_rules_leave_it_no_token() -> None:
    """min_tokens holding back the one token a grammar allows (its end): the row draws it
    rather than a token outside the grammar; a row the rules leave a token keeps them."""
    rows, vocab = 4, 64
    logits = np.random.default_rng(2).normal(0, 3, (rows, vocab)).astype(np.float32)
    settings = TokenRuleSettings((np.zeros(0, np.int32),) * rows, (np.zeros(0, np.float32),) * rows,
                                 np.full(rows, 5, np.int32), (np.array([7], np.int32),) * rows)
    slot = np.arange(rows, dtype=np.int32)
    rules = TokenRules(set_rows(SlotRules.zeros(rows, vocab), slot, settings, slot), slot, settings.biased,
                       np.ones(rows, bool))
    allowed = np.zeros((rows, vocab), bool)
    allowed[:, 7] = True  # rows 0-1: only the held-back token
    allowed[2:, 9] = True  # rows 2-3: another one too
    mask = np.packbits(allowed, axis=1, bitorder="little").view(np.int32)  # llguidance's layout
    o = np.array([0, 1, 0, 1], np.float32)  # greedy and sampled rows of each kind
    tokens, _ = sample_tokens(logits, o, np.ones(rows, np.float32), np.zeros(rows, np.int32),
                              np.arange(rows, dtype=np.uint32), np.zeros(rows, np.int32),
                              token_mask=mask, masked=np.bool_(True), rules=rules)
    assert np.asarray(tokens).tolist() == [7, 7, 9, 9]


@pytest.mark.parametrize("kwargs,name", [
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"), (dict(logit_bias={"a": 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"), (dict(logit_bias={1: "x"}), "logit_bias"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words=[3]), "bad_words")])
def test_invalid_rules_name_their_field(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == name


def test_rules_resolve_against_the_model(tiny_smollm2_vocab: LoadedModel) -> None:
    tok, vocab = tiny_smollm2_vocab.tokenizer, tiny_smollm2_vocab.config.vocab_size
    params = SamplingParams(bad_words=["hello", " the"], min_tokens=2, stop_token_ids=[7]).resolved(tok, vocab, 2)
    # each word alone and after a space, as vLLM tokenizes them; EOS held back beside the stop id
    assert params.bad_word_ids == tuple(dict.fromkeys(tok.encode("hello") + tok.encode(" hello")
                                                      + tok.encode("the") + tok.encode(" the")))
    assert params.min_tokens_stop_ids == (7, 2)
    assert SamplingParams(min_tokens=2, ignore_eos=True).resolved(tok, vocab, 2).min_tokens_stop_ids == ()
    # past what the device's int32 columns hold, meaning the same (fuzzed values once failed steps)
    wide = SamplingParams(top_k=2**31, min_tokens=2**40, max_tokens=2**41).resolved(tok, vocab, 2)
    assert (wide.top_k, wide.min_tokens) == (0, 2**31 - 1)
    assert SamplingParams(top_k=vocab - 1).resolved(tok, vocab, 2).top_k == vocab - 1
    for bad, name in ((dict(logit_bias={vocab: 1.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
                      (dict(stop_token_ids=[vocab]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
                      (dict(bad_words=["antidisestablishmentarianism"]), "bad_words")):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**bad).resolved(tok, vocab, 2)
        assert e.value.param == name
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        SamplingParams(bad_words=["x"]).resolved(None, vocab, 2)


def _reference(loaded: LoadedModel, prompt: list[int], params: SamplingParams, eos: int | None) -> list[int]:
    """Greedy decoding of the dense model with the request's rules applied in numpy, ending
    at EOS or a stop id as the engine does."""
    cfg, weights = loaded.config, llama_weights_of(loaded.model)
    out: list[int] = []
    stops = list(params.stop_token_ids) + ([] if params.ignore_eos or eos is None else [eos])
    while len(out) < params.max_tokens:
        logits = dense_logits(cfg, weights, np.asarray(prompt + out))[-1]
        token = int(reference_rules(logits, dict(params.logit_bias), list(params.bad_word_ids), stops, len(out),
                                    params.min_tokens).argmax())
        out.append(token)
        if token in stops:
            break
    return out


def _cases(plain: list[list[int]]) -> list[SamplingParams]:
    """Rules that change each prompt's greedy output: its first tokens biased away or banned,
    its second token a stop id held back by min_tokens."""
    g = dict(temperature=0.0, max_tokens=10)
    return [SamplingParams(**g, ignore_eos=True, logit_bias={plain[0][0]: -50.0, 3: 2.5}),
            SamplingParams(**g, ignore_eos=True, bad_word_ids=(plain[1][0], plain[1][2])),
            SamplingParams(**g, ignore_eos=True, stop_token_ids=[plain[2][1]], min_tokens=5),
            SamplingParams(**g, ignore_eos=True),
            SamplingParams(**g, stop_token_ids=[plain[4][1]], min_tokens=3, logit_bias={plain[4][1]: 5.0})]


def test_engine_rules_match_reference(tiny_loaded: LoadedModel) -> None:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, size=int(k)).tolist() for k in (5, 9, 3, 12, 7)]
    eos = tiny_loaded.config.eos_token_id
    plain = [_reference(tiny_loaded, p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), eos)
             for p in prompts]
    params = _cases(plain)
    expected = [_reference(tiny_loaded, p, sp.resolved(None, tiny_loaded.config.vocab_size, eos), eos)
                for p, sp in zip(prompts, params)]
    assert sum(a != b for a, b in zip(expected, plain)) >= 4  # the rules do change the tokens
    for pipelined in (False, True):
        llm = LLM(tiny_loaded, num_blocks=256, warmup=False, async_scheduling=pipelined)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected
        assert outs[3].token_ids == plain[3]  # no rules: the plain step


def test_forked_children_keep_the_rules(tiny_loaded: LoadedModel) -> None:
    prompt = [5, 6, 7, 8, 9]
    eos = tiny_loaded.config.eos_token_id
    plain = _reference(tiny_loaded, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), eos)
    params = SamplingParams(temperature=0.0, max_tokens=8, n=3, stop_token_ids=[plain[1]], min_tokens=4,
                            logit_bias={plain[0]: -30.0}, ignore_eos=True)
    expected = _reference(tiny_loaded, prompt, params.resolved(None, tiny_loaded.config.vocab_size, eos), eos)
    assert expected != plain
    for pipelined in (False, True):
        llm = LLM(tiny_loaded, num_blocks=64, warmup=False, async_scheduling=pipelined)
        (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == [expected] * 3


def test_stop_strings_wait_for_min_tokens(tiny_smollm2_vocab: LoadedModel) -> None:
    """vLLM's rule: a stop string in the first `min_tokens` tokens' text does not stop the
    request, and is not found later either; one after them does."""
    llm = LLM(tiny_smollm2_vocab, num_blocks=64, warmup=False, async_scheduling=False)
    g = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    text = llm.generate(["Hello"], SamplingParams(**g), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 3: len(text) // 3 + 2]
    early = llm.generate(["Hello"], SamplingParams(**g, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and early.text == text[:text.find(stop)]
    late = llm.generate(["Hello"], SamplingParams(**g, stop=[stop], min_tokens=12), use_tqdm=False)[0].outputs[0]
    assert late.finish_reason == "length" and late.text == text


def test_the_simulator_accepts_the_rules() -> None:
    """The simulator's runner reads no logits: a request with rules runs to its length."""
    engine = build_engine(EngineConfig(runner="sim", model="opt-13b", num_blocks=64)).engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True, min_tokens=2,
                                                      logit_bias={5: 1.0}))
    done = []
    while engine.has_unfinished:
        done += [r for r in engine.step() if r.finished]
    assert [len(r.output_token_ids) for r in done] == [4]
