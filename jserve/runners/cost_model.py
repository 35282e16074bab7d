"""How long one engine iteration takes, for the simulator's virtual clock.

The simulator runs the real engine loop with a runner that charges each step
`cost_model.step_time(StepShape.of(batch))` seconds. A `StepShape` is the handful of numbers
that decide a step's cost; two models turn it into seconds:

- `RooflineCostModel`: analytic, from the model's shape and a `Hardware` datasheet:
  `max(compute, memory) + host transfers + fixed overhead`.
- `CalibratedCostModel`: linear in the shape's features, fitted (non-negative least squares)
  to step times profiled on a real device, saved as a JSON profile.

`swap_time` and `recompute_time` price the two ways of preempting a request (CacheOpt's
swap-vs-recompute choice). A swap is priced as the runner being modelled moves K/V
(`SwapPath`): vLLM v0 copies every block of every layer's K and V separately, jserve gathers
a request's blocks into one buffer and moves that; either way the step waits for it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from jserve.cache_features.layer_offload.batch import LayerTraffic
from jserve.models.config import ModelConfig
from jserve.runners.engine_overhead import FLAT_2MS, EngineOverhead, FitRange, FitRangeWatch
from jserve.runners.hardware import Hardware

if TYPE_CHECKING:
    from jserve.engine.batch import Batch

# ---------------------------------------------------------------------------------------
# Step shape
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one iteration computes and moves.

    - `num_prefill_tokens`: tokens of sequences whose query length is > 1 (prefill chunks);
      `num_decode_tokens`: sequences with query length 1 (as `Batch.num_decode_tokens`; a
      one-token prefill chunk counts here, and costs the same).
    - `attended`: sum over scheduled tokens of the context each attends to; a chunk of `q`
      tokens starting at position `s` contributes `sum_{j<q} (s+j+1) = q*s + q*(q+1)/2`.
    - `kv_read_tokens`: sum over sequences of their context length `s + q`: the K/V each
      sequence streams from memory once per layer.
    - `swap_bytes`: bytes moved between host and device this step (swap in/out);
      `swap_blocks`: the blocks they fill (each direction counted), `swap_moves`: the
      requests moved (a swap-out and a swap-in are one each). The fixed costs of the copies
      depend on these (`SwapPath`).
    - `hidden_tokens`: past tokens (`s`, a subset of `kv_read_tokens`) of sequences held in
      Apt-Serve's hidden-state cache, whose K/V are recomputed from the stored layer inputs
      this step. The step's own `q` tokens are not counted: their K/V projections are part of
      every token's forward pass, on either cache type (priced in compute already).
    - `padded_tokens`, `page_walk`: the work of a runner that pads steps to shape buckets
      (the JAX runner): tokens after padding, and padded tokens x the longest cached prefix,
      which the jnp attention walks for every token. Zero when no bucketing is modelled.
    - `layer_bytes`: per-layer transfers of layer-wise residency (LayerKV); None when the
      step moves no layer (never in a profile, so not in `to_dict`).
    - `prefill_square`, `prefill_prefix`, `decode_context`: `attended` split the way
      measured attention kernels cost it (`MeasuredCostModel`): over prefill chunks the sum
      of `q*q` (the chunk against itself) and of `q*s` (against its cached prefix), and over
      decodes the sum of their contexts `s+1`, which a paged decode kernel streams.
    - `padded_prefill_tokens`: the prefill chunks' tokens were each padded to the longest
      (chunks x longest), what a stack that pads prompts into a 2-D batch computes (vLLM
      0.2.x, `EngineOverhead.pads_prompts`).
    - `copy_bytes`: bytes of device blocks copied to other device blocks before the step
      (a forked sequence's copy-on-write, `Batch.block_copies`), read and written once.
    """

    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    attended: int
    kv_read_tokens: int
    swap_bytes: int = 0
    hidden_tokens: int = 0
    padded_tokens: int = 0
    page_walk: int = 0
    swap_blocks: int = 0
    swap_moves: int = 0
    layer_bytes: LayerTraffic | None = None
    prefill_square: int = 0
    prefill_prefix: int = 0
    decode_context: int = 0
    padded_prefill_tokens: int = 0
    copy_bytes: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def moves_cache(self) -> bool:
        """Whether the step swaps, moves layers or recomputes hidden-cache K/V: work a
        profile of the plain runner does not measure."""
        return bool(self.swap_bytes or self.copy_bytes or self.layer_bytes is not None or self.hidden_tokens)

    @classmethod
    def from_lens(cls, start: np.ndarray | Sequence[int], query_lens: np.ndarray | Sequence[int]) -> StepShape:
        """Shape of sequences computing `query_lens[i]` tokens from position `start[i]`."""
        q = np.asarray(query_lens, dtype=np.int64)
        s = np.asarray(start, dtype=np.int64)
        total = int(q.sum())
        decode = q == 1
        num_decode = int(np.count_nonzero(decode))
        # q*(2s+q+1) is always even, so the halving is exact.
        attended = int((q * (2 * s + q + 1)).sum()) // 2
        chunk = ~decode
        return cls(
            num_seqs=len(q),
            num_prefill_tokens=total - num_decode,
            num_decode_tokens=num_decode,
            attended=attended,
            kv_read_tokens=int(s.sum()) + total,
            prefill_square=int((q[chunk] * q[chunk]).sum()),
            prefill_prefix=int((q[chunk] * s[chunk]).sum()),
            decode_context=int(s[decode].sum()) + num_decode,
            padded_prefill_tokens=int(chunk.sum()) * int(q[chunk].max()) if chunk.any() else 0,
        )

    @classmethod
    def of(cls, batch: Batch, pad: Callable[[int], int] | None = None,
           bytes_per_block: int = 0) -> StepShape:
        """Shape of a runner's `Batch` (a few numpy reductions: called every simulated step);
        `pad` maps a token count to the runner's bucket when padding is modelled;
        `bytes_per_block` prices the batch's swapped blocks (all layers' K and V), out and in,
        and whatever the cache features' parts of the batch move."""
        shape = cls.from_lens(batch.start, batch.query_lens)
        if batch.num_swapped_blocks:
            blocks = batch.num_swapped_blocks
            shape = dataclasses.replace(shape, swap_bytes=blocks * bytes_per_block, swap_blocks=blocks,
                                        swap_moves=len(batch.swap_out) + len(batch.swap_in))
        if batch.block_copies:
            shape = dataclasses.replace(shape, copy_bytes=len(batch.block_copies) * bytes_per_block)
        for section in batch.features.values():  # the cache features' own terms
            shape = dataclasses.replace(shape, **section.shape_terms(batch, bytes_per_block))
        if pad is None or batch.num_seqs == 0:
            return shape
        padded = pad(shape.num_tokens)
        return dataclasses.replace(shape, padded_tokens=padded, page_walk=padded * int(batch.start.max()))

    def one_token_on(self) -> StepShape:
        """The next step of the same decodes, every sequence one token further on (for
        repeated steps, `Plan.repeat`): each attends to, and reads, one more token, and the
        padded page walk reaches one position further."""
        if self.num_prefill_tokens or self.moves_cache:
            raise ValueError(f"only a step of plain decodes repeats, not {self}")
        return dataclasses.replace(self, attended=self.attended + self.num_seqs,
                                   kv_read_tokens=self.kv_read_tokens + self.num_seqs,
                                   decode_context=self.decode_context + self.num_seqs,
                                   page_walk=self.page_walk + self.padded_tokens)

    @classmethod
    def prefill(cls, num_tokens: int, start: int = 0) -> StepShape:
        """One sequence computing `num_tokens` tokens after `start` cached ones."""
        return cls.from_lens([start], [num_tokens])

    @classmethod
    def swap(cls, num_blocks: int, bytes_per_block: int, moves: int = 1) -> StepShape:
        """A step that only moves `num_blocks` blocks of `moves` requests (no compute)."""
        return cls(0, 0, 0, 0, 0, swap_bytes=num_blocks * bytes_per_block, swap_blocks=num_blocks,
                   swap_moves=moves)

    @classmethod
    def decode(cls, context_lens: np.ndarray | Sequence[int]) -> StepShape:
        """One decode token for each sequence; `context_lens` include the new token."""
        ctx = np.asarray(context_lens, dtype=np.int64)
        return cls.from_lens(ctx - 1, np.ones_like(ctx))

    def to_dict(self) -> dict[str, int]:
        if self.layer_bytes is not None:
            raise ValueError("a step that moves layers is not a profile sample")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layer_bytes"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepShape:
        names = {f.name for f in dataclasses.fields(cls)}
        # Profiles written before layer moves were per layer carry a zero `host_layer_tokens`.
        d = {k: v for k, v in d.items() if not (k == "host_layer_tokens" and v == 0)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown StepShape fields {sorted(unknown)}; known: {sorted(names)}")
        return cls(**{k: int(v) for k, v in d.items()})


class CostModel(Protocol):
    def step_time(self, shape: StepShape) -> float:
        """Seconds one iteration of this shape takes."""
        ...


# ---------------------------------------------------------------------------------------
# Swap paths
# ---------------------------------------------------------------------------------------

# jserve's gathered swap moves one buffer per request with `jax.device_put`; its fixed cost
# is the intercept of a line through bench/results/host_transfer_NVIDIA-H100-80GB-HBM3.json
# (16 MiB - 1 GiB pinned-host copies, 2026-11-22): 0.228 ms device->host, 0.211 ms
# host->device (slopes 54.3 / 54.6 GB/s). Measured on H100 only; used for every device.
JAX_PUT_LATENCY = 0.22e-3


class SwapPath(enum.Enum):
    """How the modelled runner moves one request's K/V between device and host.

    - `PER_BLOCK_LAYER` (vLLM v0, which CacheOpt modified): `CacheEngine.swap_in/out` calls
      `swap_blocks` for each layer's K and V cache, and that issues one `cudaMemcpyAsync`
      per block, on the stream the next forward pass runs on. A request of n blocks costs
      `n * 2 * layers` copies, each paying `Hardware.copy_latency`, plus its bytes over the
      host link. For OPT-13B (10 KB per token per layer's K or V) this moves 9-17 GB/s at
      block sizes 8-32. A published cross-check, whose page size we could not find: vLLM
      PR #11531 measured v0's `swap_blocks` at 3.1 GB/s on A100-40GB-SXM for 1,250 pages
      (1.2 GB/s for one); at that rate swapping would lose to recompute at every length.
    - `GATHERED` (jserve's `HostKVStore`): a jit gathers the request's blocks of every
      layer into one device buffer (device memory read and written once), one `device_put`
      moves it (`JAX_PUT_LATENCY`), and the swap-in scatters it back the same way.
    """

    PER_BLOCK_LAYER = "per-block-layer"
    GATHERED = "gathered"


# ---------------------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------------------


def overlap_layers(work: float, before: np.ndarray, out_before: np.ndarray,
                   out_after: np.ndarray, allreduce: float = 0.0, shared_link: bool = False) -> float:
    """Seconds of a step whose `work` is split evenly over its layers while LayerKV's layer
    copies run on their own streams (Section 4: a dedicated copy stream), per layer `l`:
    `before[l]` host -> device (an offloaded layer brought back) must end before layer `l`
    computes; on the device -> host stream, `out_before[l]` (a retained layer offloaded, its
    slots reused by this step) must end before layer `l` computes, and `out_after[l]` (a
    prefill's new K/V of an offloaded layer) starts once layer `l` has computed. The link is
    full duplex, so the two streams do not wait for each other; the device -> host stream
    runs the offloads first, in layer order, then the prefill's writes. With one kind of copy of x
    seconds a layer and c of compute, the step takes `L * max(c, x) + min(c, x)`:
    `max(C, X) + min(C, X) / L`, the compute hidden under the copies or the other way round
    but for one layer.

    Under tensor parallelism each layer ends with `allreduce` seconds of all-reduces (its
    two, after attention and after the MLP, counted together at the layer's end). With
    `shared_link` (no NVLink: the all-reduces cross the PCIe link the copies use) the copies
    pause while an all-reduce runs, in both directions, and advance only in the link's idle
    time: LayerKV Section 3.1.3 checks the link before each sub-unit of a copy and holds it
    back while an all-reduce is on, so the all-reduce keeps its speed and the copies wait.
    (The sub-unit in flight when an all-reduce starts is not modelled.)"""
    num_layers = len(before)
    c = work / num_layers
    busy: list[tuple[float, float]] = []  # the all-reduces' windows on a shared link
    t_in = t_out = 0.0
    i_in = i_out = 0
    t_compute = 0.0
    ends = []
    for l in range(num_layers):
        t_in, i_in = _advance(t_in, float(before[l]), busy, i_in)
        t_out, i_out = _advance(t_out, float(out_before[l]), busy, i_out)
        t_compute = max(t_compute, t_in, t_out) + c
        ends.append(t_compute)
        if shared_link and allreduce > 0:
            busy.append((t_compute, t_compute + allreduce))
        t_compute += allreduce
    for l in range(num_layers):  # the prefill's writes, queued after the offloads
        t_out, i_out = _advance(max(t_out, ends[l]), float(out_after[l]), busy, i_out)
    return max(t_compute, t_out)


def _advance(t: float, amount: float, busy: list[tuple[float, float]], i: int) -> tuple[float, int]:
    """When a copy of `amount` seconds of link time, started at `t`, ends if it cannot use
    the link during the sorted windows `busy` (`i`: the first window not yet passed, which
    is returned updated, since a stream's copies only move forward in time)."""
    while i < len(busy) and busy[i][1] <= t:
        i += 1
    while i < len(busy) and busy[i][0] < t + amount:
        start, end = busy[i]
        amount -= max(start - t, 0.0)
        t = max(t, end)
        i += 1
    return t + amount, i


# Megatron-LM's tensor-parallel transformer layer all-reduces twice: after the attention's
# output projection and after the MLP's down projection (Shoeybi et al., 2019, Section 3).
ALLREDUCES_PER_LAYER = 2
# Kernels a transformer layer launches in an eager step: four GEMMs (QKV, output, the MLP's
# two), six element-wise kernels (two norms, rotary or positions, activation, two residual
# adds) and attention (a prefill and a decode kernel when the step holds both); the LM head
# adds one a step.
GEMMS_PER_LAYER = 4
ELEMENTWISE_KERNELS_PER_LAYER = 6


class RooflineCostModel:
    """`step_time = overlap(gpu work + all-reduces, layer transfers) + swaps + the stack's
    overhead` (0 for an empty step), for one GPU of a tensor-parallel group of
    `tensor_parallel` (each computes and reads its 1/tp share at once). The GPU's work is
    `max(compute, memory)` here (`MeasuredCostModel` prices measured kernels instead), times
    the stack's `gpu_slowdown`, plus its eager launches; the stack (`engine`, an
    `EngineOverhead` profile) adds its CPU time per step, per sequence and per worker.

    - compute = FLOPs / (peak * mfu * tp) with FLOPs = `2 * num_params` per scheduled token
      (every parameter counted as a matmul weight for every token: the LM head really runs
      only on sampled rows and the embedding is a lookup; simple, slightly pessimistic for
      prefill) + attention `4 * heads * head_dim * layers` per attended token (QK^T and PV).
    - hidden-cache recompute (Apt-Serve): `2 * 2 * hidden * kv_dim * layers` FLOPs per
      hidden token (the K and V projections of every past row of a hidden sequence),
      added after the rest: it runs inside the attention, after the layer's weight-bound
      projections, compute-bound on rows the step reads anyway (as the calibrated model
      adds it), so each hidden block costs the step its projection, Eq. 6's linear rho.
    - memory = bytes / (hbm * mbu * tp): all weights once + K/V of `kv_read_tokens` (hidden
      tokens read `hidden` values per layer instead of `2 * kv_dim`); activations ignored.
    - swaps = `swap_bytes / (pcie * tp)` plus the swap's fixed costs by `swap_path`
      (`SwapPath`), added serially: the step waits for its swaps, as in vLLM v0 where the
      copies run on the compute stream before the forward pass.
    - layer moves (LayerKV, `StepShape.layer_bytes`, per layer) are pipelined with the
      per-layer compute (`overlap_layers`): a prefill writes layer l's K/V to host right
      after computing it, and a decode's layer l comes back while earlier layers compute
      (LayerKV Section 4, its own copy stream), each direction at `pcie * tp` (the link is
      full duplex); kept layers' slots copied into whole blocks cost a read and a write at
      HBM speed.
      Each GPU of a TP group issues its own copies in parallel over its host link, and GPUs
      that share one link (`Hardware.gpus_per_host_link`) split it: host copies move at
      `pcie * hw.host_links(tp)`.
    - all-reduces (`allreduce_time`): Megatron-style tensor parallelism all-reduces the
      layer's output twice a layer (after attention, after the MLP), each of `tokens *
      hidden * dtype_bytes` (tokens after padding when the shape has them) as a ring over
      the hardware's `Interconnect`, serially with the compute. Without NVLink the
      all-reduces share the PCIe link with LayerKV's layer copies, which then wait for them
      (`overlap_layers`' `shared_link`; LayerKV Section 3.1.3). Swaps wait anyway (serial).
    """

    def __init__(self, cfg: ModelConfig, hw: Hardware, dtype_bytes: int = 2,
                 tensor_parallel: int = 1, engine: EngineOverhead = FLAT_2MS,
                 swap_path: SwapPath = SwapPath.PER_BLOCK_LAYER) -> None:
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        self.cfg, self.hw, self.engine = cfg, hw, engine
        self.dtype_bytes, self.tensor_parallel = dtype_bytes, tensor_parallel
        self.swap_path = swap_path
        self.watch = FitRangeWatch(self.fit_terms(), tensor_parallel, self.tp_terms())
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        self.flops_per_token = 2.0 * cfg.num_params
        self.flops_per_attended = 4.0 * cfg.num_heads * cfg.head_dim * cfg.num_layers
        self.flops_per_hidden_token = 4.0 * cfg.hidden_size * kv_dim * cfg.num_layers
        self.weight_bytes = float(cfg.num_params * dtype_bytes)
        self.kv_bytes_per_token_layer = 2.0 * kv_dim * dtype_bytes
        self.kv_bytes_per_token = self.kv_bytes_per_token_layer * cfg.num_layers
        # every GPU reads whole hidden rows (see `jserve.cache.sizing.hidden_block_tokens`)
        self.hidden_bytes_per_token = float(cfg.hidden_size * dtype_bytes * cfg.num_layers * tensor_parallel)
        self.flop_rate = hw.peak_flops * hw.mfu * tensor_parallel
        self.byte_rate = hw.hbm_bandwidth * hw.mbu * tensor_parallel
        self.pcie_rate = hw.pcie_bandwidth * hw.host_links(tensor_parallel)
        self.allreduce_bytes_per_token = float(cfg.hidden_size * dtype_bytes)

    def __repr__(self) -> str:
        return (f"RooflineCostModel({self.cfg.name}, {self.hw.name}, tp={self.tensor_parallel}, "
                f"dtype_bytes={self.dtype_bytes}, engine={self.engine.name}, "
                f"swap_path={self.swap_path.value})")

    def fit_terms(self) -> list[tuple[str, FitRange]]:
        """The terms whose fit ranges a step is checked against (`FitRangeWatch`)."""
        return [(f"engine overhead {self.engine.name}: CPU time per step and per sequence",
                 self.engine.fit_range)]

    def tp_terms(self) -> list[tuple[str, FitRange]]:
        """The terms checked against the tensor-parallel degree, once."""
        if self.tensor_parallel == 1:
            return []
        return [(f"engine overhead {self.engine.name}: per-step cost of its workers", self.engine.worker_range)]

    def compute_time(self, shape: StepShape) -> float:
        flops = self.flops_per_token * shape.num_tokens + self.flops_per_attended * shape.attended
        return flops / self.flop_rate

    def memory_time(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        kv = max(shape.kv_read_tokens - shape.hidden_tokens, 0) * self.kv_bytes_per_token
        hidden = shape.hidden_tokens * self.hidden_bytes_per_token
        return (self.weight_bytes + kv + hidden) / self.byte_rate

    def allreduce_time(self, shape: StepShape) -> float:
        """One of a layer's all-reduces (0 without tensor parallelism): the step's tokens'
        hidden states, as many as the runner computes (padded when it pads)."""
        tokens = max(shape.num_tokens, shape.padded_tokens)
        if tokens == 0:
            return 0.0
        return self.hw.interconnect.allreduce_time(tokens * self.allreduce_bytes_per_token,
                                                   self.tensor_parallel)

    def communication_time(self, shape: StepShape) -> float:
        """All the step's all-reduces: two a layer."""
        return ALLREDUCES_PER_LAYER * self.cfg.num_layers * self.allreduce_time(shape)

    def transfer_time(self, shape: StepShape) -> float:
        """Swaps and device block copies, which the step waits for."""
        return (shape.swap_bytes / self.pcie_rate + self.swap_fixed_time(shape)
                + 2 * shape.copy_bytes / self.byte_rate)

    def layer_transfer_time(self, shape: StepShape) -> float:
        """LayerKV's host<->device layer moves on their own: the busier direction of the link."""
        t = shape.layer_bytes
        if t is None:
            return 0.0
        return max(sum(t.prefill_to_host) + sum(t.to_host), sum(t.to_device)) / self.pcie_rate

    def layered_time(self, work: float, shape: StepShape, allreduce: float = 0.0) -> float:
        """`work` seconds of compute split evenly over the layers, each followed by
        `allreduce` seconds of all-reduces, pipelined with the step's layer moves
        (`overlap_layers`, with the link shared when the interconnect is PCIe), plus the
        device-to-device copies of kept layers' slots into whole blocks (read and written
        once, at HBM speed)."""
        t = shape.layer_bytes
        if t is None:
            return work + allreduce * self.cfg.num_layers
        rate = self.pcie_rate
        return (overlap_layers(work, np.asarray(t.to_device) / rate, np.asarray(t.to_host) / rate,
                               np.asarray(t.prefill_to_host) / rate, allreduce,
                               self.hw.interconnect.shares_host_link)
                + 2 * sum(t.device_copy) / self.byte_rate)

    def swap_fixed_time(self, shape: StepShape) -> float:
        """What a swap costs beyond its bytes on the link (see `SwapPath`)."""
        if self.swap_path is SwapPath.PER_BLOCK_LAYER:
            return shape.swap_blocks * 2 * self.cfg.num_layers * self.hw.copy_latency
        return shape.swap_moves * JAX_PUT_LATENCY + 2 * shape.swap_bytes / self.byte_rate

    def hidden_recompute_time(self, shape: StepShape) -> float:
        """Compute time of the hidden-cache K/V recompute alone."""
        return self.flops_per_hidden_token * shape.hidden_tokens / self.flop_rate

    def kernel_time(self, shape: StepShape) -> float:
        """The device's work of a step that moves no cache: here the roofline's
        `max(compute, memory)`."""
        return max(self.compute_time(shape), self.memory_time(shape))

    def kernel_launches(self, shape: StepShape) -> int:
        """Kernels one GPU launches in the step (see `GEMMS_PER_LAYER`)."""
        attention = (shape.num_prefill_tokens > 0) + (shape.num_decode_tokens > 0)
        return self.cfg.num_layers * (GEMMS_PER_LAYER + ELEMENTWISE_KERNELS_PER_LAYER + attention) + 1

    def launch_time(self, shape: StepShape) -> float:
        """The GPU's idle time between eagerly launched kernels (0 under a CUDA graph)."""
        e = self.engine
        if not e.eager_launch or not shape.num_tokens or \
                not e.launches_eagerly(shape.num_seqs, shape.num_prefill_tokens > 0):
            return 0.0
        return e.eager_launch * self.kernel_launches(shape)

    def gpu_time(self, shape: StepShape) -> float:
        """The GPU's work of a busy step before all-reduces and copies: its kernels as this
        stack runs them, their launches, and the hidden cache's K/V recompute."""
        return (self.engine.gpu_slowdown * self.kernel_time(shape) + self.launch_time(shape)
                + self.hidden_recompute_time(shape))

    def overhead_time(self, shape: StepShape) -> float:
        """The stack's time per busy step outside the GPU's work."""
        if not shape.num_tokens:
            return 0.0
        return self.engine.cpu_time(shape.num_seqs, self.tensor_parallel)

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        """The terms of `step_time`, for reports and tests."""
        return {
            "compute": self.compute_time(shape),
            "memory": self.memory_time(shape),
            "hidden_recompute": self.hidden_recompute_time(shape),
            "transfer": self.transfer_time(shape),
            "layer_transfer": self.layer_transfer_time(shape),
            "allreduce": self.communication_time(shape),
            "launches": self.launch_time(shape),
            "overhead": self.overhead_time(shape),
        }

    def step_time(self, shape: StepShape) -> float:
        transfer = self.transfer_time(shape)
        if shape.num_tokens == 0:
            return self.layered_time(0.0, shape) + transfer
        self.watch.check(shape.num_seqs, shape.kv_read_tokens / shape.num_seqs, shape.num_tokens)
        work = self.gpu_time(shape)
        per_layer = ALLREDUCES_PER_LAYER * self.allreduce_time(shape)
        return self.layered_time(work, shape, per_layer) + transfer + self.overhead_time(shape)


# ---------------------------------------------------------------------------------------
# Calibrated (fitted) model
# ---------------------------------------------------------------------------------------

FEATURES = ("intercept", "num_prefill_tokens", "num_decode_tokens", "num_seqs", "attended",
            "kv_read_tokens", "padded_tokens", "page_walk")
PROFILE_FORMAT = "jserve-cost-profile"
PROFILE_VERSION = 1


def features(shape: StepShape) -> np.ndarray:
    """The calibrated model's feature vector of one shape (order: `FEATURES`)."""
    return np.array([1.0, shape.num_prefill_tokens, shape.num_decode_tokens, shape.num_seqs,
                     shape.attended, shape.kv_read_tokens, shape.padded_tokens, shape.page_walk],
                    dtype=np.float64)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set; small problems only).

    Columns are scaled to unit norm internally so features of very different magnitudes
    (an intercept next to attended-token counts of 1e8) are solved stably.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    m, n = a.shape
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, np.abs(a).sum(axis=0).max())
    max_iter = max_iter or 3 * n + 10
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or not (w[~passive] > tol).any():
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            neg = passive & (z <= tol)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
        w = a.T @ (b - a @ x)
    return np.maximum(x, 0.0) / scale


