"""vLLM as measured: step times built from published A100 kernel and engine measurements.

The roofline (`cost_model.RooflineCostModel`) prices a step at conventional fractions of the
datasheet peaks plus a flat 2 ms. Replayed against real vLLM runs it is about twice too
fast (`bench/sim_vs_real.py`). This model prices each part of a step as it was measured on
A100s instead (`jserve.benchmarking.published_fit` fits it; `bench/calibrate_sim.py` prints the
fits and their residuals):

- linear layers: `launch + max(bytes / (HBM * weight_mbu), FLOPs / (peak * gemm_mfu))` per
  projection per layer (QKV, output, the MLP's two), and the LM head on one row per sequence
  (vLLM computes logits only for each sequence's last token);
- element-wise kernels (norms, activation, rotary, residual adds): a launch plus a rate per
  token and hidden unit, per layer;
- prefill attention: FlashAttention's measured rates, one against a chunk's own tokens
  (`q*q`, about a third of peak) and one against its cached prefix (`q*s`);
- decode attention: a launch plus the K/V the batch reads at `kv_mbu` of HBM bandwidth;
- the serving engine (`EngineOverhead`): a CPU time per step and per sequence, and the
  factor by which its kernels ran slower than the profiled ones.

Everything else a step may do (swaps, LayerKV's layer copies, Apt-Serve's hidden-cache
recompute, tensor parallelism's all-reduces) is priced as the roofline prices it, with the
measured GEMM and bandwidth efficiencies. The efficiencies are fractions of the hardware's
peaks, so on another entry of `jserve.runners.hardware` they scale by its datasheet: an
estimate wherever the entry is not the A100 they were measured on (`estimated_on`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from dataclasses import dataclass
from typing import Any

from jserve.models.config import ModelConfig
from jserve.runners.cost_model import RooflineCostModel, StepShape, SwapPath
from jserve.runners.hardware import Hardware

PUBLISHED = pathlib.Path(__file__).with_name("data") / "published_a100.json"
# The chip every published profile ran on: the fractions hold on both A100 memory sizes.
MEASURED_CHIPS = ("a100-80g", "a100-40g")


@dataclass(frozen=True)
class KernelFit:
    """Kernel efficiencies fitted to Vidur's A100 operator profiles (seconds; fractions of
    the hardware's peak FLOP/s or HBM bandwidth)."""

    gemm_launch: float
    weight_mbu: float
    gemm_mfu: float
    elementwise_launch: float
    elementwise_rate: float  # seconds per token per hidden unit, one layer
    prefill_launch: float
    prefill_square_mfu: float
    prefill_prefix_mfu: float
    decode_launch: float
    kv_mbu: float


@dataclass(frozen=True)
class EngineOverhead:
    """A serving engine's time per step beyond its kernels: `step + per_seq * sequences`
    of CPU (scheduling, preparing inputs, sampling, processing outputs), and its kernels'
    time as a multiple (`gpu_slowdown`) of the profiled ones."""

    name: str
    step: float
    per_seq: float
    gpu_slowdown: float = 1.0
    source: str = ""

    @classmethod
    def none(cls) -> EngineOverhead:
        """The kernels alone."""
        return cls("kernels only", 0.0, 0.0)


@dataclass(frozen=True)
class PublishedFit:
    """The shipped fit: kernels and the engines measured beside them."""

    kernels: KernelFit
    engines: dict[str, EngineOverhead]
    sources: dict[str, str]

    def to_dict(self, residuals: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"sources": self.sources, "kernels": dataclasses.asdict(self.kernels),
                "engines": {k: dataclasses.asdict(v) for k, v in self.engines.items()},
                "residuals": residuals or []}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PublishedFit:
        return cls(KernelFit(**d["kernels"]), {k: EngineOverhead(**v) for k, v in d["engines"].items()},
                   dict(d["sources"]))


@functools.cache
def published_fit(path: pathlib.Path = PUBLISHED) -> PublishedFit:
    """The fit shipped with jserve (`bench/calibrate_sim.py` writes it)."""
    return PublishedFit.from_dict(json.loads(path.read_text()))


