"""A test-only policy that forces Apt-Serve's hidden cache (`Plan.cache_type`), so the
engine's and runners' hidden paths run under any trace: vLLM-like FCFS (whole prompts
first, then every running request decodes, the newest preempted by recompute when blocks
run out), with each request's type chosen by `choose(seq)` when it is admitted, and
optionally a running request switching type once (discard and recompute in the same plan).

Not a model of Apt-Serve's decisions (that is the policy helper's `apt_serve.py`): only a
way to make every hidden-cache path happen. Blocks are counted per type with
`blocks_for_type(view, ...)`, as the engine counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jserve.cache_features.hidden_cache.section import CacheType, blocks_for_type, hidden_view, request_types, section
from jserve.engine.plan import Plan
from jserve.engine.policy import PolicyCapabilities
from jserve.engine.request import RUNNING, WAITING
from jserve.engine.view import SchedulerView


def all_hidden(seq: int) -> CacheType:
    return CacheType.HIDDEN


def every_other(seq: int) -> CacheType:
    return CacheType(seq % 2)


@dataclass(frozen=True)
class ForcedHiddenCache:
    """`choose(seq)`: the type a request is admitted with; a request whose whole length
    the cache cannot hold in that type (GQA's hidden blocks hold fewer tokens) gets KV.
    `switch`: a running request about to decode its third output token switches type,
    re-prefilling everything in that step, when the step's tokens and blocks allow."""

    choose: Callable[[int], CacheType] = all_hidden
    switch: bool = False
    name: str = "forced-hidden-cache"
    chunked_prefill: bool = False
    capabilities: PolicyCapabilities = PolicyCapabilities(uses_hidden_cache=True)

    def _type(self, view: SchedulerView, i: int) -> CacheType:
        want = self.choose(int(view.requests.seq_id[i]))
        if want is CacheType.HIDDEN and (
                hidden_view(view).block_tokens < 1
                or blocks_for_type(view, int(view.requests.max_len[i]), 1) > view.num_blocks):
            return CacheType.KV
        return want

    def schedule(self, view: SchedulerView) -> Plan:
        return self._prefills(view) or self._decodes(view)

    def _prefills(self, view: SchedulerView) -> Plan | None:
        r, lim = view.requests, view.limits
        running = int((r.status == RUNNING).sum())
        free, budget = view.num_free_blocks, lim.max_num_batched_tokens
        run, allocate, types = {}, {}, {}
        for i in r.with_status(WAITING):
            kind = self._type(view, i)
            tokens = int(r.num_tokens[i])
            need = blocks_for_type(view, tokens, int(kind))
            if tokens > budget or running + len(run) >= lim.max_num_seqs or need > free:
                break
            seq = int(r.seq_id[i])
            run[seq], allocate[seq], types[seq] = tokens, need, kind
            free, budget = free - need, budget - tokens
        return Plan(run=run, allocate=allocate, features=section(types)) if run else None

    def _decodes(self, view: SchedulerView) -> Plan:
        r = view.requests
        running = list(r.with_status(RUNNING))  # oldest first
        free = view.num_free_blocks
        preempt: list[int] = []

        def need(i: int) -> int:
            return blocks_for_type(view, int(r.num_computed[i]) + 1, int(request_types(view)[i])) - int(r.num_blocks[i])

        while running and sum(need(i) for i in running) > free:
            victim = running.pop()
            preempt.append(int(r.seq_id[victim]))
            free += int(r.num_blocks[victim])
        run = {int(r.seq_id[i]): 1 for i in running}
        allocate = {int(r.seq_id[i]): need(i) for i in running if need(i)}
        free -= sum(allocate.values())
        types: dict[int, CacheType] = {}
        if self.switch:
            for i in running:
                seq, tokens = int(r.seq_id[i]), int(r.num_tokens[i])
                if tokens - int(r.prompt_len[i]) != 2 or types:
                    continue
                new = CacheType(1 - int(request_types(view)[i]))
                if new is CacheType.HIDDEN and (hidden_view(view).block_tokens < 1 or blocks_for_type(view,
                        int(r.max_len[i]), 1) > view.num_blocks):
                    continue
                blocks = blocks_for_type(view, tokens, int(new))
                room = free + int(r.num_blocks[i]) + allocate.get(seq, 0)
                fits = sum(run.values()) - 1 + tokens <= view.limits.max_num_batched_tokens
                if blocks > room or not fits:
                    continue
                run[seq], allocate[seq], types[seq] = tokens, blocks, new
                free = room - blocks
        return Plan(run=run, allocate={s: n for s, n in allocate.items() if n}, preempt=preempt,
                    features=section(types))
