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

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    """What an eviction rule may read. Evicting a block makes the blocks after it in its
    chain unreachable (they stay cached, holding memory for nothing, until evicted in
    turn), so rules pick deepest-first within a chain."""

    now: float
    block_size: int
    blocks: CachedBlocks
    conversations: Conversations
    # T-LRU's latency model, fitted to recent turns: a turn's TTFT is about `ttft_floor`
    # seconds plus its tokens to compute over `prefill_rate` tokens per second (0 before any
    # turn): how a TTFT threshold in seconds becomes the tokens a turn may compute within it.
    prefill_rate: float
    # Mean length of the new part of arriving prompts (prompt minus the conversation's
    # history), T-LRU's default next-turn estimate Q_hat; 0 before any arrival.
    mean_new_prompt_len: float
    ttft_floor: float = 0.0


CAPACITY_COUNTS = ("all", "unreferenced")
XI_FITS = ("offline", "online")
# Appendix F of the T-LRU paper: "the average prompt length in ShareGPT is approximately 100
# tokens (we thus set Q_hat = 100 in implementation)". Its Section 6 says 150 for ShareGPT;
# Tables 4-5, which our reproduction compares with, are Appendix F's runs.
PAPER_Q_HAT_SHAREGPT = 100.0
# Section 6.2: Threshold-LRU caches a conversation only once its history exceeds 1,024
# tokens, the threshold of OpenAI's prompt caching.
PAPER_HISTORY_THRESHOLD = 1024


