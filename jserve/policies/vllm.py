"""vLLM (v0 default scheduler): FCFS, whole-prompt prefills first, recompute preemption of the
latest arrival; with `preemption_mode=SWAP` (`vllm-swap`) victims go to host memory, and with
`max_paddings` (`vllm-0.2.3`) prompts batch padded as vLLM 0.2.x ran them. How admission,
growth, repeated steps and swaps follow vLLM: docs/policies.md, vLLM.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from jserve.cache_features.swap_tier.section import PreemptMode, preemptions
from jserve.engine.plan import Plan
from jserve.engine.policy import PolicyCapabilities
from jserve.engine.request import RUNNING, SWAPPED, WAITING
from jserve.engine.view import SchedulerView
from jserve.policies.preemption import make_room, swap_or_recompute


@dataclass(frozen=True)
class VLLMPolicy:
    name: str = "vllm"
    chunked_prefill: bool = False
    watermark: float = 0.01
    preemption_mode: PreemptMode = PreemptMode.RECOMPUTE
    max_paddings: int | None = None

    @property
    def capabilities(self) -> PolicyCapabilities:
        """Its prefill batches are padded to their longest prompt with `max_paddings` (vLLM 0.2.x)."""
        return PolicyCapabilities(pads_prompts=self.max_paddings is not None)

    def schedule(self, view: SchedulerView) -> Plan:
        return self._prefills(view) or self._decodes(view)

    def _prefills(self, view: SchedulerView) -> Plan | None:
        r, lim = view.requests, view.limits
        if (r.status == SWAPPED).any():
            return None
        running = int((r.status == RUNNING).sum())
        watermark = int(self.watermark * view.num_blocks) if running else 0
        free, budget = view.num_free_blocks, lim.max_num_batched_tokens
        run: dict[int, int] = {}
        allocate: dict[int, int] = {}
        longest = total = 0
        for i in r.with_status(WAITING):
            tokens = int(r.num_tokens[i] - r.num_computed[i])
            need = view.blocks_for(int(r.num_tokens[i])) - int(r.num_blocks[i])
            if self.max_paddings is not None:  # the batch padded to its longest prompt
                longest, total = max(longest, tokens), total + tokens
                padded = (len(run) + 1) * longest
                if padded > lim.max_num_batched_tokens or padded - total > self.max_paddings:
                    break
            if tokens > budget or running + len(run) >= lim.max_num_seqs or free - need < watermark:
                break
            seq = int(r.seq_id[i])
            run[seq], allocate[seq] = tokens, need
            free, budget = free - need, budget - tokens
            watermark = int(self.watermark * view.num_blocks)
        return Plan(run=run, allocate=allocate) if run else None

    def _decodes(self, view: SchedulerView) -> Plan:
        r = view.requests
        running = r.with_status(RUNNING)  # oldest first
        needs = view.blocks_for(r.num_computed[running] + 1) - r.num_blocks[running]
        if (np.cumsum(needs) <= view.num_free_blocks).all():
            return self._decode_all(view, running, needs)
        queue = collections.deque(running.tolist())
        free = view.num_free_blocks
        run: dict[int, int] = {}
        allocate: dict[int, int] = {}
        preempt: dict[int, PreemptMode] = {}
        host_free = view.num_free_host_blocks
        swap = self.preemption_mode is PreemptMode.SWAP

        def evict(i: int) -> None:
            nonlocal host_free
            preempt[int(r.seq_id[i])], host_free = swap_or_recompute(int(r.num_blocks[i]), swap, host_free)

        while queue:
            i = queue.popleft()
            need = view.blocks_for(int(r.num_computed[i]) + 1) - int(r.num_blocks[i])
            fits, free = make_room(view, i, need, free, queue, evict)
            if not fits:  # nobody left to evict but itself
                break
            seq = int(r.seq_id[i])
            run[seq] = int(r.num_tokens[i] - r.num_computed[i])
            if need:
                allocate[seq] = need
            free -= need
        swap_in = set() if preempt else self._swap_ins(view, free, len(run), run, allocate)
        return Plan(run=run, allocate=allocate, **preemptions(preempt, swap_in))

    def _decode_all(self, view: SchedulerView, running: np.ndarray, needs: np.ndarray) -> Plan:
        """What `_decodes` plans when the free blocks cover every running request's next
        block, oldest first: each decodes, nobody is preempted."""
        r = view.requests
        seq_ids = r.seq_id[running]
        run = dict(zip(seq_ids.tolist(), (r.num_tokens - r.num_computed)[running].tolist()))
        grows = needs != 0
        allocate = dict(zip(seq_ids[grows].tolist(), needs[grows].tolist()))
        if (r.status == SWAPPED).any():
            free = view.num_free_blocks - int(needs.sum())
            swap_in = self._swap_ins(view, free, len(run), run, allocate)
            return Plan(run=run, allocate=allocate, **preemptions({}, swap_in))
        return Plan(run=run, allocate=allocate, repeat=decode_repeat(view, running))

    def _swap_ins(self, view: SchedulerView, free: int, running: int, run: dict[int, int],
                  allocate: dict[int, int]) -> set[int]:
        """Swapped requests back in, oldest first, while blocks and sequence slots allow;
        each also decodes this step (adding to `run` / `allocate`)."""
        r = view.requests
        swap_in: set[int] = set()
        for i in r.with_status(SWAPPED):
            held = int(r.num_host_blocks[i])
            grow = view.blocks_for(int(r.num_computed[i]) + 1) - held
            if held + grow > free or running + len(swap_in) >= view.limits.max_num_seqs:
                break
            seq = int(r.seq_id[i])
            swap_in.add(seq)
            run[seq] = int(r.num_tokens[i] - r.num_computed[i])
            if grow:
                allocate[seq] = grow
            free -= held + grow
        return swap_in


def decode_repeat(view: SchedulerView, running: np.ndarray) -> int:
    """How many steps in a row, this one included, the free blocks cover every running
    request's decode: the largest J whose growth, sum_i ceil(max(0, J - slack_i) / B)
    blocks (slack_i: token slots left in the blocks request i holds), fits the free ones.
    Searched up to the step that ends the first request by length, after which the
    running set changes anyway."""
    r, bs = view.requests, view.block_size
    if not len(running):
        return 1
    slack = r.num_blocks[running] * bs - r.num_computed[running]

    def growth(steps: int) -> int:
        return int(((np.maximum(0, steps - slack) + bs - 1) // bs).sum())

    lo, hi = 1, int((r.max_len[running] - r.num_tokens[running]).min())
    if growth(hi) <= view.num_free_blocks:
        return hi
    while lo + 1 < hi:  # growth(lo) fits, growth(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if growth(mid) <= view.num_free_blocks else (lo, mid)
    return lo
