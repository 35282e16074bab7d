"""Reservation bookkeeping shared by the prediction-based policies (RLP, S3, CacheOpt).

These policies allocate a request's *predicted* demand up front instead of block by block:
at admission a plan sets `reserve[seq]` to the blocks promised to the request, and later
plans materialise them with `allocate` as the request grows. The rules every plan keeps:

- a request never holds more device blocks than its reservation (`held + allocate <=
  reserved` after the plan), so a reservation is never cut below what its request holds;
- reservations sum to at most `num_blocks`. Since every block holder holds within its
  reservation, the blocks nobody has promised are `num_blocks - sum(reserved)`
  (= `num_free_blocks - view.num_reserved_blocks`): the `Ledger.pool` a new reservation,
  or an extension of one, may take. Because of the two rules, any allocation inside a
  reservation finds a free block: no separate free-block count is needed.

Preemption releases the whole reservation (the state clears it), so a request that comes
back (recompute or swap-in) is reserved for afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from jserve.cache_features.swap_tier.section import PreemptMode, preemptions
from jserve.engine.plan import Plan
from jserve.engine.request import RequestStatus
from jserve.engine.view import SchedulerView
from jserve.policies.preemption import swap_or_recompute


def demand_blocks(view: SchedulerView, i: int, total_tokens: int | None) -> int:
    """Blocks for request `i` expected to reach `total_tokens` (prompt + output; None: no
    prediction, its `max_len`): never fewer than its tokens so far plus the next one, never
    more than `max_len` can fill."""
    r = view.requests
    cap = int(r.max_len[i])
    total = cap if total_tokens is None else int(total_tokens)
    return view.blocks_for(min(max(total, int(r.num_tokens[i]) + 1), cap))


def demand_blocks_of(view: SchedulerView, rows: np.ndarray, total_tokens: np.ndarray) -> np.ndarray:
    """`demand_blocks` of many rows at once (a per-step scan over the running requests)."""
    r = view.requests
    total = np.maximum(total_tokens.astype(np.int64), r.num_tokens[rows].astype(np.int64) + 1)
    return view.blocks_for(np.minimum(total, r.max_len[rows]))


@dataclass
class Ledger:
    """One `schedule` call's working copy of the reservations (after the plan so far),
    by row of the view's columns, so that a scan over the running requests reads them as
    one array.

    Local to a call (the policy stays pure); `reserve` (by seq id) is what goes into
    `Plan.reserve`."""

    view: SchedulerView
    promised: np.ndarray  # [rows] int64: blocks promised to each request (held or reserved)
    pool: int = 0  # blocks promised to nobody
    host_free: int = 0
    reserve: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, view: SchedulerView) -> Ledger:
        r = view.requests
        promised = np.maximum(r.reserved_blocks, r.num_blocks).astype(np.int64)
        return cls(view, promised, view.num_blocks - int(promised.sum()), view.num_free_host_blocks)

    def get(self, i: int) -> int:
        return int(self.promised[i])

    def get_many(self, rows: np.ndarray) -> np.ndarray:
        return self.promised[rows]

    def set(self, i: int, blocks: int) -> None:
        self.pool -= blocks - int(self.promised[i])
        self.promised[i] = self.reserve[int(self.view.requests.seq_id[i])] = blocks
        assert self.pool >= 0, "reserved more than the cache holds"

    def release(self, i: int) -> None:
        self.pool += int(self.promised[i])
        self.promised[i] = 0
        self.reserve.pop(int(self.view.requests.seq_id[i]), None)


@dataclass
class Work:
    """A plan under construction."""

    run: dict[int, int] = field(default_factory=dict)
    allocate: dict[int, int] = field(default_factory=dict)
    preempt: dict[int, PreemptMode] = field(default_factory=dict)
    swap_in: set[int] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return sum(self.run.values())

    def plan(self, ledger: Ledger) -> Plan:
        return Plan(run=self.run, allocate=self.allocate, reserve=ledger.reserve,
                    **preemptions(self.preempt, self.swap_in))

    def schedule(self, view: SchedulerView, i: int, blocks_after: int) -> None:
        """Run all of request `i`'s uncomputed tokens, holding `blocks_after` blocks."""
        r = view.requests
        seq = int(r.seq_id[i])
        self.run[seq] = int(r.num_tokens[i] - r.num_computed[i])
        held = int(r.num_blocks[i] + (r.num_host_blocks[i] if seq in self.swap_in else 0))
        if blocks_after > held:
            self.allocate[seq] = blocks_after - held

    def schedule_rows(self, view: SchedulerView, rows: np.ndarray, blocks_after: np.ndarray) -> None:
        """`schedule` of many running rows (their blocks are on the device), in their order
        (the batch order)."""
        r = view.requests
        seqs = r.seq_id[rows].tolist()
        self.run.update(zip(seqs, (r.num_tokens[rows] - r.num_computed[rows]).tolist()))
        grow = blocks_after - r.num_blocks[rows]
        for k in np.flatnonzero(grow > 0).tolist():
            self.allocate[seqs[k]] = int(grow[k])


