"""Requests of several sequences (`SamplingParams.n` / `best_of`) in the engine: the prompt
prefilled once, its blocks shared by reference count, the block its last token lies in
copied for each forked sequence; every sequence generates what it would alone; the
bookkeeping holds after every step of random traces with such requests, preemptions,
swaps and aborts mixed in, for every registered policy."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from policy_harness import Harness, Spec, aborts_strategy, configs, specs_for
from property_examples import examples

from jserve.builder import build_engine
from jserve.cache.prefix import PrefixCacheConfig
from jserve.config import EngineConfig
from jserve.engine.batch import Batch
from jserve.engine.fork import child_params, child_request_id
from jserve.engine.request import FinishReason, Request, RequestOutput
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.view import SchedulerLimits
from jserve.errors import InvalidRequestError
from jserve.models.registry import get_config
from jserve.policies import POLICIES
from jserve.runners.cost_model import RooflineCostModel, StepShape
from jserve.runners.hardware import get_hardware


class ForkHarness(Harness):
    """The policy harness for requests of several sequences: the fake runner reads the
    tokens a sequence's KV must hold (so a shared block is checked by content, as with a
    prefix cache), and each sequence's output is checked against its own reference."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.runner.context_of = self._context
        self.runner.kept = self._kept if self.prefix_cache else lambda b: self.state.blocks.ref_counts[b] > 0
        self.seqs: dict[str, Request] = {}  # every sequence seen, by engine request id
        self.n_of: dict[str, int] = {}
        self.forked_waiting = self.shared = False  # what the trace exercised

    def add_n(self, rid: str, spec: Spec, n: int) -> bool:
        params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos, n=n)
        if not self.valid(spec) or n > self.limits.max_num_seqs:
            with pytest.raises(InvalidRequestError):
                self.engine.add_request(rid, spec.prompt, params)
            return False
        req = self.engine.add_request(rid, spec.prompt, params)
        self.seqs[rid], self.specs[rid], self.n_of[rid] = req, spec, n
        return True

    def check(self) -> None:
        self.state.check_invariants()
        self.shared |= bool((self.state.blocks.ref_counts > 1).any())

    def step(self) -> None:
        for req in self.engine.step():
            self.seqs[req.request_id] = req
        for req in self.state.requests.values():
            if req.request_id not in self.seqs:
                self.seqs[req.request_id] = req
                self.forked_waiting |= req.parent_seq_id is not None and not self.state.blocks.num_held(req.seq_id)
        self.num_steps += 1
        self.check()

    def reference(self, req: Request) -> tuple[list[int], str]:
        return self.produced(self.specs[req.group_request_id], req.seq_id)

    def check_done(self) -> None:
        assert not self.engine.has_unfinished and len(self.state.table) == 0
        assert (self.state.blocks.ref_counts == 0).all() and self._num_unheld() == self.num_blocks
        by_group = collections.defaultdict(list)
        for req in self.seqs.values():
            by_group[req.group_request_id].append(req)
            ref, reason = self.reference(req)
            if req.finish_reason is FinishReason.ABORT:
                assert req.output_token_ids == ref[: len(req.output_token_ids)]
            else:
                assert (req.output_token_ids, req.finish_reason.value) == (ref, reason), req.request_id
        for rid, seqs in by_group.items():
            if all(r.finish_reason is not FinishReason.ABORT for r in seqs):
                assert sorted(r.index for r in seqs) == list(range(self.n_of[rid]))


def _fork_harness(policy_name: str = "vllm", num_blocks: int = 64, block_size: int = 4,
                  limits: SchedulerLimits = SchedulerLimits(8, 64, 64), **kw: object) -> ForkHarness:
    return ForkHarness(num_blocks, block_size, limits, None, policy=POLICIES[policy_name](), **kw)


def _drain(h: ForkHarness) -> None:
    while h.engine.has_unfinished:
        h.step()
    h.check_done()


def test_children_share_full_blocks_and_copy_the_last() -> None:
    h = _fork_harness()
    prompt = list(range(1, 11))  # 10 tokens: two full blocks of 4, then a partial one
    h.add_n("a", Spec(prompt, 6, True, 0), 3)
    h.step()  # the prefill: the parent samples its first token, and forks
    parent = h.seqs["a"]
    children = [r for r in h.state.requests.values() if r.parent_request_id == "a"]
    assert [c.request_id for c in children] == [child_request_id("a", i) for i in (1, 2)]
    assert [c.index for c in children] == [1, 2]
    bm = h.state.blocks
    ptable = bm.table(parent.seq_id)
    for c in children:
        table = bm.table(c.seq_id)
        assert table[:2] == ptable[:2] and table[2] != ptable[2]
        assert c.parent_seq_id == parent.seq_id and not c.output_token_ids
    assert (bm.ref_counts[ptable[:2]] == 3).all() and bm.ref_counts[ptable[2]] == 1
    # Three sequences hold 3 + 3 + 3 table entries but only 2 shared + 3 last blocks; the
    # policies' view counts a shared block per holder.
    assert bm.num_blocks - bm.num_free == 5 < 3 * 3
    assert h.state.snapshot(0.0).num_free_blocks == bm.num_blocks - 9
    copies = h.state._forks._copies  # made by the next batch, before its compute
    assert copies == [(ptable[2], bm.table(c.seq_id)[2]) for c in children]
    _drain(h)


