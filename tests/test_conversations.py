"""Multi-turn chat arrivals: seeded schedules, the birth-death model's rates, oracle
futures, synthetic message ids, and the closed-loop driver on a simulated engine."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from jserve.benchmarking.conversations import (
    ConversationArrivals,
    ConversationRecord,
    FutureTurn,
    ScheduledConversation,
    ScheduledTurn,
    conversation_futures,
    multiturn_summary,
    run_conversations,
    schedule_conversations,
    synthetic_message_ids,
)
from jserve.benchmarking.metrics import RequestRecord
from jserve.benchmarking.workload import ConversationTrace, ConversationTurn
from jserve.builder import assemble_engine
from jserve.engine.clock import VirtualClock
from jserve.engine.loop import Engine
from jserve.engine.view import SchedulerLimits
from jserve.policies.vllm import VLLMPolicy
from jserve.runners.cost_model import StepShape
from jserve.runners.sim_runner import SimRunner

VOCAB = 1000


def _conversations(n: int, turns: int, prompt_len: int = 10, response_len: int = 5) -> list[ConversationTrace]:
    turn = ConversationTurn(prompt_len, response_len, "hi", "hello")
    return [ConversationTrace(f"conv-{i}", (turn,) * turns) for i in range(n)]


def _varied_conversations() -> list[ConversationTrace]:
    rng = np.random.default_rng(7)
    return [
        ConversationTrace(f"c{i}", tuple(
            ConversationTurn(int(rng.integers(1, 40)), int(rng.integers(1, 12)), f"m{k}", "r")
            for k in range(int(rng.integers(1, 5)))))
        for i in range(12)
    ]


# ----------------------------------------------------------------------------- schedules


def test_schedule_is_seeded_and_reproducible() -> None:
    convs = _conversations(50, 6)
    arrivals = ConversationArrivals("birth-death", conversation_rate=2.0)
    a = schedule_conversations(convs, arrivals, seed=3)
    assert a == schedule_conversations(convs, arrivals, seed=3)
    assert a != schedule_conversations(convs, arrivals, seed=4)
    starts = [c.start_time for c in a]
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert [c.conversation_id for c in a] == [c.conversation_id for c in convs]
    # The end rate moves only the conversations' ends, not their starts.
    other = schedule_conversations(convs, ConversationArrivals("birth-death", 2.0, end_rate=0.5), seed=3)
    assert [c.start_time for c in other] == starts


def test_birth_death_turn_counts_and_think_times() -> None:
    # 1 + turn_rate/end_rate = 3 turns per conversation, think times 1/turn_rate = 10 s
    # over turns (docs/simulator.md), when the conversations are long enough
    # (40 turns) never to be cut.
    arrivals = ConversationArrivals("birth-death", conversation_rate=1.0)
    schedule = schedule_conversations(_conversations(10_000, 40), arrivals, seed=0)
    counts = np.array([len(c.turns) for c in schedule])
    thinks = np.array([t.think_time for c in schedule for t in c.turns[1:]])
    assert counts.mean() == pytest.approx(3.0, rel=0.05)
    assert thinks.mean() == pytest.approx(10.0, rel=0.1)
    assert all(c.turns[0].think_time == 0.0 for c in schedule)
    gaps = np.diff([c.start_time for c in schedule])
    assert gaps.mean() == pytest.approx(1.0, rel=0.05)
    # ShareGPT's turns cap the count; every turn keeps its lengths and text.
    short = schedule_conversations(_conversations(2000, 2, 17, 9), arrivals, seed=0)
    assert max(len(c.turns) for c in short) == 2
    assert {(t.new_tokens, t.response_len, t.prompt) for c in short for t in c.turns} == {(17, 9, "hi")}


def test_think_time_mode_runs_every_turn_at_fixed_gaps() -> None:
    convs = _varied_conversations()
    schedule = schedule_conversations(convs, ConversationArrivals("think-time", 0.5, think_time=2.5), seed=1)
    for conv, sched in zip(convs, schedule):
        assert len(sched.turns) == len(conv.turns)
        assert [t.think_time for t in sched.turns] == [0.0] + [2.5] * (len(conv.turns) - 1)
        assert [(t.new_tokens, t.response_len, t.prompt) for t in sched.turns] == \
            [(t.prompt_len, t.response_len, t.prompt) for t in conv.turns]


def test_infinite_rate_starts_everything_at_zero() -> None:
    schedule = schedule_conversations(_conversations(5, 2), ConversationArrivals("think-time", math.inf), seed=0)
    assert [c.start_time for c in schedule] == [0.0] * 5


def test_futures_match_the_schedule() -> None:
    schedule = schedule_conversations(_conversations(30, 8, 11), ConversationArrivals("birth-death", 1.0), seed=2)
    futures = conversation_futures(schedule)
    assert set(futures) == {c.conversation_id for c in schedule}
    for conv in schedule:
        assert futures[conv.conversation_id] == tuple(
            FutureTurn(t.new_tokens, t.think_time) for t in conv.turns)


@pytest.mark.parametrize("kwargs", [
    {"process": "poisson", "conversation_rate": 1.0},
    {"process": "think-time", "conversation_rate": 0.0},
    {"process": "think-time", "conversation_rate": -1.0},
    {"process": "think-time", "conversation_rate": float("nan")},
    {"process": "think-time", "conversation_rate": True},
    {"process": "birth-death", "conversation_rate": 1.0, "turn_rate": 0.0},
    {"process": "birth-death", "conversation_rate": 1.0, "turn_rate": math.inf},
    {"process": "birth-death", "conversation_rate": 1.0, "end_rate": -0.1},
    {"process": "think-time", "conversation_rate": 1.0, "think_time": -1.0},
    {"process": "think-time", "conversation_rate": 1.0, "think_time": math.inf},
])
def test_invalid_arrivals_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ConversationArrivals(**kwargs)


def test_invalid_schedules_raise() -> None:
    arrivals = ConversationArrivals("think-time", 1.0)
    with pytest.raises(ValueError, match="duplicate"):
        schedule_conversations(_conversations(2, 2) * 2, arrivals, seed=0)
    with pytest.raises(ValueError, match="no turns"):
        schedule_conversations([ConversationTrace("empty", ())], arrivals, seed=0)
    with pytest.raises(ValueError, match="seed"):
        schedule_conversations(_conversations(2, 2), arrivals, seed=-1)
    with pytest.raises(ValueError):
        ScheduledTurn(0, 5, 0.0)
    with pytest.raises(ValueError):
        ScheduledTurn(5, 5, -1.0)
    with pytest.raises(ValueError):
        ScheduledConversation("c", 0.0, ())


def test_birth_death_without_end_rate_runs_every_turn() -> None:
    schedule = schedule_conversations(_conversations(200, 5), ConversationArrivals("birth-death", 1.0, end_rate=0.0),
                                      seed=0)
    assert all(len(c.turns) == 5 for c in schedule)


# ----------------------------------------------------------------------------- message ids


def test_synthetic_ids_are_deterministic_and_distinct() -> None:
    a = synthetic_message_ids("conv-a", 0, 64, VOCAB)
    assert a == synthetic_message_ids("conv-a", 0, 64, VOCAB)
    assert len(a) == 64 and all(3 <= t < VOCAB for t in a)
    assert a[:16] != synthetic_message_ids("conv-b", 0, 64, VOCAB)[:16]
    assert a[:16] != synthetic_message_ids("conv-a", 1, 64, VOCAB)[:16]
    # A shorter message is a prefix of a longer one of the same turn.
    assert synthetic_message_ids("conv-a", 0, 10, VOCAB) == a[:10]
    firsts = {tuple(synthetic_message_ids(f"c{i}", 0, 4, VOCAB)) for i in range(2000)}
    assert len(firsts) == 2000
    with pytest.raises(ValueError):
        synthetic_message_ids("c", 0, 4, 3)
    with pytest.raises(ValueError):
        synthetic_message_ids("c", -1, 4, VOCAB)


# ----------------------------------------------------------------------------- driver


class _LinearCost:
    """A step costs a fixed overhead plus a per-token charge: enough for virtual time."""

    def step_time(self, shape: StepShape) -> float:
        return 0.002 + 1e-5 * shape.num_tokens


class _CountingRunner(SimRunner):
    """Distinct output ids (a running counter), so the test can tell which reply went where."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_LinearCost(), clock)
        self._next = 0

    def execute(self, batch):
        out = super().execute(batch)
        n = len(out.next_tokens)
        out.next_tokens[:] = (np.arange(self._next, self._next + n) % (VOCAB - 3)) + 3
        self._next += n
        return out