class MeasuredCostModel(RooflineCostModel):
    """Step times from measured kernel efficiencies and an engine's measured overhead (see
    the module's docstring); what the roofline's other terms price, priced the same way."""

    def __init__(self, cfg: ModelConfig, hw: Hardware, dtype_bytes: int = 2, tensor_parallel: int = 1,
                 swap_path: SwapPath = SwapPath.PER_BLOCK_LAYER, *, kernels: KernelFit,
                 engine: EngineOverhead) -> None:
        super().__init__(cfg, hw, dtype_bytes, tensor_parallel, step_overhead=0.0, swap_path=swap_path)
        self.kernels, self.engine = kernels, engine
        # The roofline's terms that stay (hidden-cache recompute, swap gathers, slot copies)
        # run at the measured efficiencies.
        self.flop_rate = hw.peak_flops * kernels.gemm_mfu * tensor_parallel
        self.byte_rate = hw.hbm_bandwidth * kernels.weight_mbu * tensor_parallel
        tp, d, hd = tensor_parallel, cfg.hidden_size, cfg.head_dim
        q_heads, kv_heads = cfg.num_heads // tp, max(cfg.num_kv_heads // tp, 1)
        ffn = cfg.intermediate_size // tp
        mlp = [(d, 2 * ffn), (ffn, d)] if cfg.family == "llama" else [(d, ffn), (ffn, d)]
        self.layer_gemms = [(d, (q_heads + 2 * kv_heads) * hd), (q_heads * hd, d), *mlp]
        self.head_gemm = (d, -(-cfg.vocab_size // tp))
        self.pair_flops = 4.0 * q_heads * hd  # per (query, key) pair, per layer
        self.kv_token_bytes = 2.0 * kv_heads * hd * dtype_bytes  # K and V, per layer
        self.hidden = d

    @property
    def estimated_on(self) -> bool:
        """Whether the hardware is not the chip the efficiencies were measured on."""
        return self.hw.name not in MEASURED_CHIPS

    def __repr__(self) -> str:
        return (f"MeasuredCostModel({self.cfg.name}, {self.hw.name}, tp={self.tensor_parallel}, "
                f"engine={self.engine.name}{', estimate' if self.estimated_on else ''})")

    def _gemm(self, m: int, k: int, n: int) -> float:
        memory = (k * n + m * (k + n)) * self.dtype_bytes / (self.hw.hbm_bandwidth * self.kernels.weight_mbu)
        compute = 2.0 * m * k * n / (self.hw.peak_flops * self.kernels.gemm_mfu)
        return self.kernels.gemm_launch + max(memory, compute)

    def attention_time(self, shape: StepShape) -> float:
        """One layer's attention kernels: prefill chunks and decodes."""
        k, t = self.kernels, 0.0
        if shape.num_prefill_tokens:
            rate = self.hw.peak_flops
            t += k.prefill_launch + self.pair_flops * (shape.prefill_square / (rate * k.prefill_square_mfu)
                                                       + shape.prefill_prefix / (rate * k.prefill_prefix_mfu))
        if shape.num_decode_tokens:
            t += k.decode_launch + shape.decode_context * self.kv_token_bytes / (self.hw.hbm_bandwidth * k.kv_mbu)
        return t

    def kernel_time(self, shape: StepShape) -> float:
        """The step's kernels on one GPU of the group, times the engine's slowdown."""
        tokens, k = shape.num_tokens, self.kernels
        layer = (sum(self._gemm(tokens, kk, n) for kk, n in self.layer_gemms)
                 + k.elementwise_launch + k.elementwise_rate * tokens * self.hidden
                 + self.attention_time(shape))
        total = self.cfg.num_layers * layer + self._gemm(shape.num_seqs, *self.head_gemm)
        return self.engine.gpu_slowdown * total

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        """The terms of `step_time`: the measured kernels in place of the roofline's compute
        and memory."""
        terms = super().breakdown(shape)
        del terms["compute"], terms["memory"]
        return {"kernels": self.kernel_time(shape) if shape.num_tokens else 0.0} | terms

    def overhead_time(self, shape: StepShape) -> float:
        if not shape.num_tokens:
            return 0.0
        return self.engine.step + self.engine.per_seq * shape.num_seqs