def test_prompt_of_whole_blocks_copies_its_last_full_block() -> None:
    h = _fork_harness()
    h.add_n("a", Spec(list(range(1, 9)), 5, True, 0), 2)  # 8 tokens: exactly two blocks
    h.step()
    (child,) = [r for r in h.state.requests.values() if r.parent_request_id == "a"]
    bm = h.state.blocks
    assert bm.table(child.seq_id)[0] == bm.table(h.seqs["a"].seq_id)[0]
    assert bm.num_held(child.seq_id) == 2
    _drain(h)


def test_no_block_for_the_copy_forks_children_waiting() -> None:
    """With no free block, the children wait holding nothing and prefill the prompt
    themselves; their outputs are still their own."""
    h = _fork_harness(num_blocks=3, block_size=4, limits=SchedulerLimits(4, 16, 16))
    h.add_n("a", Spec(list(range(1, 12)), 1, True, 0), 3)  # 11 tokens fill all 3 blocks
    h.step()
    children = [r for r in h.state.requests.values() if r.parent_request_id == "a"]
    assert len(children) == 2
    for c in children:
        row = h.state.live.row(c.seq_id)
        assert h.state.table.data.status[row] == 0 and h.state.blocks.num_held(c.seq_id) == 0
    _drain(h)


def test_preempting_a_child_frees_only_its_own_references() -> None:
    """A cache too small for three sequences' growth: preemptions hit forked sequences,
    and each sequence still ends with its own reference output."""
    h = _fork_harness(num_blocks=8, block_size=2, limits=SchedulerLimits(4, 32, 32))
    h.add_n("a", Spec(list(range(1, 8)), 8, True, 0), 3)
    _drain(h)
    assert h.engine.stats.num_preemptions > 0


def test_abort_ends_every_sequence_of_a_request() -> None:
    h = _fork_harness()
    h.add_n("a", Spec(list(range(1, 6)), 20, True, 0), 3)
    h.step()
    h.step()
    assert len(h.state.requests) == 3
    out = h.engine.abort("a")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert not h.state.requests and (h.state.blocks.ref_counts == 0).all()
    assert h.engine.abort("a") is None


def test_abort_before_the_first_token_frees_the_promised_ids() -> None:
    h = _fork_harness()
    h.add_n("a", Spec([1, 2, 3], 4, True, 0), 2)
    with pytest.raises(InvalidRequestError, match="already in use"):
        h.engine.add_request(child_request_id("a", 1), [1], SamplingParams())
    h.engine.abort("a")
    h.check()
    h.engine.add_request(child_request_id("a", 1), [1], SamplingParams(max_tokens=2))
    _drain_plain(h)


def _drain_plain(h: ForkHarness) -> None:
    while h.engine.has_unfinished:
        h.step()


def test_child_params_follow_vllm() -> None:
    p = SamplingParams(n=3, best_of=4, seed=10, prompt_logprobs=2)
    c = child_params(p, 2)
    assert (c.n, c.best_of, c.seed, c.prompt_logprobs) == (1, None, 12, None)
    assert child_params(SamplingParams(n=2), 1).seed is None


@pytest.mark.parametrize("bad", [dict(n=0), dict(n=2, best_of=1), dict(n=True), dict(best_of=0)])
def test_bad_n_and_best_of_are_refused(bad: dict) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**bad)
    assert e.value.param in ("n", "best_of")


def test_best_of_returns_the_n_highest_cumulative_logprobs() -> None:
    h = _fork_harness()
    h.engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True, n=2, best_of=4))
    _drain_plain(h)
    seqs = [r for r in h.seqs.values() if r.group_request_id == "a"]
    assert len(seqs) == 4
    for i, r in enumerate(sorted(seqs, key=lambda r: r.index)):
        r.output_logprobs[:] = [-1.0 * ((i * 7) % 4)] * 3  # the fake runner's are all 0
    out = RequestOutput.of_group(seqs, 2)
    scores = sorted((r.cumulative_logprob for r in seqs), reverse=True)[:2]
    assert [o.cumulative_logprob for o in out.outputs] == scores
    assert out.request_id == "a" and out.index == out.outputs[0].index
    n_only = RequestOutput.of_group(seqs[:2], 2)
    assert [o.index for o in n_only.outputs] == sorted(r.index for r in seqs[:2])


