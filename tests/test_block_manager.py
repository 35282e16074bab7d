"""BlockManager: unit tests and a stateful property test against a plain-dict model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jserve.cache.blocks import BlockManager
from jserve.errors import PlanError


def _snapshot(bm: BlockManager) -> tuple:
    """Everything observable about a manager, to compare before/after a refused operation."""
    return (
        bm.num_free,
        list(bm._free),
        bm.ref_counts.copy().tolist(),
        {s: list(bm.table(s)) for s in bm.seq_ids()},
    )


# --------------------------------------------------------------------------- unit tests
@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 1), (1, -3)])
def test_rejects_empty_pool(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_fresh_manager_is_all_free() -> None:
    bm = BlockManager(8, 4)
    assert bm.num_free == 8
    assert bm.seq_ids() == set()
    assert bm.table(3) == [] and bm.num_held(3) == 0
    assert (bm.ref_counts == 0).all()
    bm.check_invariants()


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_blocks_for(block_size: int) -> None:
    bm = BlockManager(4, block_size)
    for n in range(0, 70):
        assert bm.blocks_for(n) == -(-n // block_size)
        assert bm.blocks_for(n) * block_size >= n
        assert n == 0 or (bm.blocks_for(n) - 1) * block_size < n


def test_allocate_appends_distinct_blocks() -> None:
    bm = BlockManager(6, 2)
    bm.allocate(7, 2)
    bm.allocate(9, 1)
    bm.allocate(7, 3)
    assert bm.num_held(7) == 5 and bm.num_held(9) == 1
    assert bm.num_free == 0
    assert sorted(bm.table(7) + bm.table(9)) == list(range(6))
    assert (bm.ref_counts == 1).all()
    bm.check_invariants()


def test_allocation_order_and_lifo_reuse() -> None:
    bm = BlockManager(5, 1)
    bm.allocate(0, 2)
    assert bm.table(0) == [0, 1]
    bm.allocate(1, 2)
    assert bm.table(1) == [2, 3]
    assert bm.free(0) == 2
    # Recently freed blocks come back first, in the order they were first handed out.
    bm.allocate(2, 3)
    assert bm.table(2) == [0, 1, 4]
    bm.check_invariants()


def test_over_allocation_raises_and_changes_nothing() -> None:
    bm = BlockManager(4, 4)
    bm.allocate(1, 3)
    before = _snapshot(bm)
    with pytest.raises(PlanError, match="only 1 free"):
        bm.allocate(2, 2)
    with pytest.raises(PlanError):
        bm.allocate(1, 2)
    assert _snapshot(bm) == before
    assert 2 not in bm.seq_ids()
    bm.check_invariants()


def test_negative_allocation_raises_and_changes_nothing() -> None:
    bm = BlockManager(4, 4)
    bm.allocate(1, 1)
    before = _snapshot(bm)
    with pytest.raises(PlanError):
        bm.allocate(1, -1)
    with pytest.raises(PlanError):
        bm.allocate(5, -2)
    assert _snapshot(bm) == before
    bm.check_invariants()


def test_free_unknown_seq_is_noop() -> None:
    bm = BlockManager(4, 2)
    bm.allocate(1, 2)
    before = _snapshot(bm)
    assert bm.free(42) == 0
    assert _snapshot(bm) == before
    assert bm.free(1) == 2
    assert bm.free(1) == 0  # double free: no-op
    assert bm.num_free == 4
    assert (bm.ref_counts == 0).all()
    bm.check_invariants()


def test_allocate_zero_holds_nothing() -> None:
    bm = BlockManager(3, 2)
    bm.allocate(4, 0)
    assert bm.num_held(4) == 0 and bm.table(4) == []
    assert bm.num_free == 3
    assert bm.free(4) == 0
    bm.check_invariants()


def test_allocate_everything_then_free_everything() -> None:
    bm = BlockManager(16, 1)
    for seq in range(16):
        bm.allocate(seq, 1)
    assert bm.num_free == 0
    with pytest.raises(PlanError):
        bm.allocate(99, 1)
    for seq in range(16):
        assert bm.free(seq) == 1
        bm.check_invariants()
    assert bm.num_free == 16 and bm.seq_ids() == set()


def test_check_invariants_catches_corruption() -> None:
    """The checker itself must bite, or every property test built on it is vacuous."""
    bm = BlockManager(4, 1)
    bm.allocate(0, 2)
    bm._free.append(bm.table(0)[0])  # a used block also on the free list
    with pytest.raises(AssertionError):
        bm.check_invariants()

    bm = BlockManager(4, 1)
    bm.allocate(0, 2)
    bm.ref_counts[bm.table(0)[0]] = 2  # count disagrees with tables
    with pytest.raises(AssertionError):
        bm.check_invariants()

    bm = BlockManager(4, 1)
    bm.allocate(0, 2)
    bm._free.pop()  # a block lost: neither free nor used
    with pytest.raises(AssertionError):
        bm.check_invariants()

    bm = BlockManager(4, 1)
    bm._free.append(bm._free[0])  # a block on the free list twice
    with pytest.raises(AssertionError):
        bm.check_invariants()


# --------------------------------------------------------------------------- state machine
SEQ_IDS = st.integers(min_value=0, max_value=7)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/free sequences checked against a dict of seq -> block list."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.model: dict[int, list[int]] = {}

    def _free_model(self) -> int:
        return self.bm.num_blocks - sum(len(t) for t in self.model.values())

    @rule(seq=SEQ_IDS, data=st.data())
    def allocate_fits(self, seq: int, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, self._free_model()), label="n")
        free_before = set(self.bm._free)
        self.bm.allocate(seq, n)
        new = self.bm.table(seq)[len(self.model.get(seq, [])) :]
        assert len(new) == n
        assert len(set(new)) == n and set(new) <= free_before, "allocated a block that was not free"
        if n:
            self.model.setdefault(seq, []).extend(new)

    @precondition(lambda self: self._free_model() < 64)
    @rule(seq=SEQ_IDS, data=st.data())
    def allocate_too_many(self, seq: int, data: st.DataObject) -> None:
        n = data.draw(st.integers(self._free_model() + 1, self._free_model() + 5), label="n")
        before = _snapshot(self.bm)
        with pytest.raises(PlanError):
            self.bm.allocate(seq, n)
        assert _snapshot(self.bm) == before

    @rule(seq=SEQ_IDS, n=st.integers(-5, -1))
    def allocate_negative(self, seq: int, n: int) -> None:
        before = _snapshot(self.bm)
        with pytest.raises(PlanError):
            self.bm.allocate(seq, n)
        assert _snapshot(self.bm) == before

    @rule(seq=SEQ_IDS)
    def free(self, seq: int) -> None:
        held = self.model.pop(seq, [])
        free_before = self.bm.num_free
        unknown = seq not in self.bm.seq_ids()
        before = _snapshot(self.bm)
        assert self.bm.free(seq) == len(held)
        assert self.bm.num_free == free_before + len(held)
        assert set(held) <= set(self.bm._free)
        assert self.bm.num_held(seq) == 0 and self.bm.table(seq) == []
        if unknown:
            assert _snapshot(self.bm) == before

    @rule(seq=st.integers(100, 200))
    def free_unknown(self, seq: int) -> None:
        before = _snapshot(self.bm)
        assert self.bm.free(seq) == 0
        assert _snapshot(self.bm) == before

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()
        used = [b for t in self.model.values() for b in t]
        assert bm.num_free == self._free_model()
        assert bm.num_free + len(used) == bm.num_blocks
        assert len(set(used)) == len(used), "a block held twice"
        assert not set(used) & set(bm._free), "a block both free and used"
        for seq in range(8):
            assert bm.table(seq) == self.model.get(seq, [])
            assert bm.num_held(seq) == len(self.model.get(seq, []))
        assert {s for s in bm.seq_ids() if bm.num_held(s)} == set(self.model)
        assert np.array_equal(np.flatnonzero(bm.ref_counts), np.sort(np.array(used, dtype=np.int64)))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
