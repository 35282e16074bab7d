"""Tests for models.tokenizer: BPE built from GGUF metadata, chat template, streaming decode."""

from __future__ import annotations

import pytest

from jserve.models.tokenizer import IncrementalDetokenizer, Tokenizer

SAMPLES = [
    "Hello world!",
    "What is 123?",
    "  leading spaces\n\n\ttabs and newlines  ",
    "Ünïcödé ça va? 日本語のテキスト 🤗👍🏽",
    "def f(x):\n    return x ** 2  # square",
]


def test_metadata(smollm2_tokenizer: Tokenizer) -> None:
    assert smollm2_tokenizer.vocab_size == 49152
    assert smollm2_tokenizer.bos_token_id == 1
    assert smollm2_tokenizer.eos_token_id == 2
    specials = [i for i in range(smollm2_tokenizer.vocab_size) if smollm2_tokenizer.is_special(i)]
    assert specials == list(range(17))


def test_digits_are_split_individually(smollm2_tokenizer: Tokenizer) -> None:
    # Same ids as HF's SmolLM2 tokenizer.json: "What", " is", " ", "1", "2", "3", "?"
    assert smollm2_tokenizer.encode("What is 123?") == [1780, 314, 216, 33, 34, 35, 47]


def test_special_token_markers(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids == [1, 4093, 198, 26843, 2]
    assert smollm2_tokenizer.decode(ids) == "user\nHi"
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(smollm2_tokenizer: Tokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert not any(smollm2_tokenizer.is_special(i) for i in ids)
    assert smollm2_tokenizer.decode(ids) == text


def test_chat_template_default_system_prompt(smollm2_tokenizer: Tokenizer) -> None:
    rendered = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_custom_system_prompt(smollm2_tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    rendered = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_detokenizer_matches_full_decode(smollm2_tokenizer: Tokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text) + [smollm2_tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    deltas = [detok.push(i) for i in ids]
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + detok.flush() == text


def test_incremental_detokenizer_holds_split_characters(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("🤗")
    assert len(ids) > 1, "emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    assert [detok.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🤗"]


def test_incremental_detokenizer_flushes_invalid_bytes(smollm2_tokenizer: Tokenizer) -> None:
    # Repeated UTF-8 lead bytes never complete; they must not be withheld forever.
    lead_byte = smollm2_tokenizer.encode("🤗")[0]
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    deltas = [detok.push(lead_byte) for _ in range(4)]
    assert deltas[:3] == ["", "", ""]
    assert deltas[3] and set(deltas[3]) == {"\ufffd"}
