"""LayerKV's prefill and offload time estimates (Eqs. 3 and 4 of the paper) and a decode
iteration's time, as numbers a policy can read: fitted to the runner in use and handed over by
the builder, so that the policy never knows how time is measured. The equations as we read
them: docs/policies.md, LayerKV.
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
