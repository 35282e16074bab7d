"""LayerKV (Xiong et al., Ant Group 2024): a prefill keeps only some of its layers' KV on the
device and writes the rest to host memory, so a long prompt no longer waits for all of its
blocks; an SLO-aware scheduler bounds how much prefill it lets in ahead of decodes. Everything
else is vLLM's loop. Each rule against the paper, the constants it leaves open and our readings,
with what was measured to choose them: docs/policies.md, LayerKV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from jserve.cache.layers import layer_demand, layer_shortfall
from jserve.cache_features.layer_offload.section import (
    device_layers,
    kept,
    layer_view,
    num_free_host_layer_blocks,
    num_free_layer_blocks,
    section,
)
from jserve.engine.layerkv_costs import LayerKVCosts
from jserve.engine.plan import Plan
from jserve.engine.policy import PolicyCapabilities, RunnerCosts
from jserve.engine.request import OFFLOADED, RUNNING, WAITING
from jserve.engine.view import SchedulerView
from jserve.policies.vllm import VLLMPolicy


# ------------------------------------------------------------------ Eqs. 1-2, Algorithm 1
def predicted_range(predicted: np.ndarray, known: np.ndarray, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """The output-length range a prediction stands for, (lowest, highest): S3's bucket b
    holds lengths (b * bucket, (b + 1) * bucket] (its prediction is the upper edge; one
    capped by `max_tokens` lies inside it); a known length is its own range."""
    pred = np.asarray(predicted, np.int64)
    upper = -(-pred // bucket) * bucket
    lower = np.where(known, pred, upper - bucket + 1)
    return lower, np.where(known, pred, upper)


def future_tokens(generated: np.ndarray, predicted: np.ndarray, known: np.ndarray, bucket: int) -> np.ndarray:
    """N_future: the lowest length of the predicted range (`predicted_range`; the length
    itself when known) less the tokens generated, at least 1; 1 without a prediction (0)."""
    lower, _ = predicted_range(predicted, known, bucket)
    return np.where(np.asarray(predicted) > 0, np.maximum(lower - generated, 1), 1)


def allowed_prefill_time(tpot_slo: np.ndarray, n_past: np.ndarray, n_future: np.ndarray,
                         t_past: np.ndarray, tpot: np.ndarray | float) -> np.ndarray:
    """Eq. 1: T_allow = T_tpot (N_past + N_future) - (T_past + T_future), with T_future the
    current TPOT `tpot` times N_future. No SLO (nan): inf."""
    n_past = np.asarray(n_past, np.float64)
    allow = tpot_slo * (n_past + n_future) - (t_past + np.asarray(tpot) * n_future)
    return np.where(np.isnan(tpot_slo), np.inf, allow)


@dataclass(frozen=True)
class Allowances:
    """Eq. 1 over D: its rows in the view, N_past, N_future and T_allow of each."""

    rows: np.ndarray
    n_past: np.ndarray
    n_future: np.ndarray
    allow: np.ndarray


# ------------------------------------------------------------------ Eq. 5
@dataclass(frozen=True)
class Forecast:
    """Who Eq. 5 runs over, in device layer slots. Running requests hold `held` slots, grow
    `grow` slots a stage and end after `ends` stages (inf: not within the horizon); the
    queue (oldest first) joins when `need` slots (and its growth) fit above the threshold,
    then holds `queue_held` + `need` and grows, and ends `queue_ends` (at least 1) stages
    after the stage it joined in."""

    held: np.ndarray
    ends: np.ndarray
    need: np.ndarray
    queue_held: np.ndarray
    queue_ends: np.ndarray
    grow: int


def forecast_free(avail: int, f: Forecast, horizon: int, threshold: int, joins: bool = True) -> np.ndarray:
    """Eq. 5: Avail(t) for t = 0..horizon. In stage t the requests ending in it release what
    they hold (their growth included), every other running one takes `grow` more, then
    waiting requests join (and grow) while at least `threshold` stays free (`joins`)."""
    held = f.held.astype(np.float64)
    ends = f.ends.astype(np.float64)
    out = [float(avail)]
    a, q = float(avail), 0
    for t in range(horizon):
        done = ends <= t
        a += held[done].sum() - f.grow * int((~done).sum())
        held, ends = held[~done] + f.grow, ends[~done]
        while joins and q < len(f.need) and a - f.need[q] - f.grow >= threshold:
            a -= f.need[q] + f.grow  # it decodes, and grows, from this stage
            held = np.append(held, f.queue_held[q] + f.need[q] + f.grow)
            ends = np.append(ends, t + max(f.queue_ends[q], 1))
            q += 1
        out.append(a)
    return np.asarray(out)


# ------------------------------------------------------------------ the policy
@dataclass(frozen=True)
class LayerKVPolicy:
    name: str = "layerkv"
    chunked_prefill: bool = False
    slo_aware: bool = True  # Algorithm 1; False: the paper's ablation
    decode_from_host: bool = True  # Section 4; False: decode only once brought back whole
    hide_host_reads: bool = True  # host decodes only while their reads hide under the step
    watermark: float = 0.01  # vLLM's: free blocks kept back from admissions and bring-backs
    horizon: int = 4  # Eq. 5 stages of `block_size` decode iterations (ours)
    threshold: float = 0.01  # Eq. 5's floor, a fraction of the blocks (ours: vLLM's watermark)
    bucket_tokens: int = 50  # S3's predictor classes
    costs: LayerKVCosts | None = None  # Eqs. 3-4, filled by the builder
    capabilities: ClassVar[PolicyCapabilities] = PolicyCapabilities(
        predictor_kind="s3", offloads_layers=True, reads_runner_costs=True)

    def given(self, costs: RunnerCosts) -> LayerKVPolicy:
        """With the runner's Eq. 3-4 figures, unless it has its own."""
        return self if self.costs is not None else replace(self, costs=costs.layerkv)

    def schedule(self, view: SchedulerView) -> Plan:
        offloads = self.offloads(view)
        plan = self._prefills(view, offloads) or self._decodes(view, offloads)
        if self.decode_from_host and not (plan.run or plan.preempt or plan.features or offloads):
            plan = self._unstall(view)
        if offloads:
            plan = Plan(run=plan.run, allocate=plan.allocate, preempt=plan.preempt,
                        features=section({**offloads, **kept(plan)}))
        return plan

    # -------------------------------------------------------------- Eqs. 1-3: how many
    def prefill_times(self, tokens: np.ndarray) -> np.ndarray:
        """Eq. 3 for each prompt (0 s without fitted costs)."""
        return self.costs.prefill_time(tokens) if self.costs else np.zeros(len(tokens))

    def allowances(self, view: SchedulerView) -> Allowances:
        """Eq. 1's terms and T_allow for every request past its prefill (the paper's D)."""
        r = view.requests
        d = np.flatnonzero(((r.status == RUNNING) | (r.status == OFFLOADED)) & ~np.isnan(r.first_token_time))
        generated = (r.num_tokens - r.prompt_len)[d]
        n_past = np.maximum(generated - 1, 0)
        t_past = view.now - r.first_token_time[d]
        n_future = future_tokens(generated, r.predicted_len[d], r.length_known[d], self.bucket_tokens)
        if self.costs is None:  # no fitted decode line: each request's own TPOT so far
            tpot = t_past / np.maximum(n_past, 1)
        else:
            tpot = self.current_tpot(view, d)
        return Allowances(d, n_past, n_future, allowed_prefill_time(r.tbt_slo[d], n_past, n_future, t_past, tpot))

    def current_batch(self, view: SchedulerView, d: np.ndarray) -> np.ndarray:
        """Rows of the decode iteration Eq. 1's "current TPOT" stands for: the running
        requests and the OFFLOADED ones that decode from the host with them (`hidden_reads`);
        the other OFFLOADED wait because they do not fit, so no step decodes them with the
        rest (with the whole-block return, none does). All of D only while none of it would
        decode."""
        r = view.requests
        running = d[r.status[d] == RUNNING]
        if self.decode_from_host:
            running = np.concatenate([running, self.hidden_reads(view, running, d[r.status[d] == OFFLOADED])])
        return running if len(running) else d

    def hidden_reads(self, view: SchedulerView, batch: np.ndarray, queue: np.ndarray) -> np.ndarray:
        """Of `queue` (OFFLOADED rows, oldest first), those that decode from the host beside
        `batch`: with `hide_host_reads` and fitted costs, each whose host layers' reads, with
        those of the ones before it added, take no longer than the step's compute (Eq. 4's
        time read host -> device against the decode line); else all of them. Section 3.1.1
        sets this overlap for the prefill's offload, "computation time fully overlaps with
        offloading communication time, thereby maintaining QPS", which the paper's
        throughput within 3% of vLLM's needs of the decode's reads too."""
        if not (self.hide_host_reads and self.costs is not None) or not len(queue):
            return queue
        r, L = view.requests, layer_view(view).num_layers
        seqs, context, reads, out = len(batch), int(r.num_tokens[batch].sum()), 0.0, []
        for i in queue:
            more = float(self.costs.offload_time(int(r.num_tokens[i]), L - int(device_layers(view)[i])))
            if reads + more <= self.costs.decode_time(seqs + 1, context + int(r.num_tokens[i])):
                seqs, context, reads = seqs + 1, context + int(r.num_tokens[i]), reads + more
                out.append(i)
        return np.asarray(out, np.int64)

    def current_tpot(self, view: SchedulerView, d: np.ndarray) -> float:
        """Seconds of that iteration: the fitted decode line, or the time its OFFLOADED
        requests' host layers take to reach the device (Eq. 4's per-token-layer time, the
        link's other direction) where longer, as copies pipelined with the compute."""
        r, L = view.requests, layer_view(view).num_layers
        batch = self.current_batch(view, d)
        t = self.costs.decode_time(len(batch), int(r.num_tokens[batch].sum()))
        host = batch[device_layers(view)[batch] < L]
        if not len(host):
            return t
        stream = self.costs.offload_time(r.num_tokens[host], L - device_layers(view)[host].astype(np.int64))
        return max(t, float(np.sum(stream)))

    def min_allowed_prefill_time(self, view: SchedulerView) -> float:
        """min_i T_allow over the requests past their prefill (inf when there are none)."""
        allow = self.allowances(view).allow
        return float(allow.min()) if len(allow) else math.inf

    # -------------------------------------------------------------- Eq. 5
    def forecast(self, view: SchedulerView, layers: dict[int, int] | None = None) -> Forecast:
        """Eq. 5's inputs from the view, with `layers` (seq -> kept layers) applied to the
        OFFLOADED requests."""
        r, L = view.requests, layer_view(view).num_layers
        run = r.with_status(RUNNING)
        queue = r.with_status(OFFLOADED)
        kept = device_layers(view)[queue].astype(np.int64)
        if layers:
            kept = np.array([layers.get(int(s), int(k)) for s, k in zip(r.seq_id[queue], kept)], np.int64)
        queue_held = r.num_blocks[queue].astype(np.int64) * kept
        need = view.blocks_for(r.num_computed[queue] + 1).astype(np.int64) * L - queue_held
        return Forecast(held=r.num_blocks[run].astype(np.int64) * L, ends=self._stages_left(view, run),
                        need=need, queue_held=queue_held, queue_ends=self._stages_left(view, queue),
                        grow=L)

    def _stages_left(self, view: SchedulerView, rows: np.ndarray) -> np.ndarray:
        """Stages until each request's predicted end: the middle of its predicted range
        (its known length, if known; capped by its `max_len`), inf without a prediction."""
        r = view.requests
        generated = (r.num_tokens - r.prompt_len)[rows]
        cap = (r.max_len - r.num_tokens)[rows].astype(np.float64)
        pred = r.predicted_len[rows]
        _, upper = predicted_range(pred, r.length_known[rows], self.bucket_tokens)
        middle = np.where(r.length_known[rows], upper, upper - self.bucket_tokens / 2.0)
        left = np.where(pred > 0, np.minimum(np.maximum(middle - generated, 0), cap), cap)
        return np.ceil(left / view.block_size)

    def threshold_slots(self, view: SchedulerView) -> int:
        return math.ceil(self.threshold * view.num_blocks) * layer_view(view).num_layers

    def spare_slots(self, view: SchedulerView, layers: dict[int, int] | None = None, joins: bool = True) -> int:
        """Device layer slots the forecast keeps free above the threshold at its lowest
        (negative: short of it); `layers`: offloads this plan makes; `joins`: whether the
        OFFLOADED requests come back in it."""
        freed = 0
        if layers:
            r = view.requests
            row = {int(s): i for i, s in enumerate(r.seq_id)}
            freed = sum((int(device_layers(view)[row[s]]) - x) * int(r.num_blocks[row[s]]) for s, x in layers.items())
        avail = forecast_free(num_free_layer_blocks(view) + freed, self.forecast(view, layers), self.horizon,
                              self.threshold_slots(view), joins)
        return int(avail.min()) - self.threshold_slots(view)

    def offloads(self, view: SchedulerView) -> dict[int, int]:
        """Retained layers to offload this step (seq -> layers kept): the most recently
        prefilled OFFLOADED requests first, to x/2, then to none, until the forecast stays
        at or above the threshold; all of them when decoding has stalled."""
        r = view.requests
        queue = r.with_status(OFFLOADED)
        holding = queue[device_layers(view)[queue] > 0]
        if not len(holding):
            return {}
        if not self.decode_from_host and self._stalled(view, queue):
            return {int(s): 0 for s in r.seq_id[holding]}
        if self.spare_slots(view, joins=False) >= 0:
            return {}
        newest = holding[np.argsort(-r.last_token_time[holding], kind="stable")]
        layers: dict[int, int] = {}
        host = num_free_host_layer_blocks(view)
        for halve in (True, False):
            for i in newest:
                seq, x = int(r.seq_id[i]), layers.get(int(r.seq_id[i]), int(device_layers(view)[i]))
                target = x // 2 if halve else 0
                moved = (x - target) * int(r.num_blocks[i])
                if target == x or moved > host:
                    continue
                layers[seq], host = target, host - moved
                if self.spare_slots(view, layers, joins=False) >= 0:
                    return layers
        return layers

    def _unstall(self, view: SchedulerView) -> Plan:
        """Nothing would run (no OFFLOADED request's next block fits, none comes back): every
        retained layer goes to the host, so split blocks merge back; with none retained, the
        newest OFFLOADED request is preempted by recompute, as vLLM preempts the newest."""
        r = view.requests
        queue = r.with_status(OFFLOADED)
        holding = queue[device_layers(view)[queue] > 0]
        if len(holding):
            return Plan(features=section({int(s): 0 for s in r.seq_id[holding]}))
        if len(queue):
            return Plan(preempt=[int(r.seq_id[queue[-1]])])
        return Plan()

    def _stalled(self, view: SchedulerView, queue: np.ndarray) -> bool:
        """Nothing runs and the oldest OFFLOADED request does not fit in whole blocks."""
        r = view.requests
        if (r.status == RUNNING).any() or not len(queue):
            return False
        return int(view.blocks_for(r.num_computed[queue[0]] + 1)) > view.num_free_blocks

    # -------------------------------------------------------------- prefills
    def _prefills(self, view: SchedulerView, offloads: dict[int, int]) -> Plan | None:
        """FCFS whole prompts: those vLLM would admit (whole blocks free above its
        watermark once the OFFLOADED requests, earlier in vLLM's queue, are back) fully, as
        vLLM does; past them, prompts that need layer offloading while the summed Eq. 3 times
        of this step's prefills stay below min T_allow (Algorithm 1)."""
        r, lim, L = view.requests, view.limits, layer_view(view).num_layers
        waiting = r.with_status(WAITING)
        if not len(waiting):
            return None
        tokens = (r.num_tokens - r.num_computed)[waiting]
        times = self.prefill_times(tokens)
        allowed = self.min_allowed_prefill_time(view) if self.slo_aware else math.inf
        holders = int(((r.status == RUNNING) | (r.status == OFFLOADED)).sum())
        watermark = int(self.watermark * view.num_blocks) if holders else 0
        whole, slots = view.num_free_blocks, _slots(layer_view(view).free_slots, L)
        host_whole, host_slots = view.num_free_host_blocks, _slots(layer_view(view).free_host_slots, L)
        spare = max(self.spare_slots(view, offloads), 0)
        x_min = (self.costs.min_kept_layers(tokens, L) if self.costs else np.zeros(len(tokens), np.int64))
        queue = r.with_status(OFFLOADED)
        ahead = int(view.blocks_for(r.num_computed[queue] + 1).sum())  # whole blocks to bring them back
        budget, elapsed = lim.max_num_batched_tokens, 0.0
        run: dict[int, int] = {}
        allocate: dict[int, int] = {}
        layers: dict[int, int] = {}
        for k, i in enumerate(waiting):
            need = int(view.blocks_for(int(r.num_tokens[i])))
            if (tokens[k] > budget or holders + len(run) >= lim.max_num_seqs
                    or int(view.blocks_for(int(r.num_tokens[i]) + 1)) > view.num_blocks - watermark):
                break  # the last: it could never decode here
            if need <= whole - watermark - ahead:  # vLLM's rule, behind the queue to decode
                x, whole = L, whole - need
            else:
                if not elapsed + times[k] < allowed:
                    break  # Eq. 2
                # as many layers as the forecast spares and fit, else the fewest Eqs. 3-4 allow
                for x in dict.fromkeys((max(int(x_min[k]), min(L - 1, spare // max(need, 1))), int(x_min[k]))):
                    device, host = layer_demand(L, x, need), need - layer_demand(L, x, need)
                    if not (layer_shortfall(device, slots, whole) or layer_shortfall(host, host_slots, host_whole)):
                        break
                else:
                    break
                whole, slots = _take(device, slots, whole)
                host_whole, host_slots = _take(host, host_slots, host_whole)
                layers[int(r.seq_id[i])] = x
            seq = int(r.seq_id[i])
            run[seq], allocate[seq] = int(tokens[k]), need
            budget -= int(tokens[k])
            elapsed += float(times[k])
            spare = max(spare - x * need, 0)
            watermark = int(self.watermark * view.num_blocks)
        return Plan(run=run, allocate=allocate, features=section(layers)) if run else None

    # -------------------------------------------------------------- decodes
    def _decodes(self, view: SchedulerView, offloads: dict[int, int]) -> Plan:
        """vLLM's decodes; the OFFLOADED requests (but those offloaded further now) come
        back whole while the free blocks cover them, oldest first, and (`decode_from_host`)
        the others decode with their layers on the host where their growth fits."""
        r = view.requests
        base = VLLMPolicy(watermark=self.watermark)._decodes(view)
        queue = [i for i in r.with_status(OFFLOADED) if int(r.seq_id[i]) not in offloads]
        if not queue:
            if not (r.status == WAITING).any() and not base.preempt:
                return base  # vLLM's repeated decodes: nothing waits to be admitted or brought back
            return Plan(run=base.run, allocate=base.allocate, preempt=base.preempt)
        free = view.num_free_blocks - sum(base.allocate.values())
        watermark = int(self.watermark * view.num_blocks) if base.run else 0
        run, allocate, layers = dict(base.run), dict(base.allocate), {}
        back = 0
        for i in queue if not base.preempt else ():
            seq, need = int(r.seq_id[i]), int(view.blocks_for(int(r.num_computed[i]) + 1))
            if need > free - watermark:
                break
            run[seq] = int(r.num_tokens[i] - r.num_computed[i])
            layers[seq] = layer_view(view).num_layers
            grow = need - int(r.num_blocks[i])
            if grow:
                allocate[seq] = grow
            free -= need
            watermark = int(self.watermark * view.num_blocks)
            back += 1
        if self.decode_from_host:
            self._host_decodes(view, queue[back:], free, run, allocate)
        return Plan(run=run, allocate=allocate, preempt=base.preempt, features=section(layers))

    def _host_decodes(self, view: SchedulerView, queue: list[int], free: int,
                      run: dict[int, int], allocate: dict[int, int]) -> None:
        """Add OFFLOADED requests decoding with their layers on the host, oldest first: those
        `hidden_reads` picks beside the batch, each whose next block (slots in its kept
        layers, host slots in the others) fits what is left after the whole-block takes
        (`free`)."""
        r, L = view.requests, layer_view(view).num_layers
        whole, slots = free, _slots(layer_view(view).free_slots, L)
        host_whole, host_slots = view.num_free_host_blocks, _slots(layer_view(view).free_host_slots, L)
        batch = np.flatnonzero(np.isin(r.seq_id, np.fromiter(run, np.int64, len(run))))
        for i in self.hidden_reads(view, batch, np.asarray(queue, np.int64)):
            seq, x = int(r.seq_id[i]), int(device_layers(view)[i])
            grow = int(view.blocks_for(int(r.num_computed[i]) + 1)) - int(r.num_blocks[i])
            device = layer_demand(L, x, grow)
            host = grow - device
            if layer_shortfall(device, slots, whole) or layer_shortfall(host, host_slots, host_whole):
                continue
            whole, slots = _take(device, slots, whole)
            host_whole, host_slots = _take(host, host_slots, host_whole)
            run[seq] = int(r.num_tokens[i] - r.num_computed[i])
            if grow:
                allocate[seq] = grow


def _slots(slots: np.ndarray | None, num_layers: int) -> np.ndarray:
    return np.zeros(num_layers, np.int64) if slots is None else np.asarray(slots, np.int64).copy()


def _take(demand: np.ndarray, slots: np.ndarray, whole: int) -> tuple[int, np.ndarray]:
    """Free whole blocks and per-layer free slots after taking `demand` slots per layer:
    each whole block split gives every layer one slot (`jserve.cache.layers.LayerSlab`)."""
    split = int(max(0, (demand - slots).max(initial=0)))
    return whole - split, slots + split - demand
