"""Decode-first batching with prompts chunked to fill a token budget.

Sarathi-Serve ("stall-free batching") and DeepSpeed-FastGen ("Dynamic SplitFuse") share
this skeleton: every running decode gets its token first, so a long prompt never stalls
the decodes behind it; the rest of the per-step token budget goes to prompt chunks,
ongoing ones before new admissions, all first-come first-served. They differ in how KV
memory is claimed for a prompt (`whole_prompt`):

- all of it at admission (as vLLM's chunked-prefill scheduler that Sarathi-Serve is built
  on): a prompt that started always has room to finish;
- chunk by chunk (FastGen's ragged allocation): more prompts in flight, at the risk of
  preempting one midway.

When a request cannot get the block it needs, the latest-arrived running request is
preempted by recompute (the lowest priority under FCFS).
"""

from __future__ import annotations

import collections

from jserve.engine.plan import Plan
from jserve.engine.request import RUNNING, WAITING
from jserve.engine.view import SchedulerView
from jserve.policies.preemption import make_room


def schedule_chunked(
    view: SchedulerView, token_budget: int, whole_prompt: bool, watermark: float = 0.01
) -> Plan:
    r, lim = view.requests, view.limits
    budget = min(token_budget, lim.max_num_batched_tokens)
    free = view.num_free_blocks
    run: dict[int, int] = {}
    allocate: dict[int, int] = {}
    preempt: list[int] = []  # by recompute, in order

    def claim(i: int, end: int) -> int:
        """Blocks request `i` must add to hold `end` tokens."""
        return max(0, view.blocks_for(end) - int(r.num_blocks[i]))

    running = list(r.with_status(RUNNING))  # oldest first
    remaining = r.num_tokens - r.num_computed

    def recompute(i: int) -> None:
        preempt.append(int(r.seq_id[i]))

    # 1. Decodes, oldest first; only a later arrival may be evicted for one (FCFS priority).
    later = collections.deque(running)
    while later:
        i = later.popleft()
        if remaining[i] != 1:
            continue
        need = claim(i, int(r.num_tokens[i]))
        fits, free = make_room(view, i, need, free, later, recompute)
        if not fits:
            continue
        if budget < 1:
            break
        seq = int(r.seq_id[i])
        run[seq] = 1
        if need:
            allocate[seq] = need
        free, budget = free - need, budget - 1

    # 2. Ongoing prompts, then 3. new ones, while the budget and memory last.
    keep = int(watermark * view.num_blocks)
    ongoing = [i for i in running if remaining[i] > 1 and int(r.seq_id[i]) not in preempt]
    # Requests holding KV count against max_num_seqs even in a step they sit out.
    live = len(running) - len(preempt)
    for i in ongoing + list(r.with_status(WAITING)):
        fresh = r.status[i] == WAITING
        if budget < 1 or len(run) >= lim.max_num_seqs or (fresh and live >= lim.max_num_seqs):
            break
        chunk = min(int(remaining[i]), budget)
        start = int(r.num_computed[i])
        need = claim(i, int(r.num_tokens[i]) if whole_prompt else start + chunk)
        reserve = keep if fresh and (running or run) else 0
        if need > free - reserve:
            if not fresh:
                continue  # an ongoing prompt waits for blocks; the next may fit
            break  # FCFS admission: nobody overtakes the head of the queue
        seq = int(r.seq_id[i])
        run[seq] = chunk
        if need:
            allocate[seq] = need
        free, budget = free - need, budget - chunk
        live += int(fresh)

    if not run and not preempt and running:
        # Chunk-wise allocation can leave every running prompt holding blocks while none can
        # take its next chunk; free the latest arrival's so the others progress.
        preempt.append(int(r.seq_id[running[-1]]))
    return Plan(run=run, allocate=allocate, preempt=preempt)
