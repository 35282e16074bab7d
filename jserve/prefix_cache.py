"""Prefix (prompt) cache bookkeeping: which physical KV blocks hold which token prefixes.

A full block is keyed by its token ids and the key of the block before it (a hash chain),
salted with the conversation when caches are isolated per conversation. A new request
reuses the longest chain of cached blocks that starts its prompt; blocks are shared by
reference count, and a request's full blocks stay cached when it finishes, unreferenced
and *evictable*, until an eviction rule (`jserve.policies.tail_optimized_lru`) picks them.

The index lives beside the `BlockManager`, which owns the free list and reference counts;
eviction rules never see this object, only a `CacheSnapshot` of the evictable blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class CachedBlocks:
    """The evictable cached blocks (cached, referenced by no request), one entry each."""

    block: np.ndarray  # int32 physical block id
    depth: np.ndarray  # int32 index in its chain: it holds tokens [depth*bs, (depth+1)*bs)
    last_access: np.ndarray  # float64 seconds: when a request last released it
    conversation: np.ndarray  # int32 row in `CacheSnapshot.conversations`

    def __len__(self) -> int:
        return len(self.block)


@dataclass(frozen=True)
class Conversations:
    """Per conversation that owns evictable blocks: what T-LRU's budget is computed from."""

    conversation_id: tuple[str, ...]
    history_len: np.ndarray  # int64 tokens so far (its last finished turn's prompt + reply)
    num_turns: np.ndarray  # int32 turns finished, so its next turn has index num_turns
    last_access: np.ndarray  # float64 seconds: when its last turn finished

    def __len__(self) -> int:
        return len(self.conversation_id)


@dataclass(frozen=True)
class CacheSnapshot:
    """What an eviction rule may read. Evicting a block makes every block after it in its
    chain unreachable, so a rule must pick blocks deepest-first within a chain: the
    engine refuses a choice that leaves a cached block whose parent it evicts."""

    now: float
    block_size: int
    blocks: CachedBlocks
    conversations: Conversations
    # Prefill tokens per second, measured over recent steps (0 before any): how T-LRU turns
    # a TTFT threshold in seconds into the tokens a turn may compute within it.
    prefill_rate: float
    # Mean length of the new part of arriving prompts (prompt minus the conversation's
    # history), T-LRU's default next-turn estimate Q_hat; 0 before any arrival.
    mean_new_prompt_len: float


@dataclass(frozen=True)
class FutureTurn:
    """A turn an oracle knows in advance: its new message's length and the think time
    between the previous turn's reply and its arrival."""

    new_tokens: int
    think_time: float


# conversation id -> every turn of it, in order; turn 0's think time is unused.
ConversationFutures = Mapping[str, Sequence[FutureTurn]]


class EvictionRule(Protocol):
    """A pure function from a snapshot to the blocks to evict (exactly `n`, or all of
    them if fewer are evictable). Rules hold only their configuration."""

    name: str

    def evict(self, snapshot: CacheSnapshot, n: int) -> np.ndarray: ...
