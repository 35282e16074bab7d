"""Drive any policy on the real EngineState/Engine loop with a fake (JAX-free) runner.

A helper module imported by the policy property tests (not a test file itself).

The fake runner keeps a fake paged KV cache: every computed token is written into the slot
its block table names, tagged with (seq, position), and the next token is a hash of the
sequence's whole context *read back through the block table*. So a wrong block table,
a stale block, a wrong `start` after recompute or a chunk, or wrong token ids in the batch
all change the generated tokens, and the outputs must equal what the request would produce
alone, without preemption.

`Harness` drives a trace (arrivals between steps, aborts), checks `check_invariants()` and
the generic bookkeeping after every step, and at the end that everything finished with
stop/length, with exactly the reference outputs, and that the cache is all free. Policy
specific checks plug in as `plan_checks` (called with the view and the plan of every step)
and `state_checks` (called with the harness after every step).
"""

from __future__ import annotations

import collections
import dataclasses
import types
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import strategies as st

from jserve.builder import assemble_engine
from jserve.cache.prefix import PrefixCacheConfig
from jserve.cache_features.hidden_cache.batch import hidden_mask
from jserve.cache_features.hidden_cache.section import blocks_for_type, cache_types, request_types
from jserve.cache_features.layer_offload.section import device_layers, kept, layer_view, num_free_layer_blocks
from jserve.cache_features.layer_offload.batch import LayerMove, layer_work
from jserve.engine.batch import Batch, StepOutput
from jserve.cache_features.swap_tier.section import swaps
from jserve.engine.plan import Plan
from jserve.engine.policy import Policy
from jserve.engine.request import RUNNING, WAITING, RequestOutput, RequestStatus
from jserve.engine.request_table import RequestArrays
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.view import SchedulerLimits, SchedulerView
from jserve.errors import InvalidRequestError
from jserve.policies.vllm import VLLMPolicy


# --------------------------------------------------------------------------- fakes
def next_token(seq_id: int, context: list[int] | np.ndarray, vocab_size: int) -> int:
    """The fake model: a deterministic function of the sequence and its whole context."""
    data = np.asarray(context, dtype=np.int64).tobytes() + seq_id.to_bytes(8, "little")
    return zlib.crc32(data) % vocab_size


NO_BLOCKS = np.zeros(0, np.int32)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


