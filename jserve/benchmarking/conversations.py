"""Multi-turn chat arrivals, closed loop: the workload of the prefix-cache experiments. A turn
arrives a think time after the previous reply, so the gap that decides whether a history is
still cached depends on how fast the engine answered: hence a driver of its own rather than a
replayed `Trace`. The four arrival processes: docs/simulator.md, Multi-turn conversations.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from jserve.benchmarking.metrics import (
    RequestRecord,
    summarize,
    tail_excess_latency,
    ttft,
)
from jserve.benchmarking.replay import TraceEnds, open_params, record_of
from jserve.benchmarking.workload import ConversationTrace, TraceRequest, arrival_times
from jserve.engine.clock import VirtualClock, WallClock
from jserve.engine.loop import Engine
from jserve.engine.request import FinishReason

__all__ = [
    "ConversationArrivals",
    "ConversationFutures",
    "ConversationRecord",
    "FutureTurn",
    "ScheduledConversation",
    "ScheduledTurn",
    "conversation_futures",
    "multiturn_summary",
    "run_conversations",
    "schedule_conversations",
    "synthetic_message_ids",
]

@dataclass(frozen=True)
class FutureTurn:
    """A turn an oracle eviction rule knows in advance: its new message's length and the
    think time between the previous turn's reply and its arrival, or where arrivals are
    fixed in advance (open loop) its scheduled arrival, seconds on the engine's clock."""

    new_tokens: int
    think_time: float
    arrival: float | None = None


# conversation id -> every turn of it, in order; turn 0's think time is unused.
ConversationFutures = Mapping[str, Sequence[FutureTurn]]

ArrivalProcess = Literal["birth-death", "think-time", "open-loop", "exp-think"]
PROCESSES: tuple[str, ...] = ("birth-death", "think-time", "open-loop", "exp-think")

# Sub-stream of a seed for the per-conversation draws (turn rate, continuations, think
# times), so they are independent of the start times and of each other: conversation i
# draws the same whatever the other conversations drew.
_STREAM_TURNS = 1

# Synthetic ids start above the usual special ids (pad/bos/eos), as the benchmark's do.
_FIRST_SYNTHETIC_ID = 3


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _is_count(x: Any, least: int) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= least


@dataclass(frozen=True)
class ConversationArrivals:
    """How conversations start and how their turns follow each other (docs/simulator.md).

    Rates are per second. ``turn_rate`` is read by ``"birth-death"``, ``"open-loop"`` and
    ``"exp-think"``,
    ``end_rate`` by ``"birth-death"`` only, ``think_time`` by ``"think-time"`` only; all
    are validated either way.
    ``conversation_rate=inf`` starts every conversation at t=0.
    """

    process: ArrivalProcess
    conversation_rate: float  # lambda: new conversations per second (Poisson)
    turn_rate: float = 0.1  # birth-death: mean of the turn rates r_i ~ Exp; open-loop, exp-think: the rate
    end_rate: float = 0.05  # mu: rate at which a conversation ends after a reply
    think_time: float = 5.0  # seconds between a reply and the next turn (think-time)

    def __post_init__(self) -> None:
        if self.process not in PROCESSES:
            raise ValueError(f"process must be one of {PROCESSES}, got {self.process!r}")
        if not _is_real(self.conversation_rate) or self.conversation_rate <= 0:
            raise ValueError(
                "conversation_rate must be > 0 conversations/s (inf for all at t=0), "
                f"got {self.conversation_rate!r}"
            )
        if not _is_real(self.turn_rate) or not math.isfinite(self.turn_rate) or self.turn_rate <= 0:
            raise ValueError(f"turn_rate must be a finite number > 0 per second, got {self.turn_rate!r}")
        # mu = 0 is allowed: conversations then end only when their turns run out.
        if not _is_real(self.end_rate) or not math.isfinite(self.end_rate) or self.end_rate < 0:
            raise ValueError(f"end_rate must be a finite number >= 0 per second, got {self.end_rate!r}")
        if not _is_real(self.think_time) or not math.isfinite(self.think_time) or self.think_time < 0:
            raise ValueError(f"think_time must be a finite number >= 0 seconds, got {self.think_time!r}")


