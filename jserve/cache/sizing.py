"""How many KV blocks fit in a memory budget, the way vLLM sizes its cache."""

from __future__ import annotations

import os

import jax
import numpy as np

from models.config import ModelConfig


def block_bytes(cfg: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one block of K and V across all layers."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype_bytes: int, budget_bytes: float) -> int:
    return max(0, int(budget_bytes // block_bytes(cfg, block_size, dtype_bytes)))


def device_kv_budget(weight_bytes: int, utilization: float = 0.9, host_fraction: float = 0.25,
                     host_cap: float = 2 * 2**30) -> float:
    """Bytes left for KV: on an accelerator `utilization * memory - weights` (vLLM's
    gpu_memory_utilization, activations ignored); on CPU a share of free RAM, capped, since
    the process shares the machine."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return utilization * stats["bytes_limit"] - weight_bytes
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(host_fraction * available, host_cap)


def dtype_bytes(dtype: object) -> int:
    return np.dtype(dtype).itemsize
