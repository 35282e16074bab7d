"""The GPU's work as measured: kernel efficiencies fitted to published A100 profiles
(`jserve.benchmarking.published_fit`) in place of the roofline's conventional fractions of the
datasheet peaks. How each kernel is priced: docs/simulator.md, The measured cost model.
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
from jserve.runners.engine_overhead import EngineOverhead, FitRange
from jserve.runners.hardware import Hardware

PUBLISHED = pathlib.Path(__file__).with_name("data") / "published_a100.json"
# The chip every published profile ran on: the fractions hold on both A100 memory sizes.
MEASURED_CHIPS = ("a100-80g", "a100-40g")


@dataclass(frozen=True)
class KernelFit:
    """Kernel efficiencies fitted to Vidur's A100 operator profiles (seconds; fractions of
    the hardware's peak FLOP/s or HBM bandwidth), and what those profiles covered."""

    gemm_launch: float
    weight_mbu: float
    gemm_mfu: float
    elementwise_launch: float
    elementwise_mbu: float  # of HBM bandwidth, over `elementwise_bytes`
    prefill_launch: float
    prefill_square_mfu: float
    prefill_prefix_mfu: float
    decode_launch: float
    kv_mbu: float
    fit_range: FitRange = FitRange()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelFit:
        return cls(**{k: v for k, v in d.items() if k != "fit_range"},
                   fit_range=FitRange.from_dict(d.get("fit_range", {})))


def elementwise_bytes(cfg: ModelConfig, tensor_parallel: int = 1, dtype_bytes: int = 2) -> float:
    """Bytes one layer's element-wise kernels read and write per token on one GPU of a group:
    two norms (read and write the hidden state), two residual adds (two inputs, one output),
    the activation (the gated MLP reads two halves and writes one; OPT's reads and writes
    one), and Llama's rotary embedding over its Q and K. Norms and adds are replicated
    across a tensor-parallel group; the activation and rotary are split."""
    tp, h = tensor_parallel, cfg.hidden_size
    ffn = cfg.intermediate_size // tp
    if cfg.family == "llama":
        qk = (cfg.num_heads // tp + max(cfg.num_kv_heads // tp, 1)) * cfg.head_dim
        elements = 4 * h + 6 * h + 3 * ffn + 2 * qk
    else:
        elements = 4 * h + 6 * h + 2 * ffn
    return float(elements * dtype_bytes)


@dataclass(frozen=True)
class PublishedFit:
    """The shipped fit: kernels and the engine-overhead profiles measured or derived beside
    them."""

    kernels: KernelFit
    engines: dict[str, EngineOverhead]
    sources: dict[str, str]

    def to_dict(self, residuals: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"sources": self.sources, "kernels": dataclasses.asdict(self.kernels),
                "engines": {k: v.to_dict() for k, v in self.engines.items()},
                "residuals": residuals or []}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PublishedFit:
        return cls(KernelFit.from_dict(d["kernels"]),
                   {k: EngineOverhead.from_dict(v) for k, v in d["engines"].items()}, dict(d["sources"]))


@functools.cache
def published_fit(path: pathlib.Path = PUBLISHED) -> PublishedFit:
    """The fit shipped with jserve (`bench/calibrate_sim.py` writes it)."""
    return PublishedFit.from_dict(json.loads(path.read_text()))


def engine_overhead(name: str) -> EngineOverhead:
    """A shipped engine-overhead profile by name."""
    engines = published_fit().engines
    try:
        return engines[name]
    except KeyError:
        raise ValueError(f"unknown engine overhead {name!r}; known: {', '.join(engines)}") from None


class MeasuredCostModel(RooflineCostModel):
    """Step times from measured kernel efficiencies and an engine's measured overhead (see
    the module's docstring); what the roofline's other terms price, priced the same way."""

    def __init__(self, cfg: ModelConfig, hw: Hardware, dtype_bytes: int = 2, tensor_parallel: int = 1,
                 swap_path: SwapPath = SwapPath.PER_BLOCK_LAYER, *, kernels: KernelFit,
                 engine: EngineOverhead) -> None:
        self.kernels = kernels
        super().__init__(cfg, hw, dtype_bytes, tensor_parallel, engine=engine, swap_path=swap_path)
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
        self.elementwise_token_time = elementwise_bytes(cfg, tp, dtype_bytes) / (
            hw.hbm_bandwidth * kernels.elementwise_mbu)

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

    def fit_terms(self) -> list[tuple[str, FitRange]]:
        return [("measured kernels (Vidur's A100 profiles)", self.kernels.fit_range), *super().fit_terms()]

    def tp_terms(self) -> list[tuple[str, FitRange]]:
        return [("measured kernels (Vidur's A100 profiles)", self.kernels.fit_range), *super().tp_terms()]

    def kernel_time(self, shape: StepShape) -> float:
        """The step's kernels on one GPU of the group, as profiled; the linear layers and
        element-wise kernels over padded prompts when the stack pads them."""
        k = self.kernels
        tokens = shape.num_tokens
        if self.engine.pads_prompts and shape.padded_prefill_tokens:
            tokens = shape.padded_prefill_tokens + shape.num_decode_tokens
        layer = (sum(self._gemm(tokens, kk, n) for kk, n in self.layer_gemms)
                 + k.elementwise_launch + self.elementwise_token_time * tokens
                 + self.attention_time(shape))
        return self.cfg.num_layers * layer + self._gemm(shape.num_seqs, *self.head_gemm)

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        """The terms of `step_time`: the measured kernels (as this stack runs them) in place
        of the roofline's compute and memory."""
        terms = super().breakdown(shape)
        del terms["compute"], terms["memory"]
        kernels = self.engine.gpu_slowdown * self.kernel_time(shape) if shape.num_tokens else 0.0
        return {"kernels": kernels} | terms