def _sim_engine(num_blocks: int = 256) -> tuple[Engine, VirtualClock]:
    clock = VirtualClock(start=100.0)  # arrivals are offsets from the call, not from 0
    limits = SchedulerLimits.with_default_budget(8, None, 2048)
    engine = assemble_engine(VLLMPolicy(), _CountingRunner(clock), clock.now, num_blocks=num_blocks,
                             block_size=16, limits=limits, vocab_size=VOCAB)
    return engine, clock


def _messages(cid: str, k: int, turn: ScheduledTurn) -> list[int]:
    return synthetic_message_ids(cid, k, turn.new_tokens, VOCAB)


@pytest.mark.parametrize("process", ["think-time", "birth-death"])
def test_run_conversations_closed_loop(process: str) -> None:
    arrivals = ConversationArrivals(process, conversation_rate=20.0, turn_rate=5.0, end_rate=1.0,
                                    think_time=0.05)
    schedule = schedule_conversations(_varied_conversations(), arrivals, seed=0)
    engine, clock = _sim_engine()
    start = clock.now()
    prompts: dict[str, list[int]] = {}
    real_add = engine.add_request

    def spy(request_id, prompt_token_ids, params, **kw):
        prompts[request_id] = list(prompt_token_ids)
        assert kw["conversation_id"] == request_id.split("#")[0]
        assert params.temperature == 0.0 and params.ignore_eos
        assert kw["arrival_time"] <= clock.now()
        return real_add(request_id, prompt_token_ids, params, **kw)

    engine.add_request = spy  # type: ignore[method-assign]
    outputs: dict[str, list[int]] = {}
    real_step = engine.step

    def step_spy():
        done = real_step()
        outputs.update({r.request_id: list(r.output_token_ids) for r in done if r.finished})
        return done

    engine.step = step_spy  # type: ignore[method-assign]
    seen: list[ConversationRecord] = []
    records = run_conversations(engine, schedule, clock, _messages, on_finish=seen.append)

    assert seen == records and not engine.has_unfinished
    assert len(records) == sum(len(c.turns) for c in schedule)
    by_id = {r.record.request_id: r for r in records}
    for conv in schedule:
        cid = conv.conversation_id
        assert by_id[f"{cid}#0"].record.arrival_time == pytest.approx(start + conv.start_time)
        assert prompts[f"{cid}#0"] == _messages(cid, 0, conv.turns[0])
        for k, turn in enumerate(conv.turns):
            rid = f"{cid}#{k}"
            rec = by_id[rid]
            assert (rec.conversation_id, rec.turn, rec.new_tokens) == (cid, k, turn.new_tokens)
            assert rec.record.finished and rec.record.output_len == turn.response_len
            assert rec.record.prompt_len == len(prompts[rid])
            if k == 0:
                continue
            prev_id = f"{cid}#{k - 1}"
            prev = by_id[prev_id].record
            # Arrives exactly the think time after the previous reply finished ...
            assert rec.record.arrival_time == pytest.approx(prev.finished_time + turn.think_time, abs=1e-12)
            # ... with the whole history (previous prompt and reply), then the new message.
            assert prompts[rid] == prompts[prev_id] + outputs[prev_id] + _messages(cid, k, turn)