class FakeRunner:
    """Checks each batch against the limits and writes/reads a fake paged KV cache, one per
    layer: a fully resident sequence writes and reads the same block of every layer, a
    partly offloaded one (LayerKV) its own slot of each layer, on the device for kept layers
    and in a per-layer host pool for the others."""

    def __init__(self, num_blocks: int, block_size: int, limits: SchedulerLimits, vocab_size: int,
                 context_of: Callable[[int], list[int]] | None = None,
                 kept: Callable[[np.ndarray], np.ndarray] | None = None,
                 num_layers: int = 1, num_host_blocks: int = 0, hidden_block_tokens: int = 0) -> None:
        """`context_of(seq)`: the sequence's true tokens, given when a prefix cache lets it
        read blocks another sequence wrote: then the KV it reads must hold its own tokens
        at the right positions, whoever wrote them. `kept(blocks)`: which of a swapped-out
        request's blocks stay valid on the device (shared or cached) rather than free.
        `hidden_block_tokens`: tokens a block of a hidden-cache sequence (`hidden_mask`)
        holds, which a block's slots are laid out by for it."""
        self.context_of = context_of
        self.kept = kept
        self.block_size = block_size
        self.hidden_block_tokens = hidden_block_tokens
        width = max(block_size, hidden_block_tokens)
        self.num_hidden_runs = 0  # hidden-cache sequences run
        self.limits = limits
        self.vocab_size = vocab_size
        # (tok, owner, pos) x layer x block x offset, on the device and in the host pool
        self.kv = np.full((3, num_layers, num_blocks, width), -1, np.int64)
        self.host_kv = np.full((3, num_layers, max(1, num_host_blocks), width), -1, np.int64)
        self.host: dict[int, np.ndarray] = {}  # swapped seq -> its blocks' (tok, owner, pos) x layer
        # Each sequence's block table, kept from the batches' deltas alone (the persistent
        # batch's contract, checked here against what the sequences read and write).
        self.tables: dict[int, np.ndarray] = {}
        self.num_calls = 0
        self.num_swaps = 0  # requests swapped out
        self.num_promotions = 0  # prefix-cache blocks copied back from the host tier
        self.num_layer_moves = 0  # layer copies made (to host, to device, slot to whole)
        self.num_partial_prefills = 0
        self.num_host_decodes = 0  # runs of partly offloaded sequences past their prefill

    needs_inputs = True

    def _move_blocks(self, batch: Batch) -> None:
        """Swaps as the JAX runner does them: outs, then ins, then drops, between the reads
        and the writes of the layer copies (every source is read before anything is written:
        a swap-in may land in a block whose layer slots a copy reads). A swapped-out block's
        slots are poisoned, so a sequence reading them after a swap-in that did not restore
        them fails the owner/position checks."""
        kv = self.kv
        for src, dst in batch.block_copies:  # before anything else (a forked sequence's copy)
            kv[:, :, dst] = kv[:, :, src]
        layer_reads = self._read_layers(batch)
        for move in batch.swap_out:
            assert move.seq_id not in self.host, f"seq {move.seq_id} swapped out twice"
            self.host[move.seq_id] = kv[:, :, move.device_blocks].copy()
        for move in batch.swap_out:  # every out is copied before any freed block is reused
            b = move.device_blocks
            freed = b if self.kept is None else b[~self.kept(b)]
            kv[1:, :, freed] = -2
            self.num_swaps += move.seq_id >= 0
        for move in batch.swap_in:
            held = self.host.pop(move.seq_id)
            self.num_promotions += move.seq_id < 0
            b = move.device_blocks
            assert len(b) == held.shape[2], f"seq {move.seq_id}: swapped {held.shape[2]} blocks in as {len(b)}"
            kv[:, :, b] = held
        for seq in batch.host_dropped:
            assert seq in self.host, f"seq {seq} dropped but never swapped out"
            del self.host[seq]
        for pool, m, data in layer_reads:
            pool[:, m.layer, m.dst] = data
        self.num_layer_moves += len(layer_reads)

    def _read_layers(self, batch: Batch) -> list[tuple[np.ndarray, LayerMove, np.ndarray]]:
        """Every layer copy's source read, then poisoned: (destination pool, move, data)."""
        kv, host = self.kv, self.host_kv
        work = layer_work(batch)
        moves = ([(kv, host, m) for m in work.to_host] + [(kv, kv, m) for m in work.copies]
                 + [(host, kv, m) for m in work.to_device])
        reads = [(dst, m, src[:, m.layer, m.src].copy()) for src, dst, m in moves]
        for src, _, m in moves:
            assert len(m.src) == len(m.dst)
            src[1:, m.layer, m.src] = -2
        return reads

    def _places(self, batch: Batch, i: int) -> list[tuple[np.ndarray, int, np.ndarray]]:
        """(pool, layer, block table) of every layer of batch sequence `i`."""
        tables = layer_work(batch).tables.get(i)
        if tables is None:
            return [(self.kv, layer, self.tables.get(int(batch.seq_ids[i]), NO_BLOCKS))
                    for layer in range(self.kv.shape[1])]
        return [(self.kv, layer, d) if len(d) or not len(h) else (self.host_kv, layer, h)
                for layer, (d, h) in enumerate(zip(tables.device, tables.host))]

    def _apply_delta(self, batch: Batch) -> None:
        delta = batch.inputs.delta
        for seq in delta.ended:
            self.tables.pop(seq, None)
        for seq, (at, blocks) in delta.tables.items():
            old = self.tables.get(seq, NO_BLOCKS)
            assert at <= len(old), f"seq {seq}: a table changed from {at}, past its end {len(old)}"
            self.tables[seq] = np.concatenate([old[:at], blocks])

    def execute(self, batch: Batch) -> StepOutput:
        self.num_calls += 1
        self._apply_delta(batch)
        self._move_blocks(batch)
        s = batch.num_seqs
        if s == 0:
            assert batch.updates_runner, "an empty batch that changes nothing"
            return StepOutput.empty()
        assert 1 <= s <= self.limits.max_num_seqs
        assert batch.num_tokens == int(batch.query_lens.sum()) <= self.limits.max_num_batched_tokens
        assert len(set(batch.seq_ids.tolist())) == s
        tables = [self.tables.get(int(seq), NO_BLOCKS) for seq in batch.seq_ids.tolist()]
        for layer in range(self.kv.shape[1]):
            held = [b for i in range(s) for pool, l, t in self._places(batch, i)
                    if l == layer and pool is self.kv for b in t.tolist()]
            if self.context_of is None:
                assert len(held) == len(set(held)), "two sequences in one batch share a KV block"
        held = [b for t in tables for b in t.tolist()]
        per_block = np.full(s, self.block_size)
        hidden = hidden_mask(batch)
        if hidden is not None:
            assert self.hidden_block_tokens > 0 and len(hidden) == s
            assert not layer_work(batch).tables, "a hidden sequence with layers on the host"
            per_block[hidden] = self.hidden_block_tokens
            self.num_hidden_runs += int(hidden.sum())
        written = [set(t[int(s0) // int(bs):].tolist())
                   for t, s0, bs in zip(tables, batch.start, per_block)]
        shared = [b for b, n in zip(*np.unique(held, return_counts=True)) if n > 1]
        assert not set(shared) & set().union(*written), "a step writes into a shared KV block"
        next_tokens = np.zeros(s, np.int32)
        offset = 0
        for i in range(s):
            seq, start, q = int(batch.seq_ids[i]), int(batch.start[i]), int(batch.query_lens[i])
            end = start + q
            chunk = batch.inputs.token_ids[offset : offset + q]
            offset += q
            places = self._places(batch, i)
            if i in layer_work(batch).tables:  # a prefill, or a run reading host layers
                self.num_partial_prefills += start == 0
                self.num_host_decodes += start > 0
            ps = np.arange(end)
            bs = int(per_block[i])
            for pool, layer, table in places:
                assert q >= 1 and len(table) * bs >= end, "block table too short"
                for j, p in enumerate(range(start, end)):  # write the chunk's "K/V"
                    b, o = int(table[p // bs]), p % bs
                    pool[:, layer, b, o] = chunk[j], seq, p
                blocks, offs = table[ps // bs], ps % bs
                tok, owner, pos = pool[:, layer, blocks, offs]
                if self.context_of is None:
                    assert (owner == seq).all(), f"seq {seq} reads another sequence's KV (layer {layer})"
                else:
                    truth = np.asarray(self.context_of(seq)[:end], np.int64)
                    assert (tok == truth).all(), f"seq {seq} reads KV of other tokens (layer {layer})"
                assert (pos == ps).all(), f"seq {seq} reads KV of the wrong position (layer {layer})"
                if layer == 0:
                    context = tok
                else:
                    assert (tok == context).all(), f"seq {seq}: layers hold different tokens"
            if batch.sample[i]:
                next_tokens[i] = next_token(seq, context, self.vocab_size)
        assert offset == batch.num_tokens
        return StepOutput(next_tokens, np.zeros(s, np.float32))


# --------------------------------------------------------------------------- plan checks
def copy_arrays(r: RequestArrays) -> dict[str, np.ndarray]:
    return {f.name: getattr(r, f.name).copy() for f in dataclasses.fields(r)}


def view_scalars(view: SchedulerView) -> tuple:
    return (view.now, view.block_size, view.num_blocks, view.num_free_blocks, view.limits)


def assert_view_unchanged(view: SchedulerView, before: dict[str, np.ndarray], scalars: tuple) -> None:
    for name, arr in before.items():
        now = getattr(view.requests, name)
        # np.array_equal first: numpy's asserting form built a report for every array at
        # every step, about a quarter of a random-trace test's time.
        if not np.array_equal(now, arr, equal_nan=arr.dtype.kind == "f"):
            np.testing.assert_array_equal(now, arr, err_msg=f"policy mutated {name}")
    assert view_scalars(view) == scalars


def plan_key(plan: Plan) -> tuple:
    """Everything a plan says, order of `run` included (it is the batch order)."""
    moved = swaps(plan)
    return (list(plan.run.items()), dict(plan.allocate), list(plan.preempt), sorted(moved.out),
            sorted(moved.back))


def check_plan(view: SchedulerView, plan: Plan) -> None:
    """What any plan must satisfy, stated against the view (independently of `apply`)."""
    r, lim = view.requests, view.limits
    row = {int(s): i for i, s in enumerate(r.seq_id)}
    running = {int(r.seq_id[i]) for i in r.with_status(RequestStatus.RUNNING)}
    swapped = {int(r.seq_id[i]) for i in r.with_status(RequestStatus.SWAPPED)}
    moved = swaps(plan)
    assert set(plan.run) | set(plan.allocate) | set(plan.preempt) | moved.back <= set(row), \
        "plan names an unknown request"
    assert set(plan.preempt) <= running, "preempted a request that is not running"
    assert moved.out <= set(plan.preempt), "swapped out a request it does not preempt"
    assert moved.back <= swapped, "swapped in a request that is not swapped out"
    assert not set(plan.preempt) & (set(plan.run) | set(plan.allocate)), "preempted and run/allocated"
    assert len(plan.run) <= lim.max_num_seqs
    assert plan.num_batched_tokens <= lim.max_num_batched_tokens
    L = layer_view(view).num_layers
    partial = {int(r.seq_id[i]) for i in r.with_status(RequestStatus.OFFLOADED)}
    layers = kept(plan)
    after = {s: layers.get(s, L - (s in partial)) for s in set(plan.allocate) | set(layers)}
    types, now = cache_types(plan), request_types(view)
    freed = sum(int(r.num_blocks[row[s]]) for s in set(plan.preempt) | {
        s for s, t in types.items() if s in running and t != now[row[s]]} if s not in partial)
    back = sum(int(r.num_host_blocks[row[s]]) for s in moved.back)
    whole = sum(n for s, n in plan.allocate.items() if after[s] == L)
    back_whole = [s for s, x in layers.items() if x == L and s in partial]
    whole += sum(int(r.num_blocks[row[s]]) for s in back_whole)
    # A request getting every layer back may reuse its own split blocks once its slots are
    # released, which the view does not show: the engine's checker counts that exactly.
    assert back_whole or whole + back <= view.num_free_blocks + freed, "allocates more than is free"
    assert set(layers) <= set(row) and all(0 <= x <= L for x in layers.values())
    to_host = sum(int(r.num_blocks[row[s]]) for s in moved.out)
    assert to_host <= view.num_free_host_blocks, "swaps out more than the host holds"
    assert all(n >= 0 for n in plan.allocate.values())
    # Hidden cache (Apt-Serve): a running request whose type changes discards its blocks
    # and recomputes from its first token in this plan.
    kind = {s: int(types.get(s, now[row[s]])) for s in set(plan.run) | set(plan.allocate)}
    switched = {s for s, t in types.items()
                if s in running and s not in plan.preempt and t != now[row[s]]}
    assert switched <= set(plan.run), "a running request switches cache type without running"
    for s, n in plan.run.items():
        i = row[s]
        end = (0 if s in switched else int(r.num_computed[i])) + n
        assert s not in swapped or s in moved.back, f"seq {s}: runs while swapped out"
        assert 1 <= n and end <= r.num_tokens[i], f"seq {s}: runs {n} tokens past its last known token"
        held = (0 if s in switched else int(r.num_blocks[i] + r.num_host_blocks[i])) + plan.allocate.get(s, 0)
        assert held >= blocks_for_type(view, end, kind[s]), f"seq {s}: runs {end} tokens in {held} blocks"
    # A request never holds blocks for tokens it can never have.
    for s, n in plan.allocate.items():
        i = row[s]
        held = 0 if s in switched else int(r.num_blocks[i] + r.num_host_blocks[i])
        assert held + n <= blocks_for_type(view, int(r.max_len[i]), kind[s]), f"seq {s}: over-allocated"


PlanCheck = Callable[[SchedulerView, Plan], None]


class CheckedPolicy:
    """A policy plus checks on every decision: view untouched, `check_plan`, `plan_checks`."""

    def __init__(self, inner: Policy, plan_checks: Sequence[PlanCheck] = ()) -> None:
        self.inner = inner
        self.name = inner.name
        self.chunked_prefill = inner.chunked_prefill
        self.capabilities = inner.capabilities
        self.plan_checks = tuple(plan_checks)
        self.plans: list[Plan] = []
        self.num_partial_chunks = 0  # runs that stop short of a request's last known token

    def schedule(self, view: SchedulerView) -> Plan:
        before = copy_arrays(view.requests)
        scalars = view_scalars(view)
        plan = self.inner.schedule(view)
        assert_view_unchanged(view, before, scalars)
        check_plan(view, plan)
        for check in self.plan_checks:
            check(view, plan)
        self.plans.append(plan)
        if plan.run:
            r = view.requests
            remaining = dict(zip(r.seq_id.tolist(), (r.num_tokens - r.num_computed).tolist()))
            self.num_partial_chunks += sum(n < remaining[s] for s, n in plan.run.items())
        return plan


# --------------------------------------------------------------------------- harness
@dataclasses.dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    arrive_step: int
    # What an output-length predictor said (0: no prediction) and the direction of its
    # expected error (+1 over, -1 under, 0 unknown), and the client's SLOs (None: none).
    predicted_len: int = 0
    predicted_dir: int = 0
    ttft_slo: float | None = None
    tbt_slo: float | None = None

    def request_kwargs(self) -> dict:
        return dict(predicted_len=self.predicted_len, predicted_dir=self.predicted_dir,
                    ttft_slo=self.ttft_slo, tbt_slo=self.tbt_slo)


@dataclasses.dataclass
class Harness:
    num_blocks: int
    block_size: int
    limits: SchedulerLimits
    eos: int | None
    vocab_size: int = 32
    policy: Policy = dataclasses.field(default_factory=VLLMPolicy)
    plan_checks: Sequence[PlanCheck] = ()
    state_checks: Sequence[Callable[[Harness], None]] = ()
    num_host_blocks: int = 0
    prefix_cache: PrefixCacheConfig | None = None
    num_layers: int = 1
    hidden_block_tokens: int = 0  # tokens per block of hidden-cache requests (0: none)

    def __post_init__(self) -> None:
        cache = self.prefix_cache
        self.clock = FakeClock()
        self.runner = FakeRunner(self.num_blocks, self.block_size, self.limits, self.vocab_size,
                                 context_of=self._context if cache else None,
                                 kept=self._kept if cache else None, num_layers=self.num_layers,
                                 num_host_blocks=self.num_host_blocks,
                                 hidden_block_tokens=self.hidden_block_tokens)
        self.policy = CheckedPolicy(self.policy, self.plan_checks)
        self.engine = assemble_engine(
            self.policy, self.runner, self.clock, num_blocks=self.num_blocks,
            block_size=self.block_size, limits=self.limits, vocab_size=self.vocab_size,
            eos_token_id=self.eos, num_host_blocks=self.num_host_blocks, num_layers=self.num_layers,
            hidden_block_tokens=self.hidden_block_tokens,
            prefix_cache=dataclasses.replace(cache, futures={}) if cache else None)
        self.state = self.engine.state
        self.seq_of: dict[str, int] = {}
        self.specs: dict[str, Spec] = {}
        self.final: dict[str, RequestOutput] = {}
        self.streamed: dict[str, list[int]] = {}
        self.aborted: set[str] = set()
        self.num_steps = 0

    def _context(self, seq: int) -> list[int]:
        return self.state.requests[seq].all_token_ids

    def _kept(self, blocks: np.ndarray) -> np.ndarray:
        return (self.state.blocks.ref_counts[blocks] > 0) | self.state.prefix.cached[blocks]

    def _num_unheld(self) -> int:
        """Blocks no request holds: free, or cached and evictable."""
        return self.state.blocks.num_free + self.state.blocks.num_evictable

    # ---- requests
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    def valid(self, spec: Spec) -> bool:
        return len(spec.prompt) < min(self.limits.max_model_len, self.capacity())

    def add(self, rid: str, spec: Spec) -> bool:
        params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
        if not self.valid(spec):
            before = self.fingerprint()
            with pytest.raises(InvalidRequestError):
                self.engine.add_request(rid, spec.prompt, params, **spec.request_kwargs())
            assert self.fingerprint() == before, "a refused request changed the state"
            self.check()
            return False
        self.engine.add_request(rid, spec.prompt, params, **spec.request_kwargs())
        (req,) = [q for q in self.state.requests.values() if q.request_id == rid]
        self.seq_of[rid], self.specs[rid] = req.seq_id, spec
        self.check()
        return True

    def reference(self, rid: str) -> tuple[list[int], str]:
        """What the request produces alone, never preempted."""
        return self.produced(self.specs[rid], self.seq_of[rid])

    def produced(self, spec: Spec, seq: int) -> tuple[list[int], str]:
        """What sequence `seq` of `spec` produces alone (the fake runner's tokens depend on
        the seq id and the context), never preempted."""
        cap = min(len(spec.prompt) + spec.max_tokens, self.limits.max_model_len, self.capacity())
        toks, out = list(spec.prompt), []
        while True:
            t = next_token(seq, toks, self.vocab_size)
            toks.append(t)
            out.append(t)
            if t == self.eos and not spec.ignore_eos:
                return out, "stop"
            if len(out) >= spec.max_tokens or len(toks) >= cap:
                return out, "length"

    def abort(self, rid: str) -> None:
        seq = self.seq_of[rid]
        held = self.state.blocks.num_held(seq)
        unheld_before = self._num_unheld()
        shared = int((self.state.blocks.ref_counts[self.state.blocks.table(seq)] > 1).sum())
        res = self.state.feature("layer_offload").residency
        part = res.partial.get(seq)
        slots_before = int(res.slab.used.sum())
        req = self.engine.abort(rid)
        assert req is not None
        out = RequestOutput.of(req)
        assert out.finished and out.finish_reason == "abort"
        if part is not None:  # its layer slots (LayerKV) freed, whatever blocks that merges
            assert seq not in res.partial
            slots = sum(len(t) for t in part.device.values())
            assert int(res.slab.used.sum()) == slots_before - slots, "abort did not free the layer slots"
        else:
            assert self._num_unheld() == unheld_before + held - shared, "abort did not free the blocks at once"
        assert self.state.blocks.num_held(seq) == 0 and seq not in self.state.blocks.seq_ids()
        assert seq not in self.state.snapshot(self.clock.t).requests.seq_id
        assert self.engine.abort(rid) is None  # a second abort is a no-op
        self.aborted.add(rid)
        self.final[rid] = out
        self.check()

    # ---- checks
    def fingerprint(self) -> tuple:
        st_ = self.state
        snap = copy_arrays(st_.snapshot(0.0).requests)
        return (
            {k: v.tobytes() for k, v in snap.items()}, sorted(st_.requests), list(st_.blocks._free),
            st_.blocks.ref_counts.tolist(), {s: list(st_.blocks.table(s)) for s in st_.blocks.seq_ids()},
        )

    def check(self) -> None:
        """Bookkeeping that holds between steps whatever the policy. (Not here: "at most
        max_num_seqs requests RUNNING", which is vLLM's rule; FastGen admits new prompts
        while a running one waits for blocks, so more may hold KV than run in one batch.)"""
        st_ = self.state
        st_.check_invariants()
        bm = st_.blocks
        # Independent of check_invariants: the same facts, recomputed from the public surface.
        used = [b for s in bm.seq_ids() for b in bm.table(s)]
        free = list(bm._free)
        cached = set(np.flatnonzero(st_.prefix.cached).tolist()) if st_.prefix is not None else set()
        evictable = cached - set(used)
        size = self.prefix_cache.in_blocks(self.block_size) if self.prefix_cache else None
        if size is not None and size.capacity_blocks is not None and not size.count_referenced:
            # trimmed at the end of every step and abort that released a history
            assert len(evictable) <= size.capacity_blocks, "the prefix cache is over its capacity"
        if st_.prefix is None:
            assert len(used) == len(set(used)), "a block is held twice"
        else:  # only cached blocks are shared, and never evicted while a request holds them
            counts = collections.Counter(used)
            assert {b for b, n in counts.items() if n > 1} <= cached, "an uncached block is shared"
            assert (bm.ref_counts[list(counts)] == list(counts.values())).all()
        assert not set(used) & set(free), "a block is both free and used"
        assert not cached & set(free), "a block is both free and cached"
        split = set(np.flatnonzero(bm.lent).tolist())  # split into layer slots (LayerKV)
        assert len(set(used)) + len(free) + len(evictable) + len(split) == bm.num_blocks, \
            "used + free + cached + split != total"
        view = st_.snapshot(self.clock.t)
        r = view.requests
        assert view.num_free_blocks == bm.num_blocks - len(used) - len(split)
        assert set(r.seq_id.tolist()) == set(st_.requests)
        assert {s for s in bm.seq_ids() if bm.num_held(s)} <= set(st_.requests), "blocks held by an ended request"
        assert np.isin(r.status, [RequestStatus.WAITING, RequestStatus.RUNNING,
                                  RequestStatus.SWAPPED, RequestStatus.OFFLOADED]).all()
        partial = st_.feature("layer_offload").residency.partial
        assert set(partial) == {int(r.seq_id[i]) for i in r.with_status(RequestStatus.OFFLOADED)}
        slots = sum(len(t) for part in partial.values() for t in part.device.values())
        assert slots == int(st_.feature("layer_offload").residency.slab.used.sum()), "device layer slots held != used"
        assert num_free_layer_blocks(view) + slots + self.num_layers * len(used) == self.num_layers * bm.num_blocks
        swapped = {int(r.seq_id[i]) for i in r.with_status(RequestStatus.SWAPPED)}
        # The runner hears of a request that ended while swapped at the next step.
        ended = {self.seq_of[rid] for rid in self.final}
        requests_on_host = {k for k in self.runner.host if k >= 0}  # < 0: prefix-cache copies
        assert swapped <= requests_on_host <= swapped | ended, "host copies != swapped set"
        if st_.prefix is not None:  # the next step's batch drops replaced prefix copies and
            # makes those of the blocks the last trim demoted
            pending = len(st_._trim_moves)
            assert st_.prefix.num_host_entries - pending <= len(self.runner.host) - len(requests_on_host)
        # Per request, read as Python ints once per column (numpy scalars made this loop slow).
        c = types.SimpleNamespace(device_layers=device_layers(view).tolist(), **{
            name: getattr(r, name).tolist()
            for name in ("seq_id", "num_blocks", "max_len", "status", "num_computed", "num_tokens")})
        fillable = blocks_for_type(view, r.max_len, request_types(view)).tolist()  # blocks a request can fill
        for i, seq in enumerate(c.seq_id):
            if seq in partial:
                assert bm.num_held(seq) == 0 and c.device_layers[i] < self.num_layers
                assert c.num_blocks[i] <= bm.blocks_for(c.max_len[i]), "holds blocks it can never fill"
                continue
            assert c.num_blocks[i] == bm.num_held(seq) == len(bm.table(seq))
            assert c.num_blocks[i] == 0 or c.status[i] == RUNNING
            assert c.num_blocks[i] <= fillable[i], "holds blocks it can never fill"
            if c.status[i] == WAITING:
                # its cached prefix (none without a prefix cache), at least one token short
                assert c.num_computed[i] == 0 or (st_.prefix is not None and c.num_computed[i] < c.num_tokens[i])
        for rid in self.aborted:
            assert self.seq_of[rid] not in st_.requests
        for check in self.state_checks:
            check(self)

    def step(self) -> None:
        outs = [RequestOutput.of(req) for req in self.engine.step()]
        self.num_steps += 1
        self.check()
        for out in outs:
            rid = out.request_id
            assert rid not in self.final, f"{rid} produced output after it finished or was aborted"
            prev = self.streamed.get(rid, [])
            assert out.token_ids[: len(prev)] == prev and len(out.token_ids) >= len(prev)
            self.streamed[rid] = list(out.token_ids)
            if out.finished:
                self.final[rid] = out

    def check_done(self) -> None:
        assert not self.engine.has_unfinished
        assert len(self.state.requests) == 0 and len(self.state.table) == 0
        assert self._num_unheld() == self.num_blocks and not self.state.blocks.seq_ids()
        assert (self.state.blocks.ref_counts == 0).all()
        host = self.state.host_blocks
        assert host is None or (host.num_free == self.num_host_blocks and not host.seq_ids())
        assert set(self.final) == set(self.specs)
        for rid, spec in self.specs.items():
            out = self.final[rid]
            ref, reason = self.reference(rid)
            assert len(out.token_ids) <= spec.max_tokens
            assert len(spec.prompt) + len(out.token_ids) <= self.limits.max_model_len
            assert len(out.logprobs) == len(out.token_ids)
            if rid in self.aborted:
                assert out.finish_reason == "abort"
                assert out.token_ids == ref[: len(out.token_ids)]
                continue
            assert out.finish_reason in ("stop", "length")
            assert (out.token_ids, out.finish_reason) == (ref, reason), (
                f"{rid}: outputs differ from the unpreempted run "
                f"({out.metrics.num_preemptions} preemptions)"
            )
            if reason == "stop":
                assert out.token_ids[-1] == self.eos and not spec.ignore_eos
            m = out.metrics
            assert len(m.token_times) == len(out.token_ids)
            assert all(a <= b for a, b in zip(m.token_times, m.token_times[1:]))
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time

    def step_budget(self, specs: Sequence[Spec]) -> int:
        """A bound on the steps any sane policy needs: under FCFS the oldest request always
        progresses, and alone it needs at most one step per output token, plus one per
        prompt token where prompts are chunked, again after each recompute."""
        prompt_steps = sum(len(s.prompt) for s in specs) if self.policy.chunked_prefill else 0
        work = sum(s.max_tokens for s in specs) + prompt_steps
        return 50 + 4 * work + max((s.arrive_step for s in specs), default=0)

    def run(self, specs: list[Spec], aborts: dict[int, list[int]] | None = None) -> None:
        """Add requests at their arrival steps, abort some, step until everything ends."""
        aborts = aborts or {}
        pending = sorted(enumerate(specs), key=lambda p: p[1].arrive_step)
        budget = self.step_budget(specs)
        k = 0
        while pending or self.engine.has_unfinished:
            while pending and pending[0][1].arrive_step <= k:
                i, spec = pending.pop(0)
                self.add(f"r{i}", spec)
            for pick in aborts.get(k, []):
                live = sorted(q.request_id for q in self.state.requests.values())
                if live:
                    self.abort(live[pick % len(live)])
            self.step()
            k += 1
            assert k <= budget, (
                f"livelock: policy {self.policy.name!r} ran {k} steps, "
                f"{len(self.state.requests)} requests still live"
            )
        self.check_done()


# --------------------------------------------------------------------------- strategies
@st.composite
def configs(
    draw: st.DrawFn,
    chunked: bool = False,
    block_sizes: st.SearchStrategy[int] = st.sampled_from([1, 2, 4, 16]),
    hidden: bool = False,
) -> dict:
    """Engine settings: mostly a tight cache, limits valid for a policy that does (`chunked`)
    or does not chunk prefills; with `hidden`, a hidden-cache block size too."""
    block_size = draw(block_sizes)
    max_model_len = draw(st.integers(2, 48))
    # Mostly a tight cache (one to 1.5 requests' worth of slots, so preemption is common),
    # sometimes roomy.
    roomy = draw(st.integers(0, 4)) == 0
    tight = max(2, -(-3 * max_model_len // (2 * block_size)))
    num_blocks = draw(st.integers(2, 160 if roomy else min(64, tight)))  # >= 100: a watermark
    max_num_seqs = draw(st.integers(1, 8))
    if chunked:
        # Any budget that lets every running sequence decode in one step, often below
        # max_model_len, so prompts and recomputes take several steps.
        max_num_batched_tokens = draw(st.integers(max_num_seqs, 2 * max(max_model_len, max_num_seqs)))
    else:
        # vLLM requires max_num_batched_tokens >= max(max_model_len, max_num_seqs) without chunking.
        low = max(max_model_len, max_num_seqs)
        max_num_batched_tokens = draw(st.integers(low, 2 * low))
    vocab_size = draw(st.integers(4, 48))
    eos = draw(st.one_of(st.none(), st.integers(0, vocab_size - 1)))
    # A host tier for swap preemption: none, or one that is sometimes too small for a victim.
    num_host_blocks = draw(st.sampled_from([0, max(1, num_blocks // 2), 2 * num_blocks]))
    # Tokens a hidden-cache block holds (Apt-Serve): none, an MHA model's 2 * block_size,
    # or fewer than block_size (GQA, where the hidden cache costs memory).
    extra = {"hidden_block_tokens": draw(st.sampled_from([0, 2 * block_size, max(1, 2 * block_size // 3)]))
             } if hidden else {}
    return dict(
        num_blocks=num_blocks, block_size=block_size, eos=eos, vocab_size=vocab_size,
        limits=SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_model_len),
        num_host_blocks=num_host_blocks, **extra,
    )


@st.composite
def specs_for(draw: st.DrawFn, cfg: dict, max_requests: int = 12) -> list[Spec]:
    lim: SchedulerLimits = cfg["limits"]
    n = draw(st.integers(1, max_requests))
    out = []
    for _ in range(n):
        # Mostly valid prompts, sometimes one too long for the context or the whole cache.
        limit = min(lim.max_model_len, cfg["num_blocks"] * cfg["block_size"])  # prompt must be shorter
        if draw(st.integers(0, 9)) == 0:
            plen = draw(st.integers(limit, lim.max_model_len + 8))
        else:
            plen = draw(st.integers(1, max(1, limit - 1)))
        prompt = draw(st.lists(st.integers(0, cfg["vocab_size"] - 1), min_size=plen, max_size=plen))
        max_tokens = draw(st.integers(1, 40))
        out.append(Spec(
            prompt=prompt, max_tokens=max_tokens, ignore_eos=draw(st.booleans()),
            arrive_step=draw(st.integers(0, 6)), **draw(predictions(max_tokens)),
        ))
    return out


@st.composite
def predictions(draw: st.DrawFn, max_tokens: int) -> dict:
    """A predicted output length (none, under or over the request's `max_tokens`) with a
    direction that is right, wrong or unknown, and TTFT/TBT SLOs (often none) in seconds of
    the harness's fake clock (one second per clock reading, a few per step)."""
    kind = draw(st.sampled_from(["none", "under", "over", "exact"]))
    if kind == "none":
        pred = 0
    elif kind == "exact":
        pred = max_tokens
    elif kind == "under":
        pred = draw(st.integers(1, max_tokens))
    else:
        pred = max_tokens + draw(st.integers(0, 60))
    return dict(predicted_len=pred, predicted_dir=draw(st.sampled_from([-1, 0, 1])) if pred else 0,
                ttft_slo=draw(_SLO), tbt_slo=draw(_SLO))


_SLO = st.one_of(st.none(), st.floats(1.0, 30.0))  # seconds of the fake clock, often none


def aborts_strategy() -> st.SearchStrategy[dict[int, list[int]]]:
    """Step -> picks among the live requests (by index, modulo how many are live)."""
    return st.dictionaries(st.integers(0, 30), st.lists(st.integers(0, 100), max_size=2), max_size=4)


def spec(plen: int, max_tokens: int, arrive: int = 0, first: int = 1) -> Spec:
    """A hand-written request: a patterned prompt, eos ignored."""
    prompt = [(first + j) % 7 for j in range(plen)]
    return Spec(prompt=prompt, max_tokens=max_tokens, ignore_eos=True, arrive_step=arrive)
