"""The served tokenizer as clients see it: exported as a Hugging Face tokenizer folder
(`jserve export-tokenizer`) that loads to the same ids, text and chat template, and split
into per-token texts that join back into the text where byte-level tokens split a
character (the `tokens` and `text_offset` of log-probabilities)."""

from __future__ import annotations

import json
import pathlib

import pytest
from tokenizers import Tokenizer as HFTokenizer

from jserve.cli import main
from jserve.models.tokenizer import Tokenizer, TokenTexts

SAMPLES = ["Hello world!", "日本語のテキスト", "Ünïcödé ça va? 🤗👍🏽", "<|im_start|>user\nHi<|im_end|>", "1, 2, 3"]
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 日本"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer) -> pathlib.Path:
    """`jserve export-tokenizer`'s folder, of the session's tokenizer (read once from GGUF)."""
    out = tmp_path_factory.mktemp("tokenizer")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("jserve.models.loading.load_tokenizer", lambda name: smollm2_tokenizer)
        assert main(["export-tokenizer", str(out), "--max-model-len", "4096"]) == 0
    return out


def test_the_exported_folder_tokenizes_as_the_server_does(exported: pathlib.Path,
                                                          smollm2_tokenizer: Tokenizer) -> None:
    assert sorted(p.name for p in exported.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    hf = HFTokenizer.from_file(str(exported / "tokenizer.json"))
    for text in SAMPLES:
        ids = smollm2_tokenizer.encode(text)
        assert hf.encode(text, add_special_tokens=True).ids == ids  # adds no BOS, as served
        assert hf.decode(ids, skip_special_tokens=False) == text
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config == smollm2_tokenizer.hf_tokenizer_config(4096)
    assert (config["bos_token"], config["eos_token"], config["model_max_length"]) == (
        "<|im_start|>", "<|im_end|>", 4096)
    assert config["added_tokens_decoder"]["2"]["content"] == "<|im_end|>"


def test_transformers_loads_the_folder_offline(exported: pathlib.Path, smollm2_tokenizer: Tokenizer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """What guidellm's `--processor` and lm-eval's `tokenizer=` do with the folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert [hf(t)["input_ids"] for t in SAMPLES] == [smollm2_tokenizer.encode(t) for t in SAMPLES]
    assert (hf.eos_token_id, hf.pad_token_id, hf.model_max_length) == (2, 2, 4096)
    assert hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == (
        smollm2_tokenizer.apply_chat_template(CHAT))


def test_a_model_without_a_tokenizer_has_none_to_export(tmp_path: pathlib.Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export-tokenizer", str(tmp_path), "--model", "tiny-llama"]) == 2
    assert capsys.readouterr().err.strip() == ("error: tiny-llama has no tokenizer: a named shape other than "
                                               "smollm2-135m has random weights, a checkpoint directory "
                                               "needs tokenizer.json")


def _pieces(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    texts = TokenTexts(tokenizer)
    pieces = [texts.push(t) for t in ids]
    pieces[-1] += texts.flush()
    return pieces


@pytest.mark.parametrize("text", SAMPLES)
def test_token_texts_join_back_into_the_text(smollm2_tokenizer: Tokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    pieces = _pieces(smollm2_tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == text and "\ufffd" not in text


def test_a_split_character_goes_to_the_token_that_finishes_it(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("日本")
    assert [smollm2_tokenizer.decode([t]) for t in ids] == ["\ufffd", "\ufffd", "本"]  # alone: broken
    assert _pieces(smollm2_tokenizer, ids) == ["", "日", "本"]
    texts = TokenTexts(smollm2_tokenizer)
    texts.push(ids[0])
    assert texts.peek(ids[1]) == "日" and texts.peek(ids[0]) == ""  # alternatives, nothing pushed
    assert texts.push(ids[1]) == "日"


def test_an_unfinished_character_is_flushed_as_the_replacement_character(
        smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("日")[:1]
    texts = TokenTexts(smollm2_tokenizer)
    assert texts.push(ids[0]) == "" and texts.flush() == "\ufffd" and texts.flush() == ""
