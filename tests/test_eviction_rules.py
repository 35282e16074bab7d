"""Prefix-cache eviction rules of `jserve.policies.tail_optimized_lru` on hand-made snapshots
whose answer is worked out in the comments, and properties over random snapshots: every
rule returns distinct snapshot blocks, exactly min(n, evictable) of them, and never evicts a
block while keeping a deeper one of the same conversation (the engine refuses that).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jserve.benchmarking.conversations import FutureTurn
from jserve.cache.prefix import CachedBlocks, CacheSnapshot, Conversations
from jserve.policies.tail_optimized_lru import (
    EVICTION_RULES,
    ORACLE_RULES,
    EndAwareTLRUEviction,
    LengthAwareTLRUEviction,
    TBeladyEviction,
    TLRUEviction,
    make_eviction_rule,
)

BS = 4


def snapshot(convs: dict[str, tuple[int, int, float]], blocks: list[tuple[int, str, int, float]], *,
             prefill_rate: float = 40.0, mean_new: float = 4.0, block_size: int = BS) -> CacheSnapshot:
    """convs: id -> (history_len, num_turns, last_access); blocks: (block id, conversation id,
    depth, last_access)."""
    ids = tuple(convs)
    row = {c: i for i, c in enumerate(ids)}
    return CacheSnapshot(
        now=20.0,
        block_size=block_size,
        blocks=CachedBlocks(
            block=np.array([b[0] for b in blocks], dtype=np.int32),
            depth=np.array([b[2] for b in blocks], dtype=np.int32),
            last_access=np.array([b[3] for b in blocks], dtype=np.float64),
            conversation=np.array([row[b[1]] for b in blocks], dtype=np.int32),
        ),
        conversations=Conversations(
            conversation_id=ids,
            history_len=np.array([convs[c][0] for c in ids], dtype=np.int64),
            num_turns=np.array([convs[c][1] for c in ids], dtype=np.int32),
            last_access=np.array([convs[c][2] for c in ids], dtype=np.float64),
        ),
        prefill_rate=prefill_rate,
        mean_new_prompt_len=mean_new,
    )


def uncached_next_blocks(snap: CacheSnapshot, evicted: np.ndarray,
                         futures: dict[str, list[FutureTurn]]) -> dict[str, int]:
    """Per conversation with a next turn: its next prompt's blocks (history + next message)
    that are not cached after `evicted` go, i.e. blocks_for(prompt) minus the length of the
    chain still cached from depth 0."""
    b, c = snap.blocks, snap.conversations
    gone = {int(x) for x in evicted}
    out = {}
    for i, cid in enumerate(c.conversation_id):
        t = int(c.num_turns[i])
        if t >= len(futures.get(cid, ())):
            continue
        kept = {int(b.depth[j]) for j in range(len(b)) if b.conversation[j] == i and int(b.block[j]) not in gone}
        chain = 0
        while chain in kept:
            chain += 1
        out[cid] = math.ceil((int(c.history_len[i]) + futures[cid][t].new_tokens) / snap.block_size) - chain
    return out


def ids(*xs: int) -> set[int]:
    return set(xs)


# ------------------------------------------------------------------ the shared hand-made case
# Block size 4. A: 12 tokens of history (blocks 10, 11, 12 at depths 0-2), released at t=10;
# B: 20 tokens (blocks 20-24), released at t=5, its last turn done (ended); C: 8 tokens
# (blocks 30, 31), released at t=8. Rows are listed out of order on purpose.
# xi = 0.2 s * 40 tok/s = 8 tokens (2 blocks) by the online fit, or fixed as xi_tokens = 8;
# Q_hat = 4 tokens (fixed, or the snapshot's mean new prompt with q_hat=None).
# True futures: A's next message is 12 tokens after 3 s (arrives at 13), C's is 2 tokens
# after 1 s (arrives at 9), B has no next turn.
CONVS = {"A": (12, 1, 10.0), "B": (20, 2, 5.0), "C": (8, 1, 8.0)}
BLOCKS = [(31, "C", 1, 8.0), (10, "A", 0, 10.0), (22, "B", 2, 5.0), (12, "A", 2, 10.0), (20, "B", 0, 5.0),
          (30, "C", 0, 8.0), (24, "B", 4, 5.0), (11, "A", 1, 10.0), (21, "B", 1, 5.0), (23, "B", 3, 5.0)]
FUTURES = {
    "A": [FutureTurn(30, 0.0), FutureTurn(12, 3.0)],
    "B": [FutureTurn(30, 0.0), FutureTurn(6, 2.0)],
    "C": [FutureTurn(30, 0.0), FutureTurn(2, 1.0)],
}
SNAP = snapshot(CONVS, BLOCKS)
# Next prompts: A 12 + 12 = 24 tokens (6 blocks), C 8 + 2 = 10 tokens (3 blocks).


def test_lru() -> None:
    # B is the oldest (t=5): its chain goes from the end, 24, 23, 22, 21.
    ev = make_eviction_rule("lru").evict(SNAP, 4)
    assert list(ev) == [24, 23, 22, 21]
    assert uncached_next_blocks(SNAP, ev, FUTURES) == {"A": 3, "C": 1}
    # Then B's root, then C (t=8) from its end, then A.
    assert list(make_eviction_rule("lru").evict(SNAP, 8)) == [24, 23, 22, 21, 20, 31, 30, 12]


def test_lru_ties_deepest_first_and_parent_accessed_later() -> None:
    # D's root was touched at t=7, its deeper blocks at t=5; E's only block at t=6.
    # LRU: D's depth 2 and depth 1 (t=5, deepest first), then E (t=6), then D's root.
    snap = snapshot({"D": (12, 1, 7.0), "E": (4, 1, 6.0)},
                    [(1, "D", 0, 7.0), (2, "D", 1, 5.0), (3, "D", 2, 5.0), (4, "E", 0, 6.0)])
    assert list(make_eviction_rule("lru").evict(snap, 4)) == [3, 2, 4, 1]
    # Equal access times across conversations: the deepest blocks of both go first.
    snap = snapshot({"D": (8, 1, 5.0), "E": (12, 1, 5.0)},
                    [(1, "D", 0, 5.0), (2, "D", 1, 5.0), (5, "E", 0, 5.0), (6, "E", 1, 5.0), (7, "E", 2, 5.0)])
    rule = make_eviction_rule("lru")
    assert list(rule.evict(snap, 1)) == [7]
    assert set(rule.evict(snap, 3)) == ids(7, 2, 6)


def test_threshold_lru() -> None:
    # Threshold 10: C (8 tokens <= 10) is not worth caching, so its blocks go first (31
    # before 30), then LRU: B from its end.
    ev = make_eviction_rule("threshold-lru", history_threshold=10).evict(SNAP, 4)
    assert list(ev) == [31, 30, 24, 23]
    assert uncached_next_blocks(SNAP, ev, FUTURES) == {"A": 3, "C": 3}
    # Threshold 12 (the bound is inclusive): A (12) is short too; among the short ones LRU,
    # so C (t=8) before A (t=10), and B (the oldest) waits.
    ev = make_eviction_rule("threshold-lru", history_threshold=12).evict(SNAP, 4)
    assert list(ev) == [31, 30, 12, 11]
    assert uncached_next_blocks(SNAP, ev, FUTURES) == {"A": 5, "C": 3}
    # The default 1024 marks every conversation here short: plain LRU.
    assert list(make_eviction_rule("threshold-lru").evict(SNAP, 5)) == [24, 23, 22, 21, 20]


def test_tlru() -> None:
    # Budgets with Q_hat = 4, xi = 8: A 12 + 4 - 8 = 8 tokens (keep depths 0, 1; 12 is
    # surplus), B 20 + 4 - 8 = 16 (24 surplus), C 8 + 4 - 8 = 4 (31 surplus). Surplus in LRU
    # order: 24 (t=5), 31 (t=8), 12 (t=10); then LRU among the rest: B's 23.
    ev = make_eviction_rule("tlru", q_hat=4.0, xi_tokens=8.0).evict(SNAP, 4)
    assert list(ev) == [24, 31, 12, 23]
    assert uncached_next_blocks(SNAP, ev, FUTURES) == {"A": 4, "C": 2}
    ev = make_eviction_rule("tlru", q_hat=4.0, xi_tokens=8.0).evict(SNAP, 6)
    assert list(ev) == [24, 31, 12, 23, 22, 21]
    # The earlier variants, Q_hat the running mean (4) and xi from the online fit (0.2 s at
    # 40 tok/s), reach the same numbers here.
    assert list(make_eviction_rule("tlru", q_hat=None).evict(SNAP, 6)) == list(ev)
    # A fixed xi_tokens ignores the snapshot's online fit.
    slow = snapshot(CONVS, BLOCKS, prefill_rate=0.0)
    assert list(make_eviction_rule("tlru", q_hat=4.0, xi_tokens=8.0).evict(slow, 6)) == list(ev)


def test_tlru_degenerate_thresholds() -> None:
    # No prefill measured yet: xi = 0 tokens, every budget covers the whole history plus
    # Q_hat, nothing is surplus, and T-LRU is LRU.
    snap = snapshot(CONVS, BLOCKS, prefill_rate=0.0)
    lru = make_eviction_rule("lru")
    assert list(make_eviction_rule("tlru").evict(snap, 7)) == list(lru.evict(snap, 7))
    # A huge xi makes every block surplus: LRU again.
    assert list(make_eviction_rule("tlru", tel_threshold=100.0).evict(SNAP, 7)) == list(lru.evict(SNAP, 7))
    # An explicit q_hat overrides the measured mean: with Q_hat = 0, budgets are A 4, B 12,
    # C 0, so surplus is A's 11, 12, B's 23, 24 and C's 30, 31; in LRU order B, C, A.
    ev = make_eviction_rule("tlru", q_hat=0.0).evict(SNAP, 6)
    assert list(ev) == [24, 23, 31, 30, 12, 11]
    assert uncached_next_blocks(SNAP, ev, FUTURES) == {"A": 5, "C": 3}


def test_end_aware_tlru() -> None:
    # As T-LRU, but B has ended, so all of it is surplus: 24..20 (t=5) then C's 31 (t=8),
    # then A's 12 (t=10); T-LRU would instead have taken A's 12 and B's 23-21.
    ev = make_eviction_rule("end-aware-tlru", q_hat=4.0, futures=FUTURES).evict(SNAP, 6)
    assert list(ev) == [24, 23, 22, 21, 20, 31]
    assert uncached_next_blocks(SNAP, ev, FUTURES) == {"A": 3, "C": 2}
    # A conversation missing from the futures counts as ended too.
    ev = make_eviction_rule("end-aware-tlru", q_hat=4.0,
                            futures={"A": FUTURES["A"], "C": FUTURES["C"]}).evict(SNAP, 6)
    assert list(ev) == [24, 23, 22, 21, 20, 31]


def test_length_aware_tlru() -> None:
    # True next lengths: A 12 (budget 12 + 12 - 8 = 16, all 3 blocks needed), C 2 (budget 2:
    # keep depth 0, 31 surplus); B has no next turn, so Q_hat = 4 (budget 16, 24 surplus).
    # Surplus in LRU order: 24, 31; then LRU: B's 23, 22.
    ev = make_eviction_rule("length-aware-tlru", q_hat=4.0, futures=FUTURES).evict(SNAP, 4)
    assert list(ev) == [24, 31, 23, 22]
    assert uncached_next_blocks(SNAP, ev, FUTURES) == {"A": 3, "C": 2}
    # Then B's root, C's root (t=8) before A (t=10).
    ev = make_eviction_rule("length-aware-tlru", q_hat=4.0, futures=FUTURES).evict(SNAP, 8)
    assert list(ev) == [24, 31, 23, 22, 21, 20, 30, 12]


def test_tbelady() -> None:
    # True budgets: A 16 (nothing surplus), C 2 (31 surplus), B ended (all surplus).
    # Surplus by next arrival, furthest first: B (never) 24..20, then C (t=9) 31. Then the
    # rest by next arrival: A (t=13) from its end before C's root (t=9), though A was used
    # more recently than C.
    ev = make_eviction_rule("tbelady", futures=FUTURES).evict(SNAP, 7)
    assert list(ev) == [24, 23, 22, 21, 20, 31, 12]
    assert uncached_next_blocks(SNAP, ev, FUTURES) == {"A": 4, "C": 2}
    ev = make_eviction_rule("tbelady", futures=FUTURES).evict(SNAP, 10)
    assert list(ev) == [24, 23, 22, 21, 20, 31, 12, 11, 10, 30]
    assert uncached_next_blocks(SNAP, ev, FUTURES) == {"A": 6, "C": 3}


@pytest.mark.parametrize("name", sorted(EVICTION_RULES))
def test_n_bounds(name: str) -> None:
    rule = make_eviction_rule(name, futures=FUTURES)
    assert rule.name == name
    for n in (0, -3):
        ev = rule.evict(SNAP, n)
        assert ev.dtype == np.int32 and len(ev) == 0
    ev = rule.evict(SNAP, 100)
    assert ev.dtype == np.int32
    assert sorted(ev) == sorted(b[0] for b in BLOCKS)
    empty = snapshot(CONVS, [])
    assert len(rule.evict(empty, 5)) == 0


def test_bad_names_and_missing_futures() -> None:
    with pytest.raises(ValueError, match="known rules: .*tlru"):
        make_eviction_rule("belady")
    for name in sorted(ORACLE_RULES):
        with pytest.raises(ValueError, match="futures"):
            make_eviction_rule(name)
    for cls in (EndAwareTLRUEviction, LengthAwareTLRUEviction, TBeladyEviction):
        with pytest.raises(ValueError, match="futures"):
            cls()
    with pytest.raises(ValueError):
        TLRUEviction(tel_threshold=-1.0)
    with pytest.raises(ValueError):
        make_eviction_rule("tlru", q_hat=float("nan"))


# ------------------------------------------------------------------ random snapshots
@st.composite
def random_cases(draw: st.DrawFn) -> tuple[CacheSnapshot, dict[str, list[FutureTurn]], int]:
    bs = draw(st.sampled_from([1, 4, 16]))
    n_conv = draw(st.integers(1, 5))
    convs: dict[str, tuple[int, int, float]] = {}
    blocks: list[tuple[int, str, int, float]] = []
    futures: dict[str, list[FutureTurn]] = {}
    for k in range(n_conv):
        cid = f"c{k}"
        n_full = draw(st.integers(0, 6))
        history = n_full * bs + draw(st.integers(0, bs - 1))
        num_turns = draw(st.integers(1, 3))
        last = draw(st.floats(0, 100, allow_nan=False))
        convs[cid] = (history, num_turns, last)
        # Only a suffix of the chain may be evictable (a running turn holds the rest).
        start = draw(st.integers(0, n_full))
        access = last
        for d in range(start, n_full):
            blocks.append((-1, cid, d, access))
            access -= draw(st.sampled_from([0.0, 0.0, 0.5, 3.0]))  # a parent is never older
        if draw(st.booleans()):
            n_fut = draw(st.integers(0, 4))
            futures[cid] = [FutureTurn(draw(st.integers(0, 40)), draw(st.floats(0, 50, allow_nan=False)))
                            for _ in range(n_fut)]
    order = draw(st.permutations(range(len(blocks))))
    phys = draw(st.permutations(range(100, 100 + len(blocks))))
    blocks = [(phys[i], *blocks[j][1:]) for i, j in enumerate(order)]
    snap = snapshot(convs, blocks, block_size=bs,
                    prefill_rate=draw(st.sampled_from([0.0, 10.0, 100.0, 1000.0])),
                    mean_new=draw(st.sampled_from([0.0, 3.0, 17.5])))
    return snap, futures, draw(st.integers(-1, len(blocks) + 2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_cases(), st.sampled_from([0.0, 0.05, 0.2, 1.0]), st.sampled_from([None, 0.0, 9.0]),
       st.sampled_from([0, 8, 1024]), st.sampled_from([None, 0.0, 6.0, 50.0]))
def test_random_snapshots(case: tuple[CacheSnapshot, dict[str, list[FutureTurn]], int], tel: float,
                          q_hat: float | None, threshold: int, xi_tokens: float | None) -> None:
    snap, futures, n = case
    b = snap.blocks
    row_of = {int(x): j for j, x in enumerate(b.block)}
    for name in EVICTION_RULES:
        rule = make_eviction_rule(name, tel_threshold=tel, q_hat=q_hat, history_threshold=threshold,
                                  xi_tokens=xi_tokens, futures=futures)
        ev = rule.evict(snap, n)
        assert ev.dtype == np.int32
        assert len(ev) == max(0, min(n, len(b))), name
        assert len(set(ev.tolist())) == len(ev), name
        assert set(ev.tolist()) <= set(row_of), name
        gone = set(ev.tolist())
        for j in range(len(b)):
            if int(b.block[j]) in gone:
                continue
            # A kept block's shallower blocks of the same conversation are kept too.
            for i in range(len(b)):
                if b.conversation[i] == b.conversation[j] and b.depth[i] < b.depth[j]:
                    assert int(b.block[i]) not in gone, (name, int(b.block[i]), int(b.block[j]))
        # Evicting fewer blocks picks a prefix of the same order.
        if n > 1:
            assert list(rule.evict(snap, n - 1)) == list(ev[: n - 1]), name