@dataclass(frozen=True)
class PrefixCacheConfig:
    """A prefix cache as a user asks for one: which eviction rule, how much KV it may keep,
    whether conversations are isolated, and T-LRU's parameters. The defaults are the T-LRU
    paper's definitions; the other values are the variants jserve shipped before, kept as
    options (see `jserve.policies.tail_optimized_lru` for the table of both)."""

    eviction: str = "lru"  # a name in `jserve.policies.tail_optimized_lru.EVICTION_RULES`
    capacity_tokens: int | None = None  # None: every block no request uses (vLLM)
    isolation: bool = False  # no reuse across conversations (the paper's assumption)
    tel_threshold: float = 0.2  # xi, seconds: the TTFT a turn may take without excess
    # Two-tier (beyond the paper, its stated future work): evicted blocks are demoted to
    # this many tokens of host memory and copied back when a prompt reuses them. 0: off.
    host_capacity_tokens: int = 0
    # What the oracle rules (end-aware-tlru, length-aware-tlru, tbelady) read: the
    # workload's future turns, which only a benchmark knows (its `ConversationFutures`,
    # `jserve.benchmarking.conversations`; the rules' `KnownFutures`).
    futures: Mapping[str, Sequence[Any]] | None = field(default=None, compare=False, repr=False)
    # T-LRU's next-message estimate Q_hat in tokens, fixed (the paper's); None: the running
    # mean of arriving messages' new tokens (jserve's earlier variant).
    q_hat: float | None = PAPER_Q_HAT_SHAREGPT
    # xi in tokens, given directly (as the authors' vLLM and SGLang ports take it); None:
    # `tel_threshold` seconds turned into tokens by `xi_fit`.
    xi_tokens: float | None = None
    # "offline": tokens = tel_threshold / `prefill_seconds_per_token`, a line through the
    # origin fitted once to the runner's prefill times (the paper's footnote 7), which the
    # builder fills in; "online": a line with an intercept refitted to recent turns' TTFTs
    # (jserve's earlier variant; queueing enters it).
    xi_fit: str = "offline"
    prefill_seconds_per_token: float | None = None
    # "unreferenced": the capacity bounds the idle cached blocks, those no request holds
    # (the paper's sum_i X_i <= C: its model serves a turn at once, so every cached history
    # is idle); "all": every cached block, those running requests reuse too, which no rule
    # can evict (so a busy server can be over its capacity with nothing left to trim).
    # Either way the engine trims the cache at the end of the step that released a
    # history, so it is cut to the capacity before the next turn can take it over.
    capacity_counts: str = "unreferenced"
    # Threshold-LRU: conversations whose history is at most this many tokens are not cached
    # at all (the paper's all-or-nothing rule), unless `threshold_soft`, where they are
    # cached but evicted first (the earlier variant).
    history_threshold: int = PAPER_HISTORY_THRESHOLD
    threshold_soft: bool = False

    def __post_init__(self) -> None:
        if self.capacity_tokens is not None and self.capacity_tokens < 0:
            raise ValueError(f"cache capacity must be >= 0 tokens, got {self.capacity_tokens}")
        if self.host_capacity_tokens < 0:
            raise ValueError(f"host cache capacity must be >= 0 tokens, got {self.host_capacity_tokens}")
        for name in ("q_hat", "xi_tokens", "prefill_seconds_per_token"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0 or None, got {v!r}")
        if self.capacity_counts not in CAPACITY_COUNTS:
            raise ValueError(f"capacity_counts must be one of {CAPACITY_COUNTS}, got {self.capacity_counts!r}")
        if self.xi_fit not in XI_FITS:
            raise ValueError(f"xi_fit must be one of {XI_FITS}, got {self.xi_fit!r}")
        if self.history_threshold < 0:
            raise ValueError(f"history_threshold must be >= 0 tokens, got {self.history_threshold}")

    @property
    def min_history_tokens(self) -> int:
        """Histories this short are not cached at all: Threshold-LRU's all-or-nothing rule
        (-1: every history is)."""
        if self.eviction == "threshold-lru" and not self.threshold_soft:
            return self.history_threshold
        return -1

    def in_blocks(self, block_size: int) -> PrefixCacheSize:
        """This cache as the engine state keeps it, in blocks of `block_size` tokens."""
        capacity = None if self.capacity_tokens is None else self.capacity_tokens // block_size
        return PrefixCacheSize(isolation=self.isolation, capacity_blocks=capacity,
                               count_referenced=self.capacity_counts == "all",
                               min_history=self.min_history_tokens,
                               host_blocks=self.host_capacity_tokens // block_size)


@dataclass(frozen=True)
class PrefixCacheSize:
    """A prefix cache as the engine state keeps one: finished requests' full blocks stay
    cached for later prompts that start the same way, keyed by conversation too with
    `isolation`. `capacity_blocks` caps how many unreferenced blocks stay cached (None:
    every block no request uses, as vLLM; the T-LRU paper's sum_i X_i <= C over idle
    histories), or with `count_referenced` how many blocks the cache holds, those running
    requests reuse included; the engine trims the cache to it after each step. A
    finished turn whose history is at most `min_history` tokens is not cached at all
    (Threshold-LRU's rule). `host_blocks` adds a host tier that evicted blocks are demoted
    to and promoted back from (0: none)."""

    isolation: bool = False
    capacity_blocks: int | None = None
    count_referenced: bool = False
    min_history: int = -1
    host_blocks: int = 0

    def __post_init__(self) -> None:
        if self.capacity_blocks is not None and self.capacity_blocks < 0:
            raise ValueError(f"cache capacity_blocks must be >= 0, got {self.capacity_blocks}")


class EvictionRule(Protocol):
    """A pure function from a snapshot to the blocks to evict (exactly `n`, or all of
    them if fewer are evictable). Rules hold only their configuration."""

    name: str

    def evict(self, snapshot: CacheSnapshot, n: int) -> np.ndarray: ...


ORPHAN = -2  # parent of a cached block whose chain was cut above it: never matched again
RETIRED_CONVERSATIONS = 100_000  # stats kept for conversations with no cached blocks left


@dataclass(frozen=True)
class PrefixHit:
    """The cached blocks a prompt starts with: on the device, then (with a host tier) the
    chain keys of blocks demoted to host memory, which must be copied back to be used."""

    device: tuple[int, ...] = ()
    host: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.host)


@dataclass(frozen=True)
class _HostEntry:
    move_id: int  # what the runner keeps the copy under (as BlockMove seq_id -(id + 1))
    tokens: tuple[int, ...]
    salt: str | None
    parent_key: int  # 0 at depth 0


def host_move_key(move_id: int) -> int:
    """The runner's key for a host-tier copy: negative, so it never meets a request's."""
    return -(move_id + 1)


@dataclass
class _ConversationStats:
    history_len: int = 0
    num_turns: int = 0
    last_access: float = 0.0


class PrefixIndex:
    """The hash chains of cached blocks, and per-conversation history for T-LRU.

    Lookups are exact: an entry matches only if its tokens, salt and parent block are
    equal, so a hash collision costs a miss, never a wrong KV block.
    """

    def __init__(self, num_blocks: int, block_size: int, *, isolate: bool = False,
                 host_capacity_blocks: int = 0) -> None:
        """`isolate`: key blocks by conversation too, so no conversation reuses another's
        KV (the paper's setting; also what a multi-tenant server wants).
        `host_capacity_blocks`: a second tier in host memory that evicted blocks are
        demoted to and promoted back from on reuse, least recently demoted dropped first
        (0: evicted blocks are dropped)."""
        self.host_capacity_blocks = host_capacity_blocks
        self._host: OrderedDict[int, _HostEntry] = OrderedDict()  # key -> entry, oldest first
        self._next_move_id = 0
        # Host copies the runner should forget (replaced or dropped), drained each step.
        self.dropped_moves: list[int] = []
        self.block_size = block_size
        self.isolate = isolate
        self.cached = np.zeros(num_blocks, dtype=bool)
        self.depth = np.zeros(num_blocks, dtype=np.int32)
        # The block before it in its chain; -1 at depth 0, ORPHAN once that one is evicted.
        self.parent = np.full(num_blocks, -1, dtype=np.int32)
        self._children: dict[int, set[int]] = {}
        self.last_access = np.zeros(num_blocks, dtype=np.float64)
        self.conversation = np.zeros(num_blocks, dtype=np.int32)
        self._key: list[int] = [0] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._salt: list[str | None] = [None] * num_blocks
        self._entries: dict[int, int] = {}  # chain key -> block
        # Conversations that own cached blocks (rows are recycled once they own none, so a
        # server that runs for months keeps as many as its cache holds, not all it has seen).
        self._conversation_ids: list[str] = []
        self._conversation_row: dict[str, int] = {}
        self._stats: list[_ConversationStats] = []
        self._owned: list[int] = []  # cached blocks tagged with each row
        self._free_rows: list[int] = []
        # Stats of recently forgotten conversations, so a turn that comes back after its
        # blocks were all evicted still counts its history and turn number (bounded).
        self._retired: OrderedDict[str, _ConversationStats] = OrderedDict()
        self._new_tokens_sum = 0
        self._new_tokens_count = 0
        self.version = 0  # bumped whenever an entry comes or goes

    # ------------------------------------------------------------------ keys and lookup
    def chain_keys(self, token_ids: Sequence[int], salt: str | None, num_blocks: int,
                   known: list[tuple[int, tuple[int, ...]]] | None = None
                   ) -> list[tuple[int, tuple[int, ...]]]:
        """(key, tokens) of the first `num_blocks` full blocks of `token_ids`, extending
        `known` (the keys of a shorter prefix of the same ids) instead of rehashing it."""
        keys = list(known or ())
        bs = self.block_size
        parent = keys[-1][0] if keys else 0
        for d in range(len(keys), num_blocks):
            tokens = tuple(token_ids[d * bs:(d + 1) * bs])
            parent = hash((parent, salt, tokens))
            keys.append((parent, tokens))
        return keys

    def salt(self, conversation_id: str | None) -> str | None:
        return conversation_id if self.isolate else None

    def match(self, keys: Sequence[tuple[int, tuple[int, ...]]], salt: str | None) -> PrefixHit:
        """The cached blocks holding the longest prefix of `keys`: device blocks, then the
        host tier's continuation of the chain."""
        blocks: list[int] = []
        parent = -1
        for key, tokens in keys:
            block = self._entries.get(key)
            if (block is None or self._tokens[block] != tokens or self._salt[block] != salt
                    or self.parent[block] != parent):
                break
            blocks.append(block)
            parent = block
        host: list[int] = []
        parent_key = keys[len(blocks) - 1][0] if blocks else 0
        for key, tokens in keys[len(blocks):]:
            entry = self._host.get(key)
            if entry is None or entry.tokens != tokens or entry.salt != salt or entry.parent_key != parent_key:
                break
            host.append(key)
            parent_key = key
        return PrefixHit(tuple(blocks), tuple(host))

    # ------------------------------------------------------------------ updates
    def record_arrival(self, conversation_id: str, prompt_len: int) -> None:
        """Count the new part of an arriving prompt toward T-LRU's mean estimate Q_hat."""
        row = self._conversation_row.get(conversation_id)
        stats = self._stats[row] if row is not None else self._retired.get(conversation_id)
        history = stats.history_len if stats is not None else 0
        self._new_tokens_sum += max(prompt_len - history, 0)
        self._new_tokens_count += 1

    @property
    def mean_new_prompt_len(self) -> float:
        return self._new_tokens_sum / self._new_tokens_count if self._new_tokens_count else 0.0

    def release(self, table: Sequence[int], keys: Sequence[tuple[int, tuple[int, ...]]],
                salt: str | None, conversation_id: str, history_len: int, now: float) -> None:
        """A turn ended: make its full computed blocks (`keys` covers them) cached entries,
        tagged with its conversation and stamped `now`. Where another block already holds
        the same prefix, that one stays the entry and this turn's copy is not cached."""
        row = self._conversation(conversation_id)
        stats = self._stats[row]
        stats.history_len, stats.last_access = history_len, now
        stats.num_turns += 1
        parent = -1
        for depth, (key, tokens) in enumerate(keys):
            block = table[depth]
            existing = self._entries.get(key)
            if existing is not None and (self._tokens[existing] != tokens
                                         or self._salt[existing] != salt
                                         or self.parent[existing] != parent):
                break  # a colliding key: leave the rest of this chain uncached
            if existing is None:
                self._register(block, key, tokens, salt, depth, parent, row)
            else:
                block = existing
                self._tag(block, row)
            self.last_access[block] = now
            parent = block
        self._forget_if_unowned(row)

    def _register(self, block: int, key: int, tokens: tuple[int, ...], salt: str | None,
                  depth: int, parent: int, row: int) -> None:
        self._entries[key] = block
        self.conversation[block] = row
        self._owned[row] += 1
        self.cached[block] = True
        self._key[block], self._tokens[block], self._salt[block] = key, tokens, salt
        self.depth[block], self.parent[block] = depth, parent
        if parent >= 0:
            self._children.setdefault(parent, set()).add(block)
        stale = self._host.pop(key, None)  # the device copy supersedes a host one
        if stale is not None:
            self.dropped_moves.append(stale.move_id)
        self.version += 1

    def demote(self, block: int, keep: frozenset[int] = frozenset()) -> int | None:
        """Copy an evicted block's entry to the host tier (making room by dropping the
        least recently demoted entry not in `keep`, the keys a request is about to load);
        returns the copy's move id, or None when the block is just dropped: no host tier,
        no room, or unreachable anyway."""
        parent = int(self.parent[block])
        key = self._key[block]
        if not self.host_capacity_blocks or parent == ORPHAN or key in keep:
            return None
        if key in self._host:
            self.dropped_moves.append(self._host.pop(key).move_id)
        if len(self._host) >= self.host_capacity_blocks:
            victim = next((k for k in self._host if k not in keep), None)
            if victim is None:
                return None
            self.dropped_moves.append(self._host.pop(victim).move_id)
        move_id = self._next_move_id
        self._next_move_id += 1
        self._host[key] = _HostEntry(move_id, self._tokens[block], self._salt[block],
                                     self._key[parent] if parent >= 0 else 0)
        self.version += 1
        return move_id

    def promote(self, key: int, block: int, parent: int, depth: int, conversation_id: str) -> int:
        """Bring a host entry back into `block` (fresh, held by the request that reuses
        it, after `parent` in its chain); returns the move id of the copy to load."""
        entry = self._host.pop(key)
        self._register(block, key, entry.tokens, entry.salt, depth, parent,
                       self._conversation(conversation_id))
        return entry.move_id

    @property
    def num_host_entries(self) -> int:
        return len(self._host)

    def remove(self, block: int) -> None:
        """Forget an evicted block's entry; the blocks after it can no longer be matched."""
        del self._entries[self._key[block]]
        for child in self._children.pop(block, ()):
            self.parent[child] = ORPHAN
        parent = int(self.parent[block])
        if parent >= 0:
            self._children[parent].discard(block)
        self.cached[block] = False
        self._tokens[block] = self._salt[block] = None
        self.parent[block] = -1
        row = int(self.conversation[block])
        self._owned[row] -= 1
        self._forget_if_unowned(row)
        self.version += 1

    def _conversation(self, conversation_id: str) -> int:
        row = self._conversation_row.get(conversation_id)
        if row is None:
            stats = self._retired.pop(conversation_id, None) or _ConversationStats()
            if self._free_rows:
                row = self._free_rows.pop()
                self._conversation_ids[row], self._stats[row] = conversation_id, stats
            else:
                row = len(self._conversation_ids)
                self._conversation_ids.append(conversation_id)
                self._stats.append(stats)
                self._owned.append(0)
            self._conversation_row[conversation_id] = row
        return row

    def _tag(self, block: int, row: int) -> None:
        """Make `row` the owner of a cached block (the conversation that used it last)."""
        old = int(self.conversation[block])
        if old != row:
            self._owned[old] -= 1
            self._owned[row] += 1
            self.conversation[block] = row
            self._forget_if_unowned(old)

    def _forget_if_unowned(self, row: int) -> None:
        cid = self._conversation_ids[row]
        if self._owned[row] == 0 and self._conversation_row.get(cid) == row:
            del self._conversation_row[cid]
            self._free_rows.append(row)
            self._retired[cid] = self._stats[row]
            if len(self._retired) > RETIRED_CONVERSATIONS:
                self._retired.popitem(last=False)

    @property
    def num_cached(self) -> int:
        """Blocks with an entry, held by a running request or not."""
        return len(self._entries)

    @property
    def num_conversations(self) -> int:
        """Conversations that own cached blocks."""
        return len(self._conversation_row)

    # ------------------------------------------------------------------ snapshot
    def snapshot(self, evictable: np.ndarray, now: float, ttft_model: tuple[float, float]) -> CacheSnapshot:
        """`evictable`: the candidate block ids (cached, unreferenced, not pinned);
        `ttft_model`: (floor seconds, tokens per second), see `CacheSnapshot`."""
        rows, inverse = np.unique(self.conversation[evictable], return_inverse=True)
        stats = [self._stats[r] for r in rows.tolist()]
        return CacheSnapshot(
            now=now, block_size=self.block_size,
            blocks=CachedBlocks(
                block=evictable.astype(np.int32), depth=self.depth[evictable],
                last_access=self.last_access[evictable],
                conversation=inverse.astype(np.int32).reshape(-1),
            ),
            conversations=Conversations(
                conversation_id=tuple(self._conversation_ids[r] for r in rows.tolist()),
                history_len=np.array([s.history_len for s in stats], np.int64),
                num_turns=np.array([s.num_turns for s in stats], np.int32),
                last_access=np.array([s.last_access for s in stats], np.float64),
            ),
            prefill_rate=ttft_model[1], ttft_floor=ttft_model[0],
            mean_new_prompt_len=self.mean_new_prompt_len,
        )

    def check_invariants(self) -> None:
        assert int(self.cached.sum()) == len(self._entries), "entries disagree with cached blocks"
        for key, block in self._entries.items():
            assert self.cached[block] and self._key[block] == key
            parent = int(self.parent[block])
            assert parent in (-1, ORPHAN) or self.cached[parent], f"block {block}: stale parent"
            if parent >= 0:
                assert self.depth[block] == self.depth[parent] + 1
                assert block in self._children[parent]
        owned = np.bincount(self.conversation[self.cached], minlength=len(self._owned))
        assert owned.tolist() == self._owned, "conversation ownership counts are off"
        assert {r for r, n in enumerate(self._owned) if n} == set(self._conversation_row.values()), \
            "a conversation row is kept without blocks, or dropped with some"