@dataclass(frozen=True)
class ScheduledTurn:
    """One turn as scheduled: its new message (``new_tokens`` long, text ``prompt`` when
    there is some), the reply length to generate, and the think time between the previous
    reply finishing and this turn arriving (0 for a conversation's first turn)."""

    new_tokens: int
    response_len: int
    think_time: float
    prompt: str | None = None

    def __post_init__(self) -> None:
        if not _is_count(self.new_tokens, 1):
            raise ValueError(f"new_tokens must be an int >= 1, got {self.new_tokens!r}")
        if not _is_count(self.response_len, 1):
            raise ValueError(f"response_len must be an int >= 1, got {self.response_len!r}")
        if not _is_real(self.think_time) or not math.isfinite(self.think_time) or self.think_time < 0:
            raise ValueError(f"think_time must be a finite number >= 0, got {self.think_time!r}")


@dataclass(frozen=True)
class ScheduledConversation:
    """A conversation's start (seconds from the run's start) and the turns it will make.
    ``open_loop``: each turn's ``think_time`` counts from the previous turn's arrival, not
    from its reply."""

    conversation_id: str
    start_time: float
    turns: tuple[ScheduledTurn, ...]
    open_loop: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.conversation_id, str) or not self.conversation_id:
            raise ValueError(f"conversation_id must be a non-empty string, got {self.conversation_id!r}")
        if not _is_real(self.start_time) or not math.isfinite(self.start_time) or self.start_time < 0:
            raise ValueError(
                f"conversation {self.conversation_id!r}: start_time must be finite and >= 0, "
                f"got {self.start_time!r}"
            )
        if not isinstance(self.turns, tuple):
            object.__setattr__(self, "turns", tuple(self.turns))
        if not self.turns:
            raise ValueError(f"conversation {self.conversation_id!r} has no turns")


@dataclass(frozen=True)
class ConversationRecord:
    """One finished (or aborted) turn: its request's record and where it sits in its chat.

    ``new_tokens`` is the length of the new message the driver appended (what
    ``message_ids`` returned), the part of the prompt no earlier turn could have cached.
    ``delayed``: an open-loop turn that arrived later than scheduled, when the reply it
    follows finished.
    """

    record: RequestRecord
    conversation_id: str
    turn: int
    new_tokens: int
    delayed: bool = False

    @property
    def ttft(self) -> float | None:
        return ttft(self.record)


# ----------------------------------------------------------------------------- schedule


def schedule_conversations(
    conversations: Sequence[ConversationTrace], arrivals: ConversationArrivals, seed: int
) -> list[ScheduledConversation]:
    """Draw start times and turns for `conversations`, in their order.

    Start times are a Poisson process (`jserve.benchmarking.workload.arrival_times`: the first at t=0,
    non-decreasing). Each conversation's own draws come from a stream of (seed, its index),
    so the same seed with other rates keeps every conversation's randomness aligned.
    """
    if not isinstance(arrivals, ConversationArrivals):
        raise TypeError(f"arrivals must be a ConversationArrivals, got {type(arrivals).__name__}")
    if not _is_count(seed, 0):
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    seen: set[str] = set()
    for conv in conversations:
        if conv.conversation_id in seen:
            raise ValueError(f"duplicate conversation_id {conv.conversation_id!r}")
        if not conv.turns:
            raise ValueError(f"conversation {conv.conversation_id!r} has no turns")
        seen.add(conv.conversation_id)
    starts = arrival_times(len(conversations), arrivals.conversation_rate, 1.0, int(seed))
    schedule = []
    for i, (conv, start) in enumerate(zip(conversations, starts)):
        rng = np.random.default_rng([int(seed), _STREAM_TURNS, i])
        if arrivals.process == "birth-death":
            thinks = _birth_death_think_times(rng, len(conv.turns), arrivals.turn_rate, arrivals.end_rate)
        elif arrivals.process in ("open-loop", "exp-think"):
            thinks = rng.exponential(1.0 / arrivals.turn_rate, len(conv.turns) - 1).tolist()
        else:
            thinks = [arrivals.think_time] * (len(conv.turns) - 1)
        turns = tuple(
            ScheduledTurn(t.prompt_len, t.response_len, float(think), t.prompt)
            for t, think in zip(conv.turns, [0.0, *thinks])
        )
        schedule.append(ScheduledConversation(conv.conversation_id, float(start), turns,
                                              open_loop=arrivals.process == "open-loop"))
    return schedule


