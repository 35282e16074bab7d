"""Structured outputs, the grammar layer (`jserve.structured`): specs, compilation, and
matchers whose bitmask keeps decoding inside the grammar. Decoding here draws from random
logits over SmolLM2's vocabulary, so only the mask makes the text valid; the engine's
decoding with the model is in test_structured_engine.py."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from jserve.models.tokenizer import Tokenizer
from jserve.structured import GrammarCompiler, GrammarKind, GrammarSpec, ToolDef, bitmask_words, check_grammar

from test_layering import ASSEMBLY, crossings

# A schema whose every instance is short, so a random walk through it always ends.
BOUNDED = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
           "properties": {"name": {"type": "string", "maxLength": 8},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "ok": {"type": "boolean"},
                          "tag": {"enum": ["a", "b", "c"]}}}
WEATHER = ToolDef.of("get_weather", {"type": "object", "additionalProperties": False,
                                     "required": ["city"],
                                     "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}}})
CLOCK = ToolDef.of("get_time", None)


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


def allowed(matcher, vocab: int) -> np.ndarray:
    row = np.zeros(bitmask_words(vocab), np.int32)
    matcher.fill_bitmask(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def decode(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: GrammarSpec, pick, steps: int = 200) -> str:
    """Tokens chosen by `pick(logits)` among those the mask allows, from random logits,
    until EOS."""
    matcher = compiler.matcher(spec)
    rng = np.random.default_rng(0)
    ids: list[int] = []
    for _ in range(steps):
        logits = np.where(allowed(matcher, compiler.vocab_size), rng.normal(size=compiler.vocab_size), -np.inf)
        token = pick(logits, rng)
        assert matcher.accept(token), matcher.error
        if token == tokenizer.eos_token_id:
            assert matcher.is_terminated
            return tokenizer.decode(ids)
        ids.append(token)
    raise AssertionError(f"no EOS in {steps} tokens: {tokenizer.decode(ids)!r}")


def greedy(logits: np.ndarray, _) -> int:
    return int(np.argmax(logits))


def sampled(logits: np.ndarray, rng: np.random.Generator) -> int:
    p = np.exp(logits - logits.max())
    return int(rng.choice(len(p), p=p / p.sum()))


@pytest.mark.parametrize("pick", [greedy, sampled])
def test_masked_decoding_follows_the_schema(compiler, smollm2_tokenizer, pick) -> None:
    text = decode(compiler, smollm2_tokenizer, GrammarSpec.json_schema(BOUNDED), pick)
    value = json.loads(text)
    jsonschema.validate(value, BOUNDED)
    assert list(value) == [k for k in BOUNDED["properties"] if k in value]  # the schema's order
    assert ", " in text and '": ' in text and "\n" not in text


@pytest.mark.parametrize("pick", [greedy, sampled])
def test_masked_decoding_calls_the_tools(compiler, smollm2_tokenizer, pick) -> None:
    named = GrammarSpec.tool(WEATHER)
    (call,) = named.tool_calls(decode(compiler, smollm2_tokenizer, named, pick))
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), json.loads(WEATHER.parameters))
    required = GrammarSpec.any_tools([WEATHER, CLOCK])
    calls = required.tool_calls(decode(compiler, smollm2_tokenizer, required, pick))
    assert calls
    for call in calls:
        tool = {t.name: t for t in (WEATHER, CLOCK)}[call.name]
        jsonschema.validate(json.loads(call.arguments), json.loads(tool.parameters))


def test_matcher_refuses_tokens_outside_the_grammar(compiler, smollm2_tokenizer) -> None:
    matcher = compiler.matcher(GrammarSpec.json_object())
    mask = allowed(matcher, compiler.vocab_size)
    (brace,) = smollm2_tokenizer.encode("{")
    (word,) = smollm2_tokenizer.encode("hello")
    assert mask[brace] and not mask[word] and not mask[smollm2_tokenizer.eos_token_id]
    assert not matcher.accept(word)
    assert matcher.is_terminated and "hello" in matcher.error
    other = compiler.matcher(GrammarSpec.json_object())  # a copy: the first's error is its own
    assert other.accept(brace) and not other.is_terminated
    for token in smollm2_tokenizer.encode('"a": 1}'):
        assert other.accept(token)
    assert allowed(other, compiler.vocab_size).nonzero()[0].tolist() == [smollm2_tokenizer.eos_token_id]


def test_specs_are_canonical_and_checked() -> None:
    assert GrammarSpec.json_schema({"type": "object"}) == GrammarSpec.json_schema({"type": "object"})
    assert GrammarSpec.json_object().kind is GrammarKind.JSON_OBJECT
    assert check_grammar(GrammarSpec.json_schema(BOUNDED)) == ""
    assert "foo" in check_grammar(GrammarSpec.json_schema({"type": "foo"}))
    assert GrammarSpec.any_tools([WEATHER]).tool_calls('[{"name": "get_weather"') is None


def test_structured_is_below_the_engine() -> None:
    assert crossings("structured", ("jserve.engine", "jserve.runners", "jserve.policies", *ASSEMBLY)) == []
