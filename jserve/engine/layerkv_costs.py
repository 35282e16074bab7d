"""LayerKV's prefill and offload time estimates (Eqs. 3 and 4 of Xiong et al., "LayerKV:
Optimizing Large Language Model Serving with Layer-wise KV Cache Management"), as numbers a
policy can read.

A policy must not know how time is measured or simulated, so the model's and device's
figures and the two empirical factors reach it as data: `jserve.runners.layerkv_cost` fits
alpha and beta to the runner's cost model or profile and the builder hands the result to
the `layerkv` policy, as it hands CacheOpt its preemption costs.

- Eq. 3: `T_prefill(s) = alpha * s * (2 * n_param + 2 * s * n_hidden) / FLOPS`. Its
  quadratic term has no layer factor; we keep the paper's formula as written and let the
  fitted alpha absorb what it misses (the fit weighs every profiled length equally).
- Eq. 4: `T_offload(s, x) = beta * s * 2 * (L - x) * d_head * n_heads * f_precision / PCIe`.
  The paper counts attention heads; a GQA model (Yi-34B, Llama-3.1-70B) stores only its
  KV heads, so `kv_dim` here is `d_head * n_kv_heads`, the bytes that really move.
- x, the layers a prefill keeps on the device, is the smallest with `T_offload <= T_prefill`
  (Section 3.1.1), so the offload hides under the prefill.
- Eq. 1's "current TPOT", which the paper monitors, is read here as the time of a decode
  iteration of the current batch: `decode_base + decode_per_seq * seqs + decode_per_token *
  context tokens`, a line fitted to the same runner (a policy reads no clock but the view).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

Tokens = TypeVar("Tokens", int, np.ndarray)


@dataclass(frozen=True)
class LayerKVCosts:
    """The model's and device's figures of Eqs. 3-4 and the fitted correction factors.

    num_params, hidden_size: Eq. 3's n_param and n_hidden. kv_dim: d_head * n_kv_heads.
    dtype_bytes: f_precision. flops: the device's peak FLOP/s (alpha absorbs the achieved
    fraction). pcie_bandwidth: host<->device bytes/s, one direction. alpha, beta: Eq. 3's
    and Eq. 4's empirical factors. decode_*: the fitted decode-iteration line."""

    num_params: float
    hidden_size: int
    kv_dim: int
    dtype_bytes: int
    flops: float
    pcie_bandwidth: float
    alpha: float = 1.0
    beta: float = 1.0
    decode_base: float = 0.0
    decode_per_seq: float = 0.0
    decode_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_params", "hidden_size", "kv_dim", "dtype_bytes", "flops", "pcie_bandwidth",
                     "alpha", "beta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("decode_base", "decode_per_seq", "decode_per_token"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        """Seconds of one decode iteration of `num_seqs` sequences holding `context_tokens`
        tokens of context in all (0 for an empty batch)."""
        if num_seqs <= 0:
            return 0.0
        return self.decode_base + self.decode_per_seq * num_seqs + self.decode_per_token * context_tokens

    def prefill_time(self, seqlen: Tokens) -> Tokens:
        """Eq. 3: seconds to prefill `seqlen` prompt tokens (of one request, or of each)."""
        s = np.asarray(seqlen, dtype=np.float64)
        return self.alpha * s * (2.0 * self.num_params + 2.0 * s * self.hidden_size) / self.flops

    def offload_time(self, seqlen: Tokens, offloaded_layers: Tokens) -> Tokens:
        """Eq. 4: seconds to write `offloaded_layers` (L - x) layers of `seqlen` tokens' K and
        V to host memory."""
        s = np.asarray(seqlen, dtype=np.float64)
        moved = s * 2.0 * np.asarray(offloaded_layers, dtype=np.float64) * self.kv_dim * self.dtype_bytes
        return self.beta * moved / self.pcie_bandwidth

    def min_kept_layers(self, seqlen: Tokens, num_layers: int) -> Tokens:
        """The smallest x in [0, L] whose offload of L - x layers hides under the prefill
        (`T_offload <= T_prefill`): x = max(0, L - floor(T_prefill / T_offload(1 layer)))."""
        s = np.maximum(np.asarray(seqlen, dtype=np.float64), 1.0)
        hidden = np.floor(self.prefill_time(s) / self.offload_time(s, 1))
        x = np.clip(num_layers - hidden, 0, num_layers).astype(np.int64)
        return int(x) if np.ndim(x) == 0 else x