def _birth_death_think_times(
    rng: np.random.Generator, max_turns: int, turn_rate: float, end_rate: float
) -> list[float]:
    """Think times before turns 1, 2, ... of one conversation, stopping where it ends."""
    rate = float(rng.exponential(turn_rate))
    thinks: list[float] = []
    # rate == 0 (a zero draw) can never make a next turn; it also keeps 0/0 out when mu = 0.
    while rate > 0 and len(thinks) + 1 < max_turns:
        if rng.random() >= rate / (rate + end_rate):
            break
        thinks.append(float(rng.exponential(1.0 / rate)))
    return thinks


def conversation_futures(schedule: Sequence[ScheduledConversation]) -> ConversationFutures:
    """What an oracle eviction rule may know: every scheduled turn of every conversation
    (new message length and think time, and for open-loop turns the scheduled arrival,
    seconds from the run's start), by conversation id."""
    return {c.conversation_id: tuple(_future_turns(c)) for c in schedule}


def _future_turns(conv: ScheduledConversation) -> list[FutureTurn]:
    if not conv.open_loop:
        return [FutureTurn(t.new_tokens, t.think_time) for t in conv.turns]
    due = conv.start_time + np.cumsum([t.think_time for t in conv.turns])
    return [FutureTurn(t.new_tokens, t.think_time, float(at)) for t, at in zip(conv.turns, due)]


def synthetic_message_ids(conversation_id: str, turn: int, length: int, vocab_size: int) -> list[int]:
    """Deterministic token ids of one simulated message.

    Seeded from a stable 128-bit hash of the conversation id (not Python's per-process
    `hash`, and wider than crc32, whose 32 bits collide among ~10^5 conversations), so runs
    repeat exactly and two conversations never share a cached prefix by accident: their
    first blocks differ, and with them every chained block after.
    """
    if not _is_count(turn, 0):
        raise ValueError(f"turn must be an int >= 0, got {turn!r}")
    if not _is_count(length, 0):
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    if not _is_count(vocab_size, _FIRST_SYNTHETIC_ID + 1):
        raise ValueError(f"vocab_size must be an int > {_FIRST_SYNTHETIC_ID}, got {vocab_size!r}")
    digest = hashlib.blake2b(conversation_id.encode("utf-8"), digest_size=16).digest()
    rng = np.random.default_rng([int.from_bytes(digest, "little"), int(turn)])
    return rng.integers(_FIRST_SYNTHETIC_ID, vocab_size, int(length)).tolist()


# ----------------------------------------------------------------------------- driver


MessageIds = Callable[[str, int, ScheduledTurn], list[int]]


