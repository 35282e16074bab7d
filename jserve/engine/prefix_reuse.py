"""The engine's side of the prefix cache: which cached blocks each waiting prompt starts
with, handing them over when a plan starts it, copying host-tier blocks back, keeping a
finished turn's full blocks for the next, and what an eviction rule is shown.

`PrefixIndex` (jserve/cache/prefix.py) knows blocks and hash chains; this part knows
requests: their chain keys (hashed once, extended as they grow), the hit each waiting one
was offered in the last snapshot, and the TTFTs that T-LRU's latency model is fitted to.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache.prefix import CacheSnapshot, PrefixHit, PrefixIndex, host_move_key
from jserve.engine.batch import BlockMove
from jserve.engine.live_requests import LiveRequests
from jserve.engine.plan import Plan
from jserve.engine.request import WAITING, Request


def conversation(req: Request) -> str:
    """The chat a request is a turn of: its own id when it names none."""
    return req.conversation_id if req.conversation_id is not None else req.request_id


class PrefixReuse:
    def __init__(self, index: PrefixIndex, live: LiveRequests, blocks: BlockManager,
                 capacity_blocks: int | None, *, count_referenced: bool = False,
                 min_history: int = -1) -> None:
        """`capacity_blocks`: most idle (unreferenced) blocks the cache keeps (None: every
        block no request uses, as vLLM), or with `count_referenced` most cached blocks,
        those running requests hold included; `min_history`: a turn whose history is at most
        this many tokens leaves nothing cached."""
        self.index = index
        self.live = live
        self.blocks = blocks
        self.capacity_blocks = capacity_blocks
        self.count_referenced = count_referenced
        self.min_history = min_history
        self._chains: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        self._hits: dict[int, tuple[int, PrefixHit]] = {}  # seq -> (index version, hit)
        self._offered: dict[int, PrefixHit] = {}  # what the last snapshot showed each one
        # (tokens computed for the first token, TTFT) of recent turns: T-LRU's latency model
        self._ttft_samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=512)

    def record_arrival(self, req: Request) -> None:
        self.index.record_arrival(conversation(req), len(req.prompt_token_ids))

    def _chain(self, req: Request, num_blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        """The request's first `num_blocks` chain keys, hashed once and extended as needed."""
        known = self._chains.get(req.seq_id)
        if known is None or len(known) < num_blocks:
            salt = self.index.salt(req.conversation_id)
            known = self.index.chain_keys(req.all_token_ids, salt, num_blocks, known)
            self._chains[req.seq_id] = known
        return known[:num_blocks]

    def offer(self) -> None:
        """Find each waiting request's cached prefix and show it as its `num_computed`.
        At least the last token is left to compute: its logits give the next token. A
        host-tier block is offered to the earliest waiting request that reaches it only:
        one copy can be loaded once, and the next request finds it on the device."""
        cols, bs, version = self.live.cols, self.blocks.block_size, self.index.version
        waiting = np.flatnonzero(self.live.table.live_mask & (cols.status == WAITING))
        claimed: set[int] = set()
        self._offered = {}
        for row in waiting[np.argsort(cols.arrival_time[waiting], kind="stable")]:
            seq_id = int(cols.seq_id[row])
            memo = self._hits.get(seq_id)
            if memo is None or memo[0] != version:
                req = self.live.requests[seq_id]
                keys = self._chain(req, (int(cols.num_tokens[row]) - 1) // bs)
                memo = self._hits[seq_id] = (version, self.index.match(keys, self.index.salt(req.conversation_id)))
            hit = memo[1]
            if hit.host:
                free = list(itertools.takewhile(lambda k: k not in claimed, hit.host))
                claimed.update(free)
                hit = PrefixHit(hit.device, tuple(free))
            self._offered[seq_id] = hit
            cols.num_computed[row] = hit.num_blocks * bs

    def admitted_hits(self, plan: Plan) -> dict[int, PrefixHit]:
        """Cached blocks each waiting request the plan starts takes over."""
        cols, rows = self.live.cols, self.live.rows(plan.run)
        starting = (rows >= 0) & (cols.status[rows] == WAITING) & (cols.num_computed[rows] > 0)
        if not starting.any():
            return {}
        seq_ids = list(plan.run)
        return {seq_ids[i]: self._offered[seq_ids[i]] for i in np.flatnonzero(starting).tolist()}

    def uncached(self, blocks: np.ndarray) -> int:
        """How many of these blocks go back on the free list when released."""
        return int((~self.index.cached[blocks]).sum())

    def evict(self, evict: list[int], hits: dict[int, PrefixHit]) -> list[BlockMove]:
        """Drop these cached blocks, demoting each to the host tier where there is one
        (but never the host copies a started request is about to load); returns the
        copies to make before the blocks are reused."""
        loading = frozenset(k for hit in hits.values() for k in hit.host)
        moves = []
        for block in evict:
            move_id = self.index.demote(block, loading)
            if move_id is not None:
                moves.append(BlockMove(host_move_key(move_id), np.array([block], np.int32)))
        self.blocks.evict(evict)
        return moves

    def take_over(self, seq_id: int, hit: PrefixHit, num_blocks: int) -> list[BlockMove]:
        """Start a table with the hit's device blocks, then fresh ones up to `num_blocks`;
        returns the copies that load the hit's host-tier blocks into the first fresh ones."""
        if hit.device:
            self.blocks.attach(seq_id, list(hit.device))
        self.blocks.allocate(seq_id, num_blocks - len(hit.device))
        del self._hits[seq_id]
        req = self.live.requests[seq_id]
        req.metrics.num_cached_tokens = hit.num_blocks * self.blocks.block_size
        table = self.blocks.table(seq_id)
        moves = []
        for i, key in enumerate(hit.host, start=len(hit.device)):
            move_id = self.index.promote(key, table[i], table[i - 1] if i else -1, i, conversation(req))
            moves.append(BlockMove(host_move_key(move_id), np.array([table[i]], np.int32)))
        return moves

    def take_dropped_moves(self) -> list[int]:
        """Host-tier copies replaced or dropped since the last call: the runner frees them."""
        dropped = [host_move_key(m) for m in self.index.dropped_moves]
        self.index.dropped_moves.clear()
        return dropped

    def record_first_token(self, req: Request, now: float) -> None:
        computed = len(req.prompt_token_ids) - req.metrics.num_cached_tokens
        self._ttft_samples.append((computed, now - req.metrics.arrival_time))

    def cache_turn(self, req: Request, now: float) -> None:
        """Keep an ending request's full computed blocks cached, for its next turn."""
        table = self.blocks.table(req.seq_id)
        computed = int(self.live.cols.num_computed[self.live.row(req.seq_id)]) if table else 0
        n = min(computed // self.blocks.block_size, len(table))
        if req.num_tokens <= self.min_history:
            n = 0  # too short to be worth caching (its stats are still recorded)
        self.index.release(table, self._chain(req, n), self.index.salt(req.conversation_id),
                           conversation(req), req.num_tokens, now)
        self._chains.pop(req.seq_id, None)
        self._hits.pop(req.seq_id, None)

    def over_capacity(self, released: int = 0) -> int:
        """Cached blocks past the capacity (<= 0: within it): idle blocks, as the T-LRU
        paper's cache holds only histories no request is using, plus `released` blocks a
        plan's preemptions would idle; or with `count_referenced` every cached block."""
        if self.capacity_blocks is None:
            return 0
        held = self.index.num_cached if self.count_referenced else self.blocks.num_evictable + released
        return held - self.capacity_blocks

    def capacity_request(self, now: float) -> tuple[int, CacheSnapshot] | None:
        """How many idle cached blocks must go for the cache to be within its capacity
        now, and the snapshot of all idle blocks an eviction rule picks them from. The
        engine asks once a step has released histories, so each is trimmed (Algorithm 1:
        X <- L, then trim to C) before the next turn can take it over. None when the cache
        is within its capacity."""
        n = self.over_capacity()
        if n <= 0:
            return None
        candidates = self.blocks.evictable()
        n = min(n, len(candidates))
        return (n, self.index.snapshot(candidates, now, self.ttft_model())) if n > 0 else None

    def eviction_request(self, shortfall: int, released: np.ndarray, hits: dict[int, PrefixHit],
                         now: float) -> tuple[int, CacheSnapshot] | None:
        """How many cached blocks must go (the plan's `shortfall` of free blocks, and
        enough for the cache to stay within its capacity once preemptions have idled
        theirs), and the snapshot an eviction rule picks them from: every block that
        will be unreferenced once the plan's preemptions have `released` theirs, less
        those the plan's `hits` take over. None when nothing needs evicting."""
        if shortfall <= 0 and self.over_capacity(len(released)) <= 0:
            return None  # the common step: nothing to free, the capacity kept
        candidates = np.union1d(self.blocks.evictable(), released[self.index.cached[released]])
        pinned = [b for hit in hits.values() for b in hit.device]
        if pinned:
            candidates = np.setdiff1d(candidates, pinned)
        n = max(shortfall, 0)
        if self.capacity_blocks is not None:
            held = self.index.num_cached if self.count_referenced else len(candidates)
            n = max(n, held - self.capacity_blocks)
        n = min(n, len(candidates))
        if n <= 0:
            return None
        return n, self.index.snapshot(candidates, now, self.ttft_model())

    def ttft_model(self) -> tuple[float, float]:
        """(floor seconds, tokens per second): a least-squares line TTFT = floor + tokens /
        rate through recent turns' first tokens, in the tokens each had to compute; (0, 0)
        before two turns. Without spread in the tokens (or a slope <= 0) it is the plain
        ratio of tokens to TTFT."""
        if len(self._ttft_samples) < 2:
            return 0.0, 0.0
        tokens, ttft = np.array(self._ttft_samples, np.float64).T
        if tokens.std() > 0:
            slope, floor = np.polyfit(tokens, ttft, 1)
            if slope > 0:
                return max(float(floor), 0.0), 1.0 / float(slope)
        return 0.0, float(tokens.sum() / ttft.sum()) if ttft.sum() > 0 else 0.0
