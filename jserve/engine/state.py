"""The one owner of mutable serving state: requests, their columns and the KV blocks.

The engine loop only talks to it through `snapshot` / `apply` / `batch` / `commit`, so
every policy and runner meets the same bookkeeping, and `check_invariants` can be run
after any step.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache.prefix import CacheSnapshot, PrefixHit, PrefixIndex, host_move_key
from jserve.engine.batch import Batch, BatchInputs, BlockMove, StepOutput
from jserve.engine.plan import Plan, PreemptMode
from jserve.engine.request import FinishReason, Request, RequestMetrics, RequestStatus
from jserve.engine.request_table import RequestTable
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.view import SchedulerLimits, SchedulerView
from jserve.errors import InvalidRequestError, PlanError
from models.tokenizer import IncrementalDetokenizer, Tokenizer


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
        prefix_cache: bool = False,
        cache_isolation: bool = False,
        cache_capacity_blocks: int | None = None,
        host_cache_blocks: int = 0,
    ) -> None:
        """`num_host_blocks`: the host tier that swap preemption moves KV to (0: none, and
        plans may only preempt by recompute). `prefix_cache`: keep finished requests' full
        blocks for later prompts that start the same way; `cache_isolation` keys them by
        conversation too; `cache_capacity_blocks` caps how many unreferenced blocks stay
        cached (None: every block no request uses, as vLLM); `host_cache_blocks` adds a host
        tier that evicted blocks are demoted to and promoted back from (0: none)."""
        if cache_capacity_blocks is not None and cache_capacity_blocks < 0:
            raise ValueError(f"cache_capacity_blocks must be >= 0, got {cache_capacity_blocks}")
        self.prefix = PrefixIndex(num_blocks, block_size, isolate=cache_isolation,
                                  host_capacity_blocks=host_cache_blocks) if prefix_cache else None
        self.cache_capacity_blocks = cache_capacity_blocks
        self.blocks = BlockManager(num_blocks, block_size, self.prefix)
        self.host_blocks = BlockManager(num_host_blocks, block_size) if num_host_blocks else None
        self.limits = limits
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
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
        self.table = RequestTable()
        self.requests: dict[int, Request] = {}  # live (unfinished) requests by seq_id
        self._row: dict[int, int] = {}
        self._by_request_id: dict[str, int] = {}
        self._next_seq_id = 0
        self._applied: Plan | None = None
        self._moves: tuple[tuple[BlockMove, ...], tuple[BlockMove, ...]] = ((), ())
        self._host_dropped: list[int] = []  # ended while swapped: the runner drops their copy
        # Arrival times inside the rate window (older ones are dropped as time passes).
        self._arrivals: collections.deque[float] = collections.deque()
        self._first_arrival: float | None = None
        self._step_times: collections.deque[float] = collections.deque(maxlen=16)
        self._applied_at = 0.0
        # Prefix cache: each request's chain keys (computed once, extended as it grows) and
        # the cached blocks its prompt starts with as of the last snapshot (waiting ones).
        self._chains: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        self._hits: dict[int, tuple[int, PrefixHit]] = {}  # seq -> (index version, hit)
        self._offered: dict[int, PrefixHit] = {}  # what the last snapshot showed each one
        # (tokens computed for the first token, TTFT) of recent turns: T-LRU's latency model
        self._ttft_samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=512)

    # ----------------------------------------------------------------------- requests
    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float,
        prompt: str | None = None,
        ttft_slo: float | None = None,
        tbt_slo: float | None = None,
        predicted_len: int = 0,
        predicted_dir: int = 0,
        conversation_id: str | None = None,
    ) -> Request:
        """Admit a request to the waiting set, or raise `InvalidRequestError` saying why.

        `ttft_slo` / `tbt_slo` (seconds) are the client's targets; policies read them from
        the view's columns (nan where none was given). `predicted_len` / `predicted_dir`: an
        output-length predictor's estimate and expected error direction (+1 over, -1 under),
        for policies that allocate by prediction."""
        ids = [int(t) for t in prompt_token_ids]
        self._validate(request_id, ids, params)
        for name, slo in (("ttft_slo", ttft_slo), ("tbt_slo", tbt_slo)):
            if slo is not None and not (math.isfinite(slo) and slo > 0):
                raise InvalidRequestError(f"{name} must be a positive number of seconds, got {slo}")
        cap = min(len(ids) + params.max_tokens, self.limits.max_model_len, self.capacity_tokens)
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        req = Request(
            request_id=request_id, seq_id=seq_id, prompt=prompt, prompt_token_ids=ids,
            params=params, max_len=cap, metrics=RequestMetrics(arrival_time), detokenizer=detok,
            conversation_id=conversation_id,
        )
        self.requests[seq_id] = req
        self._by_request_id[request_id] = seq_id
        self._row[seq_id] = self.table.add(
            seq_id=seq_id, status=RequestStatus.WAITING, arrival_time=arrival_time,
            prompt_len=len(ids), num_tokens=len(ids), max_len=cap, first_token_time=math.nan,
            ttft_slo=math.nan if ttft_slo is None else ttft_slo,
            tbt_slo=math.nan if tbt_slo is None else tbt_slo,
            predicted_len=predicted_len, predicted_dir=predicted_dir, last_token_time=math.nan,
        )
        if self.prefix is not None:
            self.prefix.record_arrival(self._conversation(req), len(ids))
        self._arrivals.append(arrival_time)
        if self._first_arrival is None:
            self._first_arrival = arrival_time
        return req

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def _validate(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params)}")
        if request_id in self._by_request_id:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must lie in [0, {self.vocab_size})")
        limit = self.limits.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context limit is {limit} "
                f"(prompt + at least one output token)"
            )
        if len(ids) >= self.capacity_tokens:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but the whole KV cache holds {self.capacity_tokens}"
            )

    def abort(self, request_id: str, now: float) -> Request | None:
        """End a request early (client gone); frees its blocks. Unknown/finished ids: None."""
        seq_id = self._by_request_id.get(request_id)
        if seq_id is None:
            return None
        req = self.requests[seq_id]
        self._finish(req, FinishReason.ABORT, now)
        return req

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------------- the loop
    ARRIVAL_WINDOW = 30.0  # seconds over which `SchedulerView.arrival_rate` is measured

    def arrival_rate(self, now: float) -> float:
        """Requests per second that arrived in the last `ARRIVAL_WINDOW` seconds (or since
        the first arrival, if that is more recent)."""
        if self._first_arrival is None:
            return 0.0
        window_start = now - self.ARRIVAL_WINDOW
        while self._arrivals and self._arrivals[0] <= window_start:  # out of every later window
            self._arrivals.popleft()
        start = max(window_start, self._first_arrival)
        n = len(self._arrivals) - sum(1 for _ in itertools.takewhile(lambda t: t <= start, self._arrivals))
        return n / max(now - start, 1e-9) if n else 0.0

    def snapshot(self, now: float) -> SchedulerView:
        """With a prefix cache, a waiting request's `num_computed` is the cached prefix it
        would start from, and `num_free_blocks` counts every block no table holds (free or
        evictable) less what sharing saves, so that preempting a request frees, as far as
        any policy can tell, exactly the blocks its table lists."""
        if self.prefix is not None:
            self._match_waiting()
        return SchedulerView(
            now=now, requests=self.table.snapshot(), block_size=self.blocks.block_size,
            num_blocks=self.blocks.num_blocks,
            num_free_blocks=self.blocks.num_blocks - self.blocks.num_table_blocks,
            limits=self.limits,
            num_host_blocks=0 if self.host_blocks is None else self.host_blocks.num_blocks,
            num_free_host_blocks=0 if self.host_blocks is None else self.host_blocks.num_free,
            arrival_rate=self.arrival_rate(now),
            iteration_time=max(self._step_times, default=0.0),
        )

    def apply(self, plan: Plan, now: float) -> None:
        """Carry the plan out, or raise `PlanError` and change nothing: a plan the state
        cannot honour is a policy bug, never trimmed."""
        self._validate_plan(plan)
        cols = self.table.data
        swap_out, swap_in = [], []
        hits = self._admitted_hits(plan)
        for seq_id, mode in plan.preempt.items():
            row = self._row[seq_id]
            held = np.asarray(self.blocks.table(seq_id), np.int32)
            self.blocks.free(seq_id)
            cols.num_blocks[row] = 0
            cols.reserved_blocks[row] = 0
            if mode is PreemptMode.SWAP:
                self.host_blocks.allocate(seq_id, len(held))
                cols.num_host_blocks[row] = len(held)
                cols.status[row] = RequestStatus.SWAPPED
                swap_out.append(BlockMove(seq_id, held))
            else:
                cols.num_computed[row] = 0
                cols.status[row] = RequestStatus.WAITING
            cols.num_preemptions[row] += 1
            metrics = self.requests[seq_id].metrics
            metrics.num_preemptions += 1
            metrics.last_preempted_at = now
        loading = frozenset(k for hit in hits.values() for k in hit.host)
        for block in sorted(plan.evict):
            move_id = self.prefix.demote(block, loading)
            if move_id is not None:
                swap_out.append(BlockMove(host_move_key(move_id), np.array([block], np.int32)))
        self.blocks.evict(sorted(plan.evict))
        for seq_id in sorted(plan.swap_in):
            row = self._row[seq_id]
            n = self.host_blocks.free(seq_id)
            self.blocks.allocate(seq_id, n)
            cols.num_host_blocks[row] = 0
            cols.num_blocks[row] = n
            cols.status[row] = RequestStatus.RUNNING
            swap_in.append(BlockMove(seq_id, np.asarray(self.blocks.table(seq_id), np.int32)))
        for seq_id, n in plan.allocate.items():
            hit = hits.get(seq_id, PrefixHit())
            if hit.device:
                self.blocks.attach(seq_id, list(hit.device))
            self.blocks.allocate(seq_id, n - len(hit.device))
            if hit.num_blocks:
                swap_in.extend(self._promote(seq_id, hit))
                self.requests[seq_id].metrics.num_cached_tokens = hit.num_blocks * self.blocks.block_size
            cols.num_blocks[self._row[seq_id]] += n
        self._moves = (tuple(swap_out), tuple(swap_in))
        for seq_id in hits:
            del self._hits[seq_id]
        for seq_id in plan.run:
            cols.status[self._row[seq_id]] = RequestStatus.RUNNING
            metrics = self.requests[seq_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if metrics.last_preempted_at is not None:
                metrics.preempted_time += now - metrics.last_preempted_at
                metrics.last_preempted_at = None
        for seq_id, n in plan.reserve.items():
            cols.reserved_blocks[self._row[seq_id]] = n
        self._applied = plan
        self._applied_at = now

    def _validate_plan(self, plan: Plan) -> None:
        cols, lim, bs = self.table.data, self.limits, self.blocks.block_size
        to_host = 0
        for seq_id, mode in plan.preempt.items():
            row = self._live_row(seq_id, "preempt")
            if cols.status[row] != RequestStatus.RUNNING:
                raise PlanError(f"seq {seq_id}: only running requests can be preempted")
            if mode is PreemptMode.SWAP:
                if self.host_blocks is None:
                    raise PlanError(f"seq {seq_id}: swap preemption needs a host KV tier "
                                    "(num_host_blocks > 0)")
                to_host += int(cols.num_blocks[row])
        for seq_id in plan.swap_in:
            row = self._live_row(seq_id, "swap in")
            if cols.status[row] != RequestStatus.SWAPPED:
                raise PlanError(f"seq {seq_id}: only swapped requests can be swapped in")
        if to_host and to_host > self.host_blocks.num_free:
            raise PlanError(f"plan swaps out {to_host} blocks, {self.host_blocks.num_free} free "
                            "on the host")
        released = self.blocks.released_by(list(plan.preempt))
        hits = self._admitted_hits(plan)
        self._validate_evictions(plan, released, hits)
        for seq_id, n in plan.allocate.items():
            self._live_row(seq_id, "allocate to")
            if seq_id in hits and n < hits[seq_id].num_blocks:
                raise PlanError(f"seq {seq_id}: allocates {n} blocks, fewer than the "
                                f"{hits[seq_id].num_blocks} cached ones its table starts with")
            if n < 0:
                raise PlanError(f"seq {seq_id}: cannot allocate {n} blocks")
            if seq_id in plan.preempt:
                raise PlanError(f"seq {seq_id}: allocated to and preempted in the same plan")
        wanted = self._fresh_blocks(plan, hits)
        available = self.blocks.num_free + self._uncached(released) + len(plan.evict)
        if wanted > available:
            from_host = self._swapped_in_blocks(plan)
            swapping = f" ({from_host} of them to swap in)" if from_host else ""
            raise PlanError(f"plan allocates {wanted} blocks, {available} free" + swapping)
        if len(plan.run) > lim.max_num_seqs:
            raise PlanError(f"plan runs {len(plan.run)} sequences, max_num_seqs is {lim.max_num_seqs}")
        if plan.num_batched_tokens > lim.max_num_batched_tokens:
            raise PlanError(
                f"plan runs {plan.num_batched_tokens} tokens, max_num_batched_tokens is "
                f"{lim.max_num_batched_tokens}"
            )
        if plan.reserve:
            for seq_id, n in plan.reserve.items():
                self._live_row(seq_id, "reserve for")
                if n < 0 or seq_id in plan.preempt:
                    raise PlanError(f"seq {seq_id}: cannot reserve {n} blocks"
                                    + (" and preempt it" if seq_id in plan.preempt else ""))
            promised = cols.reserved_blocks.copy()
            for seq_id, n in plan.reserve.items():
                promised[self._row[seq_id]] = n
            for seq_id in plan.preempt:
                promised[self._row[seq_id]] = 0
            live = np.fromiter(self._row.values(), np.int64, len(self._row))
            if int(promised[live].sum()) > self.blocks.num_blocks:
                raise PlanError(f"plan reserves {int(promised[live].sum())} blocks in all, the "
                                f"cache has {self.blocks.num_blocks}")
        for seq_id, n in plan.run.items():
            row = self._live_row(seq_id, "run")
            if seq_id in plan.preempt:
                raise PlanError(f"seq {seq_id}: run and preempted in the same plan")
            if cols.status[row] == RequestStatus.SWAPPED and seq_id not in plan.swap_in:
                raise PlanError(f"seq {seq_id}: is swapped out; swap it in before running it")
            end = int(cols.num_computed[row]) + n
            if n < 1 or end > cols.num_tokens[row]:
                raise PlanError(
                    f"seq {seq_id}: cannot run {n} tokens with {cols.num_computed[row]} of "
                    f"{cols.num_tokens[row]} computed"
                )
            held = int(cols.num_blocks[row] + cols.num_host_blocks[row]) + plan.allocate.get(seq_id, 0)
            if held * bs < end:
                raise PlanError(
                    f"seq {seq_id}: holds {held} blocks, needs {self.blocks.blocks_for(end)} "
                    f"for {end} tokens"
                )

    # ----------------------------------------------------------------------- prefix cache
    def _conversation(self, req: Request) -> str:
        return req.conversation_id if req.conversation_id is not None else req.request_id

    def _chain(self, req: Request, num_blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        """The request's first `num_blocks` chain keys, hashed once and extended as needed."""
        known = self._chains.get(req.seq_id)
        if known is None or len(known) < num_blocks:
            salt = self.prefix.salt(req.conversation_id)
            known = self.prefix.chain_keys(req.all_token_ids, salt, num_blocks, known)
            self._chains[req.seq_id] = known
        return known[:num_blocks]

    def _match_waiting(self) -> None:
        """Find each waiting request's cached prefix and show it as its `num_computed`.
        At least the last token is left to compute: its logits give the next token. A
        host-tier block is offered to the earliest waiting request that reaches it only:
        one copy can be loaded once, and the next request finds it on the device."""
        cols, bs, version = self.table.data, self.blocks.block_size, self.prefix.version
        waiting = np.flatnonzero(self.table.live_mask & (cols.status == RequestStatus.WAITING))
        claimed: set[int] = set()
        self._offered = {}
        for row in waiting[np.argsort(cols.arrival_time[waiting], kind="stable")]:
            seq_id = int(cols.seq_id[row])
            memo = self._hits.get(seq_id)
            if memo is None or memo[0] != version:
                req = self.requests[seq_id]
                keys = self._chain(req, (int(cols.num_tokens[row]) - 1) // bs)
                memo = self._hits[seq_id] = (version, self.prefix.match(keys, self.prefix.salt(req.conversation_id)))
            hit = memo[1]
            if hit.host:
                free = list(itertools.takewhile(lambda k: k not in claimed, hit.host))
                claimed.update(free)
                hit = PrefixHit(hit.device, tuple(free))
            self._offered[seq_id] = hit
            cols.num_computed[row] = hit.num_blocks * bs

    def _promote(self, seq_id: int, hit: PrefixHit) -> list[BlockMove]:
        """Load a hit's host-tier blocks into the fresh blocks after its device ones."""
        table = self.blocks.table(seq_id)
        moves = []
        for i, key in enumerate(hit.host, start=len(hit.device)):
            move_id = self.prefix.promote(key, table[i], table[i - 1] if i else -1, i,
                                          self._conversation(self.requests[seq_id]))
            moves.append(BlockMove(host_move_key(move_id), np.array([table[i]], np.int32)))
        return moves

    def _admitted_hits(self, plan: Plan) -> dict[int, PrefixHit]:
        """Cached blocks each waiting request the plan starts takes over."""
        if self.prefix is None:
            return {}
        cols = self.table.data
        hits = {}
        for seq_id in plan.run:
            row = self._row.get(seq_id)
            if row is not None and cols.status[row] == RequestStatus.WAITING and cols.num_computed[row]:
                hits[seq_id] = self._offered[seq_id]
        return hits

    def _fresh_blocks(self, plan: Plan, hits: dict[int, PrefixHit]) -> int:
        """Blocks the plan takes off the free list: its allocations less the cached blocks
        they take over, plus its swap-ins."""
        return (sum(plan.allocate.values()) - sum(len(h.device) for h in hits.values())
                + self._swapped_in_blocks(plan))

    def _swapped_in_blocks(self, plan: Plan) -> int:
        """Host blocks the plan brings back (a seq that is not live counts 0: `apply`
        refuses the plan with the reason)."""
        return sum(int(self.table.data.num_host_blocks[self._row[s]]) for s in plan.swap_in
                   if s in self._row)

    def _uncached(self, blocks: np.ndarray) -> int:
        return len(blocks) if self.prefix is None else int((~self.prefix.cached[blocks]).sum())

    def _validate_evictions(self, plan: Plan, released: np.ndarray, hits: dict[int, PrefixHit]) -> None:
        if not plan.evict:
            return
        if self.prefix is None:
            raise PlanError("plan evicts blocks but the engine has no prefix cache")
        evict = np.fromiter(plan.evict, np.int64, len(plan.evict))
        if evict.min() < 0 or evict.max() >= self.blocks.num_blocks:
            raise PlanError(f"plan evicts block ids outside [0, {self.blocks.num_blocks})")
        unreferenced = self.blocks.ref_counts == 0
        unreferenced[released] = True
        bad = evict[~(self.prefix.cached[evict] & unreferenced[evict])]
        if len(bad):
            raise PlanError(f"plan evicts blocks {sorted(bad.tolist())[:8]} that are not cached "
                            "or that a request still uses")
        pinned = {b for hit in hits.values() for b in hit.device}
        if pinned & plan.evict:
            raise PlanError(f"plan evicts blocks {sorted(pinned & plan.evict)[:8]} that a request "
                            "it starts takes from the cache")

    def eviction_request(self, plan: Plan, now: float) -> tuple[int, CacheSnapshot] | None:
        """How many cached blocks must go for `plan` to fit (and for the cache to stay
        within its capacity), and the snapshot an eviction rule picks them from: every
        block that will be unreferenced once the plan's preemptions are done, less those
        the requests it starts take over. None when nothing needs evicting."""
        if self.prefix is None:
            return None
        released = self.blocks.released_by(list(plan.preempt))
        hits = self._admitted_hits(plan)
        shortfall = self._fresh_blocks(plan, hits) - self.blocks.num_free - self._uncached(released)
        if shortfall <= 0 and self.cache_capacity_blocks is None:
            return None  # the common step: nothing to free, no capacity to keep
        candidates = np.union1d(self.blocks.evictable(), released[self.prefix.cached[released]])
        pinned = [b for hit in hits.values() for b in hit.device]
        if pinned:
            candidates = np.setdiff1d(candidates, pinned)
        n = max(shortfall, 0)
        if self.cache_capacity_blocks is not None:
            n = max(n, len(candidates) - self.cache_capacity_blocks)
        n = min(n, len(candidates))
        if n <= 0:
            return None
        return n, self.prefix.snapshot(candidates, now, self.ttft_model())

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

    def batch(self, with_inputs: bool = True) -> Batch:
        """The applied plan's work, in plan order; `with_inputs` adds the token ids, block
        tables and sampling settings a real runner needs."""
        if self._applied is None:
            raise RuntimeError("batch() before apply()")
        run = self._applied.run
        cols = self.table.data
        seq_ids = np.fromiter(run.keys(), np.int64, len(run))
        query_lens = np.fromiter(run.values(), np.int32, len(run))
        rows = np.array([self._row[s] for s in run], dtype=np.int64)
        start = cols.num_computed[rows].astype(np.int32)
        sample = (start + query_lens) == cols.num_tokens[rows]
        inputs = self._inputs(seq_ids, start, query_lens) if with_inputs else None
        swap_out, swap_in = self._moves
        if self.prefix is not None and self.prefix.dropped_moves:
            self._host_dropped += [host_move_key(m) for m in self.prefix.dropped_moves]
            self.prefix.dropped_moves.clear()
        dropped, self._host_dropped = tuple(self._host_dropped), []
        return Batch(seq_ids=seq_ids, start=start, query_lens=query_lens, sample=sample,
                     inputs=inputs, swap_out=swap_out, swap_in=swap_in, host_dropped=dropped)

    def _inputs(self, seq_ids: np.ndarray, start: np.ndarray, query_lens: np.ndarray) -> BatchInputs:
        reqs = [self.requests[int(s)] for s in seq_ids]
        tokens = [_slice(r, b, q) for r, b, q in zip(reqs, start.tolist(), query_lens.tolist())]
        params = [r.params for r in reqs]
        return BatchInputs(
            token_ids=np.fromiter((t for chunk in tokens for t in chunk), np.int32, int(query_lens.sum())),
            block_tables=tuple(np.asarray(self.blocks.table(int(s)), np.int32) for s in seq_ids),
            temperature=np.array([p.temperature for p in params], np.float32),
            top_p=np.array([p.top_p for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int32),
            seeds=np.array([_seed(r) for r in reqs], np.uint32),
            output_index=np.array([len(r.output_token_ids) for r in reqs], np.int32),
        )

    def commit(self, batch: Batch, out: StepOutput, now: float) -> list[Request]:
        """Record the step's progress and new tokens; finished requests release everything.

        Returns the requests that gained a token (live objects: read, don't keep mutating)."""
        self._applied = None
        self._moves = ((), ())
        if batch.num_seqs:
            self._step_times.append(now - self._applied_at)
        cols = self.table.data
        updated = []
        tokens, logprobs = out.next_tokens.tolist(), out.logprobs.tolist()
        for i, (seq_id, n, sampled) in enumerate(
            zip(batch.seq_ids.tolist(), batch.query_lens.tolist(), batch.sample.tolist())
        ):
            row = self._row[seq_id]
            cols.num_computed[row] += n
            if not sampled:
                continue
            req = self.requests[seq_id]
            self._append_token(req, tokens[i], logprobs[i], now)
            updated.append(req)
            if req.finished:
                continue
            cols.num_tokens[row] += 1
            cols.last_token_time[row] = now
            if np.isnan(cols.first_token_time[row]):
                cols.first_token_time[row] = now
        return updated

    # ----------------------------------------------------------------------- helpers
    def _live_row(self, seq_id: int, verb: str) -> int:
        row = self._row.get(int(seq_id))
        if row is None:
            raise PlanError(f"plan tries to {verb} seq {seq_id}, which is not a live request")
        return row

    def _append_token(self, req: Request, token: int, logprob: float, now: float) -> None:
        req.output_token_ids.append(token)
        req.output_logprobs.append(logprob)
        req.metrics.token_times.append(now)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            if self.prefix is not None:
                computed = len(req.prompt_token_ids) - req.metrics.num_cached_tokens
                self._ttft_samples.append((computed, now - req.metrics.arrival_time))
        params = req.params
        if req.detokenizer is not None:
            req.text += req.detokenizer.push(token)
        if token == self.eos_token_id and not params.ignore_eos:
            self._finish(req, FinishReason.STOP, now)
        elif token in params.stop_token_ids:
            req.stop_reason = token
            self._finish(req, FinishReason.STOP, now)
        elif params.stop and self._hit_stop_string(req):
            self._finish(req, FinishReason.STOP, now)
        elif len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= req.max_len:
            self._finish(req, FinishReason.LENGTH, now)

    def _hit_stop_string(self, req: Request) -> bool:
        for stop in req.params.stop:
            at = req.text.find(stop)
            if at >= 0:
                end = at + len(stop) if req.params.include_stop_str_in_output else at
                req.text = req.text[:end]
                req.stop_reason = stop
                return True
        return False

    def _finish(self, req: Request, reason: FinishReason, now: float) -> None:
        if req.detokenizer is not None and reason is not FinishReason.STOP:
            req.text += req.detokenizer.flush()
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.metrics.finished_time = now
        if self.prefix is not None:
            self._cache_turn(req, now)
        self.blocks.free(req.seq_id)
        if self.host_blocks is not None and self.host_blocks.free(req.seq_id):
            self._host_dropped.append(req.seq_id)
        self.table.remove(self._row.pop(req.seq_id))
        del self.requests[req.seq_id]
        del self._by_request_id[req.request_id]

    def _cache_turn(self, req: Request, now: float) -> None:
        """Keep an ending request's full computed blocks cached, for its next turn."""
        table = self.blocks.table(req.seq_id)
        computed = int(self.table.data.num_computed[self._row[req.seq_id]]) if table else 0
        n = min(computed // self.blocks.block_size, len(table))
        self.prefix.release(table, self._chain(req, n), self.prefix.salt(req.conversation_id),
                            self._conversation(req), req.num_tokens, now)
        self._chains.pop(req.seq_id, None)
        self._hits.pop(req.seq_id, None)

    def check_invariants(self) -> None:
        """Bookkeeping that must hold between steps; property tests call this every step."""
        self.blocks.check_invariants()
        if self.host_blocks is not None:
            self.host_blocks.check_invariants()
            assert self.host_blocks.seq_ids() <= set(self._row), "host blocks of a request that ended"
        cols = self.table.data
        assert len(self.table) == len(self.requests) == len(self._row)
        for seq_id, row in self._row.items():
            assert cols.seq_id[row] == seq_id
            assert cols.num_blocks[row] == self.blocks.num_held(seq_id), f"seq {seq_id} blocks"
            assert 0 <= cols.num_computed[row] <= cols.num_tokens[row] <= cols.max_len[row]
            held = cols.num_blocks[row] + cols.num_host_blocks[row]
            assert cols.status[row] == RequestStatus.WAITING or cols.num_computed[row] <= held * self.blocks.block_size
            req = self.requests[seq_id]
            assert cols.num_tokens[row] == req.num_tokens
            host = 0 if self.host_blocks is None else self.host_blocks.num_held(seq_id)
            assert cols.num_host_blocks[row] == host, f"seq {seq_id} host blocks"
            if cols.status[row] == RequestStatus.WAITING:
                # num_computed: the cached prefix it starts from (0 without a prefix cache)
                assert cols.num_blocks[row] == 0 and host == 0
                assert cols.num_computed[row] % self.blocks.block_size == 0
                assert self.prefix is not None or cols.num_computed[row] == 0
            elif cols.status[row] == RequestStatus.SWAPPED:
                assert cols.num_blocks[row] == 0, f"swapped seq {seq_id} holds device blocks"
                assert cols.num_computed[row] <= host * self.blocks.block_size
            else:
                assert host == 0, f"running seq {seq_id} holds host blocks"
        assert self.blocks.seq_ids() <= set(self._row), "blocks held by a request that ended"
        live = np.fromiter(self._row.values(), np.int64, len(self._row))
        assert (cols.reserved_blocks[live] >= 0).all()
        assert int(cols.reserved_blocks[live].sum()) <= self.blocks.num_blocks, "over-reserved"


def _slice(req: Request, start: int, n: int) -> list[int]:
    prompt = req.prompt_token_ids
    if start + n <= len(prompt):
        return prompt[start : start + n]
    return req.all_token_ids[start : start + n]


def _seed(req: Request) -> int:
    """Per-request RNG seed: the user's, or one derived from the engine's seq id."""
    seed = req.params.seed if req.params.seed is not None else req.seq_id * 2654435761
    return seed & 0xFFFFFFFF
