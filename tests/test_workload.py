"""Workloads and arrivals: counts, length budgets, published means, seeding, JSONL replay."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from jserve.benchmarking import workload as wl
from jserve.benchmarking.workload import (
    WORKLOADS,
    ConversationTrace,
    Trace,
    TraceRequest,
    arrival_times,
    build_trace,
    get_workload,
    load_trace,
    multiturn_conversations,
    sample_lengths,
    save_trace,
    with_slos,
)
from jserve.datasets.sharegpt import Conversation, Turn


def words(text: str) -> list[str]:
    """A fast stand-in tokenizer (one token per word) for tests of the sampling logic."""
    return text.split()


ALL_NAMES = [*WORKLOADS, "fixed:100:28"]


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("max_total_len", [512, 2048])
def test_count_and_length_budget(name: str, max_total_len: int) -> None:
    samples = sample_lengths(name, 60, seed=3, max_total_len=max_total_len)
    assert len(samples) == 60
    for prompt_len, output_len, prompt in samples:
        assert isinstance(prompt_len, int) and isinstance(output_len, int)
        assert prompt_len >= 1 and output_len >= 1
        assert prompt_len + output_len <= max_total_len
        assert (prompt is not None) == get_workload(name).has_text


def test_sharegpt_matches_vllm_filter() -> None:
    samples = sample_lengths("sharegpt", 300, seed=0)
    assert all(p >= 4 and o >= 4 and p <= 1024 and p + o <= 2048 for p, o, _ in samples)
    assert all(isinstance(text, str) and text for _, _, text in samples)
    # A fixed output budget replaces every reply length and still fits the context.
    fixed = sample_lengths("sharegpt", 50, seed=0, max_total_len=600, output_len=256)
    assert all(o == 256 and p + o <= 600 for p, o, _ in fixed)


def test_synthetic_flags() -> None:
    assert {n for n, s in WORKLOADS.items() if s.synthetic} == {"alpaca", "bookcorpus", "longbench", "longbench-filtered"}
    assert get_workload("fixed:8:8").synthetic
    assert "synthetic" in (wl.__doc__ or "").lower()


@pytest.mark.parametrize(
    ("name", "mean_in", "mean_out"),
    [("alpaca", 19, 58), ("bookcorpus", 1952, 681), ("longbench", 8700, 148)],
)
def test_synthetic_means_near_published(name: str, mean_in: float, mean_out: float) -> None:
    # A budget large enough that nothing is capped, so the means are the distributions'.
    samples = np.array([s[:2] for s in sample_lengths(name, 20_000, seed=1, max_total_len=1 << 24)])
    assert samples[:, 0].mean() == pytest.approx(mean_in, rel=0.1)
    assert samples[:, 1].mean() == pytest.approx(mean_out, rel=0.1)
    assert samples[:, 0].std() > 0 and samples.min() >= 1


def test_synthetic_capping_truncates_the_prompt() -> None:
    samples = np.array([s[:2] for s in sample_lengths("bookcorpus", 2000, seed=0, max_total_len=2048)])
    assert samples.sum(axis=1).max() <= 2048
    assert samples[:, 1].max() <= 1024  # outputs keep at most half the budget
    assert samples[:, 0].min() >= 1


@pytest.mark.parametrize("name", ["alpaca", "bookcorpus", "longbench", "humaneval"])
def test_deterministic_per_seed(name: str) -> None:
    a = sample_lengths(name, 200, seed=7)
    assert a == sample_lengths(name, 200, seed=7)
    assert a != sample_lengths(name, 200, seed=8)


def test_sharegpt_deterministic_per_seed() -> None:
    # A custom tokenizer bypasses the memo, so this really samples twice.
    a = sample_lengths("sharegpt", 100, seed=5, encode=words)
    assert a == sample_lengths("sharegpt", 100, seed=5, encode=words)
    assert a != sample_lengths("sharegpt", 100, seed=6, encode=words)
    assert sample_lengths("sharegpt", 100, seed=5) == sample_lengths("sharegpt", 100, seed=5)


def test_multiturn_trace_deterministic_and_ordered() -> None:
    trace = build_trace("sharegpt-multiturn", 300, rate=5.0, seed=2, encode=words)
    again = build_trace("sharegpt-multiturn", 300, rate=5.0, seed=2, encode=words)
    assert trace == again
    assert len(trace.requests) == 300
    by_conv: dict[str, list[TraceRequest]] = {}
    for req in trace.requests:
        assert req.conversation_id is not None and req.prompt_len + req.output_len <= 2048
        by_conv.setdefault(req.conversation_id, []).append(req)
    assert any(len(turns) > 1 for turns in by_conv.values())
    for turns in by_conv.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in zip(turns, turns[1:]):
            # Each turn's context holds the previous context, its reply and a new message.
            assert cur.prompt_len > prev.prompt_len + prev.output_len
            assert cur.arrival_time >= prev.arrival_time


def test_multiturn_conversations_real_data() -> None:
    convs = multiturn_conversations(40, seed=0, max_total_len=4096)
    assert len(convs) == 40
    assert len({c.conversation_id for c in convs}) == 40
    for conv in convs:
        assert len(conv.turns) >= 2 and conv.total_len <= 4096
        assert all(t.prompt_len >= 1 and t.response_len >= 1 and t.prompt for t in conv.turns)
        lengths = conv.request_lengths()
        assert lengths[0] == (conv.turns[0].prompt_len, conv.turns[0].response_len)
        assert lengths[-1][0] + lengths[-1][1] == conv.total_len
    assert convs == multiturn_conversations(40, seed=0, max_total_len=4096)


def test_multiturn_truncates_and_tokenizes_lazily() -> None:
    def conv(cid: str, *texts: tuple[str, str]) -> Conversation:
        return Conversation(cid, tuple(Turn(role, text) for role, text in texts))

    data = [
        # Four pairs of 2+3 words: a 12-token budget keeps two of them.
        conv("long", *[("user", "a b"), ("assistant", "c d e")] * 4),
        # Breaks alternation after one pair: too few turns, dropped.
        conv("odd", ("user", "a"), ("assistant", "b"), ("assistant", "c"), ("user", "d")),
        # Starts with the assistant: dropped.
        conv("gptfirst", ("assistant", "a"), ("user", "b"), ("assistant", "c"), ("user", "d")),
        conv("short", ("user", "x"), ("assistant", "y")),  # one pair: never a candidate
    ]
    calls: list[str] = []

    def counting(text: str) -> list[str]:
        calls.append(text)
        return text.split()

    convs = multiturn_conversations(1, seed=0, max_total_len=12, encode=counting, conversations=data)
    assert [c.conversation_id for c in convs] == ["long"]
    assert [(t.prompt_len, t.response_len) for t in convs[0].turns] == [(2, 3), (2, 3)]
    assert convs[0].request_lengths() == [(2, 3), (7, 3)]
    # The third pair's prompt is tokenized to find it does not fit; nothing after it is.
    assert calls.count("a b") <= 3 and calls.count("c d e") <= 2
    assert "x" not in calls and "y" not in calls
    with pytest.raises(ValueError, match="only 1 conversations"):
        multiturn_conversations(2, seed=0, max_total_len=12, encode=counting, conversations=data)


def test_humaneval_164_problems() -> None:
    samples = sample_lengths("humaneval", 164, seed=0)
    assert len({text for _, _, text in samples}) == 164
    assert all(o > 0 and p > 0 for p, o, _ in samples)
    more = sample_lengths("humaneval", 400, seed=0)
    assert len(more) == 400 and len({text for _, _, text in more}) == 164
    fixed = sample_lengths("humaneval", 20, seed=0, output_len=128)
    assert all(o == 128 for _, o, _ in fixed)


def test_fixed_workload_parse_and_errors() -> None:
    assert sample_lengths("fixed:128:64", 3) == [(128, 64, None)] * 3
    assert sample_lengths("fixed:128:64", 2, output_len=10) == [(128, 10, None)] * 2
    for bad in ["fixed:1", "fixed:a:b", "fixed:0:5", "fixed:5:-1", "fixed:1:2:3"]:
        with pytest.raises(ValueError, match="fixed"):
            sample_lengths(bad, 1)
    with pytest.raises(ValueError, match="max_total_len"):
        sample_lengths("fixed:2000:100", 1, max_total_len=2048)


def test_unknown_workload_lists_known_names() -> None:
    with pytest.raises(ValueError) as info:
        sample_lengths("sharegtp", 1)
    message = str(info.value)
    assert all(name in message for name in WORKLOADS) and "fixed:IN:OUT" in message
    with pytest.raises(ValueError):
        build_trace("nope", 1, rate=1.0)


def test_bad_counts_and_output_len() -> None:
    with pytest.raises(ValueError):
        sample_lengths("alpaca", -1)
    with pytest.raises(ValueError):
        sample_lengths("alpaca", 1, max_total_len=1)
    with pytest.raises(ValueError):
        sample_lengths("alpaca", 1, output_len=0)
    with pytest.raises(ValueError):
        sample_lengths("alpaca", 1, max_total_len=64, output_len=64)
    with pytest.raises(ValueError):
        sample_lengths("sharegpt-multiturn", 1, output_len=16, encode=words)
    with pytest.raises(ValueError, match="seed"):
        sample_lengths("alpaca", 1, seed=-1)
    with pytest.raises(ValueError, match="seed"):
        arrival_times(3, rate=1.0, seed=-1)
    assert sample_lengths("alpaca", 0) == []


def test_poisson_arrivals() -> None:
    times = arrival_times(20_000, rate=4.0, seed=0)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    np.testing.assert_array_equal(times, arrival_times(20_000, rate=4.0, seed=0))
    assert not np.array_equal(times, arrival_times(20_000, rate=4.0, seed=1))


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_have_requested_cv(cv: float) -> None:
    gaps = np.diff(arrival_times(20_000, rate=2.0, cv=cv, seed=0))
    assert gaps.mean() == pytest.approx(0.5, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_infinite_rate_is_offline() -> None:
    np.testing.assert_array_equal(arrival_times(50, rate=math.inf, cv=3.0), np.zeros(50))
    trace = build_trace("alpaca", 20, rate=float("inf"))
    assert all(r.arrival_time == 0.0 for r in trace.requests) and trace.duration == 0.0
    assert arrival_times(0, rate=1.0).shape == (0,)


@pytest.mark.parametrize(("rate", "cv"), [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, -2.0), (1.0, math.inf)])
def test_bad_rate_or_cv(rate: float, cv: float) -> None:
    with pytest.raises(ValueError):
        arrival_times(10, rate=rate, cv=cv)
    with pytest.raises(ValueError):
        build_trace("alpaca", 10, rate=rate, cv=cv)


def test_rate_changes_only_arrivals() -> None:
    slow = build_trace("bookcorpus", 100, rate=1.0, seed=4)
    fast = build_trace("bookcorpus", 100, rate=50.0, cv=2.0, seed=4)
    strip = lambda t: [(r.prompt_len, r.output_len) for r in t.requests]  # noqa: E731
    assert strip(slow) == strip(fast)
    assert slow.requests[-1].arrival_time > fast.requests[-1].arrival_time
    assert [r.request_id for r in slow.requests] == [str(i) for i in range(100)]


@pytest.mark.parametrize(
    ("workload", "rate", "cv"),
    [("sharegpt", 3.5, 1.0), ("sharegpt-multiturn", 2.0, 2.5), ("alpaca", math.inf, 1.0)],
)
def test_jsonl_round_trip(tmp_path: Path, workload: str, rate: float, cv: float) -> None:
    trace = build_trace(workload, 80, rate=rate, cv=cv, seed=9, encode=words)
    if workload == "alpaca":  # SLOs and unusual text survive too
        reqs = list(trace.requests)
        reqs[0] = dataclasses.replace(reqs[0], prompt='quote " newline \n snow ☃', ttft_slo=0.25, tbt_slo=0.05)
        trace = dataclasses.replace(trace, requests=tuple(reqs))
    path = tmp_path / "trace.jsonl"
    save_trace(trace, path)
    assert load_trace(path) == trace
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 81 and '"jserve_trace"' in lines[0]


def test_load_trace_rejects_malformed(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = build_trace("fixed:4:4", 3, rate=1.0)
    save_trace(good, path)
    header, *reqs = path.read_text().splitlines()
    cases = {
        "": "empty",
        "{}\n": "header",
        header + "\n{not json\n": ":2",
        header + '\n{"request_id": "0", "arrival_time": 0.0, "prompt_len": 4, "output_len": 4, "x": 1}\n': "unknown",
        header + '\n{"request_id": "0", "arrival_time": 0.0, "prompt_len": 0, "output_len": 4}\n': "prompt_len",
        header + "\n" + reqs[0] + "\n": "header says 3",
        header + "\n" + "\n".join([reqs[1], reqs[0], reqs[2]]) + "\n": "arrival order",
    }
    for content, match in cases.items():
        path.write_text(content)
        with pytest.raises(ValueError, match=match):
            load_trace(path)


def test_trace_validates_requests() -> None:
    req = TraceRequest("a", 0.0, 4, 4)
    with pytest.raises(ValueError, match="duplicate"):
        Trace("fixed:4:4", (req, req), seed=0, rate=1.0, cv=1.0)
    with pytest.raises(ValueError):
        TraceRequest("b", -1.0, 4, 4)
    with pytest.raises(ValueError):
        TraceRequest("b", 0.0, 4, 0)
    assert isinstance(multiturn_conversations(0), list)
    assert ConversationTrace("c", ()).request_lengths() == []


@pytest.mark.parametrize("workload, prompt, output", [
    ("alpaca", (19.31, 9, 2470), (58.41, 13, 292)),
    ("bookcorpus", (1952.11, 18, 2048), (681.2, 32, 1041)),
])
def test_synthetic_lengths_match_the_cacheopt_papers_table_1(workload: str, prompt: tuple,
                                                               output: tuple) -> None:
    """Mean within 2%, every length within [min, max] (BookCorpus prompts are 2,048-token
    pieces), given a context that fits prompt + output."""
    samples = sample_lengths(workload, 4000, seed=1, max_total_len=2048 + 1041)
    for lengths, (mean, lo, hi) in ((np.array([s[0] for s in samples]), prompt),
                                    (np.array([s[1] for s in samples]), output)):
        assert lengths.mean() == pytest.approx(mean, rel=0.02)
        assert lo <= lengths.min() and lengths.max() <= hi


def test_with_slos_attaches_each_pair_in_request_order() -> None:
    trace = build_trace("fixed:8:4", 3, 2.0, seed=1)
    got = with_slos(trace, [(1.0, 0.1), (None, 0.2), (3.0, None)])
    assert [(r.ttft_slo, r.tbt_slo) for r in got.requests] == [(1.0, 0.1), (None, 0.2), (3.0, None)]
    assert [dataclasses.replace(r, ttft_slo=None, tbt_slo=None) for r in got.requests] == list(trace.requests)
    assert (got.workload, got.seed, got.rate) == (trace.workload, trace.seed, trace.rate)
    with pytest.raises(ValueError, match="3 requests but 2"):
        with_slos(trace, [(1.0, 0.1)] * 2)
