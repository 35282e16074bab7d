"""The JAX runner's persistent batch (`jserve.runners.input_batch`) holds, after every step,
the block tables the engine's block manager holds, whatever preempts, swaps or ends the
sequences; and it holds nothing once every request has ended (no slot leaks)."""

from __future__ import annotations

import numpy as np
import pytest

from jserve import LLM, SamplingParams
from jserve.engine.batch import BatchDelta, SequenceSettings
from jserve.models.loading import LoadedModel
from jserve.runners.input_batch import PersistentBatch


def _checking_tables(llm: LLM) -> None:
    """Check the held tables each time a batch's delta is applied: the block manager then
    holds what the batch was built from (a step's booking may change it before the next)."""
    blocks, held = llm.engine.state.blocks, llm.engine.runner.held
    apply = held.apply

    def checked(delta: BatchDelta) -> None:
        apply(delta)
        for seq_id, slot in held._slot.items():
            assert held.table(slot).tolist() == blocks.table(seq_id), f"seq {seq_id}"

    held.apply = checked


# Tight: growth preempts (recompute, or swap with `vllm-swap`); and roomy.
@pytest.mark.parametrize("options", [dict(num_blocks=16, block_size=4, max_model_len=64),
                                     dict(num_blocks=16, block_size=4, max_model_len=64,
                                          policy="vllm-swap", swap_space=0.01),
                                     dict(num_blocks=256)])
def test_held_tables_follow_the_block_manager(tiny_smollm2_vocab: LoadedModel, options: dict) -> None:
    llm = LLM(tiny_smollm2_vocab, warmup=False, max_num_seqs=6, **options)
    rng = np.random.default_rng(0)
    engine = llm.engine
    _checking_tables(llm)
    for i, k in enumerate(rng.integers(1, 30, size=10)):
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 24)), ignore_eos=True)
        engine.add_request(str(i), rng.integers(3, 100, size=int(k)).tolist(), params)
    while engine.has_unfinished:
        engine.step()
        if rng.random() < 0.05:
            engine.abort(str(int(rng.integers(10))))
    engine.step()  # the last step's ended sequences reach the runner with the next batch
    assert engine.runner.held.num_held == 0
    if options["num_blocks"] == 16:
        assert llm.num_preemptions > 0


def test_slots_grow_and_are_reused() -> None:
    held = PersistentBatch(max_blocks=4, scratch_block=99, slots=2)

    def added(*seq_ids: int) -> SequenceSettings:
        n = len(seq_ids)
        return SequenceSettings(np.array(seq_ids, np.int64), np.full(n, 0.5, np.float32),
                                np.ones(n, np.float32), np.zeros(n, np.int32), np.arange(n, dtype=np.uint32))

    held.apply(BatchDelta(added(1, 2, 3), {1: (0, np.array([5, 6], np.int32)), 3: (0, np.array([7], np.int32))}))
    assert held.num_held == 3 and held.table(held.slots([1])[0]).tolist() == [5, 6]
    held.apply(BatchDelta(added(), {1: (1, np.array([8, 9], np.int32))}, ended=(2,)))
    slot = held.slots([1])[0]
    assert held.table(slot).tolist() == [5, 8, 9] and held.tables[slot, 3] == 99
    held.apply(BatchDelta(added(), {1: (0, np.zeros(0, np.int32))}))  # freed by a preemption
    assert held.table(slot).tolist() == [] and (held.tables[slot] == 99).all()
    assert held.num_held == 2 and held.slots([4])[0] not in held.slots([1, 3]).tolist()
