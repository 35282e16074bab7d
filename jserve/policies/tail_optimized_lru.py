"""Prefix-cache eviction rules aimed at the tail of time-to-first-token, after "Tail-Optimized
Caching for LLM Inference" (Zhang et al., NeurIPS 2025): each a pure function of a
`CacheSnapshot` to the evictable blocks it gives up, looked up by name in `EVICTION_RULES`.
Every order evicts a chain from its end, so no eviction strands deeper blocks. Each rule against
the paper and our readings: docs/policies.md, Tail-Optimized LRU's rules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from jserve.cache.prefix import (
    PAPER_HISTORY_THRESHOLD,
    PAPER_Q_HAT_SHAREGPT,
    CacheSnapshot,
    EvictionRule,
    PrefixCacheConfig,
)


class KnownTurn(Protocol):
    """A turn an oracle rule knows in advance (a benchmark's `FutureTurn`): its new
    message's tokens, its think time after the last reply, or its scheduled arrival."""

    new_tokens: int
    think_time: float
    arrival: float | None


# conversation id -> every turn of it, in order: what the oracle rules read.
KnownFutures = Mapping[str, Sequence[KnownTurn]]


def _first(snapshot: CacheSnapshot, n: int, *keys: np.ndarray) -> np.ndarray:
    """The first `n` block ids in lexicographic order of `keys` (most significant first),
    deepest first on ties; `np.lexsort` is stable, so the snapshot's order breaks the rest."""
    b = snapshot.blocks
    if n <= 0 or len(b) == 0:
        return np.zeros(0, dtype=np.int32)
    order = np.lexsort((-b.depth.astype(np.int64), *reversed(keys)))
    return b.block[order[:n]].astype(np.int32)


def _xi_tokens(snapshot: CacheSnapshot, tel_threshold: float, xi_tokens: float | None) -> float:
    """xi in tokens: the rule's fixed value (the paper's: fitted offline), or else the
    tokens a turn can compute and still see its first token within `tel_threshold` seconds
    by the engine's online TTFT fit (floor + tokens / rate; the earlier variant)."""
    if xi_tokens is not None:
        return xi_tokens
    return max(tel_threshold - snapshot.ttft_floor, 0.0) * max(snapshot.prefill_rate, 0.0)


def _next_turns(snapshot: CacheSnapshot, futures: KnownFutures) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per conversation row: whether it has a next turn, that turn's new tokens and when
    it arrives (its scheduled time, or its think time after the last turn's reply;
    infinity where it has none)."""
    conv = snapshot.conversations
    has_next = np.zeros(len(conv), dtype=bool)
    new_tokens = np.zeros(len(conv), dtype=np.float64)
    arrival = np.full(len(conv), np.inf)
    for i, cid in enumerate(conv.conversation_id):
        turns = futures.get(cid, ())
        t = int(conv.num_turns[i])
        if 0 <= t < len(turns):
            has_next[i] = True
            new_tokens[i] = turns[t].new_tokens
            known = turns[t].arrival
            arrival[i] = known if known is not None else conv.last_access[i] + turns[t].think_time
    return has_next, new_tokens, arrival


def _surplus(snapshot: CacheSnapshot, xi_tokens: float, next_len: np.ndarray | float,
             ended: np.ndarray | None = None) -> np.ndarray:
    """Per block: past its conversation's TEL-safe budget `b_c = max(0, history + next_len
    - xi)`, i.e. `depth * block_size >= b_c` (keeping depths below ceil(b_c / bs) already
    brings the next turn's prefill within xi), or of an ended conversation."""
    conv = snapshot.conversations
    budget = np.maximum(0.0, conv.history_len.astype(np.float64) + next_len - xi_tokens)
    if ended is not None:
        budget = np.where(ended, 0.0, budget)
    b = snapshot.blocks
    return b.depth.astype(np.float64) * snapshot.block_size >= budget[b.conversation]


def _surplus_first(surplus: np.ndarray) -> np.ndarray:
    """Sort key that puts surplus blocks before the rest."""
    return np.where(surplus, 0, 1).astype(np.int8)


def _check_tel_threshold(tel_threshold: float) -> None:
    if not (tel_threshold >= 0 and math.isfinite(tel_threshold)):
        raise ValueError(f"tel_threshold must be a finite number of seconds >= 0, got {tel_threshold!r}")


def _check_tokens(name: str, value: float | None) -> None:
    if value is not None and not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number of tokens >= 0 or None, got {value!r}")


def _check_futures(name: str, futures: KnownFutures | None) -> None:
    if futures is None:
        raise ValueError(f"eviction rule {name!r} is an oracle: it needs the conversations' futures "
                         "(conversation id -> FutureTurn per turn)")


@dataclass(frozen=True)
class LRUEviction:
    """Least recently used first; deepest first on ties (a chain's blocks are released
    together, so this evicts a conversation from its end)."""

    name: str = "lru"

    def evict(self, snapshot: CacheSnapshot, n: int) -> np.ndarray:
        return _first(snapshot, n, snapshot.blocks.last_access)


@dataclass(frozen=True)
class ThresholdLRUEviction:
    """LRU after the blocks of conversations with at most `history_threshold` tokens of
    history, which are cheap to recompute and so treated as infinitely old."""

    name: str = "threshold-lru"
    history_threshold: int = PAPER_HISTORY_THRESHOLD

    def __post_init__(self) -> None:
        if self.history_threshold < 0:
            raise ValueError(f"history_threshold must be >= 0 tokens, got {self.history_threshold}")

    def evict(self, snapshot: CacheSnapshot, n: int) -> np.ndarray:
        b = snapshot.blocks
        short = snapshot.conversations.history_len <= self.history_threshold
        return _first(snapshot, n, _surplus_first(short[b.conversation]), b.last_access)


@dataclass(frozen=True)
class TLRUEviction:
    """T-LRU: blocks past their conversation's TEL-safe budget (with the next message
    estimated as `q_hat` tokens) first, then LRU."""

    name: str = "tlru"
    tel_threshold: float = 0.2  # xi, seconds of prefill a turn may take at no cost
    q_hat: float | None = PAPER_Q_HAT_SHAREGPT  # next message, tokens; None: the running mean
    xi_tokens: float | None = None  # xi in tokens; None: from tel_threshold by the online fit

    def __post_init__(self) -> None:
        _check_tel_threshold(self.tel_threshold)
        _check_tokens("q_hat", self.q_hat)
        _check_tokens("xi_tokens", self.xi_tokens)

    def _q_hat(self, snapshot: CacheSnapshot) -> float:
        return snapshot.mean_new_prompt_len if self.q_hat is None else self.q_hat

    def _xi(self, snapshot: CacheSnapshot) -> float:
        return _xi_tokens(snapshot, self.tel_threshold, self.xi_tokens)

    def evict(self, snapshot: CacheSnapshot, n: int) -> np.ndarray:
        surplus = _surplus(snapshot, self._xi(snapshot), self._q_hat(snapshot))
        return _first(snapshot, n, _surplus_first(surplus), snapshot.blocks.last_access)


@dataclass(frozen=True)
class _OracleTLRU(TLRUEviction):
    """T-LRU that also reads the conversations' future turns."""

    futures: KnownFutures | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_futures(self.name, self.futures)


@dataclass(frozen=True)
class EndAwareTLRUEviction(_OracleTLRU):
    """T-LRU told which conversations have no next turn (an oracle): those keep nothing."""

    name: str = "end-aware-tlru"

    def evict(self, snapshot: CacheSnapshot, n: int) -> np.ndarray:
        assert self.futures is not None
        has_next, _, _ = _next_turns(snapshot, self.futures)
        surplus = _surplus(snapshot, self._xi(snapshot), self._q_hat(snapshot), ended=~has_next)
        return _first(snapshot, n, _surplus_first(surplus), snapshot.blocks.last_access)


@dataclass(frozen=True)
class LengthAwareTLRUEviction(_OracleTLRU):
    """T-LRU told each next message's true length (an oracle); a conversation with no next
    turn falls back to `q_hat`, since this rule is not told that it ended."""

    name: str = "length-aware-tlru"

    def evict(self, snapshot: CacheSnapshot, n: int) -> np.ndarray:
        assert self.futures is not None
        has_next, new_tokens, _ = _next_turns(snapshot, self.futures)
        next_len = np.where(has_next, new_tokens, self._q_hat(snapshot))
        surplus = _surplus(snapshot, self._xi(snapshot), next_len)
        return _first(snapshot, n, _surplus_first(surplus), snapshot.blocks.last_access)


@dataclass(frozen=True)
class TBeladyEviction:
    """Tail-Optimized Belady (offline, hindsight): blocks past the TEL-safe budget computed
    with the true next length (everything of an ended conversation) first, then the
    conversation whose next turn arrives furthest in the future; within each group by next
    arrival (ended conversations at infinity), last access, then deepest first."""

    name: str = "tbelady"
    tel_threshold: float = 0.2
    xi_tokens: float | None = None
    futures: KnownFutures | None = None

    def __post_init__(self) -> None:
        _check_tel_threshold(self.tel_threshold)
        _check_tokens("xi_tokens", self.xi_tokens)
        _check_futures(self.name, self.futures)

    def evict(self, snapshot: CacheSnapshot, n: int) -> np.ndarray:
        assert self.futures is not None
        b = snapshot.blocks
        has_next, new_tokens, arrival = _next_turns(snapshot, self.futures)
        xi = _xi_tokens(snapshot, self.tel_threshold, self.xi_tokens)
        surplus = _surplus(snapshot, xi, new_tokens, ended=~has_next)
        return _first(snapshot, n, _surplus_first(surplus), -arrival[b.conversation], b.last_access)


EVICTION_RULES: dict[str, type[EvictionRule]] = {
    "lru": LRUEviction,
    "threshold-lru": ThresholdLRUEviction,
    "tlru": TLRUEviction,
    "end-aware-tlru": EndAwareTLRUEviction,
    "length-aware-tlru": LengthAwareTLRUEviction,
    "tbelady": TBeladyEviction,
}
ORACLE_RULES = frozenset({"end-aware-tlru", "length-aware-tlru", "tbelady"})


def make_eviction_rule(name: str, *, tel_threshold: float = 0.2,
                       q_hat: float | None = PAPER_Q_HAT_SHAREGPT, xi_tokens: float | None = None,
                       history_threshold: int = PAPER_HISTORY_THRESHOLD,
                       futures: KnownFutures | None = None) -> EvictionRule:
    """The rule registered as `name`, given those of the options it takes (the others are
    ignored, so one set of flags configures any rule)."""
    try:
        cls = EVICTION_RULES[name]
    except KeyError:
        raise ValueError(f"unknown eviction rule {name!r}; known rules: {', '.join(sorted(EVICTION_RULES))}") from None
    if name in ORACLE_RULES:
        _check_futures(name, futures)
    options = {"tel_threshold": tel_threshold, "q_hat": q_hat, "xi_tokens": xi_tokens,
               "history_threshold": history_threshold, "futures": futures}
    accepted = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in options.items() if k in accepted})


def xi_tokens_for(config: PrefixCacheConfig) -> float | None:
    """xi in tokens as the configuration fixes it: given directly, or `tel_threshold` over
    the offline prefill fit's seconds per token; None leaves it to the online fit (asked
    for, or no offline fit was available: a real engine without a profile)."""
    if config.xi_tokens is not None:
        return config.xi_tokens
    spt = config.prefill_seconds_per_token
    if config.xi_fit == "offline" and spt:
        return config.tel_threshold / spt
    return None


def eviction_rule_for(config: PrefixCacheConfig) -> EvictionRule:
    """The rule a prefix-cache configuration names, with its parameters and futures."""
    return make_eviction_rule(config.eviction, tel_threshold=config.tel_threshold,
                              q_hat=config.q_hat, xi_tokens=xi_tokens_for(config),
                              history_threshold=config.history_threshold, futures=config.futures)
