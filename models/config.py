"""Model shape description shared by the model code, the runners and the cost model.

One dataclass describes every family so that the simulator's cost model (FLOPs, bytes of
weights and KV) and the real runner read the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from jserve.pallas_kernels.rope import Llama3RopeScaling

Family = Literal["llama", "opt"]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer."""

    name: str
    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    qkv_bias: bool = False  # Llama family: q/k/v projections with biases (Qwen2)
    rope_scaling: Llama3RopeScaling | None = None  # Llama 3.1's long-context frequencies

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, at 2 bytes per value."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @property
    def num_params(self) -> int:
        """Parameter count, used for weight bytes and matmul FLOPs per token."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * self.num_heads * self.head_dim * 2 + d * self.num_kv_heads * self.head_dim * 2
        if self.family == "llama":
            mlp, norms, final_norm, positions = 3 * d * f, 2 * d, d, 0
            if self.qkv_bias:
                attn += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        else:  # OPT: fc1/fc2 with biases, LayerNorm scale+bias, attention biases, and a
            # learned position table with 2 leading rows no token reads
            mlp, norms, final_norm = 2 * d * f + f + d, 4 * d + 4 * d, 2 * d
            positions = (self.max_position + 2) * d
        embed = v * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + positions + final_norm


def repeated_kv_columns(cfg: ModelConfig, held: ModelConfig) -> np.ndarray:
    """For a K/V projection held with `held.num_kv_heads` heads, each a repeat of one of
    `cfg`'s (tensor parallelism over more devices than KV heads): the column of `cfg`'s
    projection each held column is. Held KV head `j` is head `j // repeats`, so query head
    `h` still reads the head it did."""
    repeats = held.num_kv_heads // cfg.num_kv_heads
    column = np.arange(held.num_kv_heads * held.head_dim)
    return (column // held.head_dim // repeats) * cfg.head_dim + column % held.head_dim
