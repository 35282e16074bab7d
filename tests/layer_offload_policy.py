"""A test-only policy that forces layer-wise KV residency (LayerKV's mechanics) on top of
vLLM's schedule, so the engine's and runners' layer paths run under any trace: every
prompt vLLM prefills keeps `keep(seq)` layers on the device (the rest written to the
host), partly offloaded requests come back to every layer (oldest first) when whole blocks
allow, decoding in the same step, and are vLLM's running requests after that, and optionally decoding requests are
offloaded and partly offloaded ones move between residencies.

Not a model of LayerKV's decisions (that is `jserve/policies/layerkv.py`): only a way to
make every residency change happen. Its room accounting follows `PlanChecker`'s: whole
blocks first, then layer slots per layer against free slots, slots freed by the plan and
whole blocks left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jserve import LLM, SamplingParams
from jserve.cache.layers import kept_layers
from jserve.cache_features.layer_offload.batch import layer_work
from jserve.cache_features.layer_offload.section import device_layers, layer_view, section
from jserve.cache_features.swap_tier.section import swaps
from jserve.engine.plan import Plan
from jserve.engine.policy import Policy, PolicyCapabilities
from jserve.engine.request import OFFLOADED, RUNNING, WAITING
from jserve.engine.view import SchedulerView
from jserve.policies.vllm import VLLMPolicy
from jserve.models.loading import LoadedModel


@dataclass
class _Room:
    """Device and host layer slots a plan takes and frees, per layer, and whole blocks."""

    view: SchedulerView
    whole: int
    host_whole: int
    device: np.ndarray = field(init=False)
    device_freed: np.ndarray = field(init=False)
    host: np.ndarray = field(init=False)
    host_freed: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        L = layer_view(self.view).num_layers
        self.device, self.device_freed = np.zeros(L, np.int64), np.zeros(L, np.int64)
        self.host, self.host_freed = np.zeros(L, np.int64), np.zeros(L, np.int64)

    def _slots(self, free: np.ndarray | None) -> np.ndarray:
        return np.zeros(layer_view(self.view).num_layers, np.int64) if free is None else free

    def fits(self, device: np.ndarray, host: np.ndarray, whole: int = 0) -> bool:
        v = self.view
        ok_device = (self.device + device <= self._slots(layer_view(v).free_slots) + self.device_freed
                     + self.whole - whole).all()
        ok_host = (self.host + host <= self._slots(layer_view(v).free_host_slots) + self.host_freed
                   + self.host_whole).all()
        return bool(ok_device and ok_host and whole <= self.whole)

    def change(self, before: tuple[int, ...], x: int, n: int) -> tuple[np.ndarray, ...]:
        """(device taken, device freed, host taken, host freed) of `n` blocks going from
        keeping `before` to keeping `x` layers (short of all of them)."""
        L = layer_view(self.view).num_layers
        after = kept_layers(L, x)
        gained, lost = _mask(L, set(after) - set(before), n), _mask(L, set(before) - set(after), n)
        return gained, lost, lost, gained

    def book(self, device: np.ndarray, device_freed: np.ndarray, host: np.ndarray,
             host_freed: np.ndarray, whole: int = 0) -> None:
        self.device += device
        self.device_freed += device_freed
        self.host += host
        self.host_freed += host_freed
        self.whole -= whole


def _mask(num_layers: int, layers: set[int], n: int) -> np.ndarray:
    out = np.zeros(num_layers, np.int64)
    out[list(layers)] = n
    return out


@dataclass(frozen=True)
class ForcedLayerOffload:
    """`keep(seq, num_layers)`: how many layers a prefill keeps (default: none).
    `offload_running`: the newest request about to decode its second token is offloaded to
    `keep` layers instead (once each, so it cannot livelock). `reshuffle`: partly
    offloaded requests not brought back move to another partial residency now and then
    (chosen by token counts, not the wall clock, so a run is the same on a loaded machine).
    `host_decodes`: partly offloaded requests not brought back decode with their layers on
    the host (LayerKV Section 4), where room for their growth allows."""

    inner: Policy = field(default_factory=VLLMPolicy)
    keep: Callable[[int, int], int] = lambda seq, num_layers: 0
    offload_running: bool = False
    reshuffle: bool = False
    host_decodes: bool = False
    name: str = "forced-layer-offload"
    chunked_prefill: bool = False
    capabilities: PolicyCapabilities = PolicyCapabilities(offloads_layers=True)

    def schedule(self, view: SchedulerView) -> Plan:
        r, L = view.requests, layer_view(view).num_layers
        room = _Room(view, view.num_free_blocks, view.num_free_host_blocks)
        offloaded = r.with_status(OFFLOADED)  # oldest first
        layers: dict[int, int] = {}
        back_run: dict[int, int] = {}
        back_allocate: dict[int, int] = {}
        for i in offloaded:  # every layer back and a decode, oldest first, as blocks allow
            n, x = int(r.num_blocks[i]), int(device_layers(view)[i])
            grow = view.blocks_for(int(r.num_computed[i]) + 1) - n
            if n + grow <= room.whole and r.num_computed[i] + 1 == r.num_tokens[i]:
                before = kept_layers(L, x)
                room.book(*(np.zeros(L, np.int64), _mask(L, set(before), n),
                            np.zeros(L, np.int64), _mask(L, set(range(L)) - set(before), n)), whole=n + grow)
                seq = int(r.seq_id[i])
                layers[seq], back_run[seq] = L, 1
                if grow:
                    back_allocate[seq] = grow
        # vLLM sees the blocks, tokens and sequence slots the offloaded requests leave.
        limits = dataclasses.replace(
            view.limits, max_num_seqs=max(0, view.limits.max_num_seqs - len(offloaded)),
            max_num_batched_tokens=view.limits.max_num_batched_tokens - len(offloaded))
        inner = self.inner.schedule(dataclasses.replace(view, num_free_blocks=room.whole, limits=limits))
        run, allocate = {**back_run, **inner.run}, {**back_allocate, **inner.allocate}
        row = {int(s): i for i, s in enumerate(r.seq_id.tolist())}
        room.whole -= sum(inner.allocate.values()) + sum(int(r.num_host_blocks[row[s]]) for s in swaps(inner).back)
        room.host_whole -= sum(int(r.num_blocks[row[s]]) for s in swaps(inner).out)
        for seq, n in inner.allocate.items():  # prefills keep `keep` layers where the host has room
            i = row[seq]
            x = self.keep(seq, L)
            if r.status[i] != WAITING or x >= L:
                continue
            kept = set(kept_layers(L, x))
            device, host = _mask(L, kept, n), _mask(L, set(range(L)) - kept, n)
            room.whole += n
            if room.fits(device, host):
                room.book(device, np.zeros(L, np.int64), host, np.zeros(L, np.int64))
                layers[seq] = x
            else:
                room.whole -= n
        if self.host_decodes:
            self._decode_from_host(view, offloaded, run, allocate, layers, room)
        if self.offload_running:
            self._offload_one(view, run, allocate, layers, room, inner)
        if self.reshuffle and run and int(r.num_tokens.sum()) % 3 == 0:  # every few steps, not by the clock
            for i in offloaded:
                seq = int(r.seq_id[i])
                x = int(device_layers(view)[i])
                target = (x + seq + 1) % L
                if seq in layers or seq in allocate or target == x:
                    continue
                change = room.change(kept_layers(L, x), target, int(r.num_blocks[i]))
                if room.fits(change[0], change[2]):
                    room.book(*change)
                    layers[seq] = target
        if not run and not inner.preempt and not swaps(inner).back and not layers and len(offloaded):
            self._unstick(view, offloaded, layers, room)
        preempt = list(inner.preempt)
        if not run and not preempt and not layers and len(offloaded):
            preempt.append(int(r.seq_id[offloaded[-1]]))
        return Plan(run=run, allocate=allocate, preempt=preempt, reserve=inner.reserve,
                    features={**inner.features, **section(layers)},
                    repeat=inner.repeat if not len(offloaded) and not layers else 1)

    def _decode_from_host(self, view: SchedulerView, offloaded: np.ndarray, run: dict[int, int],
                          allocate: dict[int, int], layers: dict[int, int], room: _Room) -> None:
        """Partly offloaded requests not brought back decode as they are, taking their next
        block as slots in the layers they keep and on the host for the others."""
        r, L = view.requests, layer_view(view).num_layers
        none = np.zeros(L, np.int64)
        for i in offloaded:
            seq = int(r.seq_id[i])
            if seq in layers or r.num_computed[i] + 1 != r.num_tokens[i]:
                continue
            grow = int(view.blocks_for(int(r.num_computed[i]) + 1)) - int(r.num_blocks[i])
            kept = set(kept_layers(L, int(device_layers(view)[i])))
            device, host = _mask(L, kept, grow), _mask(L, set(range(L)) - kept, grow)
            if grow and not room.fits(device, host):
                continue
            room.book(device, none, host, none)
            run[seq] = 1
            if grow:
                allocate[seq] = grow

    def _offload_one(self, view: SchedulerView, run: dict[int, int], allocate: dict[int, int],
                     layers: dict[int, int], room: _Room, inner: Plan) -> None:
        """The newest request decoding this step offloads to `keep` layers instead."""
        r, L = view.requests, layer_view(view).num_layers
        for i in r.with_status(RUNNING)[::-1]:
            seq = int(r.seq_id[i])
            x = self.keep(seq, L)
            if run.get(seq) != 1 or x >= L or r.num_tokens[i] - r.prompt_len[i] != 1:
                continue
            change = room.change(tuple(range(L)), x, int(r.num_blocks[i]))
            if room.fits(change[0], change[2]):
                room.book(*change)
                room.whole += allocate.pop(seq, 0)
                del run[seq]
                layers[seq] = x
            return

    def _unstick(self, view: SchedulerView, offloaded: np.ndarray, layers: dict[int, int], room: _Room) -> None:
        """Nothing runs and every offloaded request waits for whole blocks that split slots
        hold: offload the oldest one still keeping layers entirely (the last resort,
        preempting the newest, is the caller's)."""
        r, L = view.requests, layer_view(view).num_layers
        for i in offloaded:
            x = int(device_layers(view)[i])
            if x == 0:
                continue
            change = room.change(kept_layers(L, x), 0, int(r.num_blocks[i]))
            if room.fits(change[0], change[2]):
                room.book(*change)
                layers[int(r.seq_id[i])] = 0
                return


def greedy_ids(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def random_prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def identical_to_roomy_run(llm: LLM, loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, max_len: int) -> dict[str, int]:
    """Greedy outputs of `llm` equal a roomy vLLM run's and everything is given back after;
    returns what moved (partly offloaded prefills, runs past the prefill reading layers
    from the host, layer copies to host, to device, slot copies), so a test can check the
    layer paths really ran."""
    roomy = LLM(loaded, num_blocks=512, warmup=False)
    expected = [e[: max_len - len(p)] for e, p in zip(greedy_ids(roomy, prompts, max_tokens), prompts)]
    seen = {"prefills": 0, "host_decodes": 0, "to_host": 0, "to_device": 0, "copies": 0}
    execute = llm.runner.execute

    def counting(batch):
        work = layer_work(batch)
        starts = [int(batch.start[i]) for i in work.tables]
        seen["prefills"] += sum(s == 0 for s in starts)
        seen["host_decodes"] += sum(s > 0 for s in starts)
        seen["to_host"] += len(work.to_host)
        seen["to_device"] += len(work.to_device)
        seen["copies"] += len(work.copies)
        return execute(batch)

    llm.runner.execute = counting
    assert greedy_ids(llm, prompts, max_tokens) == expected
    state = llm.engine.state
    assert state.blocks.num_free == state.blocks.num_blocks and not state.feature("layer_offload").residency.partial
    assert int(state.feature("layer_offload").residency.slab.used.sum()) == 0 and int(state.feature("layer_offload").residency.host_slab.used.sum()) == 0
    return seen
