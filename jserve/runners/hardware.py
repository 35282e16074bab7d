"""Accelerator descriptions for the simulator's cost model, and vLLM-style KV capacity.

Figures are per GPU, from the vendors' datasheets (cited next to each entry). `memory_bytes`
is the capacity the device reports to the framework (what vLLM's `gpu_memory_utilization`
multiplies), which for HBM parts is the datasheet "GB" read as GiB. `pcie_bandwidth` is the
*effective* one-direction host<->device rate of pinned-memory copies, about 75-80% of the
link's theoretical rate. `copy_latency` is the fixed cost of one host<->device copy call,
what a swap that copies block by block pays per block (see `cost_model.SwapPath`). `mfu` / `mbu` are the fractions of peak FLOP/s and HBM bandwidth
that large bf16 GEMMs / streaming reads achieve in practice; 0.6 / 0.8 are conventional
planning figures, not measurements: fit a `CalibratedCostModel` where accuracy matters.

Each entry also names the GPU-to-GPU `Interconnect` of the server it is modelled in (NVLink,
or PCIe only), which prices tensor parallelism's all-reduces, and how many GPUs share one
host link (`gpus_per_host_link`), which caps a TP group's host<->device bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from jserve.cache.sizing import block_bytes
from jserve.models.config import ModelConfig

GB = 1e9
GiB = 2**30
MiB = 2**20
TFLOPS = 1e12

# Fixed cost of one `cudaMemcpyAsync` call: "approximately 5-7 us" per copy of a small chunk,
# measured by DualPath (Wu et al., arXiv 2602.21548, Section 5.2); the middle of that range.
# A published figure, not measured here: no GPU of ours ran vLLM's per-block copies.
CUDA_MEMCPY_LATENCY = 6e-6

# NCCL's own cost model of a ring all-reduce (src/graph/tuning.cc, `baseLat` and `hwLat`,
# Ring with the LL protocol it picks for the small messages of decode steps): 6.6 us per
# call plus 0.6 us per ring step over NVLink, 1.0 us over PCIe. NCCL's tuning figures, not
# measured here.
NCCL_RING_BASE_LATENCY = 6.6e-6
NCCL_NVLINK_STEP_LATENCY = 0.6e-6
NCCL_PCIE_STEP_LATENCY = 1.0e-6
# Achieved fraction of an interconnect's per-direction peak in a ring all-reduce: the `mbu`
# planning figure, not a measurement (NCCL reaches ~80% of NVLink's peak in nccl-tests, as
# commonly reported; we found no figure to cite for A100 or L20).
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Interconnect:
    """How the GPUs of one server talk to each other, for tensor parallelism's all-reduces.

    `kind` is 'nvlink' or 'pcie'. `bandwidth` is the effective one-direction rate one GPU
    sends (and receives) at in a ring; `step_latency` the fixed cost of each of a ring's
    2(N-1) steps and `call_latency` that of one collective call. Over PCIe the all-reduce
    uses the same link as host copies (`shares_host_link`), which is what makes LayerKV's
    offload contend with it (LayerKV Section 3.1.3)."""

    kind: str
    bandwidth: float  # B/s, one direction, per GPU, effective
    step_latency: float
    call_latency: float = NCCL_RING_BASE_LATENCY

    def __post_init__(self) -> None:
        if self.kind not in ("nvlink", "pcie"):
            raise ValueError(f"interconnect kind must be 'nvlink' or 'pcie', got {self.kind!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"interconnect bandwidth must be > 0, got {self.bandwidth}")
        if self.step_latency < 0 or self.call_latency < 0:
            raise ValueError("interconnect latencies must be >= 0")

    @property
    def shares_host_link(self) -> bool:
        return self.kind == "pcie"

    def allreduce_time(self, num_bytes: float, num_gpus: int) -> float:
        """Seconds of one ring all-reduce of `num_bytes` (each GPU's whole tensor) over
        `num_gpus`: reduce-scatter then all-gather, 2(N-1) steps each moving 1/N of it,
        `2(N-1)/N * bytes / bandwidth + 2(N-1) * step_latency + call_latency`; 0 for one GPU."""
        if num_gpus <= 1:
            return 0.0
        steps = 2 * (num_gpus - 1)
        return steps / num_gpus * num_bytes / self.bandwidth + steps * self.step_latency + self.call_latency


# NVIDIA A100 datasheet: third-generation NVLink, 600 GB/s total bidirectional per GPU (12
# links x 50 GB/s), i.e. 300 GB/s a direction. H100 / H200 SXM datasheets: fourth-generation
# NVLink, 900 GB/s total, 450 GB/s a direction.
NVLINK3 = Interconnect("nvlink", LINK_EFFICIENCY * 300 * GB, NCCL_NVLINK_STEP_LATENCY)
NVLINK4 = Interconnect("nvlink", LINK_EFFICIENCY * 450 * GB, NCCL_NVLINK_STEP_LATENCY)
# PCIe 4.0 x16 peer-to-peer: 25 GB/s a direction effective, the host link's effective rate
# below (79% of 31.5 GB/s); not measured on an L20.
PCIE4 = Interconnect("pcie", 25 * GB, NCCL_PCIE_STEP_LATENCY)


@dataclass(frozen=True)
class Hardware:
    """One accelerator: peak rates, memory, and the achievable fractions of the peaks."""

    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    hbm_bandwidth: float  # device memory bandwidth, B/s
    pcie_bandwidth: float  # host<->device, one direction, effective, B/s
    memory_bytes: float  # device memory capacity as the device reports it, B
    copy_latency: float = CUDA_MEMCPY_LATENCY  # fixed seconds per host<->device copy call
    mfu: float = 0.6  # achievable fraction of peak_flops for large matmuls
    mbu: float = 0.8  # achievable fraction of hbm_bandwidth
    interconnect: Interconnect = PCIE4  # GPU-to-GPU, for tensor parallelism (PCIe unless named)
    gpus_per_host_link: int = 1  # GPUs sharing one host PCIe link (through a switch)

    def __post_init__(self) -> None:
        for field in ("peak_flops", "hbm_bandwidth", "pcie_bandwidth", "memory_bytes"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{self.name}: {field} must be > 0, got {getattr(self, field)}")
        if self.copy_latency < 0:
            raise ValueError(f"{self.name}: copy_latency must be >= 0, got {self.copy_latency}")
        for field in ("mfu", "mbu"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"{self.name}: {field} must be in (0, 1], got {getattr(self, field)}")
        if self.gpus_per_host_link < 1:
            raise ValueError(f"{self.name}: gpus_per_host_link must be >= 1, got {self.gpus_per_host_link}")

    def host_links(self, tensor_parallel: int) -> int:
        """Host links a TP group of `tensor_parallel` GPUs (numbered together, as
        CUDA_VISIBLE_DEVICES=0..N-1 gives them) copies over at once."""
        return -(-tensor_parallel // self.gpus_per_host_link)

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.mfu

    @property
    def effective_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.mbu


HARDWARE: dict[str, Hardware] = {
    hw.name: hw
    for hw in [
        # NVIDIA A100 Tensor Core GPU datasheet: BF16 tensor 312 TFLOPS dense (624 with
        # sparsity); A100 40GB SXM HBM2 1,555 GB/s; the device reports 40,536 MiB to the
        # framework (nvidia-smi shows 40,960).
        # PCIe 4.0 x16: 31.5 GB/s per direction theoretical (16 GT/s x 16 lanes, 128b/130b);
        # 25 GB/s effective pinned copies is 79% of it, the fraction our H100 measured of
        # its link (53 of 63 GB/s, below). Not measured on an A100.
        # SXM parts: GPUs talk over NVLink 3 (NVLINK3 above), each with its own host link.
        Hardware("a100-40g", peak_flops=312 * TFLOPS, hbm_bandwidth=1555 * GB,
                 pcie_bandwidth=25 * GB, memory_bytes=40536 * MiB, interconnect=NVLINK3),
        # Same datasheet, A100 80GB SXM: HBM2e 2,039 GB/s; reported capacity 81920 MiB.
        Hardware("a100-80g", peak_flops=312 * TFLOPS, hbm_bandwidth=2039 * GB,
                 pcie_bandwidth=25 * GB, memory_bytes=80 * GiB, interconnect=NVLINK3),
        # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 tensor 1,979 TFLOPS with
        # sparsity = 989 TFLOPS dense; HBM3 3.35 TB/s; 80 GB (reported 81559 MiB).
        # PCIe 5.0 x16: 63 GB/s per direction theoretical. Measured 2026-11-22 on one
        # "NVIDIA H100 80GB HBM3" (a Firecracker VM, jax 0.11.2, bench/host_transfer.py):
        # jax.device_put to/from pinned_host moved 51.7-54.0 GB/s each way for 256 MiB-1 GiB
        # buffers (32-34 GB/s at 16 MiB); the table had 50.
        Hardware("h100", peak_flops=989 * TFLOPS, hbm_bandwidth=3350 * GB,
                 pcie_bandwidth=53 * GB, memory_bytes=81559 * MiB, interconnect=NVLINK4),
        # NVIDIA H200 datasheet (SXM): same compute as H100 SXM, 989 TFLOPS BF16 dense;
        # HBM3e 4.8 TB/s, 141 GB (reported 143771 MiB); PCIe 5.0 x16, ~50 GB/s effective.
        Hardware("h200", peak_flops=989 * TFLOPS, hbm_bandwidth=4800 * GB,
                 pcie_bandwidth=50 * GB, memory_bytes=143771 * MiB, interconnect=NVLINK4),
        # NVIDIA L20 (Ada AD102, 92 SMs, 2,520 MHz boost): 48 GB GDDR6, 864 GB/s, PCIe 4.0
        # x16. NVIDIA publishes no full public datasheet; the product brief as widely
        # reproduced gives FP16/BF16 tensor 119.5 TFLOPS and FP8 239 TFLOPS. The SM count,
        # clock, bandwidth (2,250 MHz GDDR6 on 384 bits), link and 275 W agree in the public
        # spec databases (technical.city/pl/video/L20, topcpu.net's A40-vs-L20 page,
        # checked 2026-11-23), which list no tensor rate. The link: PCIe 4.0 x16 is 31.5 GB/s
        # a direction theoretical; 25 GB/s effective is the same 79% our H100 measured of its
        # link, not measured on an L20 (the LayerKV paper's testbed shares one link between
        # two L20s, which a TP = 1 run does not contend for). We read 119.5 as
        # *dense*: it matches 92 SMs x 2.52 GHz x 512 FLOP/clk/SM = 118.7 TFLOPS, the same
        # per-SM dense rate as the L40's 181 TFLOPS (142 SMs). Uncertainty: if the brief's
        # figure were with sparsity, dense would be half. Capacity: 46068 MiB reported with
        # ECC on (ECC on GDDR6 reserves part of the 48 GB).
        # The L20 has no NVLink: GPUs all-reduce over PCIe 4.0 (PCIE4), the link their host
        # copies use. Servers: the LayerKV testbed (Section 5.1, eight L20s) has "each two
        # GPUs share one PCIe connection" to the CPU, so two GPUs of a TP group split one
        # host link's 25 GB/s (gpus_per_host_link=2); a TP = 1 run has it to itself.
        Hardware("l20", peak_flops=119.5 * TFLOPS, hbm_bandwidth=864 * GB,
                 pcie_bandwidth=25 * GB, memory_bytes=46068 * MiB, interconnect=PCIE4,
                 gpus_per_host_link=2),
    ]
}


def get_hardware(name: str) -> Hardware:
    """Look an accelerator up by name (case-insensitive), failing with the known names."""
    try:
        return HARDWARE[name.lower()]
    except (KeyError, AttributeError):
        known = ", ".join(sorted(HARDWARE))
        raise ValueError(f"unknown hardware {name!r}; known hardware: {known}") from None


# vLLM sizes its KV cache after a profiling forward pass of `max_num_batched_tokens` tokens
# over `max_num_seqs` sequences: what that pass's peak leaves of `utilization * memory` after
# the weights. We take the peak as ACTIVATION_PEAK_FACTOR times the live set of one layer of
# that pass (its tokens' residual stream, attention and MLP activations) plus the sampler's
# fp32 logits of every sequence, and a fixed part for the CUDA context, cuBLAS/NCCL workspaces
# and fragmentation. The factor is fitted (`bench/calibrate_sim.py`) to the KV capacity of
# real vLLM 0.2.3 runs of OPT-13B on an A100-80GB (16,384 batched tokens, 1,024 sequences),
# which used at most 3,370 blocks where the weights alone would leave 4,260:
# PyTorch's eager pass keeps several times the one-layer live set at its peak.
ACTIVATION_TOKENS = 2048  # vLLM v0's default max_num_batched_tokens for a 2,048 context
ACTIVATION_SEQS = 256  # and max_num_seqs
ACTIVATION_PEAK_FACTOR = 5.04
NON_TORCH_BYTES_PER_GPU = 512 * MiB


def activation_reserve_bytes(cfg: ModelConfig, dtype_bytes: int = 2, tensor_parallel: int = 1,
                             max_batched_tokens: int = ACTIVATION_TOKENS,
                             max_num_seqs: int = ACTIVATION_SEQS) -> float:
    """Estimated peak non-KV, non-weight memory of vLLM's profiling pass, summed over
    `tensor_parallel` GPUs: `ACTIVATION_PEAK_FACTOR` x (`tokens * (4*hidden +
    2*intermediate)` values of one layer's live set, the replicated residual stream
    counted once, plus fp32 logits of `max_num_seqs` rows) + a fixed part per GPU. For
    OPT-13B at vLLM's defaults this is ~2 GB; at 16,384 tokens and 1,024 sequences ~11 GB."""
    per_token = 4 * cfg.hidden_size + 2 * cfg.intermediate_size
    live = max_batched_tokens * per_token * dtype_bytes + max_num_seqs * cfg.vocab_size * 4
    return ACTIVATION_PEAK_FACTOR * live + tensor_parallel * NON_TORCH_BYTES_PER_GPU


def kv_capacity_blocks(cfg: ModelConfig, hw: Hardware, block_size: int, dtype_bytes: int = 2,
                       utilization: float = 0.9, tensor_parallel: int = 1,
                       max_batched_tokens: int = ACTIVATION_TOKENS,
                       max_num_seqs: int = ACTIVATION_SEQS) -> int:
    """KV blocks of `block_size` tokens that fit, by vLLM's rule.

    Budget = `utilization * tensor_parallel * memory - weights - activation reserve` (of a
    profiling pass of `max_batched_tokens` over `max_num_seqs`, as vLLM sizes it), over
    all `tensor_parallel` GPUs together (weights and KV heads are sharded evenly; a block's
    bytes are the whole block across the group), divided by `block_bytes`. Raises
    `ValueError` naming the smallest sufficient `tensor_parallel` when the weights do not
    leave room for a single block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    per_block = block_bytes(cfg, block_size, dtype_bytes)
    weights = cfg.num_params * dtype_bytes

    def budget(tp: int) -> float:
        reserve = activation_reserve_bytes(cfg, dtype_bytes, tp, max_batched_tokens, max_num_seqs)
        return utilization * tp * hw.memory_bytes - weights - reserve

    free = budget(tensor_parallel)
    if free < per_block:
        need = tensor_parallel + 1
        while budget(need) < per_block and need < 1024:
            need += 1
        raise ValueError(
            f"{cfg.name} ({weights / GB:.1f} GB of weights at {dtype_bytes} B/param) does not fit "
            f"on {tensor_parallel} x {hw.name} ({hw.memory_bytes / GiB:.0f} GiB each) at "
            f"utilization {utilization}: needs tensor_parallel_size (--tensor-parallel-size) >= {need}"
        )
    return int(free // per_block)