# --------------------------------------------------------------------------- random traces
SHARED = settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", sorted(POLICIES) + ["vllm+prefix-cache"])
@SHARED
@given(data=st.data())
def test_random_traces_with_several_sequences_keep_invariants(name: str, data: st.DataObject) -> None:
    """Random traces (tight caches, swaps, aborts; vLLM also with a prefix cache) where
    requests ask for 1 to 3 sequences: the invariants after every step, and each
    sequence's output its own."""
    policy = POLICIES[name.removesuffix("+prefix-cache")]()
    cfg = data.draw(configs(chunked=policy.chunked_prefill, block_sizes=st.integers(1, 8),
                            hidden="prefix" not in name), label="config")
    if "prefix" in name:
        cfg |= {"prefix_cache": PrefixCacheConfig(), "num_host_blocks": 0}
    specs = data.draw(specs_for(cfg, max_requests=6), label="requests")
    ns = data.draw(st.lists(st.integers(1, 3), min_size=len(specs), max_size=len(specs)), label="n")
    aborts = data.draw(aborts_strategy(), label="aborts")
    h = ForkHarness(**cfg, policy=policy)
    pending = sorted(zip(range(len(specs)), specs, ns), key=lambda p: p[1].arrive_step)
    k = 0
    while pending or h.engine.has_unfinished:
        while pending and pending[0][1].arrive_step <= k:
            i, spec, n = pending.pop(0)
            h.add_n(f"r{i}", spec, n)
        for pick in aborts.get(k, []):
            live = sorted({q.group_request_id for q in h.state.requests.values()})
            if live:
                h.engine.abort(live[pick % len(live)])
                h.check()
        h.step()
        k += 1
        assert k < 2000, "livelock"
    h.check_done()
    event(f"shared blocks: {h.shared}")
    event(f"a forked sequence waited: {h.forked_waiting}")


def test_fake_runner_checks_the_copy() -> None:
    """The fake runner copies blocks before anything else: a batch whose copy is dropped
    makes the child read KV of other tokens."""
    h = _fork_harness()
    h.add_n("a", Spec(list(range(1, 11)), 3, True, 0), 2)
    h.step()
    h.state._forks._copies.clear()
    with pytest.raises(AssertionError, match="other tokens"):
        h.step()


def test_more_sequences_than_can_run_is_refused() -> None:
    h = _fork_harness(limits=SchedulerLimits(2, 64, 64))
    with pytest.raises(InvalidRequestError, match="max_num_seqs is 2") as e:
        h.engine.add_request("a", [1, 2], SamplingParams(n=1, best_of=3))
    assert e.value.param == "best_of" and not h.state.requests


def test_the_simulator_prices_a_block_copy_as_device_memory_read_and_written() -> None:
    model = RooflineCostModel(get_config("opt-13b"), get_hardware("a100-80g"))
    batch = Batch(seq_ids=np.arange(1), start=np.array([99], np.int32), query_lens=np.ones(1, np.int32),
                  sample=np.ones(1, bool))
    copied = dataclasses.replace(batch, block_copies=((3, 7), (3, 8)))
    shape = StepShape.of(copied, bytes_per_block=1 << 20)
    assert shape.copy_bytes == 2 << 20 and copied.moves_blocks and not batch.moves_blocks
    extra = model.step_time(shape) - model.step_time(StepShape.of(batch, bytes_per_block=1 << 20))
    assert extra == pytest.approx(2 * (2 << 20) / model.byte_rate)


def test_a_fork_ends_the_simulators_repeated_steps() -> None:
    """A plan that repeats (`Plan.repeat`, the simulator's fast path) and forks a request
    (a one-token prompt's prefill is decode-shaped, so it may repeat) stops after the fork:
    the new sequences and their copies come first. Every sequence runs to its length."""
    engine = build_engine(EngineConfig(runner="sim", model="opt-13b", hardware="a100-80g", num_blocks=64)).engine
    vllm = engine.policy

    class RepeatEverything:
        name, chunked_prefill, capabilities = vllm.name, vllm.chunked_prefill, vllm.capabilities

        def schedule(self, view):  # type: ignore[no-untyped-def]
            return dataclasses.replace(vllm.schedule(view), repeat=5)

    engine.policy = RepeatEverything()
    engine.add_request("a", [7], SamplingParams(max_tokens=30, ignore_eos=True, n=3))
    engine.step(until=1e9)
    assert [len(r.output_token_ids) for r in engine.state.requests.values()] == [1, 0, 0]
    ended = []
    while engine.has_unfinished:
        ended += [r.request_id for r in engine.step(until=1e9) if r.finished]
        engine.state.check_invariants()
    assert sorted(ended) == ["a", "a#1", "a#2"]