@dataclass(frozen=True)
class CalibratedCostModel:
    """`step_time = coefficients . features(shape)` (see `FEATURES`).

    Fitted to profiled `(StepShape, seconds)` samples by non-negative least squares (no
    feature may make a step cheaper). With `weighting="relative"` (the default) each sample
    is weighted by 1/seconds, i.e. the fit minimizes relative error, so short decode steps,
    which set TBT, are fitted as well as long prefills.

    Profiles measure the plain runner, so the host-transfer and hidden-cache terms are not
    fitted: pass `extras` (a `RooflineCostModel` of the same model and hardware) to price
    them analytically: swaps and recompute added serially, LayerKV's layer moves pipelined
    with the fitted step time as the roofline pipelines them with its compute (the fitted
    step's fixed overhead is then counted as overlappable, a small optimism); without
    `extras` a shape using them is an error.
    """

    coefficients: tuple[float, ...]
    model_name: str = ""
    device: str = ""
    weighting: str = "relative"
    samples: tuple[tuple[StepShape, float], ...] = ()
    extras: RooflineCostModel | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"need {len(FEATURES)} coefficients {FEATURES}, got {len(self.coefficients)}")
        if any(not math.isfinite(c) or c < 0 for c in self.coefficients):
            raise ValueError(f"coefficients must be finite and >= 0, got {self.coefficients}")

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepShape, float]], *, model_name: str = "", device: str = "",
            weighting: str = "relative", extras: RooflineCostModel | None = None) -> CalibratedCostModel:
        if weighting not in ("relative", "absolute"):
            raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
        samples = tuple((shape, float(t)) for shape, t in samples)
        if len(samples) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} samples to fit {FEATURES}, got {len(samples)}")
        for shape, t in samples:
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"step times must be finite and > 0, got {t} for {shape}")
            if shape.moves_cache:
                raise ValueError(f"profile samples must not move or recompute cache (swap, host "
                                 f"layers, hidden tokens): {shape}")
        x = np.stack([features(s) for s, _ in samples])
        y = np.array([t for _, t in samples])
        # Padding features are optional: profiles of unpadded runners leave them at zero.
        missing = [FEATURES[j] for j in range(1, 6) if not x[:, j].any()]
        if missing:
            raise ValueError(f"the profile never exercises {missing}: their cost cannot be fitted; "
                             f"profile steps with prefills and decodes at several batch sizes and contexts")
        w = 1.0 / y if weighting == "relative" else np.ones_like(y)
        coef = nnls(x * w[:, None], y * w)
        return cls(tuple(float(c) for c in coef), model_name=model_name, device=device,
                   weighting=weighting, samples=samples, extras=extras)

    def step_time(self, shape: StepShape) -> float:
        c = self.coefficients
        t = float(np.dot(c, features(shape)))
        if shape.num_tokens == 0:
            t = 0.0
        if shape.moves_cache:
            if self.extras is None:
                raise ValueError("this shape moves or recomputes cache but the calibrated model has no "
                                 "`extras` (RooflineCostModel) to price transfers and recompute")
            e = self.extras
            t = e.layered_time(t, shape) + e.transfer_time(shape) + e.hidden_recompute_time(shape)
        return t

    def hidden_recompute_time(self, shape: StepShape) -> float:
        """The hidden-cache K/V recompute alone, priced by `extras` (0 without them)."""
        return 0.0 if self.extras is None else self.extras.hidden_recompute_time(shape)

    def fit_errors(self) -> np.ndarray:
        """Relative error (predicted / measured - 1) on each profiled sample."""
        if not self.samples:
            return np.zeros(0)
        return np.array([self.step_time(s) / t - 1.0 for s, t in self.samples])

    def with_extras(self, extras: RooflineCostModel | None) -> CalibratedCostModel:
        return dataclasses.replace(self, extras=extras)

    # -- profile files -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        errors = self.fit_errors()
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "model": self.model_name,
            "device": self.device,
            "weighting": self.weighting,
            "features": list(FEATURES),
            "coefficients": dict(zip(FEATURES, self.coefficients)),
            "fit": {
                "num_samples": len(self.samples),
                "rms_relative_error": float(np.sqrt(np.mean(errors**2))) if len(errors) else None,
                "max_relative_error": float(np.abs(errors).max()) if len(errors) else None,
            },
            "samples": [{"shape": s.to_dict(), "seconds": t} for s, t in self.samples],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], extras: RooflineCostModel | None = None) -> CalibratedCostModel:
        if d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a {PROFILE_FORMAT} profile (format={d.get('format')!r})")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"unsupported profile version {d.get('version')!r}; this jserve reads "
                             f"version {PROFILE_VERSION}")
        coef = d["coefficients"]
        if set(coef) != set(FEATURES):
            raise ValueError(f"profile coefficients {sorted(coef)} do not match features {list(FEATURES)}")
        samples = tuple((StepShape.from_dict(s["shape"]), float(s["seconds"])) for s in d.get("samples", ()))
        return cls(tuple(float(coef[f]) for f in FEATURES), model_name=d.get("model", ""),
                   device=d.get("device", ""), weighting=d.get("weighting", "relative"),
                   samples=samples, extras=extras)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str], extras: RooflineCostModel | None = None) -> CalibratedCostModel:
        """From JSON text, or from a profile file when `source` is a path (not starting with '{')."""
        if isinstance(source, str) and source.lstrip().startswith("{"):
            return cls.from_dict(json.loads(source), extras)
        return cls.load(source, extras)

    def save(self, path: str | os.PathLike[str]) -> None:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str], extras: RooflineCostModel | None = None) -> CalibratedCostModel:
        path = pathlib.Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ValueError(f"cost profile {str(path)!r} does not exist") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"cost profile {str(path)!r} is not valid JSON: {e}") from None
        return cls.from_dict(d, extras)