def test_run_conversations_is_deterministic_and_idles_through_gaps() -> None:
    # Two conversations far apart: the engine is idle in between and the clock jumps.
    schedule = [
        ScheduledConversation("a", 0.0, (ScheduledTurn(20, 4, 0.0), ScheduledTurn(8, 4, 30.0))),
        ScheduledConversation("b", 100.0, (ScheduledTurn(12, 3, 0.0),)),
    ]
    runs = []
    for _ in range(2):
        engine, clock = _sim_engine()
        start = clock.now()
        records = run_conversations(engine, schedule, clock, _messages, progress=True)
        runs.append(records)
        b = next(r for r in records if r.conversation_id == "b").record
        assert b.arrival_time == start + 100.0 and clock.now() > start + 100.0
    assert runs[0] == runs[1]
    assert [r.record.request_id for r in runs[0]] == ["a#0", "a#1", "b#0"]


def test_run_conversations_rejects_duplicate_ids() -> None:
    conv = ScheduledConversation("a", 0.0, (ScheduledTurn(4, 2, 0.0),))
    engine, clock = _sim_engine()
    with pytest.raises(ValueError, match="unique"):
        run_conversations(engine, [conv, conv], clock, _messages)


# ----------------------------------------------------------------------------- summary


def _record(cid: str, k: int, ttft: float, finished: bool = True) -> ConversationRecord:
    rec = RequestRecord(f"{cid}#{k}", 0.0, ttft, ttft + 1.0, (ttft,), 10, 1, finished=finished)
    return ConversationRecord(rec, cid, k, 5)


