"""The one owner of mutable serving state: requests, their columns and the KV blocks.

The engine loop only talks to it through `snapshot` / `apply` / `batch` / `commit`, so
every policy and runner meets the same bookkeeping, and `check_invariants` can be run
after any step. The work is done by parts with one job each, which this class wires
together and calls in the loop's order:

    admission.Admission        validate a new request and enter it as waiting
    live_requests.LiveRequests the live requests by seq id, request id and table row
    load_meter.LoadMeter       arrival rate and step times, for the view
    prefix_reuse.PrefixReuse   the engine's side of the prefix cache (when there is one)
    plan_check.PlanChecker     refuse a plan the state cannot honour, before any change
    plan_apply.PlanApplier     preempt, evict, swap in, allocate, book runs and reservations
    batch_builder.BatchBuilder the runner's work list for the applied plan
    token_commit.TokenCommit   record new tokens and end the requests they finish
    fork.Forks                 fork a request of several sequences at its first token
    release.Finisher           end a request and give back everything it holds
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Unpack

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache.prefix import CacheSnapshot, PrefixCacheSize, PrefixIndex
from jserve.cache_features.protocol import CacheFeature, StateParts
from jserve.cache_features.registry import build_features
from jserve.engine.admission import Admission, PredictionSource, RequestOptions
from jserve.engine.batch import Batch, BlockMove, RepeatedSteps, StepOutput
from jserve.engine.batch_builder import BatchBuilder
from jserve.engine.batch_delta import DeltaTracker
from jserve.engine.fork import Forks
from jserve.engine.invariants import check_invariants
from jserve.engine.live_requests import LiveRequests
from jserve.engine.load_meter import LoadMeter
from jserve.engine.plan import Plan
from jserve.engine.plan_apply import NO_MOVES, Moves, PlanApplier
from jserve.engine.plan_check import CheckedPlan, PlanChecker
from jserve.engine.prefix_reuse import PrefixReuse
from jserve.engine.release import Finisher
from jserve.engine.request import FinishReason, Request
from jserve.engine.request_table import RequestTable
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.token_commit import Booked, TokenCommit
from jserve.engine.view import SchedulerLimits, SchedulerView
from jserve.errors import PlanError
from jserve.models.tokenizer import Tokenizer


class EngineState:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        limits: SchedulerLimits,
        eos_token_id: int | None,
        vocab_size: int,
        tokenizer: Tokenizer | None = None,
        chunked_prefill: bool = False,
        num_host_blocks: int = 0,
        prefix_cache: PrefixCacheSize | None = None,
        predictions: PredictionSource | None = None,
        share_forks: bool = True,
        **feature_options: object,
    ) -> None:
        """`num_host_blocks`: the host tier that swap preemption and layer offload move KV
        to (0: none, and plans may only preempt by recompute). `prefix_cache`: the prefix cache to keep
        (None: none; its trim is `capacity_request` / `trim`). `predictions`: where
        admitted requests' output-length predictions come from (None: only from the
        caller). `share_forks`: whether the sequences of a request of several (`n`) share
        its prompt's blocks (`jserve.engine.fork`; off for a policy that splits blocks into
        layer slots, which cannot split shared ones). `feature_options`: the cache features' options
        (`jserve.cache_features.registry`; each feature reads its own: the model's
        `num_layers`, `hidden_block_tokens`, ...)."""
        if limits.max_num_batched_tokens < limits.max_num_seqs:
            # Every running sequence must be able to decode in the same step (vLLM's rule).
            raise ValueError(
                f"max_num_batched_tokens={limits.max_num_batched_tokens} < max_num_seqs="
                f"{limits.max_num_seqs}"
            )
        if not chunked_prefill and limits.max_num_batched_tokens < limits.max_model_len:
            # Without chunking, a request recomputed after preemption re-prefills up to
            # max_model_len tokens in one step.
            raise ValueError(
                f"max_num_batched_tokens={limits.max_num_batched_tokens} < max_model_len="
                f"{limits.max_model_len} needs a policy that chunks prefills"
            )
        self.limits = limits
        cache = prefix_cache  # its size, in blocks
        self.prefix = (PrefixIndex(num_blocks, block_size, isolate=cache.isolation,
                                   host_capacity_blocks=cache.host_blocks) if cache is not None else None)
        self.blocks = BlockManager(num_blocks, block_size, self.prefix)
        self.host_blocks = BlockManager(num_host_blocks, block_size) if num_host_blocks else None
        self.live = LiveRequests()
        self.load = LoadMeter()
        self._reuse = (PrefixReuse(self.prefix, self.live, self.blocks, cache.capacity_blocks,
                                   count_referenced=cache.count_referenced, min_history=cache.min_history)
                       if cache is not None else None)
        self._admission = Admission(self.live, limits, vocab_size, num_blocks * block_size, tokenizer,
                                    eos_token_id, self.load, self._reuse, predictions)
        self.features = build_features(StateParts(self.live, self.blocks, self.host_blocks, self._reuse),
                                       **feature_options)
        self._checker = PlanChecker(self.live, self.blocks, limits, self._reuse, self.features)
        self._applier = PlanApplier(self.live, self.blocks, self._reuse, self.features)
        self._batches = BatchBuilder(self.live, self.features, DeltaTracker(self.live, self.blocks))
        self._finisher = Finisher(self.live, self.blocks, self.host_blocks, self._reuse, self.features)
        self._forks = Forks(self.live, self.blocks, eos_token_id, self._admission.detokenizer,
                            limits.max_num_seqs, self.features, share_forks)
        self._commit = TokenCommit(self.live, self._finisher, eos_token_id, self._reuse, self._forks)
        self._applied: CheckedPlan | None = None
        # The last applied plan that repeats (`Plan.repeat`), how many more steps it promised,
        # and the live requests' membership it was planned for.
        self._repeating: tuple[CheckedPlan, int, tuple[int, int]] | None = None
        self._moves: Moves = NO_MOVES
        self._trim_moves: list[BlockMove] = []  # host-tier copies of blocks `trim` evicted
        self._applied_at = 0.0
        self._booked_at = 0.0

    def feature(self, name: str) -> CacheFeature:
        """The engine's cache feature of that name (`jserve.cache_features.registry`)."""
        return next(f for f in self.features if f.name == name)

    @property
    def requests(self) -> dict[int, Request]:
        """Live (unfinished) requests by seq id."""
        return self.live.requests

    @property
    def table(self) -> RequestTable:
        return self.live.table

    # ----------------------------------------------------------------------- requests
    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
            arrival_time: float, **options: Unpack[RequestOptions]) -> Request:
        """Admit a request to the waiting set, or raise `InvalidRequestError` saying why.
        A request of several sequences (`params.n`, `best_of`) is admitted as one and forks
        the others at its first token; they carry its id as `parent_request_id`."""
        if isinstance(params, SamplingParams):
            self._admission.check_sequences(params)
            self._forks.check_ids(request_id, params)
        req = self._admission.admit(request_id, prompt_token_ids, params, arrival_time, **options)
        self._forks.expect(req)
        return req

    @property
    def predictions(self) -> PredictionSource | None:
        return self._admission.predictions

    @predictions.setter
    def predictions(self, source: PredictionSource | None) -> None:
        """Change where predictions come from (a trace replay brings its own)."""
        self._admission.predictions = source

    def abort(self, request_id: str, now: float) -> Request | None:
        """End a request early (client gone), with every sequence forked from it; frees
        their blocks. Returns the request (or, once it has ended, a sequence forked from
        it); None when none of them is live."""
        req = self.live.by_request_id(request_id)
        forked = [r for r in self.live.requests.values() if r.parent_request_id == request_id]
        for r in ([] if req is None else [req]) + forked:
            self._forks.forget(r)
            self._finisher.finish(r, FinishReason.ABORT, now)
        return req if req is not None or not forked else forked[0]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.live.requests)

    # ----------------------------------------------------------------------- the loop
    def snapshot(self, now: float) -> SchedulerView:
        """With a prefix cache, a waiting request's `num_computed` is the cached prefix it
        would start from, and `num_free_blocks` counts every block no table holds (free or
        evictable) less what sharing saves, so that preempting a request frees, as far as
        any policy can tell, exactly the blocks its table lists. Blocks a cache feature
        has split are not free blocks (`num_lent`); each feature gives its own section.
        Requests admitted since the last snapshot get their predictions first."""
        self._admission.predict_arrivals()
        if self._reuse is not None:
            self._reuse.offer()
        host = self.host_blocks
        rows = np.flatnonzero(self.live.table.live_mask)  # the view lists requests in row order
        sections = {f.name: f.view_section(rows) for f in self.features}
        return SchedulerView(
            now=now, requests=self.live.cols.take(rows), block_size=self.blocks.block_size,
            num_blocks=self.blocks.num_blocks,
            num_free_blocks=self.blocks.num_blocks - self.blocks.num_table_blocks - self.blocks.num_lent,
            limits=self.limits,
            num_host_blocks=0 if host is None else host.num_blocks,
            num_free_host_blocks=0 if host is None else host.num_free,
            arrival_rate=self.load.arrival_rate(now),
            iteration_time=self.load.iteration_time,
            features={name: v for name, v in sections.items() if v is not None},
        )

    def capacity_request(self, now: float) -> tuple[int, CacheSnapshot] | None:
        """How many idle cached blocks must go for the prefix cache to be within its
        capacity, and the snapshot an eviction rule picks them from; asked once a step or
        an abort has released histories. None when nothing needs evicting
        (always, without a prefix cache or a capacity)."""
        return None if self._reuse is None else self._reuse.capacity_request(now)

    def trim(self, evict: Sequence[int]) -> None:
        """Evict these idle cached blocks now, outside any plan (the capacity trim); their
        host-tier copies, if any, are made by the next step's batch, before its
        allocations can reuse the blocks. `PlanError` if one is not an idle cached block."""
        if self._reuse is None:
            raise PlanError("trim() without a prefix cache")
        self._trim_moves += self._reuse.evict(sorted(int(b) for b in evict), {})

    def apply(self, plan: Plan, now: float) -> None:
        """Carry the plan out, or raise `PlanError` and change nothing: a plan the state
        cannot honour is a policy bug, never trimmed."""
        checked = self._checker.check(plan)
        self._moves = self._applier.apply(checked, now)
        if self._trim_moves:
            self._moves = dataclasses.replace(
                self._moves, swap_out=(*self._trim_moves, *self._moves.swap_out))
            self._trim_moves = []
        self._applied = checked
        self._applied_at = now
        # With a prefix cache the eviction rule chooses step by step: the policy plans each.
        repeats = plan.repeat > 1 and self._reuse is None
        self._repeating = (checked, plan.repeat - 1, self.live.membership) if repeats else None

    def apply_repeat(self, now: float) -> Plan | None:
        """Apply the next step of the last plan that repeats, as it promised (`Plan.repeat`)
        and without asking the policy: the same one-token decodes, each request taking a block
        where it fills one. None, with nothing changed, where the promise no longer holds (a
        request arrived, ended or was aborted since, or the free blocks fall short) or the
        state does not repeat (a prefix cache, forks, or a last step that moved blocks or
        in which a cache feature has a part). The policy's call, the snapshot and the
        plan's check are the host's work per decode step this saves (bench/host_step.py)."""
        if self._repeating is None:
            return None
        checked, left, membership = self._repeating
        self._repeating = None
        if membership != self.live.membership or self._forks.forked:
            return None
        rows = checked.run_rows  # nobody added or removed: the rows stand
        counts = self._applier.decode_growth(rows, 1)[0]
        if int(counts.sum()) > self.blocks.num_free:
            return None
        grows = np.flatnonzero(counts)
        seq_ids = np.fromiter(checked.plan.run, np.int64, len(rows))
        plan = dataclasses.replace(
            checked.plan, allocate=dict(zip(seq_ids[grows].tolist(), counts[grows].tolist())), repeat=left)
        again = dataclasses.replace(checked, plan=plan, allocate_rows=rows[grows], allocate_counts=counts[grows])
        self._moves = self._applier.apply(again, now)
        self._applied, self._applied_at = again, now
        self._repeating = (again, left - 1, membership) if left > 1 else None
        return plan

    def eviction_request(self, plan: Plan, now: float) -> tuple[int, CacheSnapshot] | None:
        """How many cached blocks must go for `plan` to fit (and for the cache to stay
        within its capacity), and the snapshot an eviction rule picks them from. None
        when nothing needs evicting (always, without a prefix cache)."""
        if self._reuse is None:
            return None
        released = self.blocks.released_by(list(plan.preempt))
        hits = self._reuse.admitted_hits(plan)
        return self._reuse.eviction_request(self._checker.shortfall(plan, released, hits),
                                            released, hits, now)

    def batch(self, with_inputs: bool = True) -> Batch:
        """The applied plan's work, in plan order; `with_inputs` adds the token ids, block
        tables and sampling settings a real runner needs."""
        if self._applied is None:
            raise RuntimeError("batch() before apply()")
        dropped = self._finisher.take_host_dropped()
        if self._reuse is not None:
            dropped += self._reuse.take_dropped_moves()
        batch = self._batches.build(self._applied, self._moves, tuple(dropped), with_inputs)
        if self._repeating is not None and not _repeatable(batch):
            self._repeating = None
        copies = self._forks.take_copies()
        return dataclasses.replace(batch, block_copies=copies) if copies else batch

    def commit(self, batch: Batch, out: StepOutput, now: float) -> list[Request]:
        """Record the step's progress and new tokens; finished requests release everything.

        Returns the requests that gained a token (live objects: read, don't keep mutating)."""
        applied, self._applied = self._applied, None
        self._moves = NO_MOVES
        if not batch.num_seqs:
            return []
        if applied is None or len(applied.run_rows) != batch.num_seqs:
            raise RuntimeError("commit() of a batch that is not the applied plan's")
        self.load.record_step(now - self._applied_at)
        return self._commit.commit(batch, applied.run_rows, out, now)

    def book(self, batch: Batch, now: float) -> Booked:
        """`commit`'s first half for a step whose tokens are read later (the pipelined
        loop, `Engine`): progress and lengths now, tokens and stops at `read`."""
        applied, self._applied = self._applied, None
        self._moves = NO_MOVES
        if applied is None or len(applied.run_rows) != batch.num_seqs:
            raise RuntimeError("book() of a batch that is not the applied plan's")
        self._booked_at = self._applied_at
        return self._commit.book(batch, now)

    def read(self, booked: Booked, out: StepOutput, now: float) -> list[Request]:
        """`commit`'s second half: a booked step's tokens; the requests that gained one."""
        self.load.record_step(now - self._booked_at)
        return self._commit.read(booked, out, now)

    def repeat_room(self, batch: Batch, wanted: int) -> int:
        """How many of `wanted` more steps of the just-committed `batch`'s decodes
        (`Plan.repeat`) the state lets run at once: up to the step at which the first of
        them reaches its length. None when a request ended or reads its tokens (EOS, stop
        strings, streamed text), when the step moved blocks, forked a request or a cache
        feature has a part in it, or with a prefix cache (whose evictions a rule chooses step by
        step). `PlanError` if the free blocks do not cover the growth the policy promised."""
        if wanted < 1 or self._reuse is not None or self._forks.forked or not _repeatable(batch):
            return 0
        seq_ids = batch.seq_ids.tolist()
        rows = self.live.rows(seq_ids)
        if (rows < 0).any() or self.live.token_checked_mask(seq_ids).any():
            return 0
        cols = self.live.cols
        steps = min(wanted, int((cols.max_len[rows] - cols.num_tokens[rows]).min()))
        need = int(self._applier.decode_growth(rows, steps)[0].sum())
        if need > self.blocks.num_free:
            raise PlanError(f"policy promised {wanted + 1} decode steps; {steps + 1} need {need} "
                            f"more blocks, {self.blocks.num_free} free")
        return steps

    def commit_repeated(self, batch: Batch, steps: RepeatedSteps, started: float) -> list[Request]:
        """Book repeated decode steps of `batch` (at most `repeat_room`'s), the first of
        which started at `started`: blocks, tokens, step times and the requests they end."""
        seq_ids = batch.seq_ids.tolist()
        rows = self.live.rows(seq_ids)
        self._repeating = None  # its steps ran here
        self._applier.grow_decodes(seq_ids, rows, steps.num_steps)
        for t in steps.end_times:
            self.load.record_step(t - started)
            started = t
        return self._commit.commit_repeated(rows, seq_ids, steps)

    def check_invariants(self) -> None:
        """Bookkeeping that must hold between steps; property tests call this every step."""
        check_invariants(self.live, self.blocks, self.host_blocks, self.prefix, self.features, self._forks)


def _repeatable(batch: Batch) -> bool:
    """Whether `batch`'s decodes may repeat (`Plan.repeat`): it moves no block and no cache
    feature has a part in it (a partly offloaded run reads host layers every step, a hidden
    run recomputes its K/V)."""
    return not batch.moves_blocks and not batch.features
