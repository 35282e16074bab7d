"""The T-LRU paper's own cache model (Algorithm 1), driven through jserve's eviction rules:
one turn at a time, served at once (no queueing), TTFT linear in the uncached blocks, every
conversation's whole history cached after its turn (X_theta <- L_theta) and then trimmed to
the capacity (sum_i X_i <= C). Units are the caller's: tokens, or blocks of them.

It is the reference the engine is checked against (tests/test_tlru_paper.py: Figure 1 and
Section 4's claim) and `bench/reproduce_tlru.py`'s primary reproduction of Tables 4-5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jserve.benchmarking.conversations import ScheduledConversation
from jserve.cache.prefix import CachedBlocks, CacheSnapshot, Conversations, EvictionRule


@dataclass
class PaperCache:
    """Algorithm 1's state: per conversation its history L_i, cached prefix X_i and last
    turn's time; `rule` (a jserve eviction rule) picks which units a trim evicts.
    `min_history` is Threshold-LRU's all-or-nothing rule (Section 6.2: cache a
    conversation only once its history exceeds the threshold), as the engine's
    `PrefixCacheConfig.min_history_tokens`."""

    capacity: int
    rule: EvictionRule
    min_history: int = -1  # Threshold-LRU: a history of at most this many units is not cached
    history: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    num_turns: dict[str, int] = field(default_factory=dict)
    evicted: list[tuple[str, int]] = field(default_factory=list)  # (conversation, depth) of the last trim

    def turn(self, cid: str, prompt: int, response: int, now: float) -> int:
        """Serve one turn; returns the units it computes (history + prompt - cached)."""
        uncached = self.history.get(cid, 0) + prompt - self.cached.get(cid, 0)
        self.history[cid] = self.history.get(cid, 0) + prompt + response
        # X_theta <- L_theta, or nothing for a history Threshold-LRU does not cache
        self.cached[cid] = self.history[cid] if self.history[cid] > self.min_history else 0
        self.last[cid] = now
        self.num_turns[cid] = self.num_turns.get(cid, 0) + 1
        self._trim(now)
        return uncached

    def _trim(self, now: float) -> None:
        ids = tuple(c for c in self.cached if self.cached[c] > 0)
        n = sum(self.cached[c] for c in ids) - self.capacity
        self.evicted = []
        if n <= 0:
            return
        conv = np.repeat(np.arange(len(ids)), [self.cached[c] for c in ids])
        depth = np.concatenate([np.arange(self.cached[c]) for c in ids])
        snap = CacheSnapshot(
            now=now, block_size=1,
            blocks=CachedBlocks(block=np.arange(len(conv), dtype=np.int32), depth=depth.astype(np.int32),
                                last_access=np.array([self.last[ids[i]] for i in conv]),
                                conversation=conv.astype(np.int32)),
            conversations=Conversations(ids, np.array([self.history[c] for c in ids], np.int64),
                                        np.array([self.num_turns[c] for c in ids], np.int32),
                                        np.array([self.last[c] for c in ids])),
            prefill_rate=0.0, mean_new_prompt_len=0.0)
        gone = self.rule.evict(snap, n)
        self.evicted = sorted((ids[conv[b]], int(depth[b])) for b in gone)
        for b in gone:
            self.cached[ids[conv[b]]] -= 1


def instant_turns(schedule: Sequence[ScheduledConversation]) -> list[tuple[float, str, int, int]]:
    """Every scheduled turn as (arrival, conversation, new tokens, reply tokens), in arrival
    order, with each reply given at once: turn k arrives its think time after turn k-1
    (the paper's model, where a reply joins the history the moment its turn arrives)."""
    turns = []
    for conv in schedule:
        at = conv.start_time
        for k, t in enumerate(conv.turns):
            at += t.think_time if k else 0.0
            turns.append((at, conv.conversation_id, t.new_tokens, t.response_len))
    return sorted(turns, key=lambda x: x[0])


def uncached_per_turn(turns: Sequence[tuple[float, str, int, int]], capacity: int, rule: EvictionRule,
                      unit: int = 1, min_history: int = -1) -> np.ndarray:
    """Tokens each of `turns` (from `instant_turns`) computes under Algorithm 1 with this
    capacity (tokens) and rule, counting in units of `unit` tokens (a KV block; a prompt or
    reply rounds up to whole units). The rule's xi and Q_hat must be in the same units;
    `min_history` (tokens) is Threshold-LRU's, -1 for every other rule."""
    cache = PaperCache(capacity // unit, rule, min_history if min_history < 0 else min_history // unit)
    return np.array([unit * cache.turn(cid, -(-new // unit), -(-reply // unit), at)
                     for at, cid, new, reply in turns], dtype=np.int64)