def evict(view: SchedulerView, ledger: Ledger, i: int, swap: bool) -> PreemptMode:
    """Preempt running request `i`: by swap if `swap` and the host has room, else by
    recompute; its reservation returns to the pool."""
    ledger.release(i)
    mode, ledger.host_free = swap_or_recompute(int(view.requests.num_blocks[i]), swap, ledger.host_free)
    return mode


def decode_running(view: SchedulerView, ledger: Ledger, work: Work, queue: Iterable[int],
                   victim_key: Callable[[int], object], wants_swap: Callable[[int], bool],
                   extend: bool = True) -> None:
    """Every running request in `queue` decodes, inside its reservation where it can.

    A request that exhausted its reservation extends it by the blocks it needs from the
    pool (`extend`), or else is preempted itself (`extend=False`, S3's rule). While the
    extensions together exceed the pool, the survivor with the smallest `victim_key` is
    preempted (possibly one that needs nothing itself): a single survivor always fits, since
    a request never needs more than the cache."""
    r = view.requests
    rows = np.fromiter(queue, np.int64)
    seqs = r.seq_id[rows].tolist()
    need = view.blocks_for(r.num_tokens[rows].astype(np.int64))  # to hold all after this step
    short = np.maximum(need - ledger.get_many(rows), 0)
    alive = np.ones(len(rows), bool)

    def drop(k: int) -> None:
        alive[k] = False
        i = int(rows[k])
        work.preempt[seqs[k]] = evict(view, ledger, i, wants_swap(i))

    if not extend:
        for k in np.flatnonzero(short).tolist():
            drop(k)
    while alive.any() and int(short[alive].sum()) > ledger.pool:
        drop(min(np.flatnonzero(alive).tolist(), key=lambda k: victim_key(int(rows[k]))))
    for k in np.flatnonzero(alive & (short > 0)).tolist():
        ledger.set(int(rows[k]), int(need[k]))
    work.schedule_rows(view, rows[alive], need[alive])


def swap_in_waiting(view: SchedulerView, ledger: Ledger, work: Work, queue: Iterable[int],
                    demand: Callable[[int], int]) -> None:
    """Swapped requests in `queue` order come back (and decode in this step) while a
    sequence slot and the pool allow: reserved their `demand` if the pool has it, else
    just what they need now. The first that does not fit stops the rest (no overtaking)."""
    r, lim = view.requests, view.limits
    holders = int((r.status == RequestStatus.RUNNING).sum()) - len(work.preempt)
    for i in queue:
        need = view.blocks_for(int(r.num_tokens[i]))
        if holders + len(work.swap_in) >= lim.max_num_seqs or need > ledger.pool:
            break
        if work.num_tokens + int(r.num_tokens[i] - r.num_computed[i]) > lim.max_num_batched_tokens:
            break
        want = max(need, demand(i))
        ledger.set(i, want if want <= ledger.pool else need)
        work.swap_in.add(int(r.seq_id[i]))
        work.schedule(view, i, need)


def admit_in_order(view: SchedulerView, ledger: Ledger, work: Work, queue: Iterable[int],
                   demand: Callable[[int], int], keep: int = 0) -> None:
    """Whole-prompt admissions in `queue` order (vLLM's): each is reserved its `demand`
    (at least its prompt) from the pool less `keep` blocks; the first that does not fit the
    token budget, `max_num_seqs` or the pool stops admission."""
    r, lim = view.requests, view.limits
    holders = int((r.status == RequestStatus.RUNNING).sum()) - len(work.preempt) + len(work.swap_in)
    for i in queue:
        need = view.blocks_for(int(r.num_tokens[i]))
        want = max(need, demand(i))
        tokens = int(r.num_tokens[i] - r.num_computed[i])
        if (work.num_tokens + tokens > lim.max_num_batched_tokens
                or holders >= lim.max_num_seqs or want > ledger.pool - keep):
            break
        ledger.set(i, want)
        work.schedule(view, i, need)
        holders += 1


def schedule_prefill_first(view: SchedulerView, demand: Callable[[int], int],
                           victim_key: Callable[[int], object],
                           wants_swap: Callable[[int], bool] = lambda i: False,
                           extend: bool = True) -> Plan:
    """vLLM's step structure with reservations (RLP and S3 are built on vLLM): while
    nothing is swapped out, admit waiting requests FCFS; a step that admits runs no
    decodes. Otherwise every running request decodes (`decode_running`) and, in a step
    that preempts nobody, swapped requests come back oldest first."""
    r = view.requests
    ledger, work = Ledger.of(view), Work()
    if not (r.status == RequestStatus.SWAPPED).any():
        admit_in_order(view, ledger, work, r.with_status(RequestStatus.WAITING), demand)
        if work.run:
            return work.plan(ledger)
    decode_running(view, ledger, work, r.with_status(RequestStatus.RUNNING), victim_key,
                   wants_swap, extend)
    if not work.preempt:
        swap_in_waiting(view, ledger, work, r.with_status(RequestStatus.SWAPPED), demand)
    return work.plan(ledger)


def latest_arrival_first(view: SchedulerView) -> Callable[[int], tuple]:
    """vLLM's victim order: the latest-arrived running request goes first."""
    r = view.requests
    return lambda i: (-float(r.arrival_time[i]), -int(r.seq_id[i]))