def test_multiturn_summary() -> None:
    ttfts = [0.1, 0.15, 0.3, 0.5]
    records = [_record("a", k, t) for k, t in enumerate(ttfts)]
    s = multiturn_summary(records, tel_threshold=0.2, slo=0.2)
    assert s["num_turns"] == 4 and s["num_conversations"] == 1
    assert s["ttft_mean"] == pytest.approx(np.mean(ttfts))
    for q in (50, 90, 95, 99):
        assert s[f"ttft_p{q}"] == pytest.approx(np.percentile(ttfts, q))
    assert s["tel"] == pytest.approx(0.1 + 0.3)
    assert s["slo_violation"] == pytest.approx(0.5)
    empty = multiturn_summary([], tel_threshold=0.2)
    assert empty["num_turns"] == 0 and empty["ttft_p99"] is None and empty["tel"] == 0.0
    assert empty["slo_violation"] is None
    with pytest.raises(ValueError):
        multiturn_summary(records, tel_threshold=-1.0)
    with pytest.raises(ValueError):
        multiturn_summary(records, tel_threshold=0.2, slo=0.0)


def test_open_loop_turns_follow_the_schedule_or_the_reply_they_answer() -> None:
    """Appendix F's open loop: every turn runs, Exp(turn_rate) after the previous one's
    scheduled arrival; a turn due before the reply it follows finished arrives at that
    finish and is marked delayed; the oracle futures carry the scheduled arrivals."""
    convs = _varied_conversations()
    schedule = schedule_conversations(convs, ConversationArrivals("open-loop", 20.0, turn_rate=50.0), seed=0)
    assert all(c.open_loop and len(c.turns) == len(conv.turns) for c, conv in zip(schedule, convs))
    engine, clock = _sim_engine()
    start = clock.now()
    records = run_conversations(engine, schedule, clock, _messages)
    by_id = {r.record.request_id: r for r in records}
    futures = conversation_futures(schedule)
    delayed = 0
    for conv in schedule:
        due = start + conv.start_time + np.cumsum([t.think_time for t in conv.turns])
        assert [f.arrival for f in futures[conv.conversation_id]] == pytest.approx(due - start)
        for k in range(1, len(conv.turns)):
            rec, prev = by_id[f"{conv.conversation_id}#{k}"], by_id[f"{conv.conversation_id}#{k - 1}"].record
            assert rec.record.arrival_time == pytest.approx(max(due[k], prev.finished_time), abs=1e-12)
            assert rec.delayed == (due[k] < prev.finished_time)
            delayed += rec.delayed
    assert 0 < delayed < len(records) - len(schedule)  # both cases occur at these rates


def test_exp_think_turns_arrive_an_exponential_think_time_after_the_reply() -> None:
    """Appendix F as the paper's model reads: every turn runs, Exp(turn_rate) after the
    reply it answers finished (never before it, never marked delayed); the think times
    are the open-loop process's gaps, drawn from the same streams."""
    convs = _varied_conversations()
    arrivals = ConversationArrivals("exp-think", 20.0, turn_rate=50.0)
    schedule = schedule_conversations(convs, arrivals, seed=0)
    open_loop = schedule_conversations(convs, dataclasses.replace(arrivals, process="open-loop"), seed=0)
    assert all(not c.open_loop and len(c.turns) == len(conv.turns) for c, conv in zip(schedule, convs))
    assert [[t.think_time for t in c.turns] for c in schedule] == [[t.think_time for t in c.turns] for c in open_loop]
    engine, clock = _sim_engine()
    records = run_conversations(engine, schedule, clock, _messages)
    by_id = {r.record.request_id: r for r in records}
    for conv in schedule:
        for k in range(1, len(conv.turns)):
            rec, prev = by_id[f"{conv.conversation_id}#{k}"], by_id[f"{conv.conversation_id}#{k - 1}"].record
            assert rec.record.arrival_time == pytest.approx(prev.finished_time + conv.turns[k].think_time, abs=1e-12)
            assert not rec.delayed
    thinks = np.array([t.think_time for c in schedule for t in c.turns[1:]])
    assert thinks.mean() == pytest.approx(1 / 50.0, rel=0.5)
