"""Structured outputs in the engine: the grammar's bitmask applied in the jitted sampler,
the matcher advanced by every token read, and the loop in step while a grammar request is
live. Greedy and sampled decoding of a model with random weights (SmolLM2's vocabulary)
give JSON that validates only because of the mask; SmolLM2 itself answers a chat in JSON."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from conftest import SMOL_ENGINE
from jserve import LLM, SamplingParams
from jserve.errors import InvalidRequestError
from jserve.models.loading import LoadedModel
from jserve.runners.sampling import apply_token_bitmask, sample_tokens
from jserve.structured import GrammarSpec

from test_structured import BOUNDED, WEATHER

SCHEMA = GrammarSpec.json_schema(BOUNDED)
PROMPT = "Describe a person as JSON:"


def test_apply_token_bitmask_matches_llguidances_layout() -> None:
    rng = np.random.default_rng(0)
    vocab = 70  # not a multiple of 32: the last word is partly padding
    allowed = rng.random((3, vocab)) < 0.3
    mask = np.packbits(np.pad(allowed, ((0, 0), (0, 96 - vocab))), axis=1, bitorder="little").view(np.int32)
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    out = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(out, np.where(allowed, logits, -np.inf))
    args = (jnp.asarray(logits), jnp.array([0.0, 1.0, 1.0]), jnp.array([1.0, 1.0, 0.5]), jnp.array([0, 5, 0]),
            jnp.arange(3, dtype=jnp.uint32), jnp.zeros(3, jnp.int32))
    tokens, logprobs = jax.jit(sample_tokens)(*args, token_mask=jnp.asarray(mask), masked=jnp.bool_(True))
    assert allowed[np.arange(3), np.asarray(tokens)].all()
    unmasked = sample_tokens(*args, token_mask=jnp.asarray(mask), masked=jnp.bool_(False))
    np.testing.assert_array_equal(unmasked[0], sample_tokens(*args)[0])
    # log-probabilities stay the model's, as without a grammar
    full = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)[np.arange(3), np.asarray(tokens)]
    np.testing.assert_allclose(logprobs, full, rtol=1e-6)


@pytest.fixture(scope="module")
def llm(tiny_smollm2_vocab: LoadedModel) -> LLM:
    return LLM(tiny_smollm2_vocab, warmup=False, **SMOL_ENGINE)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7),
                                      dict(temperature=0.8, top_p=0.9, top_k=50, seed=8)])
def test_decoding_under_a_schema_validates(llm: LLM, sampling: dict) -> None:
    params = SamplingParams(max_tokens=64, grammar=SCHEMA, **sampling)
    [out] = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), BOUNDED)
    assert not llm.engine.state.live.constrained


def test_constrained_and_free_requests_share_batches(llm: LLM) -> None:
    tool = GrammarSpec.tool(WEATHER)
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=i, grammar=SCHEMA if i % 3 == 0 else
                             tool if i % 3 == 1 else None) for i in range(6)]
    outs = llm.generate([PROMPT] * 6, params, use_tqdm=False)
    for i, out in enumerate(outs):
        if i % 3 == 0:
            jsonschema.validate(json.loads(out.text), BOUNDED)
        elif i % 3 == 1:
            jsonschema.validate(json.loads(tool.tool_calls(out.text)[0].arguments), json.loads(WEATHER.parameters))


def test_pipelined_loop_runs_in_step_for_grammars_with_the_same_outputs(tiny_smollm2_vocab: LoadedModel) -> None:
    """Free requests pipeline; a grammar request arriving mid-run stops it (the step in
    flight is read first) until it ends; every output equals the synchronous loop's."""
    def run(llm: LLM) -> tuple[list, list[bool]]:
        engine, pipelined = llm.engine, []
        tokens = llm.tokenizer.encode(PROMPT)
        for i in range(3):
            engine.add_request(f"free{i}", tokens, SamplingParams(temperature=1.0, seed=i, max_tokens=40))
        for _ in range(4):
            engine.step()
            pipelined.append(engine.pipelined)
        engine.add_request("json", tokens, SamplingParams(temperature=1.0, seed=9, max_tokens=64, grammar=SCHEMA))
        outs = {}
        while engine.has_unfinished:
            for req in engine.step():
                outs[req.request_id] = (list(req.output_token_ids), req.text, req.finish_reason)
            pipelined.append(engine.pipelined)
        return [outs[k] for k in sorted(outs)], pipelined

    sync, sync_modes = run(LLM(tiny_smollm2_vocab, warmup=False, async_scheduling=False, **SMOL_ENGINE))
    piped, modes = run(LLM(tiny_smollm2_vocab, warmup=False, **SMOL_ENGINE))
    assert piped == sync and not any(sync_modes)
    assert modes[:4] == [True] * 4 and not modes[4]  # in step from the grammar's arrival
    jsonschema.validate(json.loads(dict(zip(["free0", "free1", "free2", "json"], piped))["json"][1]), BOUNDED)


def test_a_grammar_needs_a_tokenizer_and_eos(tiny_loaded: LoadedModel, llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        LLM(tiny_loaded, warmup=False, num_blocks=16).generate(
            prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(grammar=SCHEMA), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(grammar=SCHEMA, ignore_eos=True)


@pytest.mark.slow  # 60-70 s on CPU (SmolLM2's 30-layer steps compile); bench/nightly.sh runs it
def test_smollm2_answers_a_chat_in_json(smollm2_loaded: LoadedModel) -> None:
    llm = LLM(smollm2_loaded, warmup=False, **SMOL_ENGINE)
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Give a name and an age of a famous person, as JSON."}]
    outs = llm.chat([messages, messages], [SamplingParams(temperature=0.0, max_tokens=48, grammar=g)
                                           for g in (GrammarSpec.json_object(), GrammarSpec.json_schema(person))],
                    use_tqdm=False)
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert isinstance(json.loads(outs[0].text), dict)
    jsonschema.validate(json.loads(outs[1].text), person)
