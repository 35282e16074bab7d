"""How many KV blocks fit in a memory budget, the way vLLM sizes its cache."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

from jserve.models.config import ModelConfig

log = logging.getLogger(__name__)


def block_bytes(cfg: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one block of K and V across all layers."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def hidden_rows_per_page(cfg: ModelConfig, block_size: int) -> int:
    """Hidden rows (`hidden_size` values each) one page of a block holds: a block's K page
    and its V page each have room for `block_size * kv_heads * head_dim` values."""
    return block_size * cfg.num_kv_heads * cfg.head_dim // cfg.hidden_size


def hidden_block_tokens(cfg: ModelConfig, block_size: int, tensor_parallel: int = 1) -> int:
    """Tokens one block holds as Apt-Serve's hidden cache (Section 4.3's unified pool):
    rows fill the K page, then the V page. `2 * block_size` for multi-head attention (the
    cache halves); fewer than `block_size` for grouped-query attention (SmolLM2, block 16:
    10), where the hidden cache costs memory; 0 when a page cannot hold one row.

    Under tensor parallelism a GPU keeps its KV heads' share of every page, `1 / tp` of it,
    but projects its heads' K/V from whole hidden rows (Megatron's column-parallel K/V
    projection reads the full row), so each GPU keeps every row whole: a block holds `tp`
    times fewer rows. Multi-head attention at tp = 2 then saves nothing, and more GPUs make
    the hidden cache a loss (sharding the rows instead would add an all-reduce of the
    recomputed K/V per layer; not modelled)."""
    return 2 * (hidden_rows_per_page(cfg, block_size) // tensor_parallel)


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype_bytes: int, budget_bytes: float) -> int:
    return max(0, int(budget_bytes // block_bytes(cfg, block_size, dtype_bytes)))


def device_kv_budget(weight_bytes: int, utilization: float = 0.9, host_fraction: float = 0.25,
                     host_cap: float = 2 * 2**30) -> float:
    """Bytes left for KV: on an accelerator `utilization * memory - weights` (vLLM's
    gpu_memory_utilization, activations ignored); on CPU a share of the machine's RAM,
    capped, since the process shares the machine.

    Both read a total, never what happens to be free: the cache's size is a shape of the
    jit step, so a size that followed free memory changed the step's compile-cache keys from
    one start to the next and every start compiled again.
    """
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return utilization * stats["bytes_limit"] - weight_bytes
    page = os.sysconf("SC_PAGE_SIZE")
    budget = min(host_fraction * os.sysconf("SC_PHYS_PAGES") * page, host_cap)
    available = os.sysconf("SC_AVPHYS_PAGES") * page
    if budget > available:
        log.warning("the KV cache takes %.1f GiB but only %.1f GiB of RAM is free; pass "
                    "num_blocks for a smaller one", budget / 2**30, available / 2**30)
    return budget


def dtype_bytes(dtype: object) -> int:
    return np.dtype(dtype).itemsize
