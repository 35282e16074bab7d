"""The immutable snapshot a policy decides from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from jserve.cache_features.hidden_cache.section import CacheType
from jserve.engine.request_table import RequestArrays

Tokens = TypeVar("Tokens", int, np.ndarray)


@dataclass(frozen=True)
class SchedulerLimits:
    """Engine-wide bounds every plan must respect (vLLM's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    @classmethod
    def with_default_budget(cls, max_num_seqs: int, max_num_batched_tokens: int | None,
                            max_model_len: int) -> SchedulerLimits:
        """vLLM's default token budget when none is given: a whole prompt fits in one step
        (no chunking needed) and every running sequence can decode together."""
        budget = max_num_batched_tokens or max(max_model_len, 2048, max_num_seqs)
        return cls(max_num_seqs, budget, max_model_len)


@dataclass(frozen=True)
class SchedulerView:
    """Everything a policy may read: arrived, unfinished requests and cache occupancy."""

    now: float
    requests: RequestArrays
    block_size: int
    num_blocks: int
    num_free_blocks: int
    limits: SchedulerLimits
    num_host_blocks: int = 0  # host tier for swap preemption; 0: recompute only
    num_free_host_blocks: int = 0
    arrival_rate: float = 0.0  # requests/s arrived over the recent window
    iteration_time: float = 0.0  # longest recent step, seconds (0 before the first step)
    # Layer-wise residency (LayerKV). `num_free_blocks` counts whole blocks (free in every
    # layer); blocks split into per-layer slots for partly offloaded requests are not in it,
    # and their free slots are `free_layer_slots[l]` (per layer). Requests' `device_layers`
    # column says how many layers each keeps on the device (`num_layers`: all of them).
    num_layers: int = 1
    free_layer_slots: np.ndarray | None = None  # [num_layers]; None: all zero
    free_host_layer_slots: np.ndarray | None = None  # [num_layers], the host tier's
    # Apt-Serve's hidden cache: tokens one block holds as hidden rows (0: the model cannot
    # use it; requests' `cache_type` column says which hold it), and rho, the seconds a
    # step takes longer per hidden block in the batch (0.0: unknown).
    hidden_block_tokens: int = 0
    hidden_block_cost: float = 0.0

    @property
    def num_free_layer_blocks(self) -> int:
        """Device layer slots free, summed over layers: `num_layers` per whole free block
        plus the free slots of split blocks (a request keeping `x` layers takes `x` per
        logical block)."""
        return self.num_layers * self.num_free_blocks + _total(self.free_layer_slots)

    @property
    def num_free_host_layer_blocks(self) -> int:
        """Host layer slots free, summed over layers (a request keeping `x` layers takes
        `num_layers - x` per logical block)."""
        return self.num_layers * self.num_free_host_blocks + _total(self.free_host_layer_slots)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks promised to live requests beyond what they hold (reserved, not yet
        materialised): free blocks that reserving policies must not hand to others."""
        r = self.requests
        return int((r.reserved_blocks - r.num_blocks).clip(min=0).sum())

    def blocks_for(self, num_tokens: Tokens) -> Tokens:
        """Blocks that hold `num_tokens` tokens (of one request, or of each of many)."""
        return -(-num_tokens // self.block_size)

    def blocks_for_type(self, num_tokens: Tokens, cache_type: Tokens) -> Tokens:
        """Blocks that hold `num_tokens` tokens in `cache_type` (`CacheType`; one request,
        or elementwise for many); a hidden type when the model cannot use it raises."""
        hidden = np.asarray(cache_type) == CacheType.HIDDEN
        if hidden.any() and self.hidden_block_tokens < 1:
            raise ValueError("this model's blocks hold no hidden row (hidden_block_tokens == 0)")
        per_block = np.where(hidden, max(self.hidden_block_tokens, 1), self.block_size)
        out = -(-np.asarray(num_tokens) // per_block)
        return int(out) if np.ndim(out) == 0 else out


def _total(slots: np.ndarray | None) -> int:
    return 0 if slots is None else int(slots.sum())