def run_conversations(
    engine: Engine,
    schedule: Sequence[ScheduledConversation],
    clock: WallClock | VirtualClock,
    message_ids: MessageIds,
    on_finish: Callable[[ConversationRecord], None] | None = None,
    progress: bool = False,
) -> list[ConversationRecord]:
    """Run every scheduled conversation to its end; returns one record per turn, in
    finishing order. Start times are offsets from the call, as in `replay`.

    Turn k's prompt is turn k-1's prompt and generated ids, then
    ``message_ids(conversation_id, k, turn)``; it arrives ``turn.think_time`` after turn
    k-1 finished (its request's finish time, on the engine's clock) and is request
    ``f"{conversation_id}#{k}"``, greedy, exactly ``response_len`` tokens: sent with the
    context as its only bound and ended at its length by `TraceEnds`, as `replay` sends a
    ShareGPT request (a reply's length is the model's, not the client's, so no policy is
    told it).
    A reply cut short (context cap) is the history as generated. An aborted turn ends its
    conversation: the user has left. A history that outgrows the engine's context makes
    `add_request` raise; fit conversations to it beforehand
    (`jserve.benchmarking.workload.multiturn_conversations` takes ``max_total_len``).
    """
    ids = [c.conversation_id for c in schedule]
    if len(set(ids)) != len(ids):
        raise ValueError("conversation ids in the schedule must be unique")
    start = clock.now()
    # (arrival time, conversation index, turn index): conversation indices break ties, so
    # the heap never compares further and simultaneous arrivals enter in schedule order.
    arrivals = [(start + c.start_time, i, 0) for i, c in enumerate(schedule)]
    heapq.heapify(arrivals)
    history: dict[int, list[int]] = {}  # conversation index -> prompt + output of its last turn
    inflight: dict[str, tuple[int, int, int, TraceRequest]] = {}
    delayed: set[str] = set()  # open-loop turns that waited for the previous reply
    records: list[ConversationRecord] = []
    params = open_params(engine.state.limits.max_model_len)
    ends = TraceEnds(engine.runner)
    engine.runner = ends
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(c.turns) for c in schedule), desc="conversations", unit="turn")
    try:
        while arrivals or engine.has_unfinished:
            now = clock.now()
            while arrivals and arrivals[0][0] <= now:
                at, i, k = heapq.heappop(arrivals)
                conv = schedule[i]
                turn = conv.turns[k]
                message = [int(t) for t in message_ids(conv.conversation_id, k, turn)]
                prompt = history.pop(i, []) + message
                # The turn as a trace request: what `record_of` reads.
                spec = TraceRequest(f"{conv.conversation_id}#{k}", max(at - start, 0.0),
                                    max(len(prompt), 1), turn.response_len,
                                    conversation_id=conv.conversation_id, turn=k)
                req = engine.add_request(spec.request_id, prompt, params, arrival_time=at,
                                         conversation_id=conv.conversation_id)
                ends.end_at(req.seq_id, len(prompt) + turn.response_len)
                inflight[spec.request_id] = (i, k, len(message), spec)
            if not engine.has_unfinished:
                clock.wait_until(arrivals[0][0])
                continue
            for req in engine.step():
                if not req.finished:
                    continue
                i, k, new_tokens, spec = inflight.pop(req.request_id)
                conv = schedule[i]
                record = ConversationRecord(record_of(req, spec), conv.conversation_id, k, new_tokens,
                                            delayed=req.request_id in delayed)
                records.append(record)
                if bar is not None:
                    bar.update(1)
                if on_finish is not None:
                    on_finish(record)
                if k + 1 < len(conv.turns) and req.finish_reason is not FinishReason.ABORT:
                    history[i] = req.prompt_token_ids + req.output_token_ids
                    finished = req.metrics.finished_time
                    assert finished is not None  # a finished request has its finish time
                    if conv.open_loop:
                        # The schedule's time, not the (maybe delayed) arrival of turn k.
                        at = start + conv.start_time + sum(t.think_time for t in conv.turns[1:k + 2])
                        if at < finished:
                            delayed.add(f"{conv.conversation_id}#{k + 1}")
                        heapq.heappush(arrivals, (max(at, finished), i, k + 1))
                    else:
                        heapq.heappush(arrivals, (finished + conv.turns[k + 1].think_time, i, k + 1))
    finally:
        engine.runner = ends.runner
        if bar is not None:
            bar.close()
    return records


# ----------------------------------------------------------------------------- summary


def multiturn_summary(
    records: Sequence[ConversationRecord], tel_threshold: float, slo: float = 0.2
) -> dict[str, float | int | None]:
    """The prefix-cache experiments' numbers, over every turn: TTFT mean and P50/P90/P95/
    P99 (seconds), Tail Excess Latency above ``tel_threshold`` seconds, and the fraction of
    turns whose TTFT exceeds ``slo`` (aborted turns count as violations, as in
    `jserve.benchmarking.metrics.summarize`). Statistics of no turns are None; TEL is then 0."""
    if not _is_real(tel_threshold) or not math.isfinite(tel_threshold) or tel_threshold < 0:
        raise ValueError(f"tel_threshold must be a finite number >= 0 seconds, got {tel_threshold!r}")
    if not _is_real(slo) or not math.isfinite(slo) or slo <= 0:
        raise ValueError(f"slo must be a finite number > 0 seconds, got {slo!r}")
    plain = [r.record for r in records]
    s = summarize(plain, ttft_slo=slo)
    ttfts = [t for t in (ttft(r) for r in plain if r.finished) if t is not None]
    return {
        "num_turns": len(plain),
        "num_conversations": len({r.conversation_id for r in records}),
        "ttft_mean": s.ttft_mean,
        "ttft_p50": s.ttft_p50,
        "ttft_p90": s.ttft_p90,
        "ttft_p95": s.ttft_p95,
        "ttft_p99": s.ttft_p99,
        "tel": tail_excess_latency(ttfts, tel_threshold),
        "tel_threshold": float(tel_threshold),
        "slo": float(slo),
        "slo_violation": None if s.ttft_slo_attainment is None else 1.0 - s.ttft_slo_attainment,
    }