# ---------------------------------------------------------------------------------------
# Preemption pricing helpers
# ---------------------------------------------------------------------------------------


def hidden_block_cost(model: RooflineCostModel | CalibratedCostModel, hidden_block_tokens: int) -> float:
    """Apt-Serve's rho (Eq. 6): the seconds one block of hidden rows in a batch adds to a
    step, the K and V projections of its `hidden_block_tokens` rows in every layer. The
    rows' reads replace the K/V reads they stand for, so only the projection is extra."""
    if hidden_block_tokens < 1:
        return 0.0
    probe = StepShape(1, 0, 1, hidden_block_tokens, hidden_block_tokens,
                      hidden_tokens=hidden_block_tokens)
    return model.hidden_recompute_time(probe)


def swap_time(model: CostModel, num_tokens: int, block_size: int, bytes_per_block: int) -> float:
    """Seconds to swap a request of `num_tokens` cached tokens out and back in (its blocks
    each way; CacheOpt's Figure 8 counts both): what the steps that move it wait for."""
    if num_tokens <= 0:
        return 0.0
    blocks = -(-num_tokens // block_size)
    return model.step_time(StepShape.swap(2 * blocks, bytes_per_block, moves=2))


def recompute_time(model: CostModel, num_tokens: int) -> float:
    """Seconds to rebuild `num_tokens` of KV: the step time of a prefill of that length."""
    return model.step_time(StepShape.prefill(num_tokens)) if num_tokens > 0 else 0.0


# Prompt lengths the prefill-time fit below samples: ShareGPT turns' range under a 4k context.
PREFILL_FIT_TOKENS = tuple(range(128, 4097, 128))


def prefill_seconds_per_token(model: CostModel, lengths: Sequence[int] = PREFILL_FIT_TOKENS) -> float:
    """Slope of a least-squares line through the origin between a lone prompt's prefill
    tokens and its prefill time: how the T-LRU paper turns xi from seconds into tokens
    (its footnote 7, a linear fit of prefill time on awaited prefill tokens, done once,
    offline; without an intercept, so xi tokens take xi seconds on this model)."""
    tokens = np.asarray(lengths, dtype=np.float64)
    times = np.array([model.step_time(StepShape.prefill(int(n))) for n in lengths])
    return float(tokens @ times / (tokens @ tokens))
